// The low-latency combine in one call: the Python layer's fast-path checks
// of x, topk_idx and topk_weights (python/turnout/ops/low_latency.py), the
// output from torch's allocator and the launch through _C's capsule
// (low_latency_entry.hpp). The Python layer has checked the handle and picked
// the streams; a call that fails a check is declined (None) before anything
// is allocated or queued, and the Python layer then takes it and names what
// is wrong.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>

#include <climits>
#include <cstdint>

#include "low_latency_entry.hpp"
#include "plain_tensor.hpp"
#include "torch_ext.hpp"

namespace turnout::torch_ext {

namespace {

using bindings::LowLatencyEntry;

const LowLatencyEntry* g_entry = nullptr;

// The output set's sizes a combine needs (ops/low_latency.py's _OutputSet.combine_sizes).
struct CombineSizes {
  int64_t num_local_experts, num_rows, hidden, num_max_tokens, num_experts;
  uintptr_t plan;
};

bool read_sizes(PyObject* o, CombineSizes* s) {
  if (!PyTuple_CheckExact(o) || PyTuple_GET_SIZE(o) != 6) {
    PyErr_Format(PyExc_TypeError, "low_latency_combine: sizes must be a tuple of 6 ints, got %s", Py_TYPE(o)->tp_name);
    return false;
  }
  int64_t* fields[] = {&s->num_local_experts, &s->num_rows, &s->hidden, &s->num_max_tokens, &s->num_experts};
  for (int i = 0; i < 5; ++i) *fields[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(o, i));
  s->plan = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(o, 5)));
  return !PyErr_Occurred();
}

bool same_sizes(const at::Tensor& t, const CombineSizes& s) {
  return t.size(0) == s.num_local_experts && t.size(1) == s.num_rows && t.size(2) == s.hidden;
}

}  // namespace

PyObject* set_low_latency_entry(PyObject*, PyObject* capsule) {
  const auto* entry =
      static_cast<const LowLatencyEntry*>(PyCapsule_GetPointer(capsule, bindings::kLowLatencyEntryName));
  if (entry == nullptr) return nullptr;
  if (entry->entry_size != sizeof(LowLatencyEntry) || entry->combine_size != sizeof(LowLatencyCombineArgs)) {
    PyErr_SetString(PyExc_ImportError,
                    "turnout._torch_ext and turnout._C come from different builds: their low-latency entries differ");
    return nullptr;
  }
  g_entry = entry;
  Py_RETURN_NONE;
}

// low_latency_combine(native, x, topk_idx, topk_weights, source, sizes,
// num_tokens, num_topk, use_logfmt, device_index, phase, stream, wait_for,
// ring): (combined_x, event), or None where the call is not one this path
// takes. `source` is the tensor whose rows go out (x, or the combine buffer
// of a zero-copy call); `sizes` the output set's (L, M*R, hidden, M,
// num_experts, plan address); `wait_for` a stream or None; `ring` the
// buffer's event ring or None (event then None).
PyObject* low_latency_combine(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (nargs != 14) {
    PyErr_Format(PyExc_TypeError, "low_latency_combine: 14 arguments, got %zd", nargs);
    return nullptr;
  }
  if (g_entry == nullptr) {
    PyErr_SetString(PyExc_RuntimeError, "low_latency_combine: set_low_latency_entry was not called");
    return nullptr;
  }
  CombineSizes sizes{};
  if (!read_sizes(args[5], &sizes)) return nullptr;
  const long long num_tokens = PyLong_AsLongLong(args[6]);
  const long long num_topk = PyLong_AsLongLong(args[7]);
  const long index = PyLong_AsLong(args[9]);
  const long phase = PyLong_AsLong(args[10]);
  const auto stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[11]));
  uintptr_t wait_for = 0;
  if (args[12] != Py_None) wait_for = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[12]));
  if (PyErr_Occurred()) return nullptr;
  PyObject* use_logfmt = args[8];
  if (use_logfmt != Py_True && use_logfmt != Py_False) Py_RETURN_NONE;
  if (num_tokens < 0 || num_tokens > INT_MAX || num_topk < 1 || num_topk > INT_MAX || sizes.hidden > INT_MAX ||
      sizes.num_max_tokens > INT_MAX || sizes.num_experts > INT_MAX || phase < INT_MIN || phase > INT_MAX ||
      (use_logfmt == Py_True && sizes.hidden % kLowLatencyScaleGroup != 0))
    Py_RETURN_NONE;

  const at::Tensor* x = plain(args[1], at::kBFloat16, 3, index);
  const at::Tensor* topk_idx = plain(args[2], at::kLong, 2, index);
  const at::Tensor* topk_weights = plain(args[3], at::kFloat, 2, index);
  const at::Tensor* source = args[4] == args[1] ? x : plain(args[4], at::kBFloat16, 3, index);
  if (x == nullptr || topk_idx == nullptr || topk_weights == nullptr || source == nullptr || !same_sizes(*x, sizes) ||
      !same_sizes(*source, sizes) || !aligned16(*source) || topk_idx->size(0) != num_tokens ||
      topk_idx->size(1) != num_topk || topk_weights->sizes() != topk_idx->sizes())
    Py_RETURN_NONE;

  const OutputSpec spec{at::kBFloat16, num_tokens, sizes.hidden};
  at::Tensor combined_x = make_outputs(at::TensorOptions().device(x->device()), &spec, 1, 1)[0];

  LowLatencyCombineArgs a;
  a.x = source->data_ptr();
  a.topk_idx = address<const int64_t>(*topk_idx);
  a.topk_weights = address<const float>(*topk_weights);
  a.num_tokens = static_cast<int>(num_tokens);
  a.num_topk = static_cast<int>(num_topk);
  a.hidden = static_cast<int>(sizes.hidden);
  a.num_max_tokens = static_cast<int>(sizes.num_max_tokens);
  a.num_experts = static_cast<int>(sizes.num_experts);
  a.plan = reinterpret_cast<const void*>(sizes.plan);
  a.use_logfmt = use_logfmt == Py_True;
  a.out = combined_x.data_ptr();

  PyObject* event = nullptr;
  const int queued = g_entry->combine(args[0], &a, static_cast<int>(phase), stream,
                                      args[12] != Py_None ? &wait_for : nullptr, args[13], &event);
  if (queued < 0) return nullptr;
  if (queued > 0) Py_RETURN_NONE;
  PyObject* out = PyTuple_New(2);
  PyObject* wrapped = out != nullptr ? THPVariable_Wrap(std::move(combined_x)) : nullptr;
  if (wrapped == nullptr) {
    Py_XDECREF(out);
    Py_DECREF(event);
    return nullptr;
  }
  PyTuple_SET_ITEM(out, 0, wrapped);
  PyTuple_SET_ITEM(out, 1, event);
  return out;
  END_HANDLE_TH_ERRORS
}

}  // namespace turnout::torch_ext
