#include <nanobind/ndarray.h>
#include <nanobind/stl/string.h>

#include <cstddef>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include "bindings.hpp"

namespace turnout::bindings {

using namespace nb::literals;

namespace {

// Calls a Python all-gather (bytes -> bytes) from the C++ bootstrap.
FunctionBootstrap::AllGather python_all_gather(nb::callable fn) {
  return [fn](std::span<const std::byte> mine) {
    nb::bytes out = nb::cast<nb::bytes>(fn(nb::bytes(mine.data(), mine.size())));
    const auto* data = static_cast<const std::byte*>(out.data());
    return std::vector<std::byte>(data, data + out.size());
  };
}

void construct(Buffer* self, int rank, int size, nb::callable all_gather, int device, size_t num_nvl_bytes,
               size_t num_rdma_bytes, bool low_latency_mode, double timeout_s, int nvl_domain_size,
               uintptr_t comm_stream, bool enable_shrink, double shrink_timeout_s, int num_qps_per_rank,
               bool allow_nvlink_for_low_latency_mode, bool allow_mnnvl) {
  TURNOUT_CUDA_CHECK(cudaSetDevice(device));
  FunctionBootstrap bootstrap(rank, size, python_all_gather(std::move(all_gather)));
  BufferOptions options;
  options.num_nvl_bytes = num_nvl_bytes;
  options.num_rdma_bytes = num_rdma_bytes;
  options.low_latency_mode = low_latency_mode;
  options.timeout_s = timeout_s;
  options.nvl_domain_size = nvl_domain_size;
  options.comm_stream = stream(comm_stream);
  options.enable_shrink = enable_shrink;
  options.shrink_timeout_s = shrink_timeout_s;
  options.num_qps_per_rank = num_qps_per_rank;
  options.allow_nvlink_for_low_latency_mode = allow_nvlink_for_low_latency_mode;
  options.allow_mnnvl = allow_mnnvl;
  new (self) Buffer(bootstrap, options);
}

using ByteTensor = nb::ndarray<nb::pytorch, uint8_t, nb::ndim<1>, nb::device::cuda>;

ByteTensor local_buffer(nb::handle_t<Buffer> self) {
  Buffer& b = nb::cast<Buffer&>(self);
  const size_t shape[1] = {b.num_nvl_bytes()};
  // The tensor keeps the Python Buffer alive, not the memory past destroy().
  return ByteTensor(b.local_nvl_buffer(), 1, shape, self, nullptr, nb::dtype<uint8_t>(), nb::device::cuda::value,
                    b.device());
}

}  // namespace

BufferClass bind_buffer(nb::module_& m) {
  m.def("default_timeout_s", &default_timeout_s);
  m.def("default_shrink_timeout_s", &default_shrink_timeout_s);
  BufferClass buffer(m, "Buffer");
  buffer
      .def("__init__", &construct, "rank"_a, "size"_a, "all_gather"_a, "device"_a, "num_nvl_bytes"_a,
           "num_rdma_bytes"_a, "low_latency_mode"_a, "timeout_s"_a, "nvl_domain_size"_a, "comm_stream"_a,
           "enable_shrink"_a = false, "shrink_timeout_s"_a = 0.0, "num_qps_per_rank"_a = 24,
           "allow_nvlink_for_low_latency_mode"_a = true, "allow_mnnvl"_a = false)
      .def_prop_ro("rank", [](const Buffer& b) { return b.topology().rank; })
      .def_prop_ro("num_ranks", [](const Buffer& b) { return b.topology().num_ranks; })
      .def_prop_ro("num_nvl_ranks", [](const Buffer& b) { return b.topology().num_nvl_ranks; })
      .def_prop_ro("num_rdma_ranks", [](const Buffer& b) { return b.topology().num_rdma_ranks(); })
      .def_prop_ro("device", &Buffer::device)
      .def_prop_ro("timeout_s", &Buffer::timeout_s)
      .def_prop_ro("peer_memory_kind", &Buffer::peer_memory_kind)
      .def_prop_ro("shrink_enabled", &Buffer::shrink_enabled)
      .def_prop_ro("shrink_timeout_s", &Buffer::shrink_timeout_s)
      .def_prop_ro("sm_budget", &Buffer::sm_budget)
      .def_prop_ro("ranks_on_gpu", &Buffer::ranks_on_gpu)
      .def_prop_ro("one_launch", &Buffer::one_launch)
      .def_prop_ro("destroyed", &Buffer::destroyed)
      .def_prop_ro("last_host_wait_s", &Buffer::last_host_wait_s)
      .def_prop_ro("comm_stream", [](const Buffer& b) { return reinterpret_cast<uintptr_t>(b.comm_stream()); })
      .def("destroy", &Buffer::destroy, nb::call_guard<nb::gil_scoped_release>())
      .def("local_buffer", &local_buffer, nb::rv_policy::reference)
      .def(
          "join", [](Buffer& b, uintptr_t waiter, uintptr_t waited) { b.join(stream(waiter), stream(waited)); },
          "waiter"_a, "waited"_a)
      .def(
          "follow",
          [](Buffer& b, uintptr_t waiter, uintptr_t waited) { return b.follow(stream(waiter), stream(waited)); },
          "waiter"_a, "waited"_a)
      .def(
          "barrier", [](Buffer& b, uintptr_t s) { b.barrier(stream(s)); }, "stream"_a)
      .def(
          "update_mask", [](Buffer& b, int rank, bool masked, uintptr_t s) { b.update_mask(rank, masked, stream(s)); },
          "rank"_a, "masked"_a, "stream"_a)
      .def(
          "query_mask", [](Buffer& b, uintptr_t out, uintptr_t s) { b.query_mask(ptr<int32_t>(out), stream(s)); },
          "out"_a, "stream"_a)
      .def(
          "clean_mask", [](Buffer& b, uintptr_t s) { b.clean_mask(stream(s)); }, "stream"_a)
      .def(
          "synchronize", [](Buffer& b, uintptr_t s, const std::string& op) { b.synchronize(stream(s), op.c_str()); },
          "stream"_a, "op"_a, nb::call_guard<nb::gil_scoped_release>())
      .def(
          "check_errors", [](Buffer& b, const std::string& op) { b.check_errors(op.c_str()); }, "op"_a)
      .def(
          "store_to_peers",
          [](Buffer& b, uintptr_t src, size_t bytes, size_t dst_offset, bool include_self, int num_sms, uintptr_t s,
             bool bulk, int warps_per_block, int words_in_flight) {
            b.store_to_peers(ptr<const void>(src), bytes, dst_offset, include_self, num_sms, stream(s), bulk,
                             warps_per_block, words_in_flight);
          },
          "src"_a, "bytes"_a, "dst_offset"_a, "include_self"_a, "num_sms"_a, "stream"_a, "bulk"_a = false,
          "warps_per_block"_a = 16, "words_in_flight"_a = 1)
      .def(
          "load_from_peers",
          [](Buffer& b, uintptr_t dst, size_t bytes, size_t src_offset, int num_sms, uintptr_t s, bool include_self,
             int warps_per_block, int words_in_flight) {
            b.load_from_peers(ptr<void>(dst), bytes, src_offset, num_sms, stream(s), include_self, warps_per_block,
                              words_in_flight);
          },
          "dst"_a, "bytes"_a, "src_offset"_a, "num_sms"_a, "stream"_a, "include_self"_a = true,
          "warps_per_block"_a = 16, "words_in_flight"_a = 1);
  return buffer;
}

}  // namespace turnout::bindings
