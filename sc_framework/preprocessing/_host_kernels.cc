// C++ loops for host preprocessing: the passes over every id of a batch that
// numpy can only express as a sort, a scatter or several temporaries.
//
// Each function computes exactly what the numpy code it stands for computes
// (`_native.py` names it; the tests compare the two bit for bit), works
// in place on arrays the caller allocated (1-D, C-contiguous, checked by item
// size), checks every index it follows, and releases the GIL while it loops.
//
//   fill_keys(keys, samples, ids, lengths, first_sample, v_s, n, r, offset, rotation)
//       For the ids of consecutive samples first_sample, first_sample + 1, ...
//       (lengths[s] ids each): samples[j] = b and keys[j] = b * v_s + row(id_j),
//       row(i) = ((i mod n + rotation) mod n) * r + floor(i / n) + offset.
//   merge_samples(keys, weights | None, lengths, repeats, v_s, samples) -> d
//       Stably sorts the keys of every sample s (lengths[s] each, weights
//       alongside), writes the d ascending positions j with sorted keys[j] ==
//       keys[j - 1] to repeats, then the n - d entries (the other positions,
//       in order): keys[e] = their key - s * v_s (the row), samples[e] = s.
//   rank_rows(rows, words, V, distinct, ranks) -> k
//       distinct[:k] = the distinct values of rows (in [0, V)), ascending, and
//       ranks[i] = j where distinct[j] = rows[i], through a bit map over
//       [0, V) in `words` (uint64, any content on entry): 1/8 byte per row,
//       so the map and its per-word counts stay in the cache.
//   drop_device(unique_index, stride, edges, U, C, samples, weights | None, distinct,
//               words, keep, out_samples, out_weights | None, out_index, out_distinct,
//               counts, unique_counts) -> k
//       One device's entries e in (sample, row) order, entry e of unique index
//       v = n * stride + u naming row edges[n] + u of distinct (the device's
//       rows, shard n's at edges[n] ... edges[n + 1] - 1). Partition = shard:
//       keep[e] = the row is among the first U rows of its shard in
//       first-entry order and the entry among the first C such entries of its
//       shard. The k kept entries' samples, weights and unique indices
//       n * U + u' (u': kept rows before the row in its shard) go to
//       out_*[:k] in order; the kept rows (those with a kept entry) to
//       out_distinct[:sum(unique_counts)], ascending; counts[n] / unique_counts[n]:
//       shard n's kept entries / rows. `words` (uint64, any content on entry):
//       the bit map of kept rows.
//   rank_kept_rows(rows, out_rows, samples, out_samples, weights | None, out_weights | None,
//                  words, V, R, U, C, keep, distinct, ranks, all_counts, unique_counts)
//       -> (k, d)
//       rank_rows and drop_device in one: one device's entries e (rows[e] in
//       [0, V), shard rows[e] / R of the len(all_counts) shards) in (sample,
//       row) order; keep[e] as in drop_device. The k kept entries' rows,
//       samples and weights go to out_*[:k] in order (each output may overlap
//       its input at or before it); distinct[:d] = the kept rows ascending,
//       ranks[:k] = their ranks among them. Before dropping, shard n had
//       all_counts[n] entries and unique_counts[n] distinct rows. `words`:
//       two bit maps over [0, V) (uint64, any content on entry).

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <system_error>
#include <thread>
#include <type_traits>
#include <utility>
#include <vector>

namespace {

// A held buffer of a 1-D C-contiguous array whose items have a given size.
class Array {
 public:
  Array() = default;
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  ~Array() {
    if (held_) PyBuffer_Release(&view_);
  }

