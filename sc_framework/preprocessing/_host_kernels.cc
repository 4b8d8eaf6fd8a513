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
//   drop_entries(ids, parts | None, P, U, C, keep, alive) -> kept
//       Entries e in (sample, row) order, of row ids[e] (numbered over all
//       partitions) in partition parts[e] (None: one): keep[e] = the row is
//       among the first U rows of its partition in first-entry order, and
//       the entry among the first C such entries of its partition;
//       alive[row] = any of its entries is kept.
//   kept_unique_index(ids, keep, alive, offsets, n, U, unique_of, out, counts) -> k
//       Rows offsets[p] ... offsets[p + 1] - 1 form partition p: unique_of[row]
//       = (p mod n) * U + (alive rows before it in p), counts[p] = alive rows
//       of p, and out[:k] = unique_of[ids[e]] of the kept entries e, in order.

#define PY_SSIZE_T_CLEAN
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <numeric>
#include <system_error>
#include <thread>
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
// and w = v / 64: the number of distinct rows below v.
template <typename Popcount>
void Ranks(const int64_t* rows, Py_ssize_t begin, Py_ssize_t end, const uint64_t* word,
           const int32_t* before, int32_t* rank, Popcount popcount) {
  for (Py_ssize_t i = begin; i < end; ++i) {
    const uint64_t v = static_cast<uint64_t>(rows[i]);
    const uint64_t below = word[v >> 6] & ((uint64_t{1} << (v & 63)) - 1);
    rank[i] = before[v >> 6] + popcount(below);
  }
}

int32_t Popcount(uint64_t x) { return static_cast<int32_t>(__builtin_popcountll(x)); }

#if defined(__x86_64__) || defined(__i386__)
// x86 builds for a baseline without the popcnt instruction: this copy uses it
// where the processor has it (RanksAnyCpu checks at run time).
__attribute__((target("popcnt"))) int32_t PopcountInstruction(uint64_t x) {
  return static_cast<int32_t>(__builtin_popcountll(x));
}

