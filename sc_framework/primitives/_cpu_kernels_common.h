// Shared pieces of the CPU kernels: the thread pool and ParallelFor, the
// operand shape checks, Axpy and the prefetch helpers.
//
// Included by _cpu_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_COMMON_H_
#define SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_COMMON_H_

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <functional>
#include <initializer_list>
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

}  // namespace

#endif  // SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_COMMON_H_