  // Takes `object`'s buffer; on a mismatch sets a Python error, returns false.
  bool Take(PyObject* object, const char* name, Py_ssize_t itemsize, bool writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, &view_, flags) != 0) {
      PyErr_Format(PyExc_TypeError, "%s must be a%s C-contiguous array", name,
                   writable ? " writable" : "");
      return false;
    }
    held_ = true;
    if (view_.ndim != 1 || view_.itemsize != itemsize) {
      PyErr_Format(PyExc_TypeError, "%s must be 1-D with %zd-byte items, got %d-D with %zd",
                   name, itemsize, view_.ndim, view_.itemsize);
      return false;
    }
    return true;
  }

  template <typename T>
  T* data() const {
    return static_cast<T*>(view_.buf);
  }
  Py_ssize_t size() const { return view_.shape[0]; }
  Py_ssize_t itemsize() const { return view_.itemsize; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// The item size of `object`'s buffer, or -1 with a Python error.
Py_ssize_t ItemSize(PyObject* object, const char* name) {
  Py_buffer view;
  if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous array", name);
    return -1;
  }
  const Py_ssize_t itemsize = view.itemsize;
  PyBuffer_Release(&view);
  return itemsize;
}

bool SizeError(const char* what, Py_ssize_t expected, Py_ssize_t actual) {
  PyErr_Format(PyExc_ValueError, "%s: expected %zd, got %zd", what, expected, actual);
  return false;
}

// Sum of lengths, or -1 (with a Python error) when one is negative.
Py_ssize_t Total(const Array& lengths) {
  const int64_t* length = lengths.data<int64_t>();
  Py_ssize_t total = 0;
  for (Py_ssize_t s = 0; s < lengths.size(); ++s) {
    if (length[s] < 0) {
      PyErr_Format(PyExc_ValueError, "lengths[%zd] = %lld is negative", s,
                   static_cast<long long>(length[s]));
      return -1;
    }
    total += length[s];
  }
  return total;
}

// Parts a loop over `work` items splits into: one per hardware thread (at
// most 8), each with at least kMinPartWork items.
constexpr Py_ssize_t kMinPartWork = 1 << 16;

int NumParts(Py_ssize_t work) {
  static const int threads =
      std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 8);
  return static_cast<int>(std::clamp<Py_ssize_t>(work / kMinPartWork, 1, threads));
}

// Runs part(0), ..., part(parts - 1), all but the first on threads of their
// own (inline when a thread cannot start); returns when all are done.
template <typename Part>
void RunParts(int parts, const Part& part) {
  std::vector<std::thread> threads;
  for (int p = 1; p < parts; ++p) {
    try {
      threads.emplace_back(part, p);
    } catch (const std::system_error&) {
      part(p);
    }
  }
  part(0);
  for (std::thread& thread : threads) thread.join();
}

// ---------------------------------------------------------------- fill_keys

template <typename Id>
void FillKeys(int64_t* keys, int32_t* samples, const Id* ids, const int64_t* lengths,
              Py_ssize_t num_samples, int64_t first_sample, int64_t v_s, int64_t n, int64_t r,
              int64_t offset, int64_t rotation) {
  Py_ssize_t j = 0;
  for (Py_ssize_t s = 0; s < num_samples; ++s) {
    const int64_t b = first_sample + s;
    const int64_t base = b * v_s + offset;
    const Py_ssize_t end = j + lengths[s];
    if (n == 1) {
      for (; j < end; ++j) {
        keys[j] = base + static_cast<int64_t>(ids[j]);
        samples[j] = static_cast<int32_t>(b);
      }
    } else {
      for (; j < end; ++j) {
        const int64_t id = static_cast<int64_t>(ids[j]);
        int64_t shard = id % n + rotation;
        if (shard >= n) shard -= n;
        keys[j] = base + shard * r + id / n;
        samples[j] = static_cast<int32_t>(b);
      }
    }
  }
}

