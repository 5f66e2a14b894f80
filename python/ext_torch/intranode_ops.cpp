// The common intranode dispatch and combine, each in one call. Dispatch: a
// fresh one, with num_worst_tokens or waiting for its counts, BF16 rows or
// FP8 rows with their scales, top-k given; combine: of this buffer's handle, BF16 rows, with or without
// top-k weights, no bias. Either: every tensor plain (exactly torch.Tensor,
// contiguous, on the buffer's device), no events, and the caller's stream
// already the buffer's last (the Python layer's gate). The checks are the
// Python layer's fast-path checks (python/turnout/ops/intranode.py); a call
// that fails one is declined (None) before anything is allocated or queued,
// and the Python layer then takes it and names what is wrong. The launch goes
// through _C's capsule (intranode_entry.hpp), so the arguments are never
// Python objects in between.
#include <ATen/ATen.h>
#include <Python.h>
#include <torch/csrc/Exceptions.h>

#include <climits>
#include <cstdint>
#include <vector>

#include "intranode_entry.hpp"
#include "plain_tensor.hpp"
#include "torch_ext.hpp"

namespace turnout::torch_ext {

namespace {

using bindings::IntranodeEntry;

const IntranodeEntry* g_entry = nullptr;

// `o` where it is exactly an int in [min, INT_MAX] (as `type(o) is int`: no bool).
bool int_at_least(PyObject* o, long long min, int* out) {
  if (!PyLong_CheckExact(o)) return false;
  int overflow = 0;
  const long long v = PyLong_AsLongLongAndOverflow(o, &overflow);
  if (overflow != 0 || v < min || v > INT_MAX) return false;
  *out = static_cast<int>(v);
  return true;
}

// The call has its argument count and the entry is set; else the Python error says which not.
bool ready_to_call(const char* name, Py_ssize_t nargs, Py_ssize_t wanted) {
  if (nargs != wanted) {
    PyErr_Format(PyExc_TypeError, "%s: %zd arguments, got %zd", name, wanted, nargs);
    return false;
  }
  if (g_entry == nullptr) {
    PyErr_Format(PyExc_RuntimeError, "%s: set_intranode_entry was not called", name);
    return false;
  }
  return true;
}

}  // namespace

PyObject* set_intranode_entry(PyObject*, PyObject* capsule) {
  const auto* entry = static_cast<const IntranodeEntry*>(PyCapsule_GetPointer(capsule, bindings::kIntranodeEntryName));
  if (entry == nullptr) return nullptr;
  if (entry->entry_size != sizeof(IntranodeEntry) || entry->args_size != sizeof(DispatchArgs) ||
      entry->counts_size != sizeof(DispatchCountsArgs) || entry->combine_size != sizeof(CombineArgs) ||
      entry->waited_size != sizeof(bindings::WaitedCounts)) {
    PyErr_SetString(PyExc_ImportError,
                    "turnout._torch_ext and turnout._C come from different builds: their intranode entries differ");
    return nullptr;
  }
  g_entry = entry;
  Py_RETURN_NONE;
}

namespace {

// A fresh dispatch with top-k as the common case has it: args[2..8] are x,
// num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx,
// topk_weights and expert_alignment.
struct FreshDispatch {
  const at::Tensor* data = nullptr;    // BF16 rows, or FP8 rows with...
  const at::Tensor* scales = nullptr;  // ...their f32 or i32 scales
  const at::Tensor* in_rank = nullptr;
  const at::Tensor* per_expert = nullptr;
  const at::Tensor* topk_idx = nullptr;
  const at::Tensor* topk_weights = nullptr;
  int64_t row_bytes = 0, num_tokens = 0, hidden = 0, num_experts = 0, num_topk = 0;
  int expert_alignment = 0;
};

// Whether args are that case (then `d` holds them); nothing is set where not.
bool take_fresh_dispatch(PyObject* const* args, long num_ranks, long index, FreshDispatch& d) {
  if (!int_at_least(args[8], 1, &d.expert_alignment)) return false;
  // The rows: a BF16 tensor, or an (FP8 rows, f32 or i32 scales) tuple.
  PyObject* x = args[2];
  if (is_tensor(x)) {
    d.data = plain(x, at::kBFloat16, 2, index);
    if (d.data == nullptr || d.data->size(1) % 8 != 0 || !aligned16(*d.data)) return false;
    d.row_bytes = d.data->size(1) * 2;
  } else if (PyTuple_CheckExact(x) && PyTuple_GET_SIZE(x) == 2 && is_tensor(PyTuple_GET_ITEM(x, 1))) {
    d.data = plain(PyTuple_GET_ITEM(x, 0), at::kFloat8_e4m3fn, 2, index);
    d.scales = &THPVariable_Unpack(PyTuple_GET_ITEM(x, 1));
    const at::ScalarType st = d.scales->scalar_type();
    if (d.data == nullptr || (st != at::kFloat && st != at::kInt) || d.scales->dim() != 2 ||
        d.scales->get_device() != index || d.scales->size(0) != d.data->size(0) || d.data->size(1) % 16 != 0 ||
        !aligned16(*d.data))
      return false;
    d.row_bytes = d.data->size(1);
  } else {
    return false;
  }
  d.num_tokens = d.data->size(0);
  d.hidden = d.data->size(1);
  // The layout and the top-k.
  const at::Tensor* per_rank = plain(args[3], at::kInt, 1, index);
  d.in_rank = plain(args[4], at::kBool, 2, index);
  d.per_expert = plain(args[5], at::kInt, 1, index);
  d.topk_idx = plain(args[6], at::kLong, 2, index);
  d.topk_weights = plain(args[7], at::kFloat, 2, index);
  if (per_rank == nullptr || d.in_rank == nullptr || d.per_expert == nullptr || d.topk_idx == nullptr ||
      d.topk_weights == nullptr)
    return false;
  d.num_experts = d.per_expert->size(0);
  d.num_topk = d.topk_idx->size(1);
  return d.in_rank->size(0) == d.num_tokens && d.in_rank->size(1) == num_ranks && per_rank->size(0) == num_ranks &&
         d.topk_idx->size(0) == d.num_tokens && d.topk_weights->sizes() == d.topk_idx->sizes() && d.num_experts != 0 &&
         d.num_experts % num_ranks == 0 && d.num_topk != 0 && d.num_tokens <= INT_MAX && d.row_bytes <= INT_MAX &&
         d.num_experts <= INT_MAX;
}

// A dispatch's outputs of `rows` rows as the Python layer makes them
// (ops/intranode.py's _receive_outputs): the rows and their scales each
// alone, the rest in one allocation; rank_prefix_matrix with them, or
// `prefix` made before.
struct ReceiveOutputs {
  at::Tensor recv_x, recv_scales, recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, prefix;
};

ReceiveOutputs make_receive_outputs(const FreshDispatch& d, int64_t rows, long num_ranks, at::Tensor prefix) {
  OutputSpec specs[7];
  size_t count = 0;
  specs[count++] = {d.data->scalar_type(), rows, d.hidden};
  if (d.scales != nullptr) specs[count++] = {d.scales->scalar_type(), rows, d.scales->size(1)};
  const size_t separate = count;
  specs[count++] = {at::kLong, rows, d.num_topk};
  specs[count++] = {at::kFloat, rows, d.num_topk};
  specs[count++] = {at::kInt, num_ranks, -1};
  specs[count++] = {at::kInt, rows, -1};
  if (!prefix.defined()) specs[count++] = {at::kInt, num_ranks, num_ranks};
  std::vector<at::Tensor> made = make_outputs(at::TensorOptions().device(d.data->device()), specs, count, separate);
  ReceiveOutputs o;
  o.recv_x = std::move(made[0]);
  if (d.scales != nullptr) o.recv_scales = std::move(made[1]);
  o.recv_topk_idx = std::move(made[separate]);
  o.recv_topk_weights = std::move(made[separate + 1]);
  o.source_num_tokens = std::move(made[separate + 2]);
  o.recv_src_idx = std::move(made[separate + 3]);
  o.prefix = prefix.defined() ? std::move(prefix) : std::move(made[separate + 4]);
  return o;
}

// The counts step's arguments; the rows the outputs have when known (num_worst_tokens), else 0.
DispatchCountsArgs counts_args(const FreshDispatch& d, const at::Tensor& prefix, int num_worst) {
  DispatchCountsArgs c;
  c.num_tokens = static_cast<int>(d.num_tokens);
  c.is_token_in_rank = address<const bool>(*d.in_rank);
  c.num_tokens_per_expert = address<const int32_t>(*d.per_expert);
  c.num_experts = static_cast<int>(d.num_experts);
  c.topk_idx = address<const int64_t>(*d.topk_idx);
  c.num_topk = static_cast<int>(d.num_topk);
  c.expert_alignment = d.expert_alignment;
  c.num_worst_tokens = num_worst;
  c.rank_prefix_matrix = address<int32_t>(prefix);
  return c;
}

// The data step's arguments into `o`'s `rows` rows.
DispatchArgs data_args(const FreshDispatch& d, const ReceiveOutputs& o, int rows, int num_worst) {
  DispatchArgs a;
  a.x = d.data->data_ptr();
  a.num_tokens = static_cast<int>(d.num_tokens);
  a.row_bytes = static_cast<int>(d.row_bytes);
  if (d.scales != nullptr) {
    a.x_scales = d.scales->data_ptr();
    a.num_scales = static_cast<int>(d.scales->size(1));
    a.scale_stride_token = d.scales->stride(0);
    a.scale_stride_group = d.scales->stride(1);
  }
  a.topk_idx = address<const int64_t>(*d.topk_idx);
  a.topk_weights = address<const float>(*d.topk_weights);
  a.num_topk = static_cast<int>(d.num_topk);
  a.num_experts = static_cast<int>(d.num_experts);
  a.is_token_in_rank = address<const bool>(*d.in_rank);
  a.rank_prefix_matrix = address<const int32_t>(o.prefix);
  a.num_recv_rows = rows;
  a.num_worst_tokens = num_worst;
  a.out.recv_x = o.recv_x.data_ptr();
  a.out.recv_x_scales = d.scales != nullptr ? o.recv_scales.data_ptr() : nullptr;
  a.out.recv_topk_idx = address<int64_t>(o.recv_topk_idx);
  a.out.recv_topk_weights = address<float>(o.recv_topk_weights);
  a.out.recv_src_idx = address<int32_t>(o.recv_src_idx);
  a.out.source_num_tokens = address<int32_t>(o.source_num_tokens);
  return a;
}

// A dispatch call's last three arguments.
struct CallScalars {
  long num_ranks = 0;
  long index = 0;  // the buffer's device
  uintptr_t stream = 0;
};

// The call has its `wanted` arguments, ending with num_ranks, device_index
// and stream (then in `c`), and the entry is set; else the Python error says why not.
bool begin_dispatch_call(const char* name, PyObject* const* args, Py_ssize_t nargs, Py_ssize_t wanted, CallScalars& c) {
  if (!ready_to_call(name, nargs, wanted)) return false;
  c.num_ranks = PyLong_AsLong(args[wanted - 3]);
  c.index = PyLong_AsLong(args[wanted - 2]);
  c.stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[wanted - 1]));
  return PyErr_Occurred() == nullptr;
}

