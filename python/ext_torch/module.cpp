// turnout._torch_ext: the method table and the element-type constants.
#include <Python.h>

#include "torch_ext.hpp"

namespace {

namespace te = turnout::torch_ext;

template <typename F>
PyCFunction function(F f) {
  return reinterpret_cast<PyCFunction>(reinterpret_cast<void (*)()>(f));
}

PyMethodDef kMethods[] = {
    {"empty", function(te::empty), METH_FASTCALL,
     "empty(device, code, rows, cols, ...) -> tuple of new tensors (cols < 0: one dimension)"},
    {"empty_packed", function(te::empty_packed), METH_FASTCALL,
     "empty_packed(device, separate, code, rows, cols, ...) -> as empty, the tensors after the first `separate` "
     "in one allocation"},
    {"set_intranode_entry", function(te::set_intranode_entry), METH_O,
     "set_intranode_entry(capsule): _C.Buffer.intranode_entry, before the first dispatch_worst"},
    {"dispatch_worst", function(te::dispatch_worst), METH_FASTCALL,
     "dispatch_worst(native, config, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, "
     "topk_weights, expert_alignment, num_worst_tokens, num_ranks, device_index, stream) -> (recv_x, recv_x_scales, "
     "recv_topk_idx, recv_topk_weights, source_num_tokens, recv_src_idx, rank_prefix_matrix) or None"},
    {"dispatch_waited", function(te::dispatch_waited), METH_FASTCALL,
     "dispatch_waited(native, config, x, num_tokens_per_rank, is_token_in_rank, num_tokens_per_expert, topk_idx, "
     "topk_weights, expert_alignment, num_ranks, device_index, stream) -> ((recv_x, recv_x_scales, recv_topk_idx, "
     "recv_topk_weights, source_num_tokens, recv_src_idx, rank_prefix_matrix), num_recv_tokens_per_expert_list, "
     "own_rows_begin, num_own_rows) or None"},
    {"combine_plain", function(te::combine_plain), METH_FASTCALL,
     "combine_plain(native, config, x, topk_weights, rank_prefix_matrix, source_num_tokens, recv_src_idx, "
     "is_token_in_rank, device_index, stream, own_rows_begin, num_own_rows) -> (combined_x, combined_topk_weights) or "
     "None"},
    {"set_low_latency_entry", function(te::set_low_latency_entry), METH_O,
     "set_low_latency_entry(capsule): _C.Buffer.low_latency_entry, before the first low-latency op"},
    {"low_latency_dispatch", function(te::low_latency_dispatch), METH_FASTCALL,
     "low_latency_dispatch(native, outputs, x, topk_idx, topk_weights, sizes, round_scale, cumulative_stats, "
     "wait_stats, device_index, phase, stream, wait_for, ring) -> (event, num_tokens, num_topk) or None"},
    {"low_latency_combine", function(te::low_latency_combine), METH_FASTCALL,
     "low_latency_combine(native, x, topk_idx, topk_weights, source, sizes, num_tokens, num_topk, use_logfmt, "
     "device_index, out, wait_stats, phase, stream, wait_for, ring) -> (combined_x, event) or None"},
    {nullptr, nullptr, 0, nullptr}};

PyModuleDef kModule = {PyModuleDef_HEAD_INIT, "_torch_ext", nullptr, -1, kMethods, nullptr, nullptr, nullptr, nullptr};

}  // namespace

PyMODINIT_FUNC PyInit__torch_ext() {
  PyObject* m = PyModule_Create(&kModule);
  if (m == nullptr) return nullptr;
  for (size_t i = 0; i < te::kTypes.size(); ++i) {
    if (PyModule_AddIntConstant(m, te::kTypeNames[i], static_cast<long>(i)) != 0) {
      Py_DECREF(m);
      return nullptr;
    }
  }
  return m;
}