PyObject* fill_keys(PyObject*, PyObject* args) {
  PyObject *keys_object, *samples_object, *ids_object, *lengths_object;
  long long first_sample, v_s, n, r, offset, rotation;
  if (!PyArg_ParseTuple(args, "OOOOLLLLLL", &keys_object, &samples_object, &ids_object,
                        &lengths_object, &first_sample, &v_s, &n, &r, &offset, &rotation)) {
    return nullptr;
  }
  Array keys, samples, ids, lengths;
  if (!keys.Take(keys_object, "keys", 8, true) ||
      !samples.Take(samples_object, "samples", 4, true) ||
      !lengths.Take(lengths_object, "lengths", 8, false)) {
    return nullptr;
  }
  const Py_ssize_t id_size = ItemSize(ids_object, "ids");
  if (id_size < 0) return nullptr;
  if ((id_size != 4 && id_size != 8) || !ids.Take(ids_object, "ids", id_size, false)) {
    if (!PyErr_Occurred()) PyErr_SetString(PyExc_TypeError, "ids must be int32 or int64");
    return nullptr;
  }
  const Py_ssize_t total = Total(lengths);
  if (total < 0) return nullptr;
  if (total != ids.size()) return SizeError("ids: sum of lengths", total, ids.size()), nullptr;
  if (keys.size() != total) return SizeError("keys: sum of lengths", total, keys.size()), nullptr;
  if (samples.size() != total) {
    return SizeError("samples: sum of lengths", total, samples.size()), nullptr;
  }
  if (n < 1 || rotation < 0 || rotation >= n) {
    PyErr_Format(PyExc_ValueError, "need 0 <= rotation < n, got rotation %lld, n %lld", rotation,
                 n);
    return nullptr;
  }
  Py_BEGIN_ALLOW_THREADS;
  if (id_size == 4) {
    FillKeys(keys.data<int64_t>(), samples.data<int32_t>(), ids.data<int32_t>(),
             lengths.data<int64_t>(), lengths.size(), first_sample, v_s, n, r, offset, rotation);
  } else {
    FillKeys(keys.data<int64_t>(), samples.data<int32_t>(), ids.data<int64_t>(),
             lengths.data<int64_t>(), lengths.size(), first_sample, v_s, n, r, offset, rotation);
  }
  Py_END_ALLOW_THREADS;
  Py_RETURN_NONE;
}

// ---------------------------------------------------------------- sort_samples

constexpr Py_ssize_t kRankMax = 32;  // longer samples: std::sort / std::stable_sort
constexpr int kIndexBits = 5;           // 2^5 = kRankMax

// Ranks of `code[0, len)` (distinct values): rank[i] = #{j : code[j] < code[i]}.
// Every inner loop runs len times, so the branch predictor learns it per
// sample, and the compiler vectorises the comparisons.
template <typename Code>
void Ranks(const Code* code, Py_ssize_t len, int32_t* rank) {
  for (Py_ssize_t i = 0; i < len; ++i) {
    const Code c = code[i];
    int32_t r = 0;
    for (Py_ssize_t j = 0; j < len; ++j) r += code[j] < c;
    rank[i] = r;
  }
}

// Stable sort of keys[0, len) (weights alongside when not null) for len <=
// kRankMax, or false when the keys span too much for the codes below. Key i
// gets the code ((key_i - min key) << 5) | i: codes are distinct and ordered
// as (key, i), so a code's rank is key i's place in the stable order.
bool RankSort(int64_t* keys, float* weights, Py_ssize_t len) {
  int64_t low = keys[0], high = keys[0];
  for (Py_ssize_t i = 1; i < len; ++i) {
    low = std::min(low, keys[i]);
    high = std::max(high, keys[i]);
  }
  const uint64_t span = static_cast<uint64_t>(high) - static_cast<uint64_t>(low);
  int32_t rank[kRankMax];
  if (span < (uint64_t{1} << (31 - kIndexBits))) {
    int32_t code[kRankMax];
    for (Py_ssize_t i = 0; i < len; ++i) {
      code[i] = static_cast<int32_t>(((keys[i] - low) << kIndexBits) | i);
    }
    Ranks(code, len, rank);
  } else if (span < (uint64_t{1} << (63 - kIndexBits))) {
    int64_t code[kRankMax];
    for (Py_ssize_t i = 0; i < len; ++i) code[i] = ((keys[i] - low) << kIndexBits) | i;
    Ranks(code, len, rank);
  } else {
    return false;
  }
  int64_t key[kRankMax];
  float weight[kRankMax];
  std::memcpy(key, keys, len * sizeof(int64_t));
  for (Py_ssize_t i = 0; i < len; ++i) keys[rank[i]] = key[i];
  if (weights) {
    std::memcpy(weight, weights, len * sizeof(float));
    for (Py_ssize_t i = 0; i < len; ++i) weights[rank[i]] = weight[i];
  }
  return true;
}

