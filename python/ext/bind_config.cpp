#include <nanobind/stl/string.h>

#include <string>

#include "bindings.hpp"

namespace turnout::bindings {

using namespace nb::literals;

void bind_config(nb::module_& m) {
  // The one place of the default: Buffer.num_sms starts from it.
  m.attr("default_num_sms") = turnout::kDefaultNumSms;
  nb::class_<Config>(m, "Config")
      .def(nb::init<int, int, int, int, int>(), "num_sms"_a = turnout::kDefaultNumSms,
           "num_max_nvl_chunked_send_tokens"_a = turnout::kDefaultSendTokens,
           "num_max_nvl_chunked_recv_tokens"_a = turnout::kDefaultRecvTokens,
           "num_max_rdma_chunked_send_tokens"_a = turnout::kDefaultSendTokens,
           "num_max_rdma_chunked_recv_tokens"_a = turnout::kDefaultRecvTokens)
      .def_ro("num_sms", &Config::num_sms)
      .def_ro("num_max_nvl_chunked_send_tokens", &Config::num_max_nvl_chunked_send_tokens)
      .def_ro("num_max_nvl_chunked_recv_tokens", &Config::num_max_nvl_chunked_recv_tokens)
      .def_ro("num_max_rdma_chunked_send_tokens", &Config::num_max_rdma_chunked_send_tokens)
      .def_ro("num_max_rdma_chunked_recv_tokens", &Config::num_max_rdma_chunked_recv_tokens)
      .def("get_nvl_buffer_size_hint", &Config::get_nvl_buffer_size_hint, "hidden_bytes"_a, "num_ranks"_a)
      .def(
          "get_rdma_buffer_size_hint",
          [](const Config& c, size_t hidden_bytes, int num_ranks, int num_nvl_ranks) {
            return num_nvl_ranks != 0 ? c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks, num_nvl_ranks)
                                      : c.get_rdma_buffer_size_hint(hidden_bytes, num_ranks);
          },
          "hidden_bytes"_a, "num_ranks"_a, "num_nvl_ranks"_a = 0)
      .def("__repr__", [](const Config& c) {
        return "Config(num_sms=" + std::to_string(c.num_sms) +
               ", num_max_nvl_chunked_send_tokens=" + std::to_string(c.num_max_nvl_chunked_send_tokens) +
               ", num_max_nvl_chunked_recv_tokens=" + std::to_string(c.num_max_nvl_chunked_recv_tokens) +
               ", num_max_rdma_chunked_send_tokens=" + std::to_string(c.num_max_rdma_chunked_send_tokens) +
               ", num_max_rdma_chunked_recv_tokens=" + std::to_string(c.num_max_rdma_chunked_recv_tokens) + ")";
      });
  m.def("get_dispatch_config", &get_dispatch_config, "num_ranks"_a, "num_sms"_a);
  m.def("get_combine_config", &get_combine_config, "num_ranks"_a, "num_sms"_a);
  m.def("get_low_latency_rdma_size_hint", &get_low_latency_rdma_size_hint, "num_max_dispatch_tokens_per_rank"_a,
        "hidden"_a, "num_ranks"_a, "num_experts"_a);
}

}  // namespace turnout::bindings
