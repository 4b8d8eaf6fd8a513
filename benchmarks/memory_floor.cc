// The memory floor of one embedding step: the plainest loops that move the
// same bytes as the lookup and the sparse update, for bench_memory_floor.py.
// Compiled by that script at run time (c++ -O3 -shared); not part of the
// package.
//
//   GatherSum:  out[sample[e]] += table[row[e]] for every entry e, entries in
//               sample order: the lookup's reads of one table row per entry.
//   TouchRows:  w <- w - 1e-6 * w for every touched row (and its slot of
//               slot_width floats), rows in the given (sorted) order: the
//               update's one read and one write of each touched row.
//   SumAndStep: w <- w - 1e-6 * sum_e gain[e] * grad[sample[e]] over the
//               entries e of every touched row (and its slot as TouchRows),
//               with the entries already grouped by row (begin[k] ..
//               begin[k + 1) of sample and gain, grouped outside the
//               timing): TouchRows plus the read of every entry's gradient
//               row, which any update must do, and the least arithmetic.
//
// Both run on `threads` threads over contiguous parts and prefetch rows
// kRowsAhead ahead, as the package's kernels do. Entries or rows outside the
// table are skipped.

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>

namespace {

constexpr int64_t kRowsAhead = 8;

template <typename Body>
void ParallelParts(int64_t count, int threads, const Body& body) {
  threads = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(threads, count)));
  std::vector<std::thread> workers;
  const int64_t step = (count + threads - 1) / threads;
  for (int part = 1; part < threads; ++part) {
    workers.emplace_back([&, part] {
      body(std::min(count, part * step), std::min(count, (part + 1) * step));
    });
  }
  body(0, std::min(count, step));
  for (std::thread& worker : workers) worker.join();
}

void PrefetchRow(const float* row, int64_t dim, int write) {
  const char* const end = reinterpret_cast<const char*>(row + dim);
  for (const char* line = reinterpret_cast<const char*>(row); line < end; line += 64) {
    if (write) {
      __builtin_prefetch(line, 1, 3);
    } else {
      __builtin_prefetch(line, 0, 3);
    }
  }
}

}  // namespace

extern "C" {

void GatherSum(const float* table, int64_t rows, int64_t dim, const int32_t* row,
               const int32_t* sample, int64_t entries, float* out, int64_t samples,
               int threads) {
  ParallelParts(samples, threads, [&](int64_t begin, int64_t end) {
    std::memset(out + begin * dim, 0, (end - begin) * dim * sizeof(float));
    int64_t e = std::lower_bound(sample, sample + entries, begin) - sample;
    for (; e < entries && sample[e] < end; ++e) {
      if (e + kRowsAhead < entries && row[e + kRowsAhead] >= 0 && row[e + kRowsAhead] < rows) {
        PrefetchRow(table + static_cast<int64_t>(row[e + kRowsAhead]) * dim, dim, 0);
      }
      if (row[e] < 0 || row[e] >= rows || sample[e] < 0) continue;
      const float* source = table + static_cast<int64_t>(row[e]) * dim;
      float* target = out + static_cast<int64_t>(sample[e]) * dim;
      for (int64_t d = 0; d < dim; ++d) target[d] += source[d];
    }
  });
}

void TouchRows(float* table, float* slot, int64_t rows, int64_t dim, int64_t slot_width,
               const int32_t* row, int64_t count, int threads) {
  ParallelParts(count, threads, [&](int64_t begin, int64_t end) {
    for (int64_t k = begin; k < end; ++k) {
      if (k + kRowsAhead < end && row[k + kRowsAhead] >= 0 && row[k + kRowsAhead] < rows) {
        const int64_t ahead = row[k + kRowsAhead];
        PrefetchRow(table + ahead * dim, dim, 1);
        if (slot_width) PrefetchRow(slot + ahead * slot_width, slot_width, 1);
      }
      if (row[k] < 0 || row[k] >= rows) continue;
      float* w = table + static_cast<int64_t>(row[k]) * dim;
      for (int64_t d = 0; d < dim; ++d) w[d] -= 1e-6f * w[d];
      float* s = slot + static_cast<int64_t>(row[k]) * slot_width;
      for (int64_t d = 0; d < slot_width; ++d) s[d] -= 1e-6f * s[d];
    }
  });
}

void SumAndStep(float* table, float* slot, int64_t rows, int64_t dim, int64_t slot_width,
                const int32_t* row, int64_t count, const int32_t* begin, const int32_t* sample,
                const float* gain, const float* grad, int threads) {
  ParallelParts(count, threads, [&](int64_t first, int64_t end) {
    std::vector<float> sum(dim);
    for (int64_t k = first; k < end; ++k) {
      if (k + kRowsAhead < end && row[k + kRowsAhead] >= 0 && row[k + kRowsAhead] < rows) {
        const int64_t ahead = row[k + kRowsAhead];
        PrefetchRow(table + ahead * dim, dim, 1);
        if (slot_width) PrefetchRow(slot + ahead * slot_width, slot_width, 1);
        for (int32_t e = begin[k + kRowsAhead]; e < begin[k + kRowsAhead + 1]; ++e) {
          PrefetchRow(grad + static_cast<int64_t>(sample[e]) * dim, dim, 0);
        }
      }
      if (row[k] < 0 || row[k] >= rows) continue;
      std::fill(sum.begin(), sum.end(), 0.0f);
      for (int32_t e = begin[k]; e < begin[k + 1]; ++e) {
        const float* g = grad + static_cast<int64_t>(sample[e]) * dim;
        for (int64_t d = 0; d < dim; ++d) sum[d] += gain[e] * g[d];
      }
      float* w = table + static_cast<int64_t>(row[k]) * dim;
      for (int64_t d = 0; d < dim; ++d) w[d] -= 1e-6f * sum[d];
      float* s = slot + static_cast<int64_t>(row[k]) * slot_width;
      for (int64_t d = 0; d < slot_width; ++d) s[d] -= 1e-6f * s[d];
    }
  });
}

}  // extern "C"