struct Sorter {
  std::vector<std::pair<int64_t, float>> pairs;

  void Sort(int64_t* keys, float* weights, Py_ssize_t len) {
    if (len <= 1) return;
    if (len <= kRankMax && RankSort(keys, weights, len)) return;
    if (std::is_sorted(keys, keys + len)) return;
    if (!weights) {
      std::sort(keys, keys + len);  // equal keys are indistinguishable
      return;
    }
    pairs.resize(len);
    for (Py_ssize_t i = 0; i < len; ++i) pairs[i] = {keys[i], weights[i]};
    std::stable_sort(pairs.begin(), pairs.end(),
                     [](const auto& a, const auto& b) { return a.first < b.first; });
    for (Py_ssize_t i = 0; i < len; ++i) {
      keys[i] = pairs[i].first;
      weights[i] = pairs[i].second;
    }
  }
};

PyObject* merge_samples(PyObject*, PyObject* args) {
  PyObject *keys_object, *weights_object, *lengths_object, *repeats_object, *samples_object;
  long long v_s;
  if (!PyArg_ParseTuple(args, "OOOOLO", &keys_object, &weights_object, &lengths_object,
                        &repeats_object, &v_s, &samples_object)) {
    return nullptr;
  }
  Array keys, weights, lengths, repeats, samples;
  if (!keys.Take(keys_object, "keys", 8, true) ||
      (weights_object != Py_None && !weights.Take(weights_object, "weights", 4, true)) ||
      !lengths.Take(lengths_object, "lengths", 8, false) ||
      !repeats.Take(repeats_object, "repeats", 8, true) ||
      !samples.Take(samples_object, "samples", 4, true)) {
    return nullptr;
  }
  const Py_ssize_t total = Total(lengths);
  if (total < 0) return nullptr;
  if (keys.size() != total) return SizeError("keys: sum of lengths", total, keys.size()), nullptr;
  if (weights_object != Py_None && weights.size() != total) {
    return SizeError("weights: sum of lengths", total, weights.size()), nullptr;
  }
  if (repeats.size() < total) return SizeError("repeats: at least", total, repeats.size()),
                                     nullptr;
  if (samples.size() < total) return SizeError("samples: at least", total, samples.size()),
                                     nullptr;
  if (lengths.size() > std::numeric_limits<int32_t>::max()) {
    PyErr_SetString(PyExc_ValueError, "more samples than int32 numbers");
    return nullptr;
  }
  int64_t* key = keys.data<int64_t>();
  float* weight = weights_object == Py_None ? nullptr : weights.data<float>();
  const int64_t* length = lengths.data<int64_t>();
  int64_t* repeat = repeats.data<int64_t>();
  int32_t* sample = samples.data<int32_t>();
  Py_ssize_t count = 0;
  Py_BEGIN_ALLOW_THREADS;
  // Part p merges samples [first[p], first[p + 1]), whose keys start at
  // start[p]: its entries go to positions start[p], start[p] + 1, ... (never
  // past the key being read), its repeats to found[p]; then the parts' entries
  // move together and the repeats follow in order.
  const Py_ssize_t num_samples = lengths.size();
  const int parts = NumParts(total);
  std::vector<Py_ssize_t> first(parts + 1), start(parts + 1, 0), written(parts, 0);
  for (int p = 0; p <= parts; ++p) first[p] = num_samples * p / parts;
  for (int p = 0; p < parts; ++p) {
    start[p + 1] = start[p];
    for (Py_ssize_t s = first[p]; s < first[p + 1]; ++s) start[p + 1] += length[s];
  }
  std::vector<std::vector<int64_t>> found(parts);
  RunParts(parts, [&](int p) {
    Sorter sorter;
    Py_ssize_t at = start[p], out = start[p];
    for (Py_ssize_t s = first[p]; s < first[p + 1]; ++s) {
      const Py_ssize_t len = length[s];
      sorter.Sort(key + at, weight ? weight + at : nullptr, len);
      const int64_t base = static_cast<int64_t>(s) * v_s;
      int64_t previous = 0;  // the sorted key before key i (key[i - 1] may be overwritten)
      for (Py_ssize_t i = at; i < at + len; ++i) {
        const int64_t k = key[i];
        if (i > at && k == previous) {
          found[p].push_back(i);
          continue;
        }
        previous = k;
        key[out] = k - base;  // out <= i: key i was read
        sample[out++] = static_cast<int32_t>(s);
      }
      at += len;
    }
    written[p] = out - start[p];
  });
  Py_ssize_t entries = 0;
  for (int p = 0; p < parts; ++p) {
    if (entries != start[p]) {
      std::memmove(key + entries, key + start[p], written[p] * sizeof(int64_t));
      std::memmove(sample + entries, sample + start[p], written[p] * sizeof(int32_t));
    }
    entries += written[p];
    std::copy(found[p].begin(), found[p].end(), repeat + count);
    count += static_cast<Py_ssize_t>(found[p].size());
  }
  Py_END_ALLOW_THREADS;
  return PyLong_FromSsize_t(count);
}

