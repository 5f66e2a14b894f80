// The Python binding: a thin layer over the C++ core. Tensors arrive as raw
// device pointers (the Python layer has checked them), streams as handles, so a
// call costs no DLPack conversion and the module links no libtorch.
#include <nanobind/nanobind.h>
#include <nanobind/ndarray.h>
#include <nanobind/stl/optional.h>
#include <nanobind/stl/string.h>
#include <nanobind/stl/tuple.h>
#include <nanobind/stl/vector.h>

#include <cstring>
#include <optional>
#include <span>
#include <vector>

#include "turnout/turnout.hpp"

namespace nb = nanobind;
using namespace nb::literals;

namespace {

template <typename T>
T* ptr(uintptr_t p) {
  return reinterpret_cast<T*>(p);
}

// The part of a Config the intranode ops read (every args struct has it).
template <typename Args>
void set_channels(Args& a, const turnout::Config& config) {
  a.num_sms = config.num_sms;
  a.num_max_send_tokens = config.num_max_nvl_chunked_send_tokens;
  a.num_max_recv_tokens = config.num_max_nvl_chunked_recv_tokens;
}

cudaStream_t stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// A dispatch's outputs from the addresses Python passes (0: none).
turnout::DispatchOutputs dispatch_outputs(uintptr_t recv_x, uintptr_t recv_x_scales, uintptr_t recv_topk_idx,
                                          uintptr_t recv_topk_weights, uintptr_t recv_src_idx,
                                          uintptr_t source_num_tokens) {
  return {ptr<void>(recv_x), ptr<void>(recv_x_scales), ptr<int64_t>(recv_topk_idx),
          ptr<float>(recv_topk_weights), ptr<int32_t>(recv_src_idx), ptr<int32_t>(source_num_tokens)};
}

// The stream joins around an op, folded into its first and last native call
// (each call into the extension costs about a microsecond): the op's stream
// waits for `wait_for` before the launch, `join_to` waits for the op's stream
// after it. None: no join (0 is a stream, the legacy default one).
using MaybeStream = std::optional<uintptr_t>;
void join_before(turnout::Buffer& b, uintptr_t s, MaybeStream wait_for) {
  if (wait_for) b.join(stream(s), stream(*wait_for));
}
void join_after(turnout::Buffer& b, uintptr_t s, MaybeStream join_to) {
  if (join_to) b.join(stream(*join_to), stream(s));
}

// What the interrupt check took out of Python's error state: a wait whose
// Interrupted the core catches itself (destroy) must not leave it set, so the
// translator puts it back only when the exception reaches Python.
struct SignalError {
  PyObject* type = nullptr;
  PyObject* value = nullptr;
  PyObject* traceback = nullptr;
};
thread_local SignalError t_signal_error;

// GIL held.
void stash_signal_error() {
  Py_XDECREF(t_signal_error.type);
  Py_XDECREF(t_signal_error.value);
  Py_XDECREF(t_signal_error.traceback);
  PyErr_Fetch(&t_signal_error.type, &t_signal_error.value, &t_signal_error.traceback);
}

// GIL held. True if there was one to put back.
bool restore_signal_error() {
  if (!t_signal_error.type) return false;
  PyErr_Restore(t_signal_error.type, t_signal_error.value, t_signal_error.traceback);
  t_signal_error = {};
  return true;
}

void translate_errors(const std::exception_ptr& p, void*) {
  try {
    std::rethrow_exception(p);
  } catch (const turnout::Interrupted& e) {
    // The signal handler's own exception (KeyboardInterrupt, or the user's).
    if (!restore_signal_error()) PyErr_SetString(PyExc_KeyboardInterrupt, e.what());
  } catch (const turnout::InvalidArgument& e) {
    PyErr_SetString(PyExc_ValueError, e.what());
  } catch (const turnout::NotSupported& e) {
    PyErr_SetString(PyExc_NotImplementedError, e.what());
  } catch (const turnout::TimeoutError& e) {
    PyErr_SetString(PyExc_TimeoutError, e.what());
  } catch (const turnout::Error& e) {
    PyErr_SetString(PyExc_RuntimeError, e.what());
  }
}

// The host waits' interrupt check: runs Python's signal handlers (the waits
// release the GIL), so Ctrl-C raises KeyboardInterrupt out of a wait.
bool python_signal_pending() {
#if PY_VERSION_HEX >= 0x030D0000
  if (Py_IsFinalizing()) return false;
#else
  if (_Py_IsFinalizing()) return false;
#endif
  nb::gil_scoped_acquire gil;
  if (PyErr_CheckSignals() == 0) return false;
  stash_signal_error();
  return true;
}

// Calls a Python all-gather (bytes -> bytes) from the C++ bootstrap.
turnout::FunctionBootstrap::AllGather python_all_gather(nb::callable fn) {
  return [fn](std::span<const std::byte> mine) {
    nb::bytes out = nb::cast<nb::bytes>(fn(nb::bytes(mine.data(), mine.size())));
    const auto* data = static_cast<const std::byte*>(out.data());
    return std::vector<std::byte>(data, data + out.size());
  };
}

void bind_config(nb::module_& m) {
  nb::class_<turnout::Config>(m, "Config")
      .def(nb::init<int, int, int, int, int>(), "num_sms"_a = 20, "num_max_nvl_chunked_send_tokens"_a = 6,
           "num_max_nvl_chunked_recv_tokens"_a = 256, "num_max_rdma_chunked_send_tokens"_a = 6,
           "num_max_rdma_chunked_recv_tokens"_a = 256)
      .def_ro("num_sms", &turnout::Config::num_sms)
      .def_ro("num_max_nvl_chunked_send_tokens", &turnout::Config::num_max_nvl_chunked_send_tokens)
      .def_ro("num_max_nvl_chunked_recv_tokens", &turnout::Config::num_max_nvl_chunked_recv_tokens)
      .def_ro("num_max_rdma_chunked_send_tokens", &turnout::Config::num_max_rdma_chunked_send_tokens)
      .def_ro("num_max_rdma_chunked_recv_tokens", &turnout::Config::num_max_rdma_chunked_recv_tokens)
      .def("get_nvl_buffer_size_hint", &turnout::Config::get_nvl_buffer_size_hint, "hidden_bytes"_a, "num_ranks"_a)
      .def("get_rdma_buffer_size_hint", &turnout::Config::get_rdma_buffer_size_hint, "hidden_bytes"_a, "num_ranks"_a)
      .def("__repr__", [](const turnout::Config& c) {
        return "Config(num_sms=" + std::to_string(c.num_sms) +
               ", num_max_nvl_chunked_send_tokens=" + std::to_string(c.num_max_nvl_chunked_send_tokens) +
               ", num_max_nvl_chunked_recv_tokens=" + std::to_string(c.num_max_nvl_chunked_recv_tokens) +
               ", num_max_rdma_chunked_send_tokens=" + std::to_string(c.num_max_rdma_chunked_send_tokens) +
               ", num_max_rdma_chunked_recv_tokens=" + std::to_string(c.num_max_rdma_chunked_recv_tokens) + ")";
      });
  m.def("get_dispatch_config", &turnout::get_dispatch_config, "num_ranks"_a, "num_sms"_a);
  m.def("get_combine_config", &turnout::get_combine_config, "num_ranks"_a, "num_sms"_a);
  m.def("get_low_latency_rdma_size_hint", &turnout::get_low_latency_rdma_size_hint,
        "num_max_dispatch_tokens_per_rank"_a, "hidden"_a, "num_ranks"_a, "num_experts"_a);
}

void bind_buffer(nb::module_& m) {
  using turnout::Buffer;
  nb::class_<Buffer>(m, "Buffer")
      .def(
          "__init__",
          [](Buffer* self, int rank, int size, nb::callable all_gather, int device, size_t num_nvl_bytes,
             size_t num_rdma_bytes, bool low_latency_mode, double timeout_s, int nvl_domain_size,
             uintptr_t comm_stream) {
            TURNOUT_CUDA_CHECK(cudaSetDevice(device));
            turnout::FunctionBootstrap bootstrap(rank, size, python_all_gather(std::move(all_gather)));
            turnout::BufferOptions options;
            options.num_nvl_bytes = num_nvl_bytes;
            options.num_rdma_bytes = num_rdma_bytes;
            options.low_latency_mode = low_latency_mode;
            options.timeout_s = timeout_s;
            options.nvl_domain_size = nvl_domain_size;
            options.comm_stream = stream(comm_stream);
            new (self) Buffer(bootstrap, options);
          },
          "rank"_a, "size"_a, "all_gather"_a, "device"_a, "num_nvl_bytes"_a, "num_rdma_bytes"_a,
          "low_latency_mode"_a, "timeout_s"_a, "nvl_domain_size"_a, "comm_stream"_a)
      .def_prop_ro("rank", [](const Buffer& b) { return b.topology().rank; })
      .def_prop_ro("num_ranks", [](const Buffer& b) { return b.topology().num_ranks; })
      .def_prop_ro("num_nvl_ranks", [](const Buffer& b) { return b.topology().num_nvl_ranks; })
      .def_prop_ro("num_rdma_ranks", [](const Buffer& b) { return b.topology().num_rdma_ranks(); })
      .def_prop_ro("device", &Buffer::device)
      .def_prop_ro("timeout_s", &Buffer::timeout_s)
      .def_prop_ro("sm_budget", &Buffer::sm_budget)
      .def_prop_ro("ranks_on_gpu", &Buffer::ranks_on_gpu)
      .def_prop_ro("destroyed", &Buffer::destroyed)
      .def_prop_ro("last_host_wait_s", &Buffer::last_host_wait_s)
      .def_prop_ro("comm_stream", [](const Buffer& b) { return reinterpret_cast<uintptr_t>(b.comm_stream()); })
      .def("destroy", &Buffer::destroy, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "local_buffer",
          [](nb::handle_t<Buffer> self) {
            Buffer& b = nb::cast<Buffer&>(self);
            const size_t shape[1] = {b.num_nvl_bytes()};
            // The tensor keeps the Python Buffer alive, not the memory past destroy().
            return nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>, nb::device::cuda>(
                b.local_nvl_buffer(), 1, shape, self, nullptr, nb::dtype<uint8_t>(), nb::device::cuda::value,
                b.device());
          },
          nb::rv_policy::reference)
      .def(
          "get_dispatch_layout",
          [](Buffer& b, uintptr_t topk_idx, int num_tokens, int num_topk, int num_experts, uintptr_t per_rank,
             uintptr_t per_rdma_rank, uintptr_t per_expert, uintptr_t in_rank, uintptr_t s, MaybeStream wait_for,
             MaybeStream join_to) {
            turnout::LayoutArgs a;
            a.topk_idx = ptr<const int64_t>(topk_idx);
            a.num_tokens = num_tokens;
            a.num_topk = num_topk;
            a.num_experts = num_experts;
            a.num_tokens_per_rank = ptr<int32_t>(per_rank);
            a.num_tokens_per_rdma_rank = ptr<int32_t>(per_rdma_rank);
            a.num_tokens_per_expert = ptr<int32_t>(per_expert);
            a.is_token_in_rank = ptr<bool>(in_rank);
            join_before(b, s, wait_for);
            b.get_dispatch_layout(a, stream(s));
            join_after(b, s, join_to);
          })
      .def(
          "dispatch_counts",
          [](Buffer& b, uintptr_t in_rank, int num_tokens, uintptr_t per_expert, int num_experts, uintptr_t topk_idx,
             int num_topk, int expert_alignment, int num_worst_tokens, const turnout::Config& config,
             uintptr_t rank_prefix_matrix, uintptr_t s, MaybeStream wait_for) {
            turnout::DispatchCountsArgs a;
            a.num_tokens = num_tokens;
            a.is_token_in_rank = ptr<const bool>(in_rank);
            a.num_tokens_per_expert = ptr<const int32_t>(per_expert);
            a.num_experts = num_experts;
            a.topk_idx = ptr<const int64_t>(topk_idx);
            a.num_topk = num_topk;
            a.expert_alignment = expert_alignment;
            a.num_worst_tokens = num_worst_tokens;
            set_channels(a, config);
            a.rank_prefix_matrix = ptr<int32_t>(rank_prefix_matrix);
            // The host wait runs without the GIL (other threads may drive other
            // GPUs); a call that does not wait keeps it (releasing costs time).
            std::optional<nb::gil_scoped_release> release;
            if (num_worst_tokens == 0 && per_expert != 0) release.emplace();
            join_before(b, s, wait_for);
            turnout::DispatchCounts c = b.dispatch_counts(a, stream(s));
            return std::make_tuple(c.num_recv_tokens, std::move(c.num_recv_tokens_per_expert));
          })
      .def("dispatch",
           [](Buffer& b, uintptr_t x, int num_tokens, int row_bytes, uintptr_t x_scales, int num_scales,
              int64_t scale_stride_token, int64_t scale_stride_group, uintptr_t topk_idx, uintptr_t topk_weights,
              int num_topk, int num_experts, uintptr_t in_rank, uintptr_t rank_prefix_matrix, int num_recv_rows,
              int num_worst_tokens, const turnout::Config& config, uintptr_t recv_x,
              uintptr_t recv_x_scales, uintptr_t recv_topk_idx, uintptr_t recv_topk_weights, uintptr_t recv_src_idx,
              uintptr_t source_num_tokens, uintptr_t s, MaybeStream join_to) {
             turnout::DispatchArgs a;
             a.x = ptr<const void>(x);
             a.num_tokens = num_tokens;
             a.row_bytes = row_bytes;
             a.x_scales = ptr<const void>(x_scales);
             a.num_scales = num_scales;
             a.scale_stride_token = scale_stride_token;
             a.scale_stride_group = scale_stride_group;
             a.topk_idx = ptr<const int64_t>(topk_idx);
             a.topk_weights = ptr<const float>(topk_weights);
             a.num_topk = num_topk;
             a.num_experts = num_experts;
             a.is_token_in_rank = ptr<const bool>(in_rank);
             a.rank_prefix_matrix = ptr<const int32_t>(rank_prefix_matrix);
             a.num_recv_rows = num_recv_rows;
             a.num_worst_tokens = num_worst_tokens;
             set_channels(a, config);
             a.out = dispatch_outputs(recv_x, recv_x_scales, recv_topk_idx, recv_topk_weights, recv_src_idx,
                                     source_num_tokens);
             b.dispatch(a, stream(s));
             join_after(b, s, join_to);
           })
      .def("combine",
           [](Buffer& b, uintptr_t x, int num_rows, int hidden, uintptr_t topk_weights, int num_topk, uintptr_t bias0,
              uintptr_t bias1, uintptr_t rank_prefix_matrix, uintptr_t source_num_tokens, uintptr_t recv_src_idx,
              uintptr_t in_rank, int num_tokens, const turnout::Config& config, uintptr_t combined_x,
              uintptr_t combined_topk_weights, uintptr_t s, MaybeStream wait_for, MaybeStream join_to) {
             turnout::CombineArgs a;
             a.x = ptr<const void>(x);
             a.num_rows = num_rows;
             a.hidden = hidden;
             a.topk_weights = ptr<const float>(topk_weights);
             a.num_topk = num_topk;
             a.bias0 = ptr<const void>(bias0);
             a.bias1 = ptr<const void>(bias1);
             a.rank_prefix_matrix = ptr<const int32_t>(rank_prefix_matrix);
             a.source_num_tokens = ptr<const int32_t>(source_num_tokens);
             a.recv_src_idx = ptr<const int32_t>(recv_src_idx);
             a.is_token_in_rank = ptr<const bool>(in_rank);
             a.num_tokens = num_tokens;
             set_channels(a, config);
             a.combined_x = ptr<void>(combined_x);
             a.combined_topk_weights = ptr<float>(combined_topk_weights);
             join_before(b, s, wait_for);
             b.combine(a, stream(s));
             join_after(b, s, join_to);
           })
      .def("join", [](Buffer& b, uintptr_t waiter, uintptr_t waited) { b.join(stream(waiter), stream(waited)); })
      .def("barrier", [](Buffer& b, uintptr_t s) { b.barrier(stream(s)); })
      .def(
          "synchronize", [](Buffer& b, uintptr_t s, const std::string& op) { b.synchronize(stream(s), op.c_str()); },
          nb::call_guard<nb::gil_scoped_release>())
      .def("check_errors", [](Buffer& b, const std::string& op) { b.check_errors(op.c_str()); })
      .def("store_to_peers",
           [](Buffer& b, uintptr_t src, size_t bytes, size_t dst_offset, bool include_self, int num_sms, uintptr_t s) {
             b.store_to_peers(ptr<const void>(src), bytes, dst_offset, include_self, num_sms, stream(s));
           })
      .def("load_from_peers", [](Buffer& b, uintptr_t dst, size_t bytes, size_t src_offset, int num_sms, uintptr_t s) {
        b.load_from_peers(ptr<void>(dst), bytes, src_offset, num_sms, stream(s));
      });
}

}  // namespace

NB_MODULE(_C, m) {
  m.doc() = "turnout's C++ core";
  nb::register_exception_translator(translate_errors);
  turnout::set_interrupt_check(python_signal_pending);
  bind_config(m);
  bind_buffer(m);
  m.def("is_sm90_compiled", &turnout::is_sm90_compiled);
  m.def("default_timeout_s", &turnout::default_timeout_s);
}
