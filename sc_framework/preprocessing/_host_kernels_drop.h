// drop_device of the host preprocessing loops: the overflow rules applied
// to one device's entries, with the bit map of kept rows.
//
// Included by _host_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_DROP_H_
#define SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_DROP_H_

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>

#include "_host_kernels_common.h"

namespace {

// ---------------------------------------------------------------- drop_device

// Row of unique index v = n * stride + u: edge[n] + u, the rows of all
// shards numbered one after the other; n = 0 (and row v) with one shard.
// Indices and stride fit int32 (checked), so the division is a 32-bit one.
struct Located {
  int64_t shard, row;
};

template <bool kOneShard>
Located Locate(int32_t v, int64_t stride, const int64_t* edge) {
  if constexpr (kOneShard) {
    return {0, v};
  } else {
    const uint32_t n = static_cast<uint32_t>(v) / static_cast<uint32_t>(stride);
    return {n, edge[n] + v - static_cast<int64_t>(n) * stride};
  }
}

// The first entry whose unique index names no row of `edge`, or -1.
Py_ssize_t FirstBadIndex(const int32_t* index, Py_ssize_t size, int64_t stride,
                         const int64_t* edge, int64_t num_shards) {
  if (num_shards == 1) {
    for (Py_ssize_t e = 0; e < size; ++e) {
      if (static_cast<uint32_t>(index[e]) >= static_cast<uint64_t>(edge[1])) return e;
    }
    return -1;
  }
  for (Py_ssize_t e = 0; e < size; ++e) {
    if (index[e] < 0) return e;
    const Located at = Locate<false>(index[e], stride, edge);
    if (at.shard >= num_shards || at.row >= edge[at.shard + 1]) return e;
  }
  return -1;
}

// Shortest run of surely kept entries `DropPass` copies as a block.
constexpr int64_t kMinDropRun = 64;

// Marks rows[0, count) in the bit map; returns how many were not marked yet.
template <typename Row>
int64_t MarkRows(const Row* rows, int64_t count, uint64_t* word) {
  int64_t marked = 0;
  for (int64_t i = 0; i < count; ++i) {
    const uint64_t row = static_cast<uint64_t>(rows[i]);
    const uint64_t bits = word[row >> 6];
    marked += (bits >> (row & 63)) & 1;
    word[row >> 6] = bits | (uint64_t{1} << (row & 63));
  }
  return count - marked;
}

// Where DropPass writes: the kept entries' samples, weights (kWeights) and
// Index values, compactly from 0. Each may overlap its input at or before it
// (entry e goes to w <= e, read before written).
template <typename Index>
struct DropOutput {
  int32_t* sample;
  float* weight;
  Index* index;
};

// Pass 1 of drop_device and rank_kept_rows: the overflow rules in one pass
// over the entries, `locate(index[e])` giving the entry's shard and its row in
// the bit map `word`. A row is marked as its first entry is kept; a row is
// marked iff it keeps an entry (its first entry decides rule (a), and once
// its shard took C entries nothing more is kept). Kept entries are written
// to `out` compactly (branch-free: overwritten unless kept); the counters of a
// single shard are plain locals so they stay in registers. counts[n]: shard
// n's kept entries. With `late` (a zeroed bit map): it marks the rows that
// keep no entry, so the rows of a shard before dropping are its marks in
// both maps; with `all_counts`: shard n's entries before dropping.
template <bool kOneShard, bool kWeights, typename Index, typename Locate>
Py_ssize_t DropPass(const Index* index, Py_ssize_t size, const Locate& locate, int64_t num_shards,
                    int64_t unique_capacity, int64_t entry_capacity, const int32_t* sample,
                    const float* weight, uint64_t* word, uint64_t* late, uint8_t* kept,
                    DropOutput<Index> out, int64_t* counts, int64_t* all_counts) {
  std::vector<int64_t> rows_seen(kOneShard ? 0 : num_shards, 0);
  int64_t one_seen = 0, one_kept = 0;
  if (!kOneShard) std::fill(counts, counts + num_shards, 0);
  if (all_counts) std::fill(all_counts, all_counts + num_shards, 0);
  Py_ssize_t w = 0, e = 0;
  if constexpr (kOneShard) {
    // Leading runs that no limit can cut: with s rows seen and k entries
    // kept, the next min(U - s, C - k) entries are all kept (each adds at
    // most one row), so their rows are marked without per-entry decisions
    // and they stay where they are. Nothing is dropped before, so w = e.
    for (;;) {
      const int64_t run = std::min({unique_capacity - one_seen, entry_capacity - one_kept,
                                    static_cast<int64_t>(size - e)});
      if (run <= 0 || (run < kMinDropRun && run < size - e)) break;
      one_seen += MarkRows(index + e, run, word);
      if (out.sample != sample) std::memmove(out.sample + e, sample + e, run * sizeof(int32_t));
      if constexpr (kWeights) {
        if (out.weight != weight) std::memmove(out.weight + e, weight + e, run * sizeof(float));
      }
      if (out.index != index) std::memmove(out.index + e, index + e, run * sizeof(Index));
      std::memset(kept + e, 1, run);
      one_kept += run;
      e += run;
    }
    w = e;
    if (all_counts) all_counts[0] = size;
  }
  for (; e < size; ++e) {
    const Index v = index[e];
    const Located at = locate(v);
    const int64_t seen = kOneShard ? one_seen : rows_seen[at.shard];
    const int64_t taken = kOneShard ? one_kept : counts[at.shard];
    const uint64_t bit = uint64_t{1} << (at.row & 63);
    const uint64_t bits = word[at.row >> 6];
    const bool marked = (bits & bit) != 0;
    const bool take = (marked | (seen < unique_capacity)) & (taken < entry_capacity);
    const bool mark = take & !marked;
    word[at.row >> 6] = bits | (bit & (uint64_t{0} - mark));
    if (late) late[at.row >> 6] |= bit & (uint64_t{0} - !(take | marked));
    if constexpr (kOneShard) {
      one_seen += mark;
      one_kept += take;
    } else {
      rows_seen[at.shard] += mark;
      counts[at.shard] += take;
      if (all_counts) ++all_counts[at.shard];
    }
    kept[e] = take;
    out.sample[w] = sample[e];
    if constexpr (kWeights) out.weight[w] = weight[e];
    out.index[w] = v;
    w += take;
  }
  if (kOneShard) counts[0] = one_kept;
  return w;
}

// Pass 3: the kept entries' unique indices v -> n * U + u', u' the marked
// rows before the entry's row in its shard: base[n] + before[w] + the marks of
// word w below the row (base[n] = n * U - marked rows before shard n). Always
// inlined, as Ranks.
template <bool kOneShard>
inline __attribute__((always_inline)) void NewIndices(int32_t* index, Py_ssize_t count,
                                                      int64_t stride, const int64_t* edge,
                                                      const int64_t* base, const uint64_t* word,
                                                      const int32_t* before) {
  for (Py_ssize_t j = 0; j < count; ++j) {
    const Located at = Locate<kOneShard>(index[j], stride, edge);
    const uint64_t below = word[at.row >> 6] & ((uint64_t{1} << (at.row & 63)) - 1);
    index[j] = static_cast<int32_t>(base[at.shard] + before[at.row >> 6] +
                                    __builtin_popcountll(below));
  }
}

#if defined(__x86_64__) || defined(__i386__)
template <bool kOneShard>
__attribute__((target("popcnt"))) void NewIndicesPopcnt(int32_t* index, Py_ssize_t count,
                                                         int64_t stride, const int64_t* edge,
                                                         const int64_t* base,
                                                         const uint64_t* word,
                                                         const int32_t* before) {
  NewIndices<kOneShard>(index, count, stride, edge, base, word, before);
}
#endif

template <bool kOneShard>
void NewIndicesAnyCpu(int32_t* index, Py_ssize_t count, int64_t stride, const int64_t* edge,
                      const int64_t* base, const uint64_t* word, const int32_t* before) {
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("popcnt")) {
    NewIndicesPopcnt<kOneShard>(index, count, stride, edge, base, word, before);
    return;
  }
#endif
  NewIndices<kOneShard>(index, count, stride, edge, base, word, before);
}

