// The fused optimizer updates of the CPU kernels: the shared options, the
// per-row loop over touched rows, and SGD and row-wise Adagrad.
//
// Included by _cpu_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_FUSED_H_
#define SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_FUSED_H_

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <vector>

#include "_cpu_kernels_common.h"
#include "_cpu_kernels_grouping.h"

namespace {

// The options every optimizer shares (sc_framework/optimizers/_options.py),
// as the fused kernels receive them after the rule's own hyperparameters:
//   {clip_lo, clip_hi, row_clipnorm, decay, weight_min, weight_max}
// clip_lo/clip_hi and weight_min/weight_max are -inf/+inf for no bound,
// row_clipnorm is +inf for none, decay is already multiplied by the learning
// rate when the spec asks for it (0 for none).
struct RowOptions {
  float clip_lo, clip_hi, row_clipnorm, decay, weight_min, weight_max;
  // Loop-invariant switches, so the default path stays plain.
  bool clips_gradients, decays, clips_weights;
  static constexpr int kCount = 6;
  static RowOptions From(const float* h) {
    return {h[0], h[1], h[2], h[3], h[4], h[5],
            std::isfinite(h[0]) || std::isfinite(h[1]) || std::isfinite(h[2]), h[3] != 0.0f,
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

// Steps 1 and 2 of the options, where options.clips_gradients: g <- clip(g *
// min(1, c / ||g||), lo, hi), written into `scratch` (g may already be
// `scratch`). Returns the clipped g. The scale is c / max(||g||, c) in float32;
// where that leaves float32's range -- ||g||^2 overflows (a row of 2e19s), or
// c / ||g|| is below the smallest normal float32 (||g|| = 1e38 with c = 1),
// which the CPU flushes to zero -- the norm and the scaling run in double.
inline const float* ClipGradient(const float* g, float* scratch, int64_t dim,
                                 const RowOptions& options) {
  float scale = 1.0f;
  if (std::isfinite(options.row_clipnorm)) {
    const float squared = SquaredNorm(g, dim);
    scale = options.row_clipnorm / std::max(std::sqrt(squared), options.row_clipnorm);
    if (std::isinf(squared) || scale < std::numeric_limits<float>::min()) {
      double wide = 0.0;
      for (int64_t d = 0; d < dim; ++d) wide += static_cast<double>(g[d]) * g[d];
      const double clipnorm = options.row_clipnorm;
      const double wide_scale = clipnorm / std::max(std::sqrt(wide), clipnorm);
      for (int64_t d = 0; d < dim; ++d) scratch[d] = static_cast<float>(g[d] * wide_scale);
      g = scratch;
      scale = 1.0f;
    }
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
      const float* g = grads.Get(k, scratch.data());
      update(k, row, options.clips_gradients ? ClipGradient(g, scratch.data(), dim, options) : g);
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

}  // namespace

#endif  // SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_FUSED_H_