std::vector<at::Tensor> tensors_of(ReceiveOutputs&& o) {
  return {std::move(o.recv_x),
          std::move(o.recv_scales),
          std::move(o.recv_topk_idx),
          std::move(o.recv_topk_weights),
          std::move(o.source_num_tokens),
          std::move(o.recv_src_idx),
          std::move(o.prefix)};
}

}  // namespace

// dispatch_worst(native, config, x, num_tokens_per_rank, is_token_in_rank,
// num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
// num_worst_tokens, num_ranks, device_index, stream): the seven outputs
// (recv_x_scales None for BF16 rows), or None where the call is not one this
// path takes.
PyObject* dispatch_worst(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  CallScalars c;
  if (!begin_dispatch_call("dispatch_worst", args, nargs, 13, c)) return nullptr;
  int num_worst = 0;
  FreshDispatch d;
  if (!int_at_least(args[9], 1, &num_worst) || !take_fresh_dispatch(args, c.num_ranks, c.index, d)) Py_RETURN_NONE;
  ReceiveOutputs o = make_receive_outputs(d, num_worst, c.num_ranks, at::Tensor());
  DispatchArgs a = data_args(d, o, num_worst, num_worst);
  DispatchCountsArgs counts = counts_args(d, o.prefix, num_worst);  // num_worst: the rows the outputs have
  const int queued = g_entry->dispatch_known_rows(args[0], args[1], &counts, &a, c.stream);
  if (queued < 0) return nullptr;
  if (queued > 0) Py_RETURN_NONE;
  return tuple_of(tensors_of(std::move(o)));
  END_HANDLE_TH_ERRORS
}

