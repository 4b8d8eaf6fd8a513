// Multi-threaded CPU kernels for the embedding primitives, as XLA FFI handlers.
//
// They replace the four row-level operations whose XLA:CPU lowering (a loop of
// dynamic slices) dominates a lookup + update step on CPU:
//
//   GatherRows(table [R, D], index [K])            -> out [K, D]
//       out[k] = table[index[k]], or zeros when index[k] is outside [0, R).
//   ScatterRows(table [R, D], index [K], rows [K, D]) -> table (aliased)
//       table[index[k]] = rows[k] for index[k] in [0, R); others dropped.
//       Indices in range must be distinct (the callers guarantee it).
//   CombineEntries(source [M, D], rows [E], samples [E], gains [E]) -> out [B, D]
//       out[b] = sum over e with samples[e] = b of gains[e] * source[rows[e]];
//       samples ascending; entries with samples[e] outside [0, B) are skipped.
//   SegmentGrads(grads [B, D], samples [E], unique_index [E], gains [E]) -> out [K, D]
//       out[k] = sum over e with unique_index[e] = k of gains[e] * grads[samples[e]];
//       entries whose sample is outside [0, B) are skipped.
//
// Each kernel splits its outputs over threads so no two threads write the
// same row; results are deterministic (a fixed summation order per row). The
// threads come from one pool per process, created on first use (ThreadPool).
// Every handler checks the sizes of its operands first and returns an
// InvalidArgument error naming the mismatch.

#include <Python.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <deque>
#include <functional>
#include <initializer_list>
#include <limits>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace {

// The most parts a kernel splits its outputs into: the hardware's
// concurrency, at most 16.
int MaxParts() {
  static const int parts =
      std::min(16, static_cast<int>(std::max(1u, std::thread::hardware_concurrency())));
  return parts;
}

// Parts for `work` (elements touched): one below a minimum, else MaxParts().
int NumThreads(int64_t work) { return work < (1 << 14) ? 1 : MaxParts(); }

// A fixed set of worker threads running submitted jobs in FIFO order. One
// pool serves every kernel call of the process (Pool()); it is created on the
// first parallel call and never destroyed, so no thread is joined while the
// interpreter shuts down.
class ThreadPool {
 public:
  explicit ThreadPool(int workers) {
    threads_.reserve(workers);
    for (int i = 0; i < workers; ++i) threads_.emplace_back([this] { Work(); });
  }
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int workers() const { return static_cast<int>(threads_.size()); }

  void Submit(std::function<void()> job) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      jobs_.push_back(std::move(job));
    }
    ready_.notify_one();
  }

 private:
  void Work() {
    for (;;) {
      std::function<void()> job;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        ready_.wait(lock, [this] { return !jobs_.empty(); });
        job = std::move(jobs_.front());
        jobs_.pop_front();
      }
      job();
    }
  }

  std::mutex mutex_;
  std::condition_variable ready_;
  std::deque<std::function<void()>> jobs_;
  std::vector<std::thread> threads_;
};

// The process's pool: MaxParts() - 1 workers, as every caller runs parts too.
ThreadPool& Pool() {
  static ThreadPool* const pool = new ThreadPool(MaxParts() - 1);
  return *pool;
}

// The parts of one ParallelFor call, claimed one at a time by the calling
// thread and by pool workers. Workers hold it through a shared_ptr, so one
// that starts after the call returned finds no part left and touches nothing
// of the caller's (the body is only read after a successful claim).
struct ParallelParts {
  int64_t count = 0;
  int64_t step = 0;
  int parts = 0;
  void (*call)(const void* body, int64_t begin, int64_t end) = nullptr;
  const void* body = nullptr;
  std::atomic<int> next{0};
  std::mutex mutex;
  std::condition_variable finished;
  int done = 0;

  // Claims and runs one part; false when none is left.
  bool RunOne() {
    const int part = next.fetch_add(1);
    if (part >= parts) return false;
    const int64_t begin = part * step;
    call(body, begin, std::min(count, begin + step));
    std::lock_guard<std::mutex> lock(mutex);
    if (++done == parts) finished.notify_all();
    return true;
  }
};

// Runs fn(begin, end) over [0, count) split into `threads` contiguous parts,
// on the calling thread and the shared pool. The caller runs every part no
// worker has claimed, then waits only for parts already running, so calls
// from several threads at once (or from a pool worker) cannot deadlock, even
// when all workers are busy.
template <typename Fn>
void ParallelFor(int64_t count, int threads, const Fn& fn) {
  if (threads <= 1 || count <= 1) {
    fn(int64_t{0}, count);
    return;
  }
  auto shared = std::make_shared<ParallelParts>();
  shared->count = count;
  shared->step = (count + threads - 1) / threads;
  shared->parts = static_cast<int>((count + shared->step - 1) / shared->step);
  shared->call = [](const void* body, int64_t begin, int64_t end) {
    (*static_cast<const Fn*>(body))(begin, end);
  };
  shared->body = &fn;
  ThreadPool& pool = Pool();
  const int jobs = std::min(shared->parts - 1, pool.workers());
  for (int i = 0; i < jobs; ++i) {
    pool.Submit([shared] {
      while (shared->RunOne()) {
      }
    });
  }
  while (shared->RunOne()) {
  }
  std::unique_lock<std::mutex> lock(shared->mutex);
  shared->finished.wait(lock, [&] { return shared->done == shared->parts; });
}