// The three passes of drop_device; returns the kept entries.
template <bool kOneShard, bool kWeights>
Py_ssize_t DropDevice(const int32_t* index, Py_ssize_t size, int64_t stride, const int64_t* edge,
                      int64_t num_shards, int64_t unique_capacity, int64_t entry_capacity,
                      const int32_t* sample, const float* weight, const int64_t* distinct,
                      uint64_t* word, uint8_t* kept, int32_t* out_sample, float* out_weight,
                      int32_t* out_index, int64_t* out_distinct, int64_t* counts,
                      int64_t* unique_counts) {
  const int64_t num_rows = edge[num_shards];
  const Py_ssize_t num_words = static_cast<Py_ssize_t>(num_rows / 64 + 1);
  std::memset(word, 0, num_words * sizeof(uint64_t));
  const auto locate = [stride, edge](int32_t v) { return Locate<kOneShard>(v, stride, edge); };
  const Py_ssize_t count = DropPass<kOneShard, kWeights>(
      index, size, locate, num_shards, unique_capacity, entry_capacity, sample, weight, word,
      nullptr, kept, DropOutput<int32_t>{out_sample, out_weight, out_index}, counts, nullptr);
  // Pass 2, over the bit map: marked rows before every word, the marked rows'
  // global rows in order, and every shard's marked rows.
  std::vector<int32_t> before(num_words);
  int32_t found = 0;
  for (Py_ssize_t w = 0; w < num_words; ++w) {
    before[w] = found;
    for (uint64_t bits = word[w]; bits; bits &= bits - 1) {
      out_distinct[found++] = distinct[w * 64 + __builtin_ctzll(bits)];
    }
  }
  auto marked_before = [&](int64_t row) {
    const uint64_t below = word[row >> 6] & ((uint64_t{1} << (row & 63)) - 1);
    return static_cast<int64_t>(before[row >> 6]) + __builtin_popcountll(below);
  };
  std::vector<int64_t> base(num_shards);
  for (int64_t n = 0; n < num_shards; ++n) {
    const int64_t first = marked_before(edge[n]);
    unique_counts[n] = marked_before(edge[n + 1]) - first;
    base[n] = n * unique_capacity - first;
  }
  NewIndicesAnyCpu<kOneShard>(out_index, count, stride, edge, base.data(), word, before.data());
  return count;
}

