// The row operations of the CPU kernels: GatherRows, ScatterRows and
// CombineEntries.
//
// Included by _cpu_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_ROWS_H_
#define SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_ROWS_H_

#include <algorithm>
#include <cstdint>
#include <cstring>

#include "_cpu_kernels_common.h"

namespace {

ffi::Error GatherRowsImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> index,
                          ffi::ResultBuffer<ffi::F32> out) {
  constexpr char kKernel[] = "sc_framework_gather_rows";
  SC_RETURN_IF_ERROR(CheckRank(kKernel, "table", table.dimensions(), 2));
  const int64_t rows = table.dimensions()[0];
  const int64_t dim = table.dimensions()[1];
  const int64_t count = index.element_count();
  SC_RETURN_IF_ERROR(CheckDims(kKernel, "the output", out->dimensions(), {count, dim},
                               "[K, D]: one table row per index"));
  const float* source = table.typed_data();
  const int32_t* idx = index.typed_data();
  float* target = out->typed_data();
  ParallelFor(count, NumThreads(count * dim), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      if (k + 8 < end && idx[k + 8] >= 0 && idx[k + 8] < rows) {
        __builtin_prefetch(source + static_cast<int64_t>(idx[k + 8]) * dim);
      }
      const int64_t row = idx[k];
      if (row >= 0 && row < rows) {
        std::memcpy(target + k * dim, source + row * dim, dim * sizeof(float));
      } else {
        std::memset(target + k * dim, 0, dim * sizeof(float));
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error ScatterRowsImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> index,
                           ffi::Buffer<ffi::F32> values, ffi::ResultBuffer<ffi::F32> out) {
  constexpr char kKernel[] = "sc_framework_scatter_rows";
  SC_RETURN_IF_ERROR(CheckTableAndOut(kKernel, table.dimensions(), out->dimensions()));
  const int64_t rows = table.dimensions()[0];
  const int64_t dim = table.dimensions()[1];
  const int64_t count = index.element_count();
  SC_RETURN_IF_ERROR(CheckDims(kKernel, "rows", values.dimensions(), {count, dim},
                               "[K, D]: one row of the table's width per index"));
  float* target = out->typed_data();
  if (target != table.typed_data()) {  // not aliased: start from a copy
    std::memcpy(target, table.typed_data(), rows * dim * sizeof(float));
  }
  const int32_t* idx = index.typed_data();
  const float* source = values.typed_data();
  ParallelFor(count, NumThreads(count * dim), [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      const int64_t row = idx[k];
      if (row >= 0 && row < rows) {
        std::memcpy(target + row * dim, source + k * dim, dim * sizeof(float));
      }
    }
  });
  return ffi::Error::Success();
}

ffi::Error CombineEntriesImpl(ffi::Buffer<ffi::F32> source, ffi::Buffer<ffi::S32> entry_rows,
                              ffi::Buffer<ffi::S32> entry_samples, ffi::Buffer<ffi::F32> gains,
                              ffi::ResultBuffer<ffi::F32> out) {
  constexpr char kKernel[] = "sc_framework_combine_entries";
  SC_RETURN_IF_ERROR(CheckRank(kKernel, "source", source.dimensions(), 2));
  const int64_t source_rows = source.dimensions()[0];
  const int64_t dim = source.dimensions()[1];
  const int64_t entries = entry_rows.element_count();
  SC_RETURN_IF_ERROR(CheckCount(kKernel, "samples", entry_samples.dimensions(), entries,
                                "one per entry, as many as rows"));
  SC_RETURN_IF_ERROR(CheckCount(kKernel, "gains", gains.dimensions(), entries,
                                "one per entry, as many as rows"));
  SC_RETURN_IF_ERROR(CheckRank(kKernel, "the output", out->dimensions(), 2));
  SC_RETURN_IF_ERROR(CheckDims(kKernel, "the output", out->dimensions(),
                               {out->dimensions()[0], dim}, "[B, D] with the source's width D"));
  const int64_t samples = out->dimensions()[0];
  const float* src = source.typed_data();
  const int32_t* rows = entry_rows.typed_data();
  const int32_t* sample_of = entry_samples.typed_data();
  const float* gain = gains.typed_data();
  float* target = out->typed_data();
  ParallelFor(samples, NumThreads(entries * dim), [&](int64_t begin, int64_t end) {
    std::memset(target + begin * dim, 0, (end - begin) * dim * sizeof(float));
    const int64_t first = std::lower_bound(sample_of, sample_of + entries, begin) - sample_of;
    for (int64_t e = first; e < entries && sample_of[e] < end; ++e) {
      if (e + kRowsAhead < entries) {
        const int64_t ahead = rows[e + kRowsAhead];
        if (ahead >= 0 && ahead < source_rows) PrefetchFloats<0>(src + ahead * dim, dim);
      }
      const int64_t row = rows[e];
      if (sample_of[e] < 0 || row < 0 || row >= source_rows) continue;
      Axpy(target + sample_of[e] * dim, src + row * dim, gain[e], dim);
    }
  });
  return ffi::Error::Success();
}

}  // namespace

#endif  // SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_ROWS_H_
