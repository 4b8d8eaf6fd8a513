// compact_padded of the host preprocessing loops: a dense [B, L] batch of ids
// with a padding id -> its CSR form (the ids that are not padding, row by row,
// and the row splits).
//
// Included by _host_kernels.cc only: the code stays in that translation unit's
// anonymous namespace.

#ifndef SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_COMPACT_H_
#define SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_COMPACT_H_

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <cstdint>

#include "_host_kernels_common.h"

namespace {

// values[:k] = the ids of rows 0, 1, ... (`width` each) that differ from
// `padding`, in order; splits[b + 1] = their count in rows 0..b. Every id is
// written and the count advanced only past a kept one: no branch to mispredict.
template <typename Id>
Py_ssize_t CompactPadded(const Id* ids, Py_ssize_t rows, Py_ssize_t width, int64_t padding,
                         Id* values, int64_t* splits) {
  Py_ssize_t k = 0;
  splits[0] = 0;
  for (Py_ssize_t b = 0; b < rows; ++b) {
    const Id* row = ids + b * width;
    for (Py_ssize_t j = 0; j < width; ++j) {
      const Id id = row[j];
      values[k] = id;
      k += static_cast<int64_t>(id) != padding;
    }
    splits[b + 1] = k;
  }
  return k;
}

PyObject* compact_padded(PyObject*, PyObject* args) {
  PyObject *ids_object, *values_object, *splits_object;
  long long width, padding;
  if (!PyArg_ParseTuple(args, "OLLOO", &ids_object, &width, &padding, &values_object,
                        &splits_object)) {
    return nullptr;
  }
  const Py_ssize_t id_size = ItemSize(ids_object, "ids");
  if (id_size < 0) return nullptr;
  if (id_size != 4 && id_size != 8) {
    PyErr_SetString(PyExc_TypeError, "ids must be int32 or int64");
    return nullptr;
  }
  Array ids, values, splits;
  if (!ids.Take(ids_object, "ids", id_size, false) ||
      !values.Take(values_object, "values", id_size, true) ||
      !splits.Take(splits_object, "splits", 8, true)) {
    return nullptr;
  }
  if (width < 1 || ids.size() % width != 0) {
    PyErr_Format(PyExc_ValueError, "width must be >= 1 and divide the %zd ids, got %lld",
                 ids.size(), width);
    return nullptr;
  }
  const Py_ssize_t rows = ids.size() / width;
  if (values.size() < ids.size()) return SizeError("values: at least", ids.size(),
                                                   values.size()), nullptr;
  if (splits.size() != rows + 1) return SizeError("splits: rows + 1", rows + 1, splits.size()),
                                        nullptr;
  Py_ssize_t kept;
  Py_BEGIN_ALLOW_THREADS;
  if (id_size == 4) {
    kept = CompactPadded(ids.data<int32_t>(), rows, width, padding, values.data<int32_t>(),
                         splits.data<int64_t>());
  } else {
    kept = CompactPadded(ids.data<int64_t>(), rows, width, padding, values.data<int64_t>(),
                         splits.data<int64_t>());
  }
  Py_END_ALLOW_THREADS;
  return PyLong_FromSsize_t(kept);
}

}  // namespace

#endif  // SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_COMPACT_H_
