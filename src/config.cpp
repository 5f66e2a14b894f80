#include "turnout/config.hpp"

#include <string>

#include "kernels/internode/region.hpp"
#include "kernels/intranode/region.hpp"
#include "runtime/align.hpp"
#include "turnout/buffer.hpp"
#include "turnout/error.hpp"
#include "turnout/low_latency.hpp"
#include "turnout/topology.hpp"

namespace turnout {
namespace {

void require(bool ok, const std::string& what) {
  if (!ok) throw InvalidArgument(what);
}

void require_ranks(int num_ranks, const char* fn) {
  require(num_ranks >= kMinRanks && num_ranks <= kMaxRanks,
          std::string(fn) + ": num_ranks must be in [" + std::to_string(kMinRanks) + ", " + std::to_string(kMaxRanks) +
              "], got " + std::to_string(num_ranks));
}

// One received token in a ring slot: its row, FP8 scales, top-k and source
// index (kernels::make_dispatch_slot with the largest top-k), on whole lines;
// a combine slot (row and weights) is smaller.
size_t token_slot_bytes(size_t hidden_bytes) {
  const int scales = static_cast<int>((hidden_bytes + 127) / 128);
  return kernels::ring_slot_bytes(
      kernels::make_dispatch_slot(static_cast<int>(align_up(hidden_bytes, 16)), scales, kMaxTopk).bytes);
}

}  // namespace

Config::Config(int sms, int nvl_send, int nvl_recv, int rdma_send, int rdma_recv)
    : num_sms(sms),
      num_max_nvl_chunked_send_tokens(nvl_send),
      num_max_nvl_chunked_recv_tokens(nvl_recv),
      num_max_rdma_chunked_send_tokens(rdma_send),
      num_max_rdma_chunked_recv_tokens(rdma_recv) {
  require(
      sms >= 2 && sms % 2 == 0,
      "Config: num_sms must be even and >= 2 (one send and one receive SM per channel), got " + std::to_string(sms));
  require(nvl_send >= 1 && nvl_recv >= 1 && nvl_send <= nvl_recv,
          "Config: need 1 <= num_max_nvl_chunked_send_tokens <= num_max_nvl_chunked_recv_tokens, got " +
              std::to_string(nvl_send) + " and " + std::to_string(nvl_recv));
  require(rdma_send >= 1 && rdma_recv >= 1 && rdma_send <= rdma_recv,
          "Config: need 1 <= num_max_rdma_chunked_send_tokens <= num_max_rdma_chunked_recv_tokens, got " +
              std::to_string(rdma_send) + " and " + std::to_string(rdma_recv));
}

size_t Config::get_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks) const {
  require(hidden_bytes > 0, "get_nvl_buffer_size_hint: hidden_bytes must be > 0");
  require_ranks(num_ranks, "get_nvl_buffer_size_hint");
  const size_t nvl_ranks = num_ranks < kMaxNvlRanks ? num_ranks : kMaxNvlRanks;
  const size_t channels = num_sms / 2;
  // The counts area, then per channel and sending peer a ring of
  // num_max_nvl_chunked_recv_tokens slots (the layout of kernels/intranode/region.hpp).
  const size_t bytes = kernels::kIntranodeMetaBytes +
                       channels * nvl_ranks * num_max_nvl_chunked_recv_tokens * token_slot_bytes(hidden_bytes);
  return align_up(bytes, 128);
}

size_t Config::get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks) const {
  const int declared = default_nvl_domain_size();
  return get_rdma_buffer_size_hint(hidden_bytes, num_ranks, declared > 0 ? declared : kMaxNvlRanks);
}