// Shape checks. Each handler validates every size it relies on before it
// touches a buffer, and otherwise returns an InvalidArgument error naming the
// kernel, the operand and its expected vs actual shape (XLA raises it in
// Python), instead of reading or writing out of bounds.
#define SC_RETURN_IF_ERROR(expr)             \
  do {                                       \
    ffi::Error status_ = (expr);             \
    if (!status_.success()) return status_;  \
  } while (0)

std::string ShapeString(ffi::Span<const int64_t> dims) {
  std::ostringstream out;
  out << "[";
  for (size_t i = 0; i < dims.size(); ++i) out << (i ? ", " : "") << dims[i];
  out << "]";
  return out.str();
}

ffi::Error ShapeError(const char* kernel, const char* operand, ffi::Span<const int64_t> actual,
                      const std::string& expected) {
  std::ostringstream message;
  message << kernel << ": " << operand << " has shape " << ShapeString(actual) << ", expected "
          << expected;
  return ffi::Error(ffi::ErrorCode::kInvalidArgument, message.str());
}

ffi::Error CheckRank(const char* kernel, const char* operand, ffi::Span<const int64_t> dims,
                     size_t rank) {
  if (dims.size() == rank) return ffi::Error::Success();
  return ShapeError(kernel, operand, dims, "rank " + std::to_string(rank));
}

ffi::Error CheckDims(const char* kernel, const char* operand, ffi::Span<const int64_t> dims,
                     std::initializer_list<int64_t> expected, const char* meaning) {
  if (std::equal(dims.begin(), dims.end(), expected.begin(), expected.end())) {
    return ffi::Error::Success();
  }
  const std::vector<int64_t> want(expected);
  return ShapeError(kernel, operand, dims,
                    ShapeString(ffi::Span<const int64_t>(want.data(), want.size())) + " (" +
                        meaning + ")");
}

// `operand` holds exactly `expected` elements (any rank).
ffi::Error CheckCount(const char* kernel, const char* operand, ffi::Span<const int64_t> dims,
                      int64_t expected, const char* meaning) {
  int64_t count = 1;
  for (int64_t d : dims) count *= d;
  if (count == expected) return ffi::Error::Success();
  return ShapeError(kernel, operand, dims,
                    std::to_string(expected) + " elements (" + meaning + ")");
}

// A table [R, D] and the output it is updated into (same shape).
ffi::Error CheckTableAndOut(const char* kernel, ffi::Span<const int64_t> table,
                            ffi::Span<const int64_t> out) {
  SC_RETURN_IF_ERROR(CheckRank(kernel, "table", table, 2));
  return CheckDims(kernel, "the output table", out, {table[0], table[1]},
                   "the input table's shape");
}

// A row-wise accumulator (one element per table row) and its output.
ffi::Error CheckAccumulator(const char* kernel, ffi::Span<const int64_t> accumulator,
                            ffi::Span<const int64_t> out, int64_t rows) {
  SC_RETURN_IF_ERROR(
      CheckCount(kernel, "accumulator", accumulator, rows, "one per table row, [R, 1]"));
  return CheckCount(kernel, "the output accumulator", out, rows, "one per table row, [R, 1]");
}

// Batch entries: grads [B, D] and samples, unique_index, gains with E elements each.
ffi::Error CheckEntries(const char* kernel, ffi::Span<const int64_t> grads, int64_t dim,
                        ffi::Span<const int64_t> samples, ffi::Span<const int64_t> unique_index,
                        ffi::Span<const int64_t> gains) {
  SC_RETURN_IF_ERROR(CheckRank(kernel, "grads", grads, 2));
  SC_RETURN_IF_ERROR(
      CheckDims(kernel, "grads", grads, {grads[0], dim}, "[B, D] with the table's width D"));
  int64_t entries = 1;
  for (int64_t d : unique_index) entries *= d;
  SC_RETURN_IF_ERROR(
      CheckCount(kernel, "samples", samples, entries, "one per entry, as many as unique_index"));
  return CheckCount(kernel, "gains", gains, entries, "one per entry, as many as unique_index");
}

inline void Axpy(float* out, const float* x, float a, int64_t dim) {
  for (int64_t d = 0; d < dim; ++d) out[d] += a * x[d];
}

// Prefetches the cache lines of the `count` floats at p into every cache
// level, for reading (kWrite 0) or writing (1).
template <int kWrite>
inline void PrefetchFloats(const float* p, int64_t count) {
  const char* const end = reinterpret_cast<const char*>(p + count);
  for (const char* line = reinterpret_cast<const char*>(p); line < end; line += 64) {
    __builtin_prefetch(line, kWrite, 3);
  }
  __builtin_prefetch(end - 1, kWrite, 3);
}

// How many rows ahead the row loops prefetch: enough to cover a DRAM miss
// with a few rows in flight per thread.
constexpr int64_t kRowsAhead = 8;

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