PyObject* drop_device(PyObject*, PyObject* args) {
  PyObject *index_object, *edges_object, *samples_object, *weights_object, *distinct_object,
      *words_object, *keep_object, *out_samples_object, *out_weights_object, *out_index_object,
      *out_distinct_object, *counts_object, *unique_counts_object;
  long long stride, unique_capacity, entry_capacity;
  if (!PyArg_ParseTuple(args, "OLOLLOOOOOOOOOOO", &index_object, &stride, &edges_object,
                        &unique_capacity, &entry_capacity, &samples_object, &weights_object,
                        &distinct_object, &words_object, &keep_object, &out_samples_object,
                        &out_weights_object, &out_index_object, &out_distinct_object,
                        &counts_object, &unique_counts_object)) {
    return nullptr;
  }
  const bool weighted = weights_object != Py_None;
  if (weighted != (out_weights_object != Py_None)) {
    PyErr_SetString(PyExc_ValueError, "weights and out_weights: both arrays or both None");
    return nullptr;
  }
  Array index, edges, samples, weights, distinct, words, keep, out_samples, out_weights,
      out_index, out_distinct, counts, unique_counts;
  if (!index.Take(index_object, "unique_index", 4, false) ||
      !edges.Take(edges_object, "edges", 8, false) ||
      !samples.Take(samples_object, "samples", 4, false) ||
      (weighted && !weights.Take(weights_object, "weights", 4, false)) ||
      !distinct.Take(distinct_object, "distinct", 8, false) ||
      !words.Take(words_object, "words", 8, true) || !keep.Take(keep_object, "keep", 1, true) ||
      !out_samples.Take(out_samples_object, "out_samples", 4, true) ||
      (weighted && !out_weights.Take(out_weights_object, "out_weights", 4, true)) ||
      !out_index.Take(out_index_object, "out_index", 4, true) ||
      !out_distinct.Take(out_distinct_object, "out_distinct", 8, true) ||
      !counts.Take(counts_object, "counts", 8, true) ||
      !unique_counts.Take(unique_counts_object, "unique_counts", 8, true)) {
    return nullptr;
  }
  const Py_ssize_t size = index.size();
  const int64_t num_shards = edges.size() - 1;
  const int64_t* edge = edges.data<int64_t>();
  if (num_shards < 1 || stride < 1 || stride > std::numeric_limits<int32_t>::max() ||
      unique_capacity < 0 ||
      num_shards * unique_capacity > std::numeric_limits<int32_t>::max()) {
    PyErr_Format(PyExc_ValueError,
                 "need len(edges) >= 2, 1 <= stride <= 2^31 - 1 and"
                 " 0 <= (len(edges) - 1) * U <= 2^31 - 1, got %lld, %lld, %lld", static_cast<long long>(num_shards + 1), stride,
                 unique_capacity);
    return nullptr;
  }
  for (int64_t n = 0; n < num_shards; ++n) {
    if (edge[0] != 0 || edge[n + 1] < edge[n] || edge[n + 1] - edge[n] > stride) {
      PyErr_Format(PyExc_ValueError,
                   "edges must rise from 0 by at most stride = %lld, got edges[%lld] = %lld",
                   stride, static_cast<long long>(n + 1), static_cast<long long>(edge[n + 1]));
      return nullptr;
    }
  }
  const int64_t num_rows = edge[num_shards];
  if (num_rows > std::numeric_limits<int32_t>::max()) {
    PyErr_SetString(PyExc_ValueError, "more rows than int32 ranks");
    return nullptr;
  }
  if (distinct.size() != num_rows) {
    return SizeError("distinct: edges[-1]", num_rows, distinct.size()), nullptr;
  }
  if (words.size() < num_rows / 64 + 1) {
    return SizeError("words: at least edges[-1] / 64 + 1", num_rows / 64 + 1, words.size()),
           nullptr;
  }
  const std::pair<const Array*, const char*> per_entry[] = {
      {&samples, "samples: len(unique_index)"}, {&keep, "keep: len(unique_index)"},
      {&out_samples, "out_samples: len(unique_index)"},
      {&out_index, "out_index: len(unique_index)"}};
  for (const auto& [array, name] : per_entry) {
    if (array->size() != size) return SizeError(name, size, array->size()), nullptr;
  }
  if (weighted && (weights.size() != size || out_weights.size() != size)) {
    return SizeError("weights and out_weights: len(unique_index)", size,
                     weights.size() != size ? weights.size() : out_weights.size()),
           nullptr;
  }
  if (out_distinct.size() != num_rows) {
    return SizeError("out_distinct: edges[-1]", num_rows, out_distinct.size()), nullptr;
  }
  if (counts.size() != num_shards || unique_counts.size() != num_shards) {
    return SizeError("counts and unique_counts: len(edges) - 1", num_shards,
                     counts.size() != num_shards ? counts.size() : unique_counts.size()),
           nullptr;
  }
  const int32_t* ui = index.data<int32_t>();
  const Py_ssize_t bad = FirstBadIndex(ui, size, stride, edge, num_shards);
  if (bad >= 0) {
    PyErr_Format(PyExc_ValueError, "unique_index[%zd] = %d names no row of edges", bad, ui[bad]);
    return nullptr;
  }
  Py_ssize_t count = 0;
  Py_BEGIN_ALLOW_THREADS;
  auto run = [&](auto one_shard, auto with_weights) {
    return DropDevice<decltype(one_shard)::value, decltype(with_weights)::value>(
        ui, size, stride, edge, num_shards, unique_capacity, entry_capacity,
        samples.data<int32_t>(), weighted ? weights.data<float>() : nullptr,
        distinct.data<int64_t>(), words.data<uint64_t>(), keep.data<uint8_t>(),
        out_samples.data<int32_t>(), weighted ? out_weights.data<float>() : nullptr,
        out_index.data<int32_t>(), out_distinct.data<int64_t>(), counts.data<int64_t>(),
        unique_counts.data<int64_t>());
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (num_shards == 1) {
    count = weighted ? run(Yes{}, Yes{}) : run(Yes{}, No{});
  } else {
    count = weighted ? run(No{}, Yes{}) : run(No{}, No{});
  }
  Py_END_ALLOW_THREADS;
  return PyLong_FromSsize_t(count);
}


}  // namespace

#endif  // SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_DROP_H_
