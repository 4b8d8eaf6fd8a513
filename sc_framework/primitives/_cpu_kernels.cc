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
//
// The kernels live in the headers _cpu_kernels_*.h next to this file; this
// file registers them as FFI handlers and defines the Python module.
//
// setup.py compiles this file twice on x86-64: `_cpu_kernels` for any x86-64
// CPU, and `_cpu_kernels_x86_64_v3` (SC_KERNELS_X86_64_V3 defined, built with
// -march=x86-64-v3: AVX2 vectors twice as wide, FMA, BMI) that
// sc_framework.primitives._row_ops loads instead where the CPU has those
// instructions (`cpu_supports_x86_64_v3` of the first module says). Both
// builds use -ffp-contract=off, so no a * b + c becomes a fused multiply-add:
// the two give the same bits.

#include <Python.h>

#include "xla/ffi/api/ffi.h"

// In the order the code had when it was one file, so the compiled code is the same.
#include "_cpu_kernels_common.h"
#include "_cpu_kernels_rows.h"
#include "_cpu_kernels_grouping.h"
#include "_cpu_kernels_fused.h"
#include "_cpu_kernels_elementwise.h"

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

// cpu_supports_x86_64_v3() -> bool: whether this CPU runs x86-64-v3 code.
// GCC 12 and newer ask for the level itself; older compilers (which must
// still build this generic module) for its vector and bit instructions,
// which every CPU that has them pairs with the level's others.
static PyObject* CpuSupportsX8664V3(PyObject*, PyObject*) {
#if defined(__x86_64__) && defined(__GNUC__)
  __builtin_cpu_init();
#if !defined(__clang__) && __GNUC__ >= 12
  return PyBool_FromLong(__builtin_cpu_supports("x86-64-v3"));
#else
  return PyBool_FromLong(__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") &&
                         __builtin_cpu_supports("bmi") && __builtin_cpu_supports("bmi2"));
#endif
#else
  Py_RETURN_FALSE;
#endif
}

#ifdef SC_KERNELS_X86_64_V3
#define SC_KERNELS_MODULE_NAME "_cpu_kernels_x86_64_v3"
#define SC_KERNELS_MODULE_INIT PyInit__cpu_kernels_x86_64_v3
#else
#define SC_KERNELS_MODULE_NAME "_cpu_kernels"
#define SC_KERNELS_MODULE_INIT PyInit__cpu_kernels
#endif

static PyMethodDef kMethods[] = {
    {"handlers", Handlers, METH_NOARGS, "XLA FFI handlers of the CPU embedding kernels."},
    {"cpu_supports_x86_64_v3", CpuSupportsX8664V3, METH_NOARGS,
     "Whether this CPU runs the x86-64-v3 build of the kernels (AVX2, FMA, BMI)."},
    {nullptr, nullptr, 0, nullptr},
};

static PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT,
    SC_KERNELS_MODULE_NAME,
    "Multi-threaded CPU kernels for the embedding primitives.",
    -1,
    kMethods,
    nullptr,  // m_slots
    nullptr,  // m_traverse
    nullptr,  // m_clear
    nullptr,  // m_free
};

PyMODINIT_FUNC SC_KERNELS_MODULE_INIT(void) { return PyModule_Create(&kModule); }