// ---------------------------------------------------------------- rank_rows

// Index of the first row outside [0, size), or -1.
Py_ssize_t FirstOutside(const int64_t* rows, Py_ssize_t count, Py_ssize_t size) {
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (static_cast<uint64_t>(rows[i]) >= static_cast<uint64_t>(size)) return i;
  }
  return -1;
}

// rank[i] = before[w] + the marks of word w below bit v mod 64, for v = rows[i]
// and w = v / 64: the number of distinct rows below v. Always inlined, so the
// popcount builtin compiles for its caller's target (below: with and without
// the popcnt instruction).
inline __attribute__((always_inline)) void Ranks(const int64_t* rows, Py_ssize_t begin,
                                                 Py_ssize_t end, const uint64_t* word,
                                                 const int32_t* before, int32_t* rank) {
  for (Py_ssize_t i = begin; i < end; ++i) {
    const uint64_t v = static_cast<uint64_t>(rows[i]);
    const uint64_t below = word[v >> 6] & ((uint64_t{1} << (v & 63)) - 1);
    rank[i] = before[v >> 6] + static_cast<int32_t>(__builtin_popcountll(below));
  }
}

#if defined(__x86_64__) || defined(__i386__)
// x86 builds for a baseline without the popcnt instruction: this copy uses it
// where the processor has it (RanksAnyCpu checks at run time).
__attribute__((target("popcnt"))) void RanksPopcnt(const int64_t* rows, Py_ssize_t begin,
                                                   Py_ssize_t end, const uint64_t* word,
                                                   const int32_t* before, int32_t* rank) {
  Ranks(rows, begin, end, word, before, rank);
}
#endif

void RanksAnyCpu(const int64_t* rows, Py_ssize_t begin, Py_ssize_t end, const uint64_t* word,
                 const int32_t* before, int32_t* rank) {
#if defined(__x86_64__) || defined(__i386__)
  if (__builtin_cpu_supports("popcnt")) {
    RanksPopcnt(rows, begin, end, word, before, rank);
    return;
  }
#endif
  Ranks(rows, begin, end, word, before, rank);
}

