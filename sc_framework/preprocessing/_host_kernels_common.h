// Shared pieces of the host preprocessing loops: the checked array buffers
// of the arguments and the split of a loop into parts run on threads.
//
// Included by _host_kernels.cc only: the code stays in that translation unit's
// anonymous namespace, as when it was part of the file.

#ifndef SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_COMMON_H_
#define SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_COMMON_H_

#ifndef PY_SSIZE_T_CLEAN
#define PY_SSIZE_T_CLEAN
#endif
#include <Python.h>

#include <algorithm>
#include <cstdint>
#include <system_error>
#include <thread>
#include <vector>

namespace {

// A held buffer of a 1-D C-contiguous array whose items have a given size.
class Array {
 public:
  Array() = default;
  Array(const Array&) = delete;
  Array& operator=(const Array&) = delete;
  ~Array() {
    if (held_) PyBuffer_Release(&view_);
  }

  // Takes `object`'s buffer; on a mismatch sets a Python error, returns false.
  bool Take(PyObject* object, const char* name, Py_ssize_t itemsize, bool writable) {
    int flags = PyBUF_C_CONTIGUOUS | PyBUF_FORMAT | (writable ? PyBUF_WRITABLE : 0);
    if (PyObject_GetBuffer(object, &view_, flags) != 0) {
      PyErr_Format(PyExc_TypeError, "%s must be a%s C-contiguous array", name,
                   writable ? " writable" : "");
      return false;
    }
    held_ = true;
    if (view_.ndim != 1 || view_.itemsize != itemsize) {
      PyErr_Format(PyExc_TypeError, "%s must be 1-D with %zd-byte items, got %d-D with %zd",
                   name, itemsize, view_.ndim, view_.itemsize);
      return false;
    }
    return true;
  }

  template <typename T>
  T* data() const {
    return static_cast<T*>(view_.buf);
  }
  Py_ssize_t size() const { return view_.shape[0]; }
  Py_ssize_t itemsize() const { return view_.itemsize; }

 private:
  Py_buffer view_{};
  bool held_ = false;
};

// The item size of `object`'s buffer, or -1 with a Python error.
Py_ssize_t ItemSize(PyObject* object, const char* name) {
  Py_buffer view;
  if (PyObject_GetBuffer(object, &view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT) != 0) {
    PyErr_Format(PyExc_TypeError, "%s must be a C-contiguous array", name);
    return -1;
  }
  const Py_ssize_t itemsize = view.itemsize;
  PyBuffer_Release(&view);
  return itemsize;
}

bool SizeError(const char* what, Py_ssize_t expected, Py_ssize_t actual) {
  PyErr_Format(PyExc_ValueError, "%s: expected %zd, got %zd", what, expected, actual);
  return false;
}

// Sum of lengths, or -1 (with a Python error) when one is negative.
Py_ssize_t Total(const Array& lengths) {
  const int64_t* length = lengths.data<int64_t>();
  Py_ssize_t total = 0;
  for (Py_ssize_t s = 0; s < lengths.size(); ++s) {
    if (length[s] < 0) {
      PyErr_Format(PyExc_ValueError, "lengths[%zd] = %lld is negative", s,
                   static_cast<long long>(length[s]));
      return -1;
    }
    total += length[s];
  }
  return total;
}

// Parts a loop over `work` items splits into: one per hardware thread (at
// most 8), each with at least kMinPartWork items.
constexpr Py_ssize_t kMinPartWork = 1 << 16;

int NumParts(Py_ssize_t work) {
  static const int threads =
      std::clamp(static_cast<int>(std::thread::hardware_concurrency()), 1, 8);
  return static_cast<int>(std::clamp<Py_ssize_t>(work / kMinPartWork, 1, threads));
}

// Runs part(0), ..., part(parts - 1), all but the first on threads of their
// own (inline when a thread cannot start); returns when all are done.
template <typename Part>
void RunParts(int parts, const Part& part) {
  std::vector<std::thread> threads;
  for (int p = 1; p < parts; ++p) {
    try {
      threads.emplace_back(part, p);
    } catch (const std::system_error&) {
      part(p);
    }
  }
  part(0);
  for (std::thread& thread : threads) thread.join();
}

}  // namespace

#endif  // SC_FRAMEWORK_PREPROCESSING_HOST_KERNELS_COMMON_H_