size_t Config::get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int num_nvl_ranks) const {
  require(hidden_bytes > 0, "get_rdma_buffer_size_hint: hidden_bytes must be > 0");
  require_ranks(num_ranks, "get_rdma_buffer_size_hint");
  require(num_nvl_ranks >= 1 && num_nvl_ranks <= kMaxNvlRanks,
          "get_rdma_buffer_size_hint: num_nvl_ranks must be in [1, " + std::to_string(kMaxNvlRanks) + "], got " +
              std::to_string(num_nvl_ranks));
  if (num_ranks <= num_nvl_ranks) return 0;
  require(num_ranks % num_nvl_ranks == 0, "get_rdma_buffer_size_hint: num_ranks " + std::to_string(num_ranks) +
                                              " is no multiple of the NVL domain size " +
                                              std::to_string(num_nvl_ranks));
  const int num_domains = num_ranks / num_nvl_ranks;
  require(num_domains <= kernels::internode::kMaxDomains, "get_rdma_buffer_size_hint: at most " +
                                                              std::to_string(kernels::internode::kMaxDomains) +
                                                              " NVL domains, got " + std::to_string(num_domains));
  require(num_domains + num_nvl_ranks <= kernels::internode::kMaxBlockWarps,
          "get_rdma_buffer_size_hint: at most " + std::to_string(kernels::internode::kMaxBlockWarps) +
              " NVL domains and ranks per domain together, got " + std::to_string(num_domains) + " domains of " +
              std::to_string(num_nvl_ranks));
  // The network region of kernels/internode/region.hpp at the largest top-k
  // (its counts area is fixed): receive and staging rings per channel and domain.
  const kernels::internode::Shape shape = kernels::internode::make_shape(
      num_domains, num_nvl_ranks, num_sms, num_max_rdma_chunked_recv_tokens, num_max_nvl_chunked_recv_tokens, 0,
      static_cast<int>(token_slot_bytes(hidden_bytes)));
  return align_up(kernels::internode::make_net_region(shape).total, 128);
}

namespace {

Config tuned_config(const char* fn, int num_ranks, int num_sms) {
  require_ranks(num_ranks, fn);
  return Config(num_sms, 8, 256, num_ranks <= kMaxNvlRanks ? 6 : 16, 128);
}

}  // namespace

Config get_dispatch_config(int num_ranks, int num_sms) {
  return tuned_config("get_dispatch_config", num_ranks, num_sms);
}

Config get_combine_config(int num_ranks, int num_sms) {
  return tuned_config("get_combine_config", num_ranks, num_sms);
}

size_t get_low_latency_rdma_size_hint(int max_tokens, int hidden, int num_ranks, int num_experts) {
  const std::string fn = "get_low_latency_rdma_size_hint: ";
  require(max_tokens >= 1 && max_tokens <= kLowLatencyMaxTokens,
          fn + "num_max_dispatch_tokens_per_rank must be in [1, " + std::to_string(kLowLatencyMaxTokens) + "], got " +
              std::to_string(max_tokens));
  require(hidden >= 8 && hidden <= kLowLatencyMaxHidden && hidden % 8 == 0,
          fn + "hidden must be a multiple of 8 in [8, " + std::to_string(kLowLatencyMaxHidden) + "], got " +
              std::to_string(hidden));
  // Low-latency groups go past the normal modes' rank limit: up to one rank per expert.
  require(num_ranks >= kMinRanks && num_ranks <= kLowLatencyMaxExperts,
          fn + "num_ranks must be in [" + std::to_string(kMinRanks) + ", " + std::to_string(kLowLatencyMaxExperts) +
              "], got " + std::to_string(num_ranks));
  require(num_experts > 0 && num_experts % num_ranks == 0 && num_experts <= kLowLatencyMaxExperts,
          fn + "num_experts must be a positive multiple of num_ranks, at most " +
              std::to_string(kLowLatencyMaxExperts) + ", got " + std::to_string(num_experts));
  // Enough for every top-k the calls may use.
  return low_latency_required_bytes(max_tokens, hidden, num_ranks, kLowLatencyMaxTopk);
}

}  // namespace turnout
