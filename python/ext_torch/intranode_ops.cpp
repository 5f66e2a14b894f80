// The common intranode dispatch and combine, each in one call. Dispatch: a
// fresh one with num_worst_tokens, BF16 rows or FP8 rows with their scales,
// top-k given; combine: of this buffer's handle, BF16 rows, with or without
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
      entry->counts_size != sizeof(DispatchCountsArgs) || entry->combine_size != sizeof(CombineArgs)) {
    PyErr_SetString(PyExc_ImportError,
                    "turnout._torch_ext and turnout._C come from different builds: their intranode entries differ");
    return nullptr;
  }
  g_entry = entry;
  Py_RETURN_NONE;
}

// dispatch_worst(native, config, x, num_tokens_per_rank, is_token_in_rank,
// num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
// num_worst_tokens, num_ranks, device_index, stream): the seven outputs
// (recv_x_scales None for BF16 rows), or None where the call is not one this
// path takes.
PyObject* dispatch_worst(PyObject*, PyObject* const* args, Py_ssize_t nargs) {
  HANDLE_TH_ERRORS
  if (!ready_to_call("dispatch_worst", nargs, 13)) return nullptr;
  const long num_ranks = PyLong_AsLong(args[10]);
  const long index = PyLong_AsLong(args[11]);
  const auto stream = static_cast<uintptr_t>(PyLong_AsUnsignedLongLong(args[12]));
  if (PyErr_Occurred()) return nullptr;
  int expert_alignment = 0, num_worst = 0;
  if (!int_at_least(args[8], 1, &expert_alignment) || !int_at_least(args[9], 1, &num_worst)) Py_RETURN_NONE;

  // The rows: a BF16 tensor, or an (FP8 rows, f32 or i32 scales) tuple.
  PyObject* x = args[2];
  const at::Tensor* data = nullptr;
  const at::Tensor* scales = nullptr;
  int64_t row_bytes = 0;
  if (is_tensor(x)) {
    data = plain(x, at::kBFloat16, 2, index);
    if (data == nullptr || data->size(1) % 8 != 0 || !aligned16(*data)) Py_RETURN_NONE;
    row_bytes = data->size(1) * 2;
  } else if (PyTuple_CheckExact(x) && PyTuple_GET_SIZE(x) == 2 && is_tensor(PyTuple_GET_ITEM(x, 1))) {
    data = plain(PyTuple_GET_ITEM(x, 0), at::kFloat8_e4m3fn, 2, index);
    scales = &THPVariable_Unpack(PyTuple_GET_ITEM(x, 1));
    const at::ScalarType st = scales->scalar_type();
    if (data == nullptr || (st != at::kFloat && st != at::kInt) || scales->dim() != 2 ||
        scales->get_device() != index || scales->size(0) != data->size(0) || data->size(1) % 16 != 0 ||
        !aligned16(*data))
      Py_RETURN_NONE;
    row_bytes = data->size(1);
  } else {
    Py_RETURN_NONE;
  }
  const int64_t num_tokens = data->size(0), hidden = data->size(1);

  // The layout and the top-k.
  const at::Tensor* per_rank = plain(args[3], at::kInt, 1, index);
  const at::Tensor* in_rank = plain(args[4], at::kBool, 2, index);
  const at::Tensor* per_expert = plain(args[5], at::kInt, 1, index);
  const at::Tensor* topk_idx = plain(args[6], at::kLong, 2, index);
  const at::Tensor* topk_weights = plain(args[7], at::kFloat, 2, index);
  if (per_rank == nullptr || in_rank == nullptr || per_expert == nullptr || topk_idx == nullptr ||
      topk_weights == nullptr)
    Py_RETURN_NONE;
  const int64_t num_experts = per_expert->size(0), num_topk = topk_idx->size(1);
  if (in_rank->size(0) != num_tokens || in_rank->size(1) != num_ranks || per_rank->size(0) != num_ranks ||
      topk_idx->size(0) != num_tokens || topk_weights->sizes() != topk_idx->sizes() || num_experts == 0 ||
      num_experts % num_ranks != 0 || num_topk == 0 || num_tokens > INT_MAX || row_bytes > INT_MAX ||
      num_experts > INT_MAX)
    Py_RETURN_NONE;

  // The outputs as the Python layer makes them (ops/intranode.py's
  // _receive_outputs), on the rows' device: the rows and their scales each
  // alone, the rest in one allocation.
  const int64_t rows = num_worst;
  OutputSpec specs[7];
  size_t count = 0;
  specs[count++] = {data->scalar_type(), rows, hidden};
  if (scales != nullptr) specs[count++] = {scales->scalar_type(), rows, scales->size(1)};
  const size_t separate = count;
  specs[count++] = {at::kLong, rows, num_topk};
  specs[count++] = {at::kFloat, rows, num_topk};
  specs[count++] = {at::kInt, num_ranks, -1};
  specs[count++] = {at::kInt, rows, -1};
  specs[count++] = {at::kInt, num_ranks, num_ranks};
  std::vector<at::Tensor> made = make_outputs(at::TensorOptions().device(data->device()), specs, count, separate);
  at::Tensor& recv_x = made[0];
  at::Tensor recv_scales = scales != nullptr ? made[1] : at::Tensor();
  at::Tensor& recv_topk_idx = made[separate];
  at::Tensor& recv_topk_weights = made[separate + 1];
  at::Tensor& source_num_tokens = made[separate + 2];
  at::Tensor& recv_src_idx = made[separate + 3];
  at::Tensor& prefix = made[separate + 4];

  DispatchArgs a;
  a.x = data->data_ptr();
  a.num_tokens = static_cast<int>(num_tokens);
  a.row_bytes = static_cast<int>(row_bytes);
  if (scales != nullptr) {
    a.x_scales = scales->data_ptr();
    a.num_scales = static_cast<int>(scales->size(1));
    a.scale_stride_token = scales->stride(0);
    a.scale_stride_group = scales->stride(1);
  }
  a.topk_idx = address<const int64_t>(*topk_idx);
  a.topk_weights = address<const float>(*topk_weights);
  a.num_topk = static_cast<int>(num_topk);
  a.num_experts = static_cast<int>(num_experts);
  a.is_token_in_rank = address<const bool>(*in_rank);
  a.rank_prefix_matrix = address<const int32_t>(prefix);
  a.num_recv_rows = num_worst;
  a.num_worst_tokens = num_worst;
  a.out.recv_x = recv_x.data_ptr();
  a.out.recv_x_scales = scales != nullptr ? recv_scales.data_ptr() : nullptr;
  a.out.recv_topk_idx = address<int64_t>(recv_topk_idx);
  a.out.recv_topk_weights = address<float>(recv_topk_weights);
  a.out.recv_src_idx = address<int32_t>(recv_src_idx);
  a.out.source_num_tokens = address<int32_t>(source_num_tokens);
  DispatchCountsArgs counts;
  counts.num_tokens = a.num_tokens;
  counts.is_token_in_rank = a.is_token_in_rank;
  counts.num_tokens_per_expert = address<const int32_t>(*per_expert);
  counts.num_experts = a.num_experts;
  counts.topk_idx = a.topk_idx;
  counts.num_topk = a.num_topk;
  counts.expert_alignment = expert_alignment;
  counts.num_worst_tokens = num_worst;  // the rows the outputs have
  counts.rank_prefix_matrix = address<int32_t>(prefix);

  const int queued = g_entry->dispatch_known_rows(args[0], args[1], &counts, &a, stream);
  if (queued < 0) return nullptr;
  if (queued > 0) Py_RETURN_NONE;
  return tuple_of({std::move(recv_x), std::move(recv_scales), std::move(recv_topk_idx), std::move(recv_topk_weights),
                   std::move(source_num_tokens), std::move(recv_src_idx), std::move(prefix)});
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
