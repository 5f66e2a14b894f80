// What the one-call ops ask of a Python argument before they take it: the
// Python layer's fast-path tests (`type(o) is torch.Tensor`, element type,
// dimensions, device, contiguity), read from the tensor without a dispatched op.
#pragma once

#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/autograd/python_variable.h>

#include <cstdint>

namespace turnout::torch_ext {

// Exactly torch.Tensor, as the Python layer's `type(o) is torch.Tensor` (THPVariable_CheckExact
// also takes a Parameter).
inline bool is_tensor(PyObject* o) {
  return Py_TYPE(o) == reinterpret_cast<PyTypeObject*>(THPVariableClass);
}

// `o` where it is a plain tensor: exactly torch.Tensor, of element type
// `type`, `dim` dimensions, on device `index` (get_device()'s numbering, -1
// the CPU) and contiguous; else null.
inline const at::Tensor* plain(PyObject* o, at::ScalarType type, int64_t dim, int64_t index) {
  if (!is_tensor(o)) return nullptr;
  const at::Tensor& t = THPVariable_Unpack(o);
  if (t.scalar_type() != type || t.dim() != dim || t.get_device() != index || !t.is_contiguous()) return nullptr;
  return &t;
}

inline bool aligned16(const at::Tensor& t) {
  return reinterpret_cast<uintptr_t>(t.data_ptr()) % 16 == 0;
}

template <typename T>
T* address(const at::Tensor& t) {
  return static_cast<T*>(t.data_ptr());
}

}  // namespace turnout::torch_ext