// row = sum over the entries of unique row k of gain[e] * grad[sample[e]].
inline void UniqueRowGradient(const EntriesByUniqueRow& groups, int64_t k, const float* grad,
                              int64_t dim, float* row) {
  std::memset(row, 0, dim * sizeof(float));
  const int64_t stop = groups.begin_of[k + 1];
  for (int64_t i = groups.begin_of[k]; i < stop; ++i) {
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

// The options every optimizer shares (sc_framework/optimizers/_options.py),
// as the fused kernels receive them after the rule's own hyperparameters:
//   {clip_lo, clip_hi, row_clipnorm, decay, weight_min, weight_max}
// clip_lo/clip_hi and weight_min/weight_max are -inf/+inf for no bound,
// row_clipnorm is +inf for none, decay is already multiplied by the learning
// rate when the spec asks for it (0 for none).
struct RowOptions {
  float clip_lo, clip_hi, row_clipnorm, decay, weight_min, weight_max;
  bool decays, clips_weights;  // loop-invariant switches, so the default path stays plain
  static constexpr int kCount = 6;
  static RowOptions From(const float* h) {
    return {h[0], h[1], h[2], h[3], h[4], h[5], h[3] != 0.0f,
            std::isfinite(h[4]) || std::isfinite(h[5])};
  }
};

// sum_d g[d]^2 in eight partial sums: a reduction the compiler can vectorise
// (a single running sum is a chain of dependent adds).
inline float SquaredNorm(const float* g, int64_t dim) {
  float partial[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
  int64_t d = 0;
  for (; d + 8 <= dim; d += 8) {
    for (int j = 0; j < 8; ++j) partial[j] += g[d + j] * g[d + j];
  }
  for (; d < dim; ++d) partial[0] += g[d] * g[d];
  float square = 0.0f;
  for (int j = 0; j < 8; ++j) square += partial[j];
  return square;
}

// Steps 1 and 2 of the options: g <- clip(g * min(1, c / ||g||), lo, hi),
// written into `scratch` (g may already be `scratch`). Returns the clipped g.
inline const float* ClipGradient(const float* g, float* scratch, int64_t dim,
                                 const RowOptions& options) {
  const bool by_norm = std::isfinite(options.row_clipnorm);
  const bool by_value = std::isfinite(options.clip_lo) || std::isfinite(options.clip_hi);
  if (!by_norm && !by_value) return g;
  float scale = 1.0f;
  if (by_norm) {
    const float norm = std::sqrt(SquaredNorm(g, dim));
    scale = options.row_clipnorm / std::max(norm, options.row_clipnorm);
  }
  for (int64_t d = 0; d < dim; ++d) {
    scratch[d] = std::min(std::max(g[d] * scale, options.clip_lo), options.clip_hi);
  }
  return scratch;
}

// Step 5 of the options: clip the logical columns d < logical_dim of the
// updated row w to [weight_min, weight_max] (padding columns keep their content).
inline void ClipWeights(float* w, int64_t dim, int32_t logical_dim, const RowOptions& options) {
  if (!options.clips_weights) return;
  const int64_t logical = std::min<int64_t>(dim, logical_dim);
  for (int64_t d = 0; d < logical; ++d) {
    w[d] = std::min(std::max(w[d], options.weight_min), options.weight_max);
  }
}

// Steps 3 to 5 for rules of the form w <- w - scale * g (SGD, row-wise
// Adagrad): the step, the decay by the row before it, then the clipping of
// the logical columns d < logical_dim. Separate loops, so each vectorises.
inline void StepRow(float* w, const float* g, int64_t dim, int32_t logical_dim, float scale,
                    const RowOptions& options) {
  if (options.decays) {
    for (int64_t d = 0; d < dim; ++d) {
      const float old = w[d];
      w[d] = (old - scale * g[d]) - options.decay * old;
    }
  } else {
    for (int64_t d = 0; d < dim; ++d) w[d] -= scale * g[d];
  }
  ClipWeights(w, dim, logical_dim, options);
}

// The row rules of the built-in optimizers (sc_framework/optimizers: SGD and
// RowWiseAdagrad) with the shared options, applied in place to one row w
// with summed gradient g (already clipped).
inline void SgdRow(float* w, const float* g, int64_t dim, int32_t logical_dim, float lr,
                   const RowOptions& options) {
  StepRow(w, g, dim, logical_dim, lr, options);
}

inline void RowwiseAdagradRow(float* w, float* accumulator, const float* g, int64_t dim,
                              int32_t logical_dim, float lr, float eps,
                              const RowOptions& options) {
  const float a = *accumulator + SquaredNorm(g, dim) / static_cast<float>(logical_dim);
  *accumulator = a;
  StepRow(w, g, dim, logical_dim, lr / (std::sqrt(a) + eps), options);
}

// The fused updates read each touched row's gradient either from a [K, D]
// buffer (RowGrads) or by summing the batch entries of its unique row on the fly
// (EntryGrads: no [K, D] buffer at all; single-device case).
struct RowGrads {
  const float* grads;
  int64_t dim;
  const float* Get(int64_t k, float*) const { return grads + k * dim; }
  void Prefetch(int64_t) const {}  // read in order: the hardware prefetches
};

struct EntryGrads {
  const EntriesByUniqueRow* groups;
  const float* grad;
  int64_t dim;
  const float* Get(int64_t k, float* scratch) const {
    UniqueRowGradient(*groups, k, grad, dim, scratch);
    return scratch;
  }
  void Prefetch(int64_t k) const { PrefetchUniqueRowGradient(*groups, k, grad, dim); }
};

// Runs update(k, row, g) for every index k whose row index[k] is in [0, R),
// with g the row's clipped gradient, over contiguous parts of [0, K) in
// parallel. It prefetches kRowsAhead rows ahead: the table row (for writing),
// the gradient's inputs, and what prefetch_state(row) asks for.
template <typename Grads, typename PrefetchState, typename Update>
void ForEachTouchedRow(float* table, int64_t rows, int64_t dim, const int32_t* index,
                       int64_t count, const Grads& grads, const RowOptions& options,
                       const PrefetchState& prefetch_state, const Update& update) {
  ParallelFor(count, NumThreads(count * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> scratch(dim);
    for (int64_t k = begin; k < end; ++k) {
      if (k + kRowsAhead < end) {
        const int64_t ahead = index[k + kRowsAhead];
        if (ahead >= 0 && ahead < rows) {
          PrefetchFloats<1>(table + ahead * dim, dim);
          prefetch_state(ahead);
          grads.Prefetch(k + kRowsAhead);
        }
      }
      const int64_t row = index[k];
      if (row < 0 || row >= rows) continue;
      update(k, row, ClipGradient(grads.Get(k, scratch.data()), scratch.data(), dim, options));
    }
  });
}

template <typename Grads>
void SgdUpdate(float* table, int64_t rows, int64_t dim, const int32_t* index, int64_t count,
               const Grads& grads, const int32_t* logical_dims, const float* hyper) {
  const float lr = hyper[0];
  const RowOptions options = RowOptions::From(hyper + 1);
  ForEachTouchedRow(
      table, rows, dim, index, count, grads, options, [](int64_t) {},
      [&](int64_t k, int64_t row, const float* g) {
        SgdRow(table + row * dim, g, dim, logical_dims[k], lr, options);
      });
}

template <typename Grads>
void RowwiseAdagradUpdate(float* table, float* accumulator, int64_t rows, int64_t dim,
                          const int32_t* index, int64_t count, const Grads& grads,
                          const int32_t* logical_dims, const float* hyper) {
  const float lr = hyper[0], eps = hyper[1];
  const RowOptions options = RowOptions::From(hyper + 2);
  ForEachTouchedRow(
      table, rows, dim, index, count, grads, options,
      [&](int64_t row) { __builtin_prefetch(accumulator + row, 1, 3); },
      [&](int64_t k, int64_t row, const float* g) {
        RowwiseAdagradRow(table + row * dim, accumulator + row, g, dim, logical_dims[k], lr, eps,
                          options);
      });
}

// Starts an in-place output from its input when XLA did not alias them.
void CopyIfNotAliased(float* out, const float* in, int64_t count) {
  if (out != in) std::memcpy(out, in, count * sizeof(float));
}

// Fused optimizer updates for the built-in SGD and row-wise Adagrad with the
// shared options: one pass per touched row (read the row, its slot and its
// gradient; write in place), instead of gather -> elementwise rule ->
// scatter. Rows outside [0, R) are skipped. The *Rows kernels take the
// per-row gradients [K, D]; the *Entries kernels take the batch entries
// (grads [B, D], samples, unique_index, gains) and sum each row's gradient on the
// fly. dims [K] are the rows' logical dimensions; `options` is RowOptions.
//   SgdStepRows(table, index [K], grads [K, D], dims [K], hyper {lr, options})
//       -> table
//   SgdStepEntries(table, index [K], grads [B, D], samples [E], unique_index [E],
//                  gains [E], dims [K], hyper {lr, options}) -> table
//   RowwiseAdagradStepRows(table, accumulator [R, 1], index, grads [K, D],
//                          dims [K], hyper {lr, eps, options}) -> (table, accumulator)
//   RowwiseAdagradStepEntries(table, accumulator, index, grads [B, D], samples,
//                             unique_index, gains, dims, hyper) -> (table, accumulator)

// hyper holds the rule's `rule_count` values, then RowOptions::kCount options.
ffi::Error CheckHyper(const char* kernel, ffi::Buffer<ffi::F32> hyper, int64_t rule_count,
                      const char* meaning) {
  return CheckCount(kernel, "hyper", hyper.dimensions(), rule_count + RowOptions::kCount,
                    meaning);
}

// The two ways a fused update receives its gradients: Check() validates them
// against K indices and the table's width D, With(count, fn) calls fn with
// the matching Grads.
struct RowGradsInput {  // grads [K, D]
  ffi::Buffer<ffi::F32> grads;
  ffi::Error Check(const char* kernel, int64_t count, int64_t dim) const {
    return CheckDims(kernel, "grads", grads.dimensions(), {count, dim},
                     "[K, D]: one gradient row of the table's width per index");
  }
  template <typename Fn>
  void With(int64_t, const Fn& fn) const {
    fn(RowGrads{grads.typed_data(), grads.dimensions()[1]});
  }
};

struct EntryGradsInput {  // grads [B, D], samples [E], unique_index [E], gains [E]
  ffi::Buffer<ffi::F32> grads;
  ffi::Buffer<ffi::S32> samples, unique_index;
  ffi::Buffer<ffi::F32> gains;
  ffi::Error Check(const char* kernel, int64_t, int64_t dim) const {
    SC_RETURN_IF_ERROR(CheckEntries(kernel, grads.dimensions(), dim, samples.dimensions(),
                                    unique_index.dimensions(), gains.dimensions()));
    return GroupingCheck(kernel, unique_index.dimensions());
  }
  template <typename Fn>
  void With(int64_t count, const Fn& fn) const {
    const EntriesByUniqueRow groups =
        GroupByUniqueRow(samples.typed_data(), unique_index.typed_data(), gains.typed_data(),
                         unique_index.element_count(), grads.dimensions()[0], count);
    fn(EntryGrads{&groups, grads.typed_data(), grads.dimensions()[1]});
  }
};

// Check every operand of an SGD or a row-wise Adagrad update, then run it in
// place, with the gradients of either Input.
template <typename Input>
ffi::Error SgdStep(const char* kernel, ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> index,
                   const Input& input, ffi::Buffer<ffi::S32> dims, ffi::Buffer<ffi::F32> hyper,
                   ffi::ResultBuffer<ffi::F32> out) {
  SC_RETURN_IF_ERROR(CheckTableAndOut(kernel, table.dimensions(), out->dimensions()));
  const int64_t rows = table.dimensions()[0], dim = table.dimensions()[1];
  const int64_t count = index.element_count();
  SC_RETURN_IF_ERROR(input.Check(kernel, count, dim));
  SC_RETURN_IF_ERROR(CheckCount(kernel, "dims", dims.dimensions(), count, "one per index"));
  SC_RETURN_IF_ERROR(CheckHyper(kernel, hyper, 1, "{learning rate, row options}"));
  CopyIfNotAliased(out->typed_data(), table.typed_data(), rows * dim);
  input.With(count, [&](const auto& grads) {
    SgdUpdate(out->typed_data(), rows, dim, index.typed_data(), count, grads, dims.typed_data(),
              hyper.typed_data());
  });
  return ffi::Error::Success();
}

template <typename Input>
ffi::Error RowwiseAdagradStep(const char* kernel, ffi::Buffer<ffi::F32> table,
                              ffi::Buffer<ffi::F32> accumulator, ffi::Buffer<ffi::S32> index,
                              const Input& input, ffi::Buffer<ffi::S32> dims,
                              ffi::Buffer<ffi::F32> hyper, ffi::ResultBuffer<ffi::F32> table_out,
                              ffi::ResultBuffer<ffi::F32> accumulator_out) {
  SC_RETURN_IF_ERROR(CheckTableAndOut(kernel, table.dimensions(), table_out->dimensions()));
  const int64_t rows = table.dimensions()[0], dim = table.dimensions()[1];
  const int64_t count = index.element_count();
  SC_RETURN_IF_ERROR(CheckAccumulator(kernel, accumulator.dimensions(),
                                      accumulator_out->dimensions(), rows));
  SC_RETURN_IF_ERROR(input.Check(kernel, count, dim));
  SC_RETURN_IF_ERROR(CheckCount(kernel, "dims", dims.dimensions(), count, "one per index"));
  SC_RETURN_IF_ERROR(CheckHyper(kernel, hyper, 2, "{learning rate, eps, row options}"));
  CopyIfNotAliased(table_out->typed_data(), table.typed_data(), rows * dim);
  CopyIfNotAliased(accumulator_out->typed_data(), accumulator.typed_data(), rows);
  input.With(count, [&](const auto& grads) {
    RowwiseAdagradUpdate(table_out->typed_data(), accumulator_out->typed_data(), rows, dim,
                         index.typed_data(), count, grads, dims.typed_data(), hyper.typed_data());
  });
  return ffi::Error::Success();
}

ffi::Error SgdStepRowsImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> index,
                           ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> dims,
                           ffi::Buffer<ffi::F32> hyper, ffi::ResultBuffer<ffi::F32> out) {
  return SgdStep("sc_framework_sgd_step_rows", table, index, RowGradsInput{grads}, dims, hyper,
                 out);
}

ffi::Error SgdStepEntriesImpl(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::S32> index,
                              ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> entry_samples,
                              ffi::Buffer<ffi::S32> entry_unique_index, ffi::Buffer<ffi::F32> gains,
                              ffi::Buffer<ffi::S32> dims, ffi::Buffer<ffi::F32> hyper,
                              ffi::ResultBuffer<ffi::F32> out) {
  return SgdStep("sc_framework_sgd_step_entries", table, index,
                 EntryGradsInput{grads, entry_samples, entry_unique_index, gains}, dims, hyper,
                 out);
}

ffi::Error RowwiseAdagradStepRowsImpl(
    ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> accumulator, ffi::Buffer<ffi::S32> index,
    ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> dims, ffi::Buffer<ffi::F32> hyper,
    ffi::ResultBuffer<ffi::F32> table_out, ffi::ResultBuffer<ffi::F32> accumulator_out) {
  return RowwiseAdagradStep("sc_framework_rowwise_adagrad_step_rows", table, accumulator, index,
                            RowGradsInput{grads}, dims, hyper, table_out, accumulator_out);
}

ffi::Error RowwiseAdagradStepEntriesImpl(
    ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> accumulator, ffi::Buffer<ffi::S32> index,
    ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> entry_samples,
    ffi::Buffer<ffi::S32> entry_unique_index, ffi::Buffer<ffi::F32> gains,
    ffi::Buffer<ffi::S32> dims, ffi::Buffer<ffi::F32> hyper, ffi::ResultBuffer<ffi::F32> table_out,
    ffi::ResultBuffer<ffi::F32> accumulator_out) {
  return RowwiseAdagradStep("sc_framework_rowwise_adagrad_step_entries", table, accumulator, index,
                            EntryGradsInput{grads, entry_samples, entry_unique_index, gains}, dims,
                            hyper, table_out, accumulator_out);
}

// Fused updates for the element-wise rules of the built-in Adagrad, Adam and
// FTRL (sc_framework/optimizers) with the shared options. Their slots are
// shaped like the table, [R, D], and each element of a touched row is updated
// from its weight w, its clipped gradient g and its slot values alone:
//   Adagrad  a <- a + g^2;  w <- w - lr * g / (sqrt(a) + eps)
//   Adam     m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2;
//            w <- w - lr * (m / c1) / (sqrt(v / c2 + eps_in) + eps_out)
//            with c1 = 1 - b1^t, c2 = 1 - b2^t (t = step + 1) and
//            (eps_in, eps_out) = (0, eps), or (eps^2, 0) for sum_inside_sqrt
//   FTRL     n' = n + g^2;  z <- z + s g - (n'^p - n^p) / q * w;
//            w <- |z| > l1 ? (sign(z) l1 - z) / ((beta + n'^p) / q + l2) : 0;  n <- n'
//            with (s, q, l1, l2) = (1, lr, l1, 2 l2), or (lr, 1, l1 lr, 2 l2 lr)
//            under multiply_linear_by_learning_rate
// then the decay by the row before the step and the weight clipping (steps 4
// and 5 of the options). The step-dependent values (lr, c1, c2, ...) arrive
// computed in `hyper`, followed by RowOptions.
//   <Rule>StepRows(table, slots..., index [K], grads [K, D], dims [K], hyper)
//       -> (table, slots...)
//   <Rule>StepEntries(table, slots..., index [K], grads [B, D], samples [E],
//                     unique_index [E], gains [E], dims [K], hyper) -> (table, slots...)
// A Rule names its slots, its kHyper values and its kernels; Rule::With(hyper,
// fn) calls fn with the rule's step, which maps (w, g, the element's slot
// values) to the new w before decay and updates the slot values in place.

struct AdagradRule {
  static constexpr int kSlots = 1;
  static constexpr int kHyper = 2;
  static constexpr const char* kSlotNames[kSlots] = {"accumulator"};
  static constexpr char kHyperMeaning[] = "{learning rate, eps, row options}";
  static constexpr char kRowsKernel[] = "sc_framework_adagrad_step_rows";
  static constexpr char kEntriesKernel[] = "sc_framework_adagrad_step_entries";
  template <typename Fn>
  static void With(const float* hyper, const Fn& fn) {
    fn(AdagradRule(hyper));
  }
  float lr, eps;
  explicit AdagradRule(const float* h) : lr(h[0]), eps(h[1]) {}
  float operator()(float w, float g, float* const* slot, int64_t d) const {
    const float a = slot[0][d] + g * g;
    slot[0][d] = a;
    return w - lr * g / (std::sqrt(a) + eps);
  }
};

struct AdamRule {
  static constexpr int kSlots = 2;
  static constexpr int kHyper = 9;
  static constexpr const char* kSlotNames[kSlots] = {"mu", "nu"};
  static constexpr char kHyperMeaning[] =
      "{learning rate, beta1, 1 - beta1, beta2, 1 - beta2, 1 - beta1^t, 1 - beta2^t, eps inside"
      " the root, eps outside, row options}";
  static constexpr char kRowsKernel[] = "sc_framework_adam_step_rows";
  static constexpr char kEntriesKernel[] = "sc_framework_adam_step_entries";
  template <typename Fn>
  static void With(const float* hyper, const Fn& fn) {
    fn(AdamRule(hyper));
  }
  float lr, beta1, one_minus_beta1, beta2, one_minus_beta2, correction1, correction2, eps_inside,
      eps_outside;
  explicit AdamRule(const float* h)
      : lr(h[0]), beta1(h[1]), one_minus_beta1(h[2]), beta2(h[3]), one_minus_beta2(h[4]),
        correction1(h[5]), correction2(h[6]), eps_inside(h[7]), eps_outside(h[8]) {}
  float operator()(float w, float g, float* const* slot, int64_t d) const {
    const float m = beta1 * slot[0][d] + one_minus_beta1 * g;
    const float v = beta2 * slot[1][d] + one_minus_beta2 * g * g;
    slot[0][d] = m;
    slot[1][d] = v;
    const float m_hat = m / correction1, v_hat = v / correction2;
    return w - lr * m_hat / (std::sqrt(v_hat + eps_inside) + eps_outside);
  }
};

// FTRL's n^p: the correctly rounded square root for the usual p = 1/2 (a
// loop over it vectorises), std::pow otherwise.
struct SquareRoot {
  explicit SquareRoot(float) {}
  float operator()(float n) const { return std::sqrt(n); }
};

struct Power {
  float power;
  explicit Power(float p) : power(p) {}
  float operator()(float n) const { return std::pow(n, power); }
};

template <typename Root>
struct FtrlStep {
  float gradient_scale, divisor, threshold, beta, l2_term;
  Root root;
  explicit FtrlStep(const float* h)
      : gradient_scale(h[0]), divisor(h[1]), threshold(h[3]), beta(h[4]), l2_term(h[5]),
        root(h[2]) {}
  float operator()(float w, float g, float* const* slot, int64_t d) const {
    const float n = slot[0][d];
    const float n_new = n + g * g;
    const float root_new = root(n_new), root_old = root(n);
    const float z = slot[1][d] + gradient_scale * g - (root_new - root_old) / divisor * w;
    slot[0][d] = n_new;
    slot[1][d] = z;
    const float quadratic = (beta + root_new) / divisor + l2_term;
    // Both sides computed, then selected: a branch-free loop (|z| > threshold >= 0
    // implies z != 0, so copysign gives sign(z) * threshold).
    const float shrunk = (std::copysign(threshold, z) - z) / quadratic;
    return std::fabs(z) > threshold ? shrunk : 0.0f;
  }
};

struct FtrlRule {
  static constexpr int kSlots = 2;
  static constexpr int kHyper = 6;
  static constexpr const char* kSlotNames[kSlots] = {"accumulator", "linear"};
  static constexpr char kHyperMeaning[] =
      "{gradient scale, divisor, power, l1 threshold, beta, l2 term, row options}";
  static constexpr char kRowsKernel[] = "sc_framework_ftrl_step_rows";
  static constexpr char kEntriesKernel[] = "sc_framework_ftrl_step_entries";
  template <typename Fn>
  static void With(const float* hyper, const Fn& fn) {
    if (hyper[2] == 0.5f) {
      fn(FtrlStep<SquareRoot>(hyper));
    } else {
      fn(FtrlStep<Power>(hyper));
    }
  }
};

// Steps 3 to 5 for an element-wise rule on one row w (slots: the row's slot rows).
template <typename Rule>
inline void ElementwiseRow(const Rule& rule, float* w, float* const* slots, const float* g,
                           int64_t dim, int32_t logical_dim, const RowOptions& options) {
  if (options.decays) {
    for (int64_t d = 0; d < dim; ++d) {
      const float old = w[d];
      w[d] = rule(old, g[d], slots, d) - options.decay * old;
    }
  } else {
    for (int64_t d = 0; d < dim; ++d) w[d] = rule(w[d], g[d], slots, d);
  }
  ClipWeights(w, dim, logical_dim, options);
}

template <typename Rule, typename Grads>
void ElementwiseUpdate(float* table, const std::array<float*, Rule::kSlots>& slots, int64_t rows,
                       int64_t dim, const int32_t* index, int64_t count, const Grads& grads,
                       const int32_t* logical_dims, const float* hyper) {
  const RowOptions options = RowOptions::From(hyper + Rule::kHyper);
  Rule::With(hyper, [&](const auto& rule) {
    ForEachTouchedRow(
        table, rows, dim, index, count, grads, options,
        [&](int64_t row) {
          for (float* slot : slots) PrefetchFloats<1>(slot + row * dim, dim);
        },
        [&](int64_t k, int64_t row, const float* g) {
          std::array<float*, Rule::kSlots> slot_rows;
          for (int s = 0; s < Rule::kSlots; ++s) slot_rows[s] = slots[s] + row * dim;
          ElementwiseRow(rule, table + row * dim, slot_rows.data(), g, dim, logical_dims[k],
                         options);
        });
  });
}

// A slot shaped like the table [R, D], and its output.
ffi::Error CheckSlotLikeTable(const char* kernel, const char* name, ffi::Span<const int64_t> slot,
                              ffi::Span<const int64_t> out, ffi::Span<const int64_t> table) {
  SC_RETURN_IF_ERROR(CheckDims(kernel, name, slot, {table[0], table[1]}, "the table's shape"));
  return CheckDims(kernel, ("the output " + std::string(name)).c_str(), out, {table[0], table[1]},
                   "the table's shape");
}

// Checks every operand of an element-wise rule's update, then runs it in place.
template <typename Rule, typename Input>
ffi::Error ElementwiseStep(const char* kernel, ffi::Buffer<ffi::F32> table,
                           const std::array<ffi::Buffer<ffi::F32>, Rule::kSlots>& slots,
                           ffi::Buffer<ffi::S32> index, const Input& input,
                           ffi::Buffer<ffi::S32> dims, ffi::Buffer<ffi::F32> hyper,
                           ffi::ResultBuffer<ffi::F32> table_out,
                           std::array<ffi::ResultBuffer<ffi::F32>, Rule::kSlots> slots_out) {
  SC_RETURN_IF_ERROR(CheckTableAndOut(kernel, table.dimensions(), table_out->dimensions()));
  const int64_t rows = table.dimensions()[0], dim = table.dimensions()[1];
  const int64_t count = index.element_count();
  for (int s = 0; s < Rule::kSlots; ++s) {
    SC_RETURN_IF_ERROR(CheckSlotLikeTable(kernel, Rule::kSlotNames[s], slots[s].dimensions(),
                                          slots_out[s]->dimensions(), table.dimensions()));
  }
  SC_RETURN_IF_ERROR(input.Check(kernel, count, dim));
  SC_RETURN_IF_ERROR(CheckCount(kernel, "dims", dims.dimensions(), count, "one per index"));
  SC_RETURN_IF_ERROR(CheckHyper(kernel, hyper, Rule::kHyper, Rule::kHyperMeaning));
  CopyIfNotAliased(table_out->typed_data(), table.typed_data(), rows * dim);
  std::array<float*, Rule::kSlots> slot_data;
  for (int s = 0; s < Rule::kSlots; ++s) {
    CopyIfNotAliased(slots_out[s]->typed_data(), slots[s].typed_data(), rows * dim);
    slot_data[s] = slots_out[s]->typed_data();
  }
  input.With(count, [&](const auto& grads) {
    ElementwiseUpdate<Rule>(table_out->typed_data(), slot_data, rows, dim, index.typed_data(),
                            count, grads, dims.typed_data(), hyper.typed_data());
  });
  return ffi::Error::Success();
}

// The handlers' signatures, for rules with one slot (Adagrad) and two (Adam, FTRL).
template <typename Rule>
ffi::Error OneSlotStepRows(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> slot,
                           ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::F32> grads,
                           ffi::Buffer<ffi::S32> dims, ffi::Buffer<ffi::F32> hyper,
                           ffi::ResultBuffer<ffi::F32> table_out,
                           ffi::ResultBuffer<ffi::F32> slot_out) {
  return ElementwiseStep<Rule>(Rule::kRowsKernel, table, {slot}, index, RowGradsInput{grads}, dims,
                               hyper, table_out, {slot_out});
}

template <typename Rule>
ffi::Error OneSlotStepEntries(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> slot,
                              ffi::Buffer<ffi::S32> index, ffi::Buffer<ffi::F32> grads,
                              ffi::Buffer<ffi::S32> samples, ffi::Buffer<ffi::S32> unique_index,
                              ffi::Buffer<ffi::F32> gains, ffi::Buffer<ffi::S32> dims,
                              ffi::Buffer<ffi::F32> hyper, ffi::ResultBuffer<ffi::F32> table_out,
                              ffi::ResultBuffer<ffi::F32> slot_out) {
  return ElementwiseStep<Rule>(Rule::kEntriesKernel, table, {slot}, index,
                               EntryGradsInput{grads, samples, unique_index, gains}, dims, hyper,
                               table_out, {slot_out});
}

template <typename Rule>
ffi::Error TwoSlotStepRows(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> first,
                           ffi::Buffer<ffi::F32> second, ffi::Buffer<ffi::S32> index,
                           ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> dims,
                           ffi::Buffer<ffi::F32> hyper, ffi::ResultBuffer<ffi::F32> table_out,
                           ffi::ResultBuffer<ffi::F32> first_out,
                           ffi::ResultBuffer<ffi::F32> second_out) {
  return ElementwiseStep<Rule>(Rule::kRowsKernel, table, {first, second}, index,
                               RowGradsInput{grads}, dims, hyper, table_out,
                               {first_out, second_out});
}

template <typename Rule>
ffi::Error TwoSlotStepEntries(ffi::Buffer<ffi::F32> table, ffi::Buffer<ffi::F32> first,
                              ffi::Buffer<ffi::F32> second, ffi::Buffer<ffi::S32> index,
                              ffi::Buffer<ffi::F32> grads, ffi::Buffer<ffi::S32> samples,
                              ffi::Buffer<ffi::S32> unique_index, ffi::Buffer<ffi::F32> gains,
                              ffi::Buffer<ffi::S32> dims, ffi::Buffer<ffi::F32> hyper,
                              ffi::ResultBuffer<ffi::F32> table_out,
                              ffi::ResultBuffer<ffi::F32> first_out,
                              ffi::ResultBuffer<ffi::F32> second_out) {
  return ElementwiseStep<Rule>(Rule::kEntriesKernel, table, {first, second}, index,
                               EntryGradsInput{grads, samples, unique_index, gains}, dims, hyper,
                               table_out, {first_out, second_out});
}

}  // namespace

XLA_FFI_DEFINE_HANDLER_SYMBOL(GatherRows, GatherRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(ScatterRows, ScatterRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(CombineEntries, CombineEntriesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SegmentGrads, SegmentGradsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SgdStepRows, SgdStepRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(SgdStepEntries, SgdStepEntriesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowwiseAdagradStepRows, RowwiseAdagradStepRowsImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(RowwiseAdagradStepEntries, RowwiseAdagradStepEntriesImpl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>());

// The element-wise rules' handlers; their bindings follow the signatures.
XLA_FFI_DEFINE_HANDLER_SYMBOL(AdagradStepRows, OneSlotStepRows<AdagradRule>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(AdagradStepEntries, OneSlotStepEntries<AdagradRule>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamStepRows, TwoSlotStepRows<AdamRule>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(AdamStepEntries, TwoSlotStepEntries<AdamRule>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtrlStepRows, TwoSlotStepRows<FtrlRule>);
XLA_FFI_DEFINE_HANDLER_SYMBOL(FtrlStepEntries, TwoSlotStepEntries<FtrlRule>);

// The Python module: handlers() -> {name: PyCapsule} for jax.ffi.register_ffi_target.
static PyObject* Handlers(PyObject*, PyObject*) {
  PyObject* out = PyDict_New();
  if (out == nullptr) return nullptr;
  const struct {
    const char* name;
    void* handler;
  } entries[] = {
      {"gather_rows", reinterpret_cast<void*>(GatherRows)},
      {"scatter_rows", reinterpret_cast<void*>(ScatterRows)},
      {"combine_entries", reinterpret_cast<void*>(CombineEntries)},
      {"segment_grads", reinterpret_cast<void*>(SegmentGrads)},
      {"sgd_step_rows", reinterpret_cast<void*>(SgdStepRows)},
      {"rowwise_adagrad_step_rows", reinterpret_cast<void*>(RowwiseAdagradStepRows)},
      {"sgd_step_entries", reinterpret_cast<void*>(SgdStepEntries)},
      {"rowwise_adagrad_step_entries", reinterpret_cast<void*>(RowwiseAdagradStepEntries)},
      {"adagrad_step_rows", reinterpret_cast<void*>(AdagradStepRows)},
      {"adagrad_step_entries", reinterpret_cast<void*>(AdagradStepEntries)},
      {"adam_step_rows", reinterpret_cast<void*>(AdamStepRows)},
      {"adam_step_entries", reinterpret_cast<void*>(AdamStepEntries)},
      {"ftrl_step_rows", reinterpret_cast<void*>(FtrlStepRows)},
      {"ftrl_step_entries", reinterpret_cast<void*>(FtrlStepEntries)},
  };
  for (const auto& entry : entries) {
    PyObject* capsule = PyCapsule_New(entry.handler, nullptr, nullptr);
    if (capsule == nullptr || PyDict_SetItemString(out, entry.name, capsule) != 0) {
      Py_XDECREF(capsule);
      Py_DECREF(out);
      return nullptr;
    }
    Py_DECREF(capsule);
  }
  return out;
}

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "XLA FFI handlers of the CPU embedding kernels."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    "_cpu_kernels",
    "Multi-threaded CPU kernels for the embedding primitives.",
    -1,
    kMethods,
    nullptr,  // m_slots
    nullptr,  // m_traverse
    nullptr,  // m_clear
    nullptr,  // m_free
};

PyMODINIT_FUNC PyInit__cpu_kernels(void) { return PyModule_Create(&kModule); }
