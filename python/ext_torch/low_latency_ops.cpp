// The low-latency dispatch and combine, each in one call: the Python layer's
// fast-path checks of the call's tensors (python/turnout/ops/low_latency.py),
// combine's output from torch's allocator where none was given, and the
// launch through _C's capsule (low_latency_entry.hpp). The Python layer has
// picked the output set (dispatch) or checked the handle (combine) and the
// streams; a call that fails a check is declined (None) before anything is
// allocated or queued, and the Python layer then takes it and names what is
// wrong.
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

// An output set's sizes a dispatch needs (_OutputSet.dispatch_sizes).
struct DispatchSizes {
  int64_t hidden, num_max_tokens, num_local_experts, num_ranks;
  uintptr_t plan;
};

bool read_sizes(PyObject* o, DispatchSizes* s) {
  if (!PyTuple_CheckExact(o) || PyTuple_GET_SIZE(o) != 5) {
    PyErr_Format(PyExc_TypeError, "low_latency_dispatch: sizes must be a tuple of 5 ints, got %s", Py_TYPE(o)->tp_name);
    return false;
  }
  int64_t* fields[] = {&s->hidden, &s->num_max_tokens, &s->num_local_experts, &s->num_ranks};
  for (int i = 0; i < 4; ++i) *fields[i] = PyLong_AsLongLong(PyTuple_GET_ITEM(o, i));
  s->plan = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(PyTuple_GET_ITEM(o, 4)));
  return !PyErr_Occurred();
}

// `o` is None (null, true) or a plain 1-D tensor of `type` and `length` elements.
bool optional_vector(PyObject* o, at::ScalarType type, int64_t length, int64_t index, const at::Tensor** out) {
  *out = nullptr;
  if (o == Py_None) return true;
  *out = plain(o, type, 1, index);
  return *out != nullptr && (*out)->size(0) == length;
}

// The stream arguments every launch ends with: (phase, stream, wait_for, ring).
struct Streams {
  int phase;
  uintptr_t stream, wait_for;
  bool waits;
  PyObject* ring;
};

bool read_streams(const char* name, PyObject* const* args, Streams* s) {
  const long phase = PyLong_AsLong(args[0]);
  s->stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[1]));
  s->waits = args[2] != Py_None;
  s->wait_for = s->waits ? static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[2])) : 0;
  s->ring = args[3];
  if (PyErr_Occurred()) return false;
  if (phase < INT_MIN || phase > INT_MAX) {
    PyErr_Format(PyExc_ValueError, "%s: phase %ld out of range", name, phase);
    return false;
  }
  s->phase = static_cast<int>(phase);
  return true;
}

bool ready(const char* name, Py_ssize_t nargs, Py_ssize_t wanted) {
  if (nargs != wanted) {
    PyErr_Format(PyExc_TypeError, "%s: %zd arguments, got %zd", name, wanted, nargs);
    return false;
  }
  if (g_entry == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "%s: set_low_latency_entry was not called", name);
    return false;
  }
  return true;
}

bool same_sizes(const at::Tensor& t, const CombineSizes& s) {
  return t.size(0) == s.num_local_experts && t.size(1) == s.num_rows && t.size(2) == s.hidden;
}

}  // namespace

PyObject* set_low_latency_entry(PyObject*, PyObject* capsule) {
  const auto* entry =
      static_cast<const LowLatencyEntry*>(PyCapsule_GetPointer(capsule, bindings::kLowLatencyEntryName));
  if (entry == nullptr) return nullptr;
  if (entry->entry_size != sizeof(LowLatencyEntry) || entry->dispatch_size != sizeof(LowLatencyDispatchArgs) ||
      entry->combine_size != sizeof(LowLatencyCombineArgs)) {
    PyErr_SetString(PyExc_ImportError,
                    "turnout._torch_ext and turnout._C come from different builds: their low-latency entries differ");
    return nullptr;
  }
  g_entry = entry;
  Py_RETURN_NONE;
}

