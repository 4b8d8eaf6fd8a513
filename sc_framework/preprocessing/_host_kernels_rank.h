// rank_rows of the host preprocessing loops: distinct rows and their ranks
// through a bit map.
//
// Included by _host_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_RANK_H_
#define SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_RANK_H_

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <utility>
#include <vector>

#include "_host_kernels_common.h"

namespace {

// ---------------------------------------------------------------- rank_rows

// True when every row is in [0, size); else sets a ValueError naming the
// first row outside and returns false.
bool RowsInside(const int64_t* rows, Py_ssize_t count, Py_ssize_t size) {
  for (Py_ssize_t i = 0; i < count; ++i) {
    if (static_cast<uint64_t>(rows[i]) >= static_cast<uint64_t>(size)) {
      PyErr_Format(PyExc_ValueError, "rows[%zd] = %lld is outside [0, %lld)", i,
                   static_cast<long long>(rows[i]), static_cast<long long>(size));
      return false;
    }
  }
  return true;
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

// Marks rows[0, count) in word[num_words] (cleared first), skipping rows
// outside [0, size); returns whether every row was inside. A large batch marks
// on NumParts(count) threads, part p its p-th share of the rows in a map of
// its own (part 0 in `word`), and the maps are OR-ed into `word` by word
// ranges: the maps are small beside the rows (num_words * 4 <= count), so
// their clearing and merging cost little.
bool MarkRows(const int64_t* rows, Py_ssize_t count, Py_ssize_t size, uint64_t* word,
              Py_ssize_t num_words) {
  std::memset(word, 0, num_words * sizeof(uint64_t));
  const int parts = num_words * 4 <= count ? NumParts(count) : 1;
  std::vector<std::vector<uint64_t>> maps(parts - 1);
  std::vector<char> inside(parts, 1);
  RunParts(parts, [&](int p) {
    uint64_t* map = word;
    if (p > 0) {
      maps[p - 1].assign(num_words, 0);
      map = maps[p - 1].data();
    }
    bool all_inside = true;
    for (Py_ssize_t i = count * p / parts; i < count * (p + 1) / parts; ++i) {
      const uint64_t v = static_cast<uint64_t>(rows[i]);
      if (v >= static_cast<uint64_t>(size)) {
        all_inside = false;
        continue;
      }
      map[v >> 6] |= uint64_t{1} << (v & 63);
    }
    inside[p] = all_inside;
  });
  if (parts > 1) {
    RunParts(parts, [&](int p) {
      for (const std::vector<uint64_t>& map : maps) {
        for (Py_ssize_t w = num_words * p / parts; w < num_words * (p + 1) / parts; ++w) {
          word[w] |= map[w];
        }
      }
    });
  }
  return std::all_of(inside.begin(), inside.end(), [](char ok) { return ok != 0; });
}

// The rows marked in word[num_words], ascending, into listed, and before[w]:
// the rows listed before word w (before[num_words]: all of them); then rank[i]
// = the rank of rows[i] among them, for i in [0, count). Both on threads: the
// listing by word ranges (each part counts its marks first, so it knows where
// its rows go), the ranks by ranges of rows. Returns the number listed.
Py_ssize_t ListAndRank(const uint64_t* word, Py_ssize_t num_words, const int64_t* rows,
                       Py_ssize_t count, int64_t* listed, int32_t* rank,
                       std::vector<int32_t>& before) {
  before.assign(num_words + 1, 0);
  const int list_parts = NumParts(num_words * 64);
  std::vector<Py_ssize_t> start(list_parts + 1, 0);
  auto words_of = [&](int p) {
    return std::make_pair(num_words * p / list_parts, num_words * (p + 1) / list_parts);
  };
  RunParts(list_parts, [&](int p) {
    const auto [first, last] = words_of(p);
    Py_ssize_t marks = 0;
    for (Py_ssize_t w = first; w < last; ++w) marks += __builtin_popcountll(word[w]);
    start[p + 1] = marks;
  });
  for (int p = 0; p < list_parts; ++p) start[p + 1] += start[p];
  RunParts(list_parts, [&](int p) {
    const auto [first, last] = words_of(p);
    Py_ssize_t found = start[p];
    for (Py_ssize_t w = first; w < last; ++w) {
      before[w] = static_cast<int32_t>(found);
      for (uint64_t bits = word[w]; bits; bits &= bits - 1) {
        listed[found++] = w * 64 + __builtin_ctzll(bits);
      }
    }
  });
  const Py_ssize_t found = start[list_parts];
  before[num_words] = static_cast<int32_t>(found);
  const int parts = NumParts(count);
  RunParts(parts, [&](int p) {
    RanksAnyCpu(rows, count * p / parts, count * (p + 1) / parts, word, before.data(), rank);
  });
  return found;
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
  uint64_t* word = words.data<uint64_t>();
  int64_t* out = distinct.data<int64_t>();
  int32_t* rank = ranks.data<int32_t>();
  Py_ssize_t found = 0;
  bool inside;
  Py_BEGIN_ALLOW_THREADS;
  inside = MarkRows(row, count, size, word, num_words);
  if (inside) {
    std::vector<int32_t> before;
    found = ListAndRank(word, num_words, row, count, out, rank, before);
  }
  Py_END_ALLOW_THREADS;
  if (!inside) {
    RowsInside(row, count, size);  // names the first row outside
    return nullptr;
  }
  return PyLong_FromSsize_t(found);
}


}  // namespace

#endif  // SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_RANK_H_
