// Tuning of the normal (training/prefill) kernels and the buffer sizes they need.
#pragma once

#include <cstddef>

namespace turnout {

// DeepEP's defaults of a Config, also those of every op's arguments.
inline constexpr int kDefaultNumSms = 20;
inline constexpr int kDefaultSendTokens = 6;
inline constexpr int kDefaultRecvTokens = 256;

struct Config {
  int num_sms = kDefaultNumSms;
  int num_max_nvl_chunked_send_tokens = kDefaultSendTokens;
  int num_max_nvl_chunked_recv_tokens = kDefaultRecvTokens;
  int num_max_rdma_chunked_send_tokens = kDefaultSendTokens;
  int num_max_rdma_chunked_recv_tokens = kDefaultRecvTokens;

  Config() = default;
  // Throws InvalidArgument naming the field if a value is out of range.
  Config(int num_sms, int nvl_send, int nvl_recv, int rdma_send = kDefaultSendTokens,
         int rdma_recv = kDefaultRecvTokens);

  // Bytes of NVL buffer every call made with this config needs. `hidden_bytes`
  // is the row size of x (hidden * element size).
  size_t get_nvl_buffer_size_hint(size_t hidden_bytes, int num_ranks) const;
  // Bytes of RDMA buffer (the network region of internode mode) for NVL
  // domains of `num_nvl_ranks` ranks; 0 when the group fits in one. Without
  // it: the declared domain size (TURNOUT_NVL_DOMAIN_SIZE) if set, else 8.
  size_t get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks) const;
  size_t get_rdma_buffer_size_hint(size_t hidden_bytes, int num_ranks, int num_nvl_ranks) const;
};

// Largest top-k and the channel group every size hint assumes.
inline constexpr int kMaxTopk = 32;
inline constexpr int kMinRanks = 2;
inline constexpr int kMaxRanks = 160;

// Tuned defaults for a group of `num_ranks` (kMinRanks..kMaxRanks); dispatch
// and combine are tuned alike today.
Config get_dispatch_config(int num_ranks, int num_sms);
Config get_combine_config(int num_ranks, int num_sms);

// Bytes of RDMA (or, on one host, NVL) buffer low-latency mode needs.
size_t get_low_latency_rdma_size_hint(int num_max_dispatch_tokens_per_rank, int hidden, int num_ranks, int num_experts);

}  // namespace turnout