// low_latency_dispatch(native, outputs, x, topk_idx, topk_weights, sizes,
// round_scale, cumulative_stats, wait_stats, device_index, phase, stream,
// wait_for, ring): (event, num_tokens, num_topk), or None where the call is
// not one this path takes. `outputs` is the output set's
// _C.LowLatencyDispatchArgs and `sizes` its (hidden, M, L, R, plan address);
// the stats tensors may be None; `wait_for` a stream or None; `ring` the
// buffer's event ring or None (event then None).
PyObject* low_latency_dispatch(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!ready("low_latency_dispatch", nargs, 14)) return nullptr;
  DispatchSizes sizes{};
  Streams streams{};
  if (!read_sizes(args[5], &sizes)) return nullptr;
  const long index = PyLong_AsLong(args[9]);
  if ((index == -1 && PyErr_Occurred()) || !read_streams("low_latency_dispatch", args + 10, &streams)) return nullptr;
  PyObject* round_scale = args[6];
  if (round_scale != Py_True && round_scale != Py_False) Py_RETURN_NONE;

  const at::Tensor* x = plain(args[2], at::kBFloat16, 2, index);
  const at::Tensor* topk_idx = plain(args[3], at::kLong, 2, index);
  if (x == nullptr || topk_idx == nullptr || x->size(1) != sizes.hidden || x->size(0) > sizes.num_max_tokens ||
      !aligned16(*x) || topk_idx->size(0) != x->size(0) || topk_idx->size(1) < 1 ||
      topk_idx->size(1) > kLowLatencyMaxTopk)
    Py_RETURN_NONE;
  const at::Tensor* weights = nullptr;
  if (args[4] != Py_None) {
    weights = plain(args[4], at::kFloat, 2, index);
    if (weights == nullptr || weights->sizes() != topk_idx->sizes()) Py_RETURN_NONE;
  }
  const at::Tensor* cumulative = nullptr;
  const at::Tensor* wait_stats = nullptr;
  if (!optional_vector(args[7], at::kInt, sizes.num_local_experts, index, &cumulative) ||
      !optional_vector(args[8], at::kLong, sizes.num_ranks, index, &wait_stats))
    Py_RETURN_NONE;

  LowLatencyDispatchArgs call;
  call.x = x->data_ptr();
  call.num_tokens = static_cast<int>(x->size(0));
  call.topk_idx = address<const int64_t>(*topk_idx);
  call.num_topk = static_cast<int>(topk_idx->size(1));
  // Whether weights were given reaches every peer's plan through this
  // address, so it must not be null when they were (an empty tensor has none).
  if (weights != nullptr)
    call.topk_weights =
        weights->data_ptr() != nullptr ? address<const float>(*weights) : reinterpret_cast<const float*>(sizes.plan);
  call.round_scale = round_scale == Py_True;
  call.cumulative_local_expert_recv_stats = cumulative != nullptr ? address<int32_t>(*cumulative) : nullptr;
  call.wait_recv_cost_stats = wait_stats != nullptr ? address<int64_t>(*wait_stats) : nullptr;

  PyObject* event = nullptr;
  const int queued = g_entry->dispatch(args[0], args[1], &call, streams.phase, streams.stream,
                                       streams.waits ? &streams.wait_for : nullptr, streams.ring, &event);
  if (queued < 0) return nullptr;
  if (queued > 0) Py_RETURN_NONE;
  return Py_BuildValue("(Nii)", event, call.num_tokens, call.num_topk);
  END_HANDLE_TH_ERRORS
}

// low_latency_combine(native, x, topk_idx, topk_weights, source, sizes,
// num_tokens, num_topk, use_logfmt, device_index, out, wait_stats, phase,
// stream, wait_for, ring): (combined_x, event), or None where the call is not
// one this path takes. `source` is the tensor whose rows go out (x, or the
// combine buffer of a zero-copy call); `sizes` the output set's (L, M*R,
// hidden, M, num_experts, plan address); `out` the output (None: a new
// tensor); `wait_stats` combine_wait_recv_cost_stats or None; `wait_for` a
// stream or None; `ring` the buffer's event ring or None (event then None).
PyObject* low_latency_combine(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!ready("low_latency_combine", nargs, 16)) return nullptr;
  CombineSizes sizes{};
  Streams streams{};
  if (!read_sizes(args[5], &sizes)) return nullptr;
  const long long num_tokens = PyLong_AsLongLong(args[6]);
  const long long num_topk = PyLong_AsLongLong(args[7]);
  const long index = PyLong_AsLong(args[9]);
  if (PyErr_Occurred() || !read_streams("low_latency_combine", args + 12, &streams)) return nullptr;
  PyObject* use_logfmt = args[8];
  if (use_logfmt != Py_True && use_logfmt != Py_False) Py_RETURN_NONE;
  if (num_tokens < 0 || num_tokens > INT_MAX || num_topk < 1 || num_topk > INT_MAX || sizes.hidden > INT_MAX ||
      sizes.num_max_tokens > INT_MAX || sizes.num_experts > INT_MAX ||
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
  PyObject* out = args[10];
  const at::Tensor* given = out != Py_None ? plain(out, at::kBFloat16, 2, index) : nullptr;
  if (out != Py_None &&
      (given == nullptr || given->size(0) != num_tokens || given->size(1) != sizes.hidden || !aligned16(*given)))
    Py_RETURN_NONE;
  const at::Tensor* wait_stats = args[11] != Py_None ? plain(args[11], at::kLong, 1, index) : nullptr;
  if (args[11] != Py_None && (wait_stats == nullptr || sizes.num_max_tokens < 1 ||
                              wait_stats->size(0) * sizes.num_max_tokens != sizes.num_rows))
    Py_RETURN_NONE;

  at::Tensor made;
  if (given == nullptr) {
    const OutputSpec spec{at::kBFloat16, num_tokens, sizes.hidden};
    made = make_outputs(at::TensorOptions().device(x->device()), &spec, 1, 1)[0];
  }

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
  a.out = given != nullptr ? given->data_ptr() : made.data_ptr();
  a.wait_recv_cost_stats = wait_stats != nullptr ? address<int64_t>(*wait_stats) : nullptr;

  PyObject* event = nullptr;
  const int queued = g_entry->combine(args[0], &a, streams.phase, streams.stream,
                                      streams.waits ? &streams.wait_for : nullptr, streams.ring, &event);
  if (queued < 0) return nullptr;
  if (queued > 0) Py_RETURN_NONE;
  // The output as a Python object: `out` itself where it was given.
  PyObject* combined_x = given != nullptr ? Py_NewRef(out) : THPVariable_Wrap(std::move(made));
  PyObject* result = combined_x != nullptr ? PyTuple_New(2) : nullptr;
  if (result == nullptr) {
    Py_XDECREF(combined_x);
    Py_DECREF(event);
    return nullptr;
  }
  PyTuple_SET_ITEM(result, 0, combined_x);
  PyTuple_SET_ITEM(result, 1, event);
  return result;
  END_HANDLE_TH_ERRORS
}

}  // namespace turnout::torch_ext
