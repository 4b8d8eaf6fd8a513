// fill_keys and merge_samples of the host preprocessing loops: the keys of
// a batch's ids and the stable sort of every sample's keys.
//
// Included by _host_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_SORT_H_
#define SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_SORT_H_

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


}  // namespace

#endif  // SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_SORT_H_