__attribute__((target("popcnt"))) void RanksPopcnt(const int64_t* rows, Py_ssize_t begin,
                                                   Py_ssize_t end, const uint64_t* word,
                                                   const int32_t* before, int32_t* rank) {
  Ranks(rows, begin, end, word, before, rank, PopcountInstruction);
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
  Ranks(rows, begin, end, word, before, rank, Popcount);
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

// ---------------------------------------------------------------- drop_entries

// The pass of drop_entries; kOnePart: all entries in partition 0, whose
// counters are plain locals (never addressed, so byte stores cannot alias
// them and they stay in registers). state[row] (zeroed, num_rows): 0 not seen
// yet, 1 among its partition's first U rows, 2 not.
template <bool kOnePart>
Py_ssize_t Drop(const int64_t* id, const int64_t* part, Py_ssize_t size, int64_t num_parts,
                int64_t unique_capacity, int64_t entry_capacity, uint8_t* kept,
                uint8_t* state, uint8_t* live) {
  std::vector<int64_t> rows_seen(kOnePart ? 0 : num_parts, 0);
  std::vector<int64_t> entries_kept(kOnePart ? 0 : num_parts, 0);
  int64_t one_seen = 0, one_kept = 0;
  Py_ssize_t total = 0;
  for (Py_ssize_t e = 0; e < size; ++e) {
    const int64_t row = id[e];
    const int64_t seen_rows = kOnePart ? one_seen : rows_seen[part[e]];
    const int64_t kept_entries = kOnePart ? one_kept : entries_kept[part[e]];
    // Branch-free: half the rows are seen for the first time, unpredictably.
    const uint8_t old = state[row];
    const uint8_t fresh = old == 0;
    const uint8_t status = fresh ? (seen_rows < unique_capacity ? 1 : 2) : old;
    const uint8_t take = (status == 1) & (kept_entries < entry_capacity);
    if constexpr (kOnePart) {
      one_seen += fresh;
      one_kept += take;
    } else {
      rows_seen[part[e]] += fresh;
      entries_kept[part[e]] += take;
    }
    state[row] = status;
    kept[e] = take;
    live[row] |= take;
    total += take;
  }
  return total;
}

PyObject* drop_entries(PyObject*, PyObject* args) {
  PyObject *ids_object, *parts_object, *keep_object, *alive_object;
  long long num_parts, unique_capacity, entry_capacity;
  if (!PyArg_ParseTuple(args, "OOLLLOO", &ids_object, &parts_object, &num_parts,
                        &unique_capacity, &entry_capacity, &keep_object, &alive_object)) {
    return nullptr;
  }
  const bool one_part = parts_object == Py_None;
  Array ids, parts, keep, alive;
  if (!ids.Take(ids_object, "ids", 8, false) ||
      (!one_part && !parts.Take(parts_object, "parts", 8, false)) ||
      !keep.Take(keep_object, "keep", 1, true) || !alive.Take(alive_object, "alive", 1, true)) {
    return nullptr;
  }
  const Py_ssize_t size = ids.size(), num_rows = alive.size();
  if (keep.size() != size) return SizeError("keep: len(ids)", size, keep.size()), nullptr;
  if (!one_part && parts.size() != size) {
    return SizeError("parts: len(ids)", size, parts.size()), nullptr;
  }
  if (num_parts < 1 || (one_part && num_parts != 1)) {
    PyErr_Format(PyExc_ValueError, "num_parts = %lld: at least 1, and 1 without parts",
                 num_parts);
    return nullptr;
  }
  const int64_t* id = ids.data<int64_t>();
  const int64_t* part = one_part ? nullptr : parts.data<int64_t>();
  Py_ssize_t outside = FirstOutside(id, size, num_rows);
  if (outside >= 0) {
    PyErr_Format(PyExc_ValueError, "ids[%zd] = %lld is outside [0, %zd)", outside,
                 static_cast<long long>(id[outside]), num_rows);
    return nullptr;
  }
  outside = one_part ? -1 : FirstOutside(part, size, num_parts);
  if (outside >= 0) {
    PyErr_Format(PyExc_ValueError, "parts[%zd] = %lld is outside [0, %lld)", outside,
                 static_cast<long long>(part[outside]), num_parts);
    return nullptr;
  }
  uint8_t* kept = keep.data<uint8_t>();
  uint8_t* live = alive.data<uint8_t>();
  Py_ssize_t total = 0;
  Py_BEGIN_ALLOW_THREADS;
  std::vector<uint8_t> state(num_rows, 0);
  std::memset(live, 0, num_rows);
  total = one_part ? Drop<true>(id, part, size, num_parts, unique_capacity, entry_capacity, kept,
                                state.data(), live)
                   : Drop<false>(id, part, size, num_parts, unique_capacity, entry_capacity,
                                 kept, state.data(), live);
  Py_END_ALLOW_THREADS;
  return PyLong_FromSsize_t(total);
}

// ---------------------------------------------------------------- kept_unique_index

PyObject* kept_unique_index(PyObject*, PyObject* args) {
  PyObject *ids_object, *keep_object, *alive_object, *offsets_object, *unique_of_object,
      *out_object, *alive_counts_object;
  long long num_shards, unique_capacity;
  if (!PyArg_ParseTuple(args, "OOOOLLOOO", &ids_object, &keep_object, &alive_object,
                        &offsets_object, &num_shards, &unique_capacity, &unique_of_object,
                        &out_object, &alive_counts_object)) {
    return nullptr;
  }
  Array ids, keep, alive, offsets, unique_of, out, alive_counts;
  if (!ids.Take(ids_object, "ids", 8, false) || !keep.Take(keep_object, "keep", 1, false) ||
      !alive.Take(alive_object, "alive", 1, false) ||
      !offsets.Take(offsets_object, "offsets", 8, false) ||
      !unique_of.Take(unique_of_object, "unique_of", 4, true) ||
      !out.Take(out_object, "out", 4, true) ||
      !alive_counts.Take(alive_counts_object, "alive_counts", 8, true)) {
    return nullptr;
  }
  const Py_ssize_t size = ids.size(), num_rows = alive.size();
  const Py_ssize_t num_parts = offsets.size() - 1;
  const int64_t* offset = offsets.data<int64_t>();
  if (keep.size() != size) return SizeError("keep: len(ids)", size, keep.size()), nullptr;
  if (out.size() != size) return SizeError("out: len(ids)", size, out.size()), nullptr;
  if (unique_of.size() != num_rows) {
    return SizeError("unique_of: len(alive)", num_rows, unique_of.size()), nullptr;
  }
  if (num_parts < 1 || alive_counts.size() != num_parts) {
    return SizeError("alive_counts: len(offsets) - 1", num_parts, alive_counts.size()), nullptr;
  }
  for (Py_ssize_t p = 0; p <= num_parts; ++p) {
    const bool bad = p == 0 ? offset[0] != 0
                            : offset[p] < offset[p - 1] || (p == num_parts && offset[p] != num_rows);
    if (bad) {
      PyErr_Format(PyExc_ValueError,
                   "offsets must not decrease from 0 to len(alive) = %zd, got offsets[%zd] = %lld",
                   num_rows, p, static_cast<long long>(offset[p]));
      return nullptr;
    }
  }
  if (num_shards < 1 || (num_shards - 1) * unique_capacity + num_rows >
                            std::numeric_limits<int32_t>::max()) {
    PyErr_SetString(PyExc_ValueError, "unique indices beyond int32");
    return nullptr;
  }
  const int64_t* id = ids.data<int64_t>();
  const Py_ssize_t outside = FirstOutside(id, size, num_rows);
  if (outside >= 0) {
    PyErr_Format(PyExc_ValueError, "ids[%zd] = %lld is outside [0, %zd)", outside,
                 static_cast<long long>(id[outside]), num_rows);
    return nullptr;
  }
  const uint8_t* kept = keep.data<uint8_t>();
  const uint8_t* live = alive.data<uint8_t>();
  int32_t* unique = unique_of.data<int32_t>();
  int32_t* index = out.data<int32_t>();
  int64_t* counts = alive_counts.data<int64_t>();
  Py_ssize_t total = 0;
  Py_BEGIN_ALLOW_THREADS;
  for (Py_ssize_t p = 0; p < num_parts; ++p) {
    const int32_t shift = static_cast<int32_t>(p % num_shards * unique_capacity);
    int32_t running = 0;
    for (int64_t row = offset[p]; row < offset[p + 1]; ++row) {
      unique[row] = shift + running;
      running += live[row] != 0;
    }
    counts[p] = running;
  }
  for (Py_ssize_t e = 0; e < size; ++e) {
    index[total] = unique[id[e]];  // branch-free: overwritten unless kept
    total += kept[e] != 0;
  }
  Py_END_ALLOW_THREADS;
  return PyLong_FromSsize_t(total);
}

PyMethodDef kMethods[] = {
    {"fill_keys", fill_keys, METH_VARARGS, "Keys and samples of consecutive samples' ids."},
    {"merge_samples", merge_samples, METH_VARARGS,
     "Stable sort of every sample's keys, then its entries; returns the repeats."},
    {"drop_entries", drop_entries, METH_VARARGS,
     "The entries kept by the overflow rules, and the rows they keep alive."},
    {"kept_unique_index", kept_unique_index, METH_VARARGS,
     "Unique indices n * U + u' of the kept entries, u' the rank among alive rows."},
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