// dispatch_waited(native, config, x, num_tokens_per_rank, is_token_in_rank,
// num_tokens_per_expert, topk_idx, topk_weights, expert_alignment, num_ranks,
// device_index, stream): a fresh dispatch without num_worst_tokens, which
// waits on the host for the receive counts (the GIL released) and then
// moves the rows into outputs of that many rows: the seven outputs, the
// per-expert receive counts (a list), and where the rows from this rank
// itself lie (begin, count); or None where the call is not one this path
// takes.
PyObject* dispatch_waited(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  CallScalars c;
  if (!begin_dispatch_call("dispatch_waited", args, nargs, 12, c)) return nullptr;
  FreshDispatch d;
  if (!take_fresh_dispatch(args, c.num_ranks, c.index, d)) Py_RETURN_NONE;
  at::Tensor prefix =
      at::empty({c.num_ranks, c.num_ranks}, at::TensorOptions().device(d.data->device()).dtype(at::kInt));
  DispatchCountsArgs counts = counts_args(d, prefix, 0);
  std::vector<int> per_expert(static_cast<size_t>(d.num_experts / c.num_ranks));
  bindings::WaitedCounts got{-1, -1, 0, static_cast<int>(per_expert.size()), per_expert.data()};
  const int counted = g_entry->dispatch_counts(args[0], args[1], &counts, &got, c.stream);
  if (counted < 0) return nullptr;
  if (counted > 0) Py_RETURN_NONE;
  ReceiveOutputs o = make_receive_outputs(d, got.num_recv_tokens, c.num_ranks, std::move(prefix));
  DispatchArgs a = data_args(d, o, got.num_recv_tokens, 0);
  // The counts step has run: the data step must follow it, so a buffer it
  // does not take is an error here, not a call to decline.
  const int queued = g_entry->dispatch(args[0], args[1], &a, c.stream);
  if (queued < 0) return nullptr;
  if (queued > 0) {
    PyErr_SetString(PyExc_RuntimeError, "dispatch_waited: the data step's entry did not take the buffer");
    return nullptr;
  }
  PyObject* outputs = tuple_of(tensors_of(std::move(o)));
  if (outputs == nullptr) return nullptr;
  PyObject* counts_list = PyList_New(static_cast<Py_ssize_t>(per_expert.size()));
  if (counts_list == nullptr) {
    Py_DECREF(outputs);
    return nullptr;
  }
  for (size_t i = 0; i < per_expert.size(); ++i) {
    PyObject* v = PyLong_FromLong(per_expert[i]);
    if (v == nullptr) {
      Py_DECREF(outputs);
      Py_DECREF(counts_list);
      return nullptr;
    }
    PyList_SET_ITEM(counts_list, static_cast<Py_ssize_t>(i), v);
  }
  PyObject* out = Py_BuildValue("(NNii)", outputs, counts_list, got.own_rows_begin, got.num_own_rows);
  return out;
  END_HANDLE_TH_ERRORS
}

