// The fused updates of the element-wise optimizer rules of the CPU kernels:
// Adagrad, Adam and FTRL.
//
// Included by _cpu_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_ELEMENTWISE_H_
#define SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_ELEMENTWISE_H_

#include <array>
#include <cmath>
#include <cstdint>
#include <string>

#include "_cpu_kernels_common.h"
#include "_cpu_kernels_fused.h"

namespace {

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
    // Only the default form divides by the rate (divisor = lr); a rate of 0 skips the rule.
    if (divisor == 0.0f) return w;
    const float n = slot[0][d];
    const float n_new = n + g * g;
    const float root_new = root(n_new), root_old = root(n);
    const float z = slot[1][d] + gradient_scale * g - (root_new - root_old) / divisor * w;
    slot[0][d] = n_new;
    slot[1][d] = z;
    const float quadratic = (beta + root_new) / divisor + l2_term;
    // Both sides computed, then selected: a branch-free loop (|z| > threshold >= 0
    // implies z != 0, so copysign gives sign(z) * threshold). Tested as
    // |z| <= threshold, so a NaN z gives a NaN weight, not a 0 that hides it.
    const float shrunk = (std::copysign(threshold, z) - z) / quadratic;
    return std::fabs(z) <= threshold ? 0.0f : shrunk;
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

#endif  // SC_FRAMEWORK_PRIMITIVES_CPU_KERNELS_ELEMENTWISE_H_
