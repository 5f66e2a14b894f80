// turnout._torch_outputs: the output tensors of an op made in one call into
// torch's C++ allocator. A tensor made from Python (new_empty) costs about
// 1.5-2 us of argument parsing and dispatch; here each costs the allocation
// and its Python object. Built only against the torch found at build time,
// and imported only under that torch (python/turnout/ops/outputs.py).
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/Device.h>
#include <torch/csrc/Exceptions.h>
#include <torch/csrc/autograd/python_variable.h>

#include <array>

namespace {

// Element types by code (the module's constants of the same names).
constexpr std::array<at::ScalarType, 7> kTypes = {at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat, at::kInt,
                                                  at::kLong,     at::kBool,          at::kByte};
constexpr const char* kTypeNames[] = {"BF16", "FP8_E4M3", "F32", "I32", "I64", "BOOL", "U8"};

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

PyMethodDef kMethods[] = {{"empty", reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(empty)), METH_FASTCALL,
                           "empty(device, code, rows, cols, ...) -> tuple of new tensors (cols < 0: one dimension)"},
                          {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {
    PyModuleDef_HEAD_INIT, "_torch_outputs", nullptr, -1, kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_outputs() {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  for (size_t i = 0; i < kTypes.size(); ++i) {
    if (PyModule_AddIntConstant(m, kTypeNames[i], static_cast<long>(i)) != 0) {
      Py_DECREF(m);
      return nullptr;
    }
  }
  return m;
}