// combine_plain(native, config, x, topk_weights, rank_prefix_matrix,
// source_num_tokens, recv_src_idx, is_token_in_rank, device_index, stream,
// own_rows_begin, num_own_rows):
// (combined_x, combined_topk_weights or None), or None where the call is not
// one this path takes. The four handle tensors are this buffer's own handle's
// (the Python layer has checked its owner); x and topk_weights get the Python
// layer's fast-path checks.
PyObject* combine_plain(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!ready_to_call("combine_plain", nargs, 12)) return nullptr;
  for (int i = 4; i < 8; ++i) {
    if (!THPVariable_Check(args[i])) {
      PyErr_Format(PyExc_TypeError, "combine_plain: handle tensor %d is a %s", i - 4, Py_TYPE(args[i])->tp_name);
      return nullptr;
    }
  }
  const long index = PyLong_AsLong(args[8]);
  const auto stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[9]));
  const long own_begin = PyLong_AsLong(args[10]), own_rows = PyLong_AsLong(args[11]);
  if (PyErr_Occurred()) return nullptr;
  const at::Tensor& recv_src_idx = THPVariable_Unpack(args[6]);
  const at::Tensor& in_rank = THPVariable_Unpack(args[7]);
  const int64_t num_rows = recv_src_idx.size(0), num_tokens = in_rank.size(0);
  const at::Tensor* x = plain(args[2], at::kBFloat16, 2, index);
  if (x == nullptr || x->size(0) != num_rows || x->size(1) % 8 != 0 || !aligned16(*x) || num_rows > INT_MAX ||
      num_tokens > INT_MAX || x->size(1) > INT_MAX)
    Py_RETURN_NONE;
  const at::Tensor* weights = nullptr;
  if (args[3] != Py_None) {
    weights = plain(args[3], at::kFloat, 2, index);
    if (weights == nullptr || weights->size(0) != num_rows || weights->size(1) == 0) Py_RETURN_NONE;
  }
  const int64_t hidden = x->size(1), num_topk = weights != nullptr ? weights->size(1) : 0;

  const at::TensorOptions on = at::TensorOptions().device(x->device());
  at::Tensor combined_x = at::empty({num_tokens, hidden}, on.dtype(at::kBFloat16));
  at::Tensor combined_weights;
  if (weights != nullptr) combined_weights = at::empty({num_tokens, num_topk}, on.dtype(at::kFloat));

  CombineArgs a;
  a.x = x->data_ptr();
  a.num_rows = static_cast<int>(num_rows);
  a.hidden = static_cast<int>(hidden);
  if (weights != nullptr) {
    a.topk_weights = address<const float>(*weights);
    a.num_topk = static_cast<int>(num_topk);
    a.combined_topk_weights = address<float>(combined_weights);
  }
  a.rank_prefix_matrix = address<const int32_t>(THPVariable_Unpack(args[4]));
  a.source_num_tokens = address<const int32_t>(THPVariable_Unpack(args[5]));
  a.recv_src_idx = address<const int32_t>(recv_src_idx);
  a.is_token_in_rank = address<const bool>(in_rank);
  a.num_tokens = static_cast<int>(num_tokens);
  a.combined_x = combined_x.data_ptr();
  if (own_begin >= 0 && own_begin <= INT_MAX && own_rows > 0 && own_rows <= INT_MAX) {
    a.own_rows_begin = static_cast<int>(own_begin);
    a.num_own_rows = static_cast<int>(own_rows);
  }

  const int queued = g_entry->combine(args[0], args[1], &a, stream);
  if (queued < 0) return nullptr;
  if (queued > 0) Py_RETURN_NONE;
  return tuple_of({std::move(combined_x), std::move(combined_weights)});
  END_HANDLE_TH_ERRORS
}

}  // namespace turnout::torch_ext
