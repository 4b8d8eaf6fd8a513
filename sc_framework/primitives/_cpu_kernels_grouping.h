// The valid entries of a batch grouped by unique row, and SegmentGrads: the
// gradient sums per unique row (the fused updates sum them the same way).
//
// Included by _cpu_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_GROUPING_H_
#define SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_GROUPING_H_

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>
#include <memory>
#include <vector>

#include "_cpu_kernels_common.h"

namespace {

// The valid entries of a batch grouped by unique row (a stable counting sort):
// unique row k's entries are positions begin_of[k] .. begin_of[k + 1) of
// sample and gain, in ascending entry order whatever the thread count, so
// every sum over them has a fixed order. Entries whose unique index is outside
// [0, unique_count) or whose sample is outside [0, samples) are left out.
struct EntriesByUniqueRow {
  std::unique_ptr<int32_t[]> begin_of;  // [K + 1]
  std::unique_ptr<int32_t[]> sample;    // [E] (the first begin_of[K] are used)
  std::unique_ptr<float[]> gain;        // [E]
};

// The sort runs in parts that own contiguous ranges of unique rows: each part
// scans all entries (sequential reads) and counts, then places, only the
// entries of its own rows, so no two parts write the same position and no
// per-part histogram is needed. Needs E < 2^31 (GroupingCheck).
EntriesByUniqueRow GroupByUniqueRow(const int32_t* sample_of, const int32_t* unique_of,
                                    const float* gain_of, int64_t entries, int64_t samples,
                                    int64_t unique_count) {
  EntriesByUniqueRow groups{std::unique_ptr<int32_t[]>(new int32_t[unique_count + 1]),
                            std::unique_ptr<int32_t[]>(new int32_t[std::max<int64_t>(entries, 1)]),
                            std::unique_ptr<float[]>(new float[std::max<int64_t>(entries, 1)])};
  int32_t* begin_of = groups.begin_of.get();
  begin_of[0] = 0;
  const int parts = static_cast<int>(
      std::min<int64_t>(std::max<int64_t>(unique_count, 1), NumThreads(entries + unique_count)));
  const int64_t step = (unique_count + parts - 1) / parts;
  std::vector<int64_t> part_total(parts + 1, 0);
  auto each_part = [&](auto&& body) {
    ParallelFor(parts, parts, [&](int64_t first, int64_t last) {
      for (int64_t part = first; part < last; ++part) {
        body(part, std::min(unique_count, part * step), std::min(unique_count, (part + 1) * step));
      }
    });
  };
  // Pass 1: begin_of[k + 1] = the count of unique row k.
  each_part([&](int64_t part, int64_t lo, int64_t hi) {
    std::fill(begin_of + lo + 1, begin_of + hi + 1, 0);
    int64_t total = 0;
    for (int64_t e = 0; e < entries; ++e) {
      const int64_t k = unique_of[e];
      if (k < lo || k >= hi || sample_of[e] < 0 || sample_of[e] >= samples) continue;
      ++begin_of[k + 1];
      ++total;
    }
    part_total[part + 1] = total;
  });
  for (int part = 0; part < parts; ++part) part_total[part + 1] += part_total[part];
  // Pass 2: begin_of[k + 1] = the start of row k, then placing each entry
  // advances it to the end of row k, i.e. the start of row k + 1.
  each_part([&](int64_t part, int64_t lo, int64_t hi) {
    int64_t running = part_total[part];
    for (int64_t k = lo; k < hi; ++k) {
      const int64_t count = begin_of[k + 1];
      begin_of[k + 1] = static_cast<int32_t>(running);
      running += count;
    }
    for (int64_t e = 0; e < entries; ++e) {
      const int64_t k = unique_of[e];
      if (k < lo || k >= hi || sample_of[e] < 0 || sample_of[e] >= samples) continue;
      const int32_t at = begin_of[k + 1]++;
      groups.sample[at] = sample_of[e];
      groups.gain[at] = gain_of[e];
    }
  });
  return groups;
}

// The grouping stores positions as int32: at most 2^31 - 1 entries.
ffi::Error GroupingCheck(const char* kernel, ffi::Span<const int64_t> unique_index) {
  int64_t entries = 1;
  for (int64_t d : unique_index) entries *= d;
  if (entries <= std::numeric_limits<int32_t>::max()) return ffi::Error::Success();
  return ShapeError(kernel, "unique_index", unique_index,
                    "at most 2^31 - 1 entries; split the batch into smaller steps");
}

// row = sum over the entries of unique row k of gain[e] * grad[sample[e]], added
// to 0 in entry order. The first term is written as 0 + gain * grad (the bits
// adding it to a zeroed row gives), so the row is not zeroed first: most rows
// of a batch have one entry, and the memset cost ~5% of an update.
inline void UniqueRowGradient(const EntriesByUniqueRow& groups, int64_t k, const float* grad,
                              int64_t dim, float* row) {
  int64_t i = groups.begin_of[k];
  const int64_t stop = groups.begin_of[k + 1];
  if (i == stop) {
    std::memset(row, 0, dim * sizeof(float));
    return;
  }
  const float* first = grad + static_cast<int64_t>(groups.sample[i]) * dim;
  const float gain = groups.gain[i];
  for (int64_t d = 0; d < dim; ++d) row[d] = 0.0f + gain * first[d];
  for (++i; i < stop; ++i) {
    Axpy(row, grad + static_cast<int64_t>(groups.sample[i]) * dim, groups.gain[i], dim);
  }
}

// Prefetches the gradient rows that UniqueRowGradient(k) reads.
inline void PrefetchUniqueRowGradient(const EntriesByUniqueRow& groups, int64_t k,
                                      const float* grad, int64_t dim) {
  const int64_t stop = groups.begin_of[k + 1];
  for (int64_t i = groups.begin_of[k]; i < stop; ++i) {
    PrefetchFloats<0>(grad + static_cast<int64_t>(groups.sample[i]) * dim, dim);
  }
}

ffi::Error SegmentGradsImpl(ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> entry_samples,
                            ffi::Buffer<ffi::S32> entry_unique_index, ffi::Buffer<ffi::F32> gains,
                            ffi::ResultBuffer<ffi::F32> out) {
  constexpr char kKernel[] = "sc_framework_segment_grads";
  SC_RETURN_IF_ERROR(CheckRank(kKernel, "grads", grads.dimensions(), 2));
  SC_RETURN_IF_ERROR(CheckEntries(kKernel, grads.dimensions(), grads.dimensions()[1],
                                  entry_samples.dimensions(), entry_unique_index.dimensions(),
                                  gains.dimensions()));
  SC_RETURN_IF_ERROR(CheckRank(kKernel, "the output", out->dimensions(), 2));
  SC_RETURN_IF_ERROR(CheckDims(kKernel, "the output", out->dimensions(),
                               {out->dimensions()[0], grads.dimensions()[1]},
                               "[K, D] with the gradients' width D"));
  const int64_t samples = grads.dimensions()[0];
  const int64_t dim = grads.dimensions()[1];
  const int64_t unique_count = out->dimensions()[0];
  const int64_t entries = entry_unique_index.element_count();
  SC_RETURN_IF_ERROR(GroupingCheck(kKernel, entry_unique_index.dimensions()));
  const EntriesByUniqueRow groups =
      GroupByUniqueRow(entry_samples.typed_data(), entry_unique_index.typed_data(),
                       gains.typed_data(), entries, samples, unique_count);
  const float* grad = grads.typed_data();
  float* target = out->typed_data();
  ParallelFor(unique_count, NumThreads(entries * dim), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      if (k + kRowsAhead < end) PrefetchUniqueRowGradient(groups, k + kRowsAhead, grad, dim);
      UniqueRowGradient(groups, k, grad, dim, target + k * dim);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#endif  // SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_GROUPING_H_
