// rank_kept_rows of the host preprocessing loops: rank_rows over the entries
// kept by the overflow rules of drop_device, in one pass.
//
// Included by _host_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_RANK_KEPT_H_
#define SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_RANK_KEPT_H_

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
#include "_host_kernels_drop.h"
#include "_host_kernels_rank.h"

namespace {

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
  if (!RowsInside(row, count, size)) return nullptr;
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
  std::vector<int32_t> before;
  found = ListAndRank(word, num_words, out, kept, listed, rank, before);
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

}  // namespace

#endif  // SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_RANK_KEPT_H_
