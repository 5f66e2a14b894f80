// turnout._torch_ext: the parts of the Python layer built against torch's C++
// API (module.cpp), each a METH_FASTCALL function. Built only against the
// torch found at build time and imported only under it (turnout/torch_ext.py).
#pragma once

#include <ATen/ATen.h>
#include <Python.h>

#include <array>
#include <cstddef>
#include <cstdint>
#include <vector>

namespace turnout::torch_ext {

// Element types by code (the module's constants BF16 ... U8, in this order).
inline constexpr std::array<at::ScalarType, 7> kTypes = {at::kBFloat16, at::kFloat8_e4m3fn, at::kFloat, at::kInt,
                                                         at::kLong,     at::kBool,          at::kByte};
inline constexpr std::array<const char*, 7> kTypeNames = {"BF16", "FP8_E4M3", "F32", "I32", "I64", "BOOL", "U8"};

// One output tensor: (rows, cols), or (rows,) where cols < 0.
struct OutputSpec {
  at::ScalarType type;
  int64_t rows;
  int64_t cols;
};

// outputs.cpp: new tensors on `on`'s device, as torch.empty allocates them
// (on a CUDA device, on its current stream). The first `separate` specs each
// get their own allocation; the others share one, each at a 128-byte boundary.
std::vector<at::Tensor> make_outputs(const at::TensorOptions& on, const OutputSpec* specs, size_t count,
                                     size_t separate);

// A tuple of the tensors as Python objects, None for an undefined one.
PyObject* tuple_of(std::vector<at::Tensor>&& tensors);

// empty(device, code, rows, cols, ...) -> tuple of new tensors, each its own
// allocation; empty_packed(device, separate, code, rows, cols, ...): the
// tensors after the first `separate` share one.
PyObject* empty(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* empty_packed(PyObject*, PyObject* const* args, Py_ssize_t nargs);

// intranode_ops.cpp: set_intranode_entry(capsule), once at import; then
// dispatch_worst(...), dispatch_waited(...) and combine_plain(...) -> the outputs of an op they
// queued, or None where the call is not the common case they take (the
// Python layer then does it).
PyObject* set_intranode_entry(PyObject*, PyObject* capsule);
PyObject* dispatch_worst(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* dispatch_waited(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* combine_plain(PyObject*, PyObject* const* args, Py_ssize_t nargs);

// low_latency_ops.cpp: set_low_latency_entry(capsule), once at import; then
// low_latency_dispatch(...) -> (event, num_tokens, num_topk) and
// low_latency_combine(...) -> (combined_x, event) of the op they queued, or
// None where the call is not the common case they take.
PyObject* set_low_latency_entry(PyObject*, PyObject* capsule);
PyObject* low_latency_dispatch(PyObject*, PyObject* const* args, Py_ssize_t nargs);
PyObject* low_latency_combine(PyObject*, PyObject* const* args, Py_ssize_t nargs);

}  // namespace turnout::torch_ext