PyObject* rank_rows(PyObject*, PyObject* args) {
  PyObject *rows_object, *words_object, *distinct_object, *ranks_object;
  long long size;
  if (!PyArg_ParseTuple(args, "OOLOO", &rows_object, &words_object, &size, &distinct_object,
                        &ranks_object)) {
    return nullptr;
  }
  Array rows, words, distinct, ranks;
  if (!rows.Take(rows_object, "rows", 8, false) ||
      !words.Take(words_object, "words", 8, true) ||
      !distinct.Take(distinct_object, "distinct", 8, true) ||
      !ranks.Take(ranks_object, "ranks", 4, true)) {
    return nullptr;
  }
  const int64_t* row = rows.data<int64_t>();
  const Py_ssize_t count = rows.size();
  const Py_ssize_t num_words = static_cast<Py_ssize_t>((size + 63) / 64);
  if (size < 0 || words.size() < num_words) {
    return SizeError("words: at least (size + 63) / 64", num_words, words.size()), nullptr;
  }
  if (count > std::numeric_limits<int32_t>::max()) {
    PyErr_SetString(PyExc_ValueError, "more rows than int32 ranks");
    return nullptr;
  }
  if (distinct.size() < std::min<Py_ssize_t>(count, size)) {
    return SizeError("distinct: at least", std::min<Py_ssize_t>(count, size), distinct.size()),
           nullptr;
  }
  if (ranks.size() != count) return SizeError("ranks: len(rows)", count, ranks.size()), nullptr;
  const Py_ssize_t outside = FirstOutside(row, count, size);
  if (outside >= 0) {
    PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld is outside [0, %lld)", outside,
                 static_cast<long long>(row[outside]), size);
    return nullptr;
  }
  uint64_t* word = words.data<uint64_t>();
  int64_t* out = distinct.data<int64_t>();
  int32_t* rank = ranks.data<int32_t>();
  Py_ssize_t found = 0;
  Py_BEGIN_ALLOW_THREADS;
  std::memset(word, 0, num_words * sizeof(uint64_t));
  for (Py_ssize_t i = 0; i < count; ++i) {
    word[static_cast<uint64_t>(row[i]) >> 6] |= uint64_t{1} << (row[i] & 63);
  }
  std::vector<int32_t> before(num_words);
  for (Py_ssize_t w = 0; w < num_words; ++w) {
    before[w] = static_cast<int32_t>(found);
    for (uint64_t bits = word[w]; bits; bits &= bits - 1) {
      out[found++] = w * 64 + __builtin_ctzll(bits);
    }
  }
  const int parts = NumParts(count);
  RunParts(parts, [&](int p) {
    RanksAnyCpu(row, count * p / parts, count * (p + 1) / parts, word, before.data(), rank);
  });
  Py_END_ALLOW_THREADS;
  return PyLong_FromSsize_t(found);
}

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

// ---------------------------------------------------------------- rank_kept_rows

// Marks of the bit map `word` over the rows [lo, hi).
int64_t CountMarks(const uint64_t* word, int64_t lo, int64_t hi) {
  int64_t total = 0;
  for (int64_t row = lo; row < hi;) {
    const int64_t w = row >> 6, end = std::min(hi, (w + 1) * 64);
    uint64_t mask = ~uint64_t{0} << (row & 63);
    if (end < (w + 1) * 64) mask &= (uint64_t{1} << (end & 63)) - 1;
    total += __builtin_popcountll(word[w] & mask);
    row = end;
  }
  return total;
}

