// The output tensors of an op made in one call into torch's C++ allocator. A
// tensor made from Python (new_empty) costs about 1.5-2 us of argument
// parsing and dispatch; here each costs the allocation and its Python object.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include "torch_ext.hpp"

namespace turnout::torch_ext {

// empty(device, code, rows, cols, code, rows, cols, ...): a tuple of new
// tensors on `device` (a torch.device), each of element type `code` and
// shape (rows, cols), or (rows,) where cols < 0. Allocated as torch.empty
// would: on a CUDA device, on its current stream.
PyObject* empty(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs < 1 || (nargs - 1) % 3 != 0) {
    PyErr_SetString(PyExc_TypeError, "empty(device, (code, rows, cols) ...): wrong number of arguments");
    return nullptr;
  }
  if (!THPDevice_Check(args[0])) {
    PyErr_Format(PyExc_TypeError, "empty: device must be a torch.device, got %s", Py_TYPE(args[0])->tp_name);
    return nullptr;
  }
  const at::TensorOptions options = at::TensorOptions().device(reinterpret_cast<THPDevice*>(args[0])->device);
  const Py_ssize_t count = (nargs - 1) / 3;
  PyObject* out = PyTuple_New(count);
  if (out == nullptr) return nullptr;
  for (Py_ssize_t i = 0; i < count; ++i) {
    const long code = PyLong_AsLong(args[1 + 3 * i]);
    const long long rows = PyLong_AsLongLong(args[2 + 3 * i]);
    const long long cols = PyLong_AsLongLong(args[3 + 3 * i]);
    if (PyErr_Occurred()) {
      Py_DECREF(out);
      return nullptr;
    }
    if (code < 0 || code >= static_cast<long>(kTypes.size()) || rows < 0) {
      Py_DECREF(out);
      PyErr_Format(PyExc_ValueError, "empty: tensor %zd: code %ld and rows %lld (a code below %zu, rows >= 0)", i, code,
                   rows, kTypes.size());
      return nullptr;
    }
    const auto opts = options.dtype(kTypes[code]);
    at::Tensor t = cols < 0 ? at::empty({rows}, opts) : at::empty({rows, cols}, opts);
    PyTuple_SET_ITEM(out, i, THPVariable_Wrap(std::move(t)));
  }
  return out;
  END_HANDLE_TH_ERRORS
}

}  // namespace turnout::torch_ext