PyObject* rank_kept_rows(PyObject*, PyObject* args) {
  PyObject *rows_object, *out_rows_object, *samples_object, *out_samples_object,
      *weights_object, *out_weights_object, *words_object, *keep_object, *distinct_object,
      *ranks_object, *all_counts_object, *unique_counts_object;
  long long size, rows_per_shard, unique_capacity, entry_capacity;
  if (!PyArg_ParseTuple(args, "OOOOOOOLLLLOOOOO", &rows_object, &out_rows_object,
                        &samples_object, &out_samples_object, &weights_object,
                        &out_weights_object, &words_object, &size, &rows_per_shard,
                        &unique_capacity, &entry_capacity, &keep_object, &distinct_object,
                        &ranks_object, &all_counts_object, &unique_counts_object)) {
    return nullptr;
  }
  const bool weighted = weights_object != Py_None;
  if (weighted != (out_weights_object != Py_None)) {
    PyErr_SetString(PyExc_ValueError, "weights and out_weights: both arrays or both None");
    return nullptr;
  }
  Array rows, out_rows, samples, out_samples, weights, out_weights, words, keep, distinct, ranks,
      all_counts, unique_counts;
  if (!rows.Take(rows_object, "rows", 8, false) ||
      !out_rows.Take(out_rows_object, "out_rows", 8, true) ||
      !samples.Take(samples_object, "samples", 4, false) ||
      !out_samples.Take(out_samples_object, "out_samples", 4, true) ||
      (weighted && !weights.Take(weights_object, "weights", 4, false)) ||
      (weighted && !out_weights.Take(out_weights_object, "out_weights", 4, true)) ||
      !words.Take(words_object, "words", 8, true) || !keep.Take(keep_object, "keep", 1, true) ||
      !distinct.Take(distinct_object, "distinct", 8, true) ||
      !ranks.Take(ranks_object, "ranks", 4, true) ||
      !all_counts.Take(all_counts_object, "all_counts", 8, true) ||
      !unique_counts.Take(unique_counts_object, "unique_counts", 8, true)) {
    return nullptr;
  }
  const Py_ssize_t count = rows.size();
  const int64_t num_shards = all_counts.size();
  if (num_shards < 1 || unique_counts.size() != num_shards || rows_per_shard < 1 ||
      size < 0 || size > num_shards * rows_per_shard || unique_capacity < 0) {
    PyErr_Format(PyExc_ValueError,
                 "need len(all_counts) = len(unique_counts) >= 1 shards of rows_per_shard >= 1"
                 " rows holding the size rows, and U >= 0; got %zd, %zd, %lld, %lld, %lld",
                 all_counts.size(), unique_counts.size(), rows_per_shard, size,
                 unique_capacity);
    return nullptr;
  }
  if (count > std::numeric_limits<int32_t>::max()) {
    PyErr_SetString(PyExc_ValueError, "more rows than int32 ranks");
    return nullptr;
  }
  const Py_ssize_t num_words = static_cast<Py_ssize_t>(size / 64 + 1);
  if (words.size() < 2 * num_words) {
    return SizeError("words: at least 2 * (size / 64 + 1)", 2 * num_words, words.size()),
           nullptr;
  }
  const std::pair<const Array*, const char*> per_entry[] = {
      {&out_rows, "out_rows: len(rows)"}, {&samples, "samples: len(rows)"},
      {&out_samples, "out_samples: len(rows)"}, {&keep, "keep: len(rows)"},
      {&ranks, "ranks: len(rows)"}};
  for (const auto& [array, name] : per_entry) {
    if (array->size() != count) return SizeError(name, count, array->size()), nullptr;
  }
  if (weighted && (weights.size() != count || out_weights.size() != count)) {
    return SizeError("weights and out_weights: len(rows)", count,
                     weights.size() != count ? weights.size() : out_weights.size()),
           nullptr;
  }
  if (distinct.size() < std::min<Py_ssize_t>(count, size)) {
    return SizeError("distinct: at least", std::min<Py_ssize_t>(count, size), distinct.size()),
           nullptr;
  }
  const int64_t* row = rows.data<int64_t>();
  const Py_ssize_t outside = FirstOutside(row, count, size);
  if (outside >= 0) {
    PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld is outside [0, %lld)", outside,
                 static_cast<long long>(row[outside]), size);
    return nullptr;
  }
  uint64_t* word = words.data<uint64_t>();
  uint64_t* late = word + num_words;
  int64_t* out = out_rows.data<int64_t>();
  int32_t* rank = ranks.data<int32_t>();
  int64_t* listed = distinct.data<int64_t>();
  int64_t* all = all_counts.data<int64_t>();
  int64_t* unique = unique_counts.data<int64_t>();
  Py_ssize_t kept = 0, found = 0;
  Py_BEGIN_ALLOW_THREADS;
  std::memset(word, 0, 2 * num_words * sizeof(uint64_t));
  std::vector<int64_t> counts(num_shards);
  auto run = [&](auto one_shard, auto with_weights, const auto& locate) {
    return DropPass<decltype(one_shard)::value, decltype(with_weights)::value>(
        row, count, locate, num_shards, unique_capacity, entry_capacity,
        samples.data<int32_t>(), weighted ? weights.data<float>() : nullptr, word, late,
        keep.data<uint8_t>(),
        DropOutput<int64_t>{out_samples.data<int32_t>(),
                            weighted ? out_weights.data<float>() : nullptr, out},
        counts.data(), all);
  };
  const auto one = [](int64_t r) { return Located{0, r}; };
  const uint64_t r = static_cast<uint64_t>(rows_per_shard);
  const auto many = [r](int64_t v) {
    return Located{static_cast<int64_t>(static_cast<uint64_t>(v) / r), v};
  };
  using Yes = std::true_type;
  using No = std::false_type;
  if (num_shards == 1) {
    kept = weighted ? run(Yes{}, Yes{}, one) : run(Yes{}, No{}, one);
  } else {
    kept = weighted ? run(No{}, Yes{}, many) : run(No{}, No{}, many);
  }
  // As rank_rows, over the kept rows: they ascending, then their ranks.
  std::vector<int32_t> before(num_words);
  for (Py_ssize_t w = 0; w < num_words; ++w) {
    before[w] = static_cast<int32_t>(found);
    for (uint64_t bits = word[w]; bits; bits &= bits - 1) {
      listed[found++] = w * 64 + __builtin_ctzll(bits);
    }
  }
  const int parts = NumParts(kept);
  RunParts(parts, [&](int p) {
    RanksAnyCpu(out, kept * p / parts, kept * (p + 1) / parts, word, before.data(), rank);
  });
  // Shard n's rows before dropping: its kept rows (from the counts of the
  // listing) and, where any row kept no entry, its marks in `late`.
  auto kept_before = [&](int64_t row) {
    const uint64_t below = word[row >> 6] & ((uint64_t{1} << (row & 63)) - 1);
    return static_cast<int64_t>(before[row >> 6]) + __builtin_popcountll(below);
  };
  uint64_t any_late = 0;
  for (Py_ssize_t w = 0; w < num_words; ++w) any_late |= late[w];
  for (int64_t n = 0; n < num_shards; ++n) {
    const int64_t lo = std::min<int64_t>(n * rows_per_shard, size);
    const int64_t hi = std::min<int64_t>((n + 1) * rows_per_shard, size);
    unique[n] = kept_before(hi) - kept_before(lo) + (any_late ? CountMarks(late, lo, hi) : 0);
  }
  Py_END_ALLOW_THREADS;
  return Py_BuildValue("nn", kept, found);
}

PyMethodDef kMethods[] = {
    {"fill_keys", fill_keys, METH_VARARGS, "Keys and samples of consecutive samples' ids."},
    {"merge_samples", merge_samples, METH_VARARGS,
     "Stable sort of every sample's keys, then its entries; returns the repeats."},
    {"drop_device", drop_device, METH_VARARGS,
     "One device's entries kept by the overflow rules, compacted, and its kept rows."},
    {"rank_kept_rows", rank_kept_rows, METH_VARARGS,
     "rank_rows over the entries kept by the overflow rules, which it applies."},
    {"rank_rows", rank_rows, METH_VARARGS,
     "Ascending distinct rows and every row's rank among them, via a bit map."},
    {nullptr, nullptr, 0, nullptr},
};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_host_kernels",
    "C++ loops of host preprocessing (see _native.py).", -1, kMethods,
    nullptr, nullptr, nullptr, nullptr,
};

}  // namespace

PyMODINIT_FUNC PyInit__host_kernels() { return PyModule_Create(&kModule); }
