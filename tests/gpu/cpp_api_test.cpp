// The C++ API alone, no Python: one process per rank (round-robin over the GPUs) bootstrapped over TCP,
// get_dispatch_layout against the host reference, peer stores and loads
// across every pair, an intranode dispatch and combine, and (on a second
// Buffer, built with low_latency_mode) low-latency dispatch and combine on raw
// device pointers against the host reference, and (a third, in shrink mode)
// the rank mask. Exit status 0 when every rank passed.
//
//   turnout_gpu_cpp_test [num_ranks] [port] [nvl_domain_size: low-latency across domains only]

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "fork_ranks.hpp"
#include "reference.hpp"
#include "turnout/turnout.hpp"

namespace {

#define EXPECT(cond, ...)                                               \
  do {                                                                  \
    if (!(cond)) {                                                      \
      std::fprintf(stderr, "rank %d: check failed: %s: ", rank, #cond); \
      std::fprintf(stderr, __VA_ARGS__);                                \
      std::fprintf(stderr, "\n");                                       \
      return 1;                                                         \
    }                                                                   \
  } while (0)

// `masked` >= 0: the buffer (shrink mode) has that rank masked, so its experts
// count as -1 in the reference.
int check_layout(turnout::Buffer& buffer, int rank, cudaStream_t stream, int masked = -1) {
  const int num_ranks = buffer.topology().num_ranks;
  const int num_tokens = 4096, num_topk = 8, num_experts = 64 * num_ranks;
  std::mt19937_64 rng(1234 + rank);
  std::vector<int64_t> topk(num_tokens * num_topk);
  for (auto& e : topk) e = static_cast<int64_t>(rng() % (num_experts + 1)) - 1;  // -1 included

  const int counters = num_ranks + num_experts;
  void *d_topk = nullptr, *d_counts = nullptr, *d_in_rank = nullptr;
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_topk, topk.size() * sizeof(int64_t)));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_counts, counters * sizeof(int32_t)));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_in_rank, num_tokens * num_ranks));
  TURNOUT_CUDA_CHECK(cudaMemcpy(d_topk, topk.data(), topk.size() * sizeof(int64_t), cudaMemcpyHostToDevice));
  TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());  // see to_device: the Buffer's stream does not wait for the copy

  turnout::LayoutArgs args;
  args.topk_idx = static_cast<const int64_t*>(d_topk);
  args.num_tokens = num_tokens;
  args.num_topk = num_topk;
  args.num_experts = num_experts;
  args.num_tokens_per_rank = static_cast<int32_t*>(d_counts);
  args.num_tokens_per_expert = static_cast<int32_t*>(d_counts) + num_ranks;
  args.is_token_in_rank = static_cast<bool*>(d_in_rank);
  buffer.get_dispatch_layout(args, stream);
  buffer.synchronize(stream, "get_dispatch_layout");

  std::vector<int32_t> counts(counters);
  std::vector<uint8_t> in_rank(num_tokens * num_ranks);
  TURNOUT_CUDA_CHECK(cudaMemcpy(counts.data(), d_counts, counters * sizeof(int32_t), cudaMemcpyDeviceToHost));
  TURNOUT_CUDA_CHECK(cudaMemcpy(in_rank.data(), d_in_rank, in_rank.size(), cudaMemcpyDeviceToHost));
  cudaFree(d_topk);
  cudaFree(d_counts);
  cudaFree(d_in_rank);

  if (masked >= 0)
    for (auto& e : topk)
      if (e >= 0 && e / (num_experts / num_ranks) == masked) e = -1;
  const auto ref = turnout::reference::get_dispatch_layout(topk, num_tokens, num_topk, num_ranks, num_experts,
                                                           buffer.topology().num_nvl_ranks);
  for (int r = 0; r < num_ranks; ++r)
    EXPECT(counts[r] == ref.num_tokens_per_rank[r], "num_tokens_per_rank[%d] = %d, reference %d", r, counts[r],
           ref.num_tokens_per_rank[r]);
  for (int e = 0; e < num_experts; ++e)
    EXPECT(counts[num_ranks + e] == ref.num_tokens_per_expert[e], "num_tokens_per_expert[%d] = %d, reference %d", e,
           counts[num_ranks + e], ref.num_tokens_per_expert[e]);
  EXPECT(in_rank == ref.is_token_in_rank, "is_token_in_rank differs from the reference");
  return 0;
}

int check_peer_memory(turnout::Buffer& buffer, int rank, cudaStream_t stream) {
  const int n = buffer.topology().num_nvl_ranks;
  const size_t bytes = buffer.num_nvl_bytes() / n / 16 * 16;
  auto pattern = [](int r, size_t i) { return static_cast<uint8_t>((i * 131 + r * 17 + (i >> 9)) & 0xff); };
  std::vector<uint8_t> mine(bytes);
  for (size_t i = 0; i < bytes; ++i) mine[i] = pattern(rank, i);
  void *src = nullptr, *dst = nullptr;
  TURNOUT_CUDA_CHECK(cudaMalloc(&src, bytes));
  TURNOUT_CUDA_CHECK(cudaMalloc(&dst, bytes * n));
  TURNOUT_CUDA_CHECK(cudaMemcpy(src, mine.data(), bytes, cudaMemcpyHostToDevice));
  TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());

  buffer.store_to_peers(src, bytes, 0, true, 16, stream);
  buffer.barrier(stream);
  buffer.synchronize(stream, "store_to_peers");
  // Peer p's buffer holds every rank's pattern; read peer p's copy of rank q's.
  std::vector<uint8_t> got(bytes * n);
  for (int q = 0; q < n; ++q) {
    buffer.load_from_peers(dst, bytes, q * bytes, 16, stream);
    buffer.synchronize(stream, "load_from_peers");
    TURNOUT_CUDA_CHECK(cudaMemcpy(got.data(), dst, bytes * n, cudaMemcpyDeviceToHost));
    for (int p = 0; p < n; ++p)
      for (size_t i = 0; i < bytes; ++i)
        EXPECT(got[p * bytes + i] == pattern(q, i), "peer %d's copy of rank %d's bytes differs at %zu", p, q, i);
  }
  buffer.barrier(stream);
  buffer.synchronize(stream, "barrier");
  cudaFree(src);
  cudaFree(dst);
  return 0;
}

// A good round trip, or one where rank 0 passes an expert id out of range:
// then every rank's dispatch_counts raises, and the next good call works.
enum class Input { kGood, kBadExpertOnRank0 };

// Every token to every rank, then back: token t of rank s carries the value
// s * T + t (exact in bf16), so each received row and each sum is known.
int check_intranode(turnout::Buffer& buffer, int rank, int num_ranks, cudaStream_t stream, Input input) {
  constexpr int T = 32, H = 256;
  std::vector<uint16_t> x(T * H);
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h) x[t * H + h] = turnout::reference::double_to_bf16(rank * T + t);
  std::vector<uint8_t> in_rank(T * num_ranks, 1);
  std::vector<int32_t> per_expert(num_ranks, T);  // one expert per rank
  const int R = num_ranks, rows = R * T;
  void *d_x, *d_in_rank, *d_per_expert, *d_meta, *d_recv, *d_src, *d_out, *d_topk;
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_x, x.size() * 2));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_in_rank, in_rank.size()));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_per_expert, R * 4));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_meta, (R * R + R) * 4));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_recv, size_t(rows) * H * 2));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_src, rows * 4));
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_out, x.size() * 2));
  // Top-1: each token names expert 0, rank 0 with bad input names 1000 for token 5.
  std::vector<int64_t> topk(T, 0);
  if (input == Input::kBadExpertOnRank0 && rank == 0) topk[5] = 1000;
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_topk, T * 8));
  TURNOUT_CUDA_CHECK(cudaMemcpy(d_topk, topk.data(), T * 8, cudaMemcpyHostToDevice));
  TURNOUT_CUDA_CHECK(cudaMemcpy(d_x, x.data(), x.size() * 2, cudaMemcpyHostToDevice));
  TURNOUT_CUDA_CHECK(cudaMemcpy(d_in_rank, in_rank.data(), in_rank.size(), cudaMemcpyHostToDevice));
  TURNOUT_CUDA_CHECK(cudaMemcpy(d_per_expert, per_expert.data(), R * 4, cudaMemcpyHostToDevice));
  TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());
  auto* prefix = static_cast<int32_t*>(d_meta);

  turnout::DispatchCountsArgs counts;
  counts.num_tokens = T;
  counts.is_token_in_rank = static_cast<const bool*>(d_in_rank);
  counts.num_tokens_per_expert = static_cast<const int32_t*>(d_per_expert);
  counts.num_experts = R;
  counts.num_sms = 4;
  counts.rank_prefix_matrix = prefix;
  counts.topk_idx = static_cast<const int64_t*>(d_topk);
  counts.num_topk = 1;

  turnout::DispatchArgs d;
  d.x = d_x;
  d.num_tokens = T;
  d.row_bytes = H * 2;
  d.is_token_in_rank = counts.is_token_in_rank;
  d.rank_prefix_matrix = prefix;
  d.num_sms = 4;
  const turnout::DispatchOutputs outputs{d_recv,        nullptr, nullptr, nullptr, static_cast<int32_t*>(d_src),
                                         prefix + R * R};
  const auto free_all = [&] {
    for (void* p : {d_x, d_in_rank, d_per_expert, d_meta, d_recv, d_src, d_out, d_topk})
      TURNOUT_CUDA_CHECK(cudaFree(p));
  };
  if (input == Input::kBadExpertOnRank0) {
    std::string error;
    try {
      buffer.dispatch_counts(counts, stream);
    } catch (const turnout::InvalidArgument& e) {
      error = e.what();
    }
    const std::string expected = rank == 0 ? "topk_idx[5, 0] = 1000" : "rank 0 passed invalid input";
    EXPECT(error.find(expected) != std::string::npos, "rank %d: dispatch_counts raised '%s', expected '%s'", rank,
           error.c_str(), expected.c_str());
    free_all();
    return 0;
  }
  turnout::DispatchCounts got = buffer.dispatch_counts(counts, stream);
  d.num_recv_rows = rows;
  d.out = outputs;
  buffer.dispatch(d, stream);
  EXPECT(got.num_recv_tokens == rows, "num_recv_tokens %d, expected %d", got.num_recv_tokens, rows);
  EXPECT(got.num_recv_tokens_per_expert.size() == 1 && got.num_recv_tokens_per_expert[0] == rows,
         "per-expert counts wrong (%zu entries)", got.num_recv_tokens_per_expert.size());
  EXPECT(got.own_rows_begin == rank * T && got.num_own_rows == T, "own rows [%d, +%d), expected [%d, +%d)",
         got.own_rows_begin, got.num_own_rows, rank * T, T);
  EXPECT(buffer.last_host_wait_s() > 0 && buffer.last_host_wait_s() < buffer.timeout_s(), "last_host_wait_s %g s",
         buffer.last_host_wait_s());

  turnout::CombineArgs c;
  c.x = d_recv;
  c.num_rows = rows;
  c.hidden = H;
  c.rank_prefix_matrix = prefix;
  c.source_num_tokens = prefix + R * R;
  c.recv_src_idx = static_cast<const int32_t*>(d_src);
  c.is_token_in_rank = counts.is_token_in_rank;
  c.num_tokens = T;
  c.num_sms = 4;
  c.combined_x = d_out;
  c.own_rows_begin = got.own_rows_begin;
  c.num_own_rows = got.num_own_rows;
  buffer.combine(c, stream);
  buffer.synchronize(stream, "intranode check");

  std::vector<uint16_t> recv(size_t(rows) * H), out(x.size());
  std::vector<int32_t> src(rows), source_tokens(R);
  TURNOUT_CUDA_CHECK(cudaMemcpy(recv.data(), d_recv, recv.size() * 2, cudaMemcpyDeviceToHost));
  TURNOUT_CUDA_CHECK(cudaMemcpy(src.data(), d_src, rows * 4, cudaMemcpyDeviceToHost));
  TURNOUT_CUDA_CHECK(cudaMemcpy(source_tokens.data(), prefix + R * R, R * 4, cudaMemcpyDeviceToHost));
  for (int j = 0; j < R; ++j)
    EXPECT(source_tokens[j] == T, "source_num_tokens[%d] = %d, expected %d", j, source_tokens[j], T);
  TURNOUT_CUDA_CHECK(cudaMemcpy(out.data(), d_out, out.size() * 2, cudaMemcpyDeviceToHost));
  for (int i = 0; i < rows; ++i) {
    const int s = i / T, t = i % T;  // rows by source rank, then source token
    EXPECT(src[i] == t, "recv_src_idx[%d] = %d, expected %d", i, src[i], t);
    for (int h = 0; h < H; ++h)
      EXPECT(recv[size_t(i) * H + h] == turnout::reference::double_to_bf16(s * T + t), "recv_x[%d, %d]", i, h);
  }
  for (int t = 0; t < T; ++t)
    for (int h = 0; h < H; ++h)
      EXPECT(out[t * H + h] == turnout::reference::double_to_bf16(double(R) * (rank * T + t)),
             "combined_x[%d, %d] = bf16 bits %u", t, h, unsigned(out[t * H + h]));

  // The same tokens as a cached dispatch, whose rows are known before its
  // counts step: both steps in one call (one launch where no other rank
  // shares this GPU), the same rows as the first dispatch.
  turnout::DispatchCountsArgs cached_counts = counts;
  cached_counts.num_tokens_per_expert = nullptr;
  cached_counts.num_experts = 0;
  cached_counts.topk_idx = nullptr;
  cached_counts.num_topk = 0;
  cached_counts.num_worst_tokens = rows;
  void* d_cached;
  TURNOUT_CUDA_CHECK(cudaMalloc(&d_cached, size_t(rows) * H * 2));
  TURNOUT_CUDA_CHECK(cudaMemset(d_cached, 0xff, size_t(rows) * H * 2));
  turnout::DispatchArgs cached = d;
  cached.out = {d_cached, nullptr, nullptr, nullptr, nullptr, nullptr};
  buffer.dispatch_known_rows(cached_counts, cached, stream);
  buffer.synchronize(stream, "cached dispatch");
  std::vector<uint16_t> again(recv.size());
  TURNOUT_CUDA_CHECK(cudaMemcpy(again.data(), d_cached, again.size() * 2, cudaMemcpyDeviceToHost));
  TURNOUT_CUDA_CHECK(cudaFree(d_cached));
  EXPECT(again == recv, "the cached dispatch's rows differ from the first dispatch's");
  free_all();
  return 0;
}

// ---------------------------------------------------------------------------
// Low-latency dispatch and combine

namespace ref = turnout::reference;

// A device allocation freed at scope exit (at least 16 bytes: a rank with no
// tokens still passes valid pointers).
struct DeviceBuffer {
  void* p = nullptr;
  explicit DeviceBuffer(size_t bytes) { TURNOUT_CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(bytes, 16))); }
  ~DeviceBuffer() { cudaFree(p); }
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  template <typename T>
  T* as() const {
    return static_cast<T*>(p);
  }
};

template <typename T>
void to_device(const DeviceBuffer& d, const std::vector<T>& v) {
  if (!v.empty()) TURNOUT_CUDA_CHECK(cudaMemcpy(d.p, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
  // From pageable memory the copy may still be in flight when cudaMemcpy
  // returns, and the Buffer's stream does not wait for the legacy stream.
  TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());
}

template <typename T>
std::vector<T> to_host(const DeviceBuffer& d, size_t n) {
  std::vector<T> v(n);
  if (n) TURNOUT_CUDA_CHECK(cudaMemcpy(v.data(), d.p, n * sizeof(T), cudaMemcpyDeviceToHost));
  return v;
}

struct LowLatencyCase {
  int max_tokens, hidden, experts_per_rank, num_topk;
  bool use_fp8;
  bool weights_at_dispatch;  // combine takes the dispatch's weights; its own must go unread
  bool split_phases;         // send, then receive, as a receive hook does
};

// Every rank's inputs, drawn from seeds of its rank, so that each rank
// rebuilds all of them for the reference. Rank 1 sends no token, rank r
// sends M - r (rank 0: T = M); a quarter of the top-k slots are -1.
std::vector<ref::LowLatencyDispatchInput> low_latency_inputs(int num_ranks, const LowLatencyCase& c) {
  const int E = c.experts_per_rank * num_ranks;
  std::vector<ref::LowLatencyDispatchInput> all(num_ranks);
  for (int r = 0; r < num_ranks; ++r) {
    std::mt19937_64 rng(5000 + r);
    std::uniform_real_distribution<float> value(-4.0f, 4.0f);
    auto& in = all[r];
    in.num_tokens = r == 1 ? 0 : c.max_tokens - r % c.max_tokens;
    in.x.resize(size_t(in.num_tokens) * c.hidden);
    for (auto& v : in.x) v = ref::float_to_bf16(value(rng));
    std::vector<int64_t> experts(E);
    for (int t = 0; t < in.num_tokens; ++t) {
      std::iota(experts.begin(), experts.end(), 0);
      std::shuffle(experts.begin(), experts.end(), rng);
      for (int k = 0; k < c.num_topk; ++k) in.topk_idx.push_back(k >= E || rng() % 4 == 0 ? -1 : experts[k]);
    }
  }
  return all;
}

std::vector<float> low_latency_weights(int rank, int num_tokens, int num_topk, uint64_t seed) {
  std::mt19937_64 rng(seed + rank);
  std::uniform_real_distribution<float> weight(0.0f, 1.0f);
  std::vector<float> w(size_t(num_tokens) * num_topk);
  for (auto& v : w) v = weight(rng);
  return w;
}

// The expert output combine sends back for token t of its source, received by global expert e.
uint16_t expert_output(const uint16_t* x, int channel, int expert) {
  return ref::float_to_bf16(ref::bf16_to_float(x[channel]) * (0.5f + float(expert % 61) / 64.0f));
}

int check_low_latency_case(turnout::Buffer& buffer, int rank, cudaStream_t stream, const LowLatencyCase& c) {
  const int R = buffer.topology().num_ranks, L = c.experts_per_rank, E = L * R, H = c.hidden, K = c.num_topk,
            M = c.max_tokens, MR = M * R, G = H / 128;
  const auto all = low_latency_inputs(R, c);
  const auto& mine = all[rank];
  const int T = mine.num_tokens;
  std::vector<std::vector<float>> weights(R);
  for (int r = 0; r < R; ++r) weights[r] = low_latency_weights(r, all[r].num_tokens, K, 9000);
  const auto other_weights = low_latency_weights(rank, T, K, 11000);

  ref::LowLatencyParams params;
  params.num_max_dispatch_tokens_per_rank = M;
  params.hidden = H;
  params.num_experts = E;
  params.num_topk = K;
  params.use_fp8 = c.use_fp8;
  const auto refs = ref::low_latency_dispatch(all, params);
  const auto& want = refs[rank];

  const size_t row_bytes = c.use_fp8 ? size_t(H) : size_t(H) * 2;
  DeviceBuffer d_x(mine.x.size() * 2), d_topk(mine.topk_idx.size() * 8), d_w(size_t(T) * K * 4),
      d_other_w(size_t(T) * K * 4), d_recv(size_t(L) * MR * row_bytes), d_scales(size_t(L) * MR * G * 4),
      d_count(size_t(L) * 4), d_src(size_t(L) * MR * 4), d_layout(size_t(L) * R * 8),
      d_plan(turnout::low_latency_plan_bytes(M, R, E)), d_cumulative(size_t(L) * 4), d_wait(size_t(R) * 8),
      d_y(size_t(L) * MR * H * 2), d_out(size_t(T) * H * 2);
  to_device(d_x, mine.x);
  to_device(d_topk, mine.topk_idx);
  to_device(d_w, weights[rank]);
  to_device(d_other_w, other_weights);
  TURNOUT_CUDA_CHECK(cudaMemset(d_cumulative.p, 0, size_t(L) * 4));
  TURNOUT_CUDA_CHECK(cudaMemset(d_wait.p, 0, size_t(R) * 8));
  TURNOUT_CUDA_CHECK(cudaDeviceSynchronize());  // the memsets ran on the legacy stream

  turnout::LowLatencyDispatchArgs d;
  d.x = d_x.p;
  d.num_tokens = T;
  d.hidden = H;
  d.topk_idx = d_topk.as<const int64_t>();
  d.num_topk = K;
  d.topk_weights = c.weights_at_dispatch ? d_w.as<const float>() : nullptr;
  d.num_max_tokens = M;
  d.num_experts = E;
  d.use_fp8 = c.use_fp8;
  d.recv_x = d_recv.p;
  d.recv_scales = c.use_fp8 ? d_scales.as<float>() : nullptr;
  d.recv_count = d_count.as<int32_t>();
  d.src_info = d_src.as<int32_t>();
  d.layout_range = d_layout.as<int64_t>();
  d.plan = d_plan.p;
  d.cumulative_local_expert_recv_stats = d_cumulative.as<int32_t>();
  d.wait_recv_cost_stats = d_wait.as<int64_t>();
  if (c.split_phases) {
    buffer.low_latency_dispatch(d, turnout::LowLatencyPhase::kSend, stream);
    buffer.low_latency_dispatch(d, turnout::LowLatencyPhase::kReceive, stream);
  } else {
    buffer.low_latency_dispatch(d, turnout::LowLatencyPhase::kSendAndReceive, stream);
  }
  buffer.synchronize(stream, "low_latency_dispatch");

  const auto count = to_host<int32_t>(d_count, L);
  const auto cumulative = to_host<int32_t>(d_cumulative, L);
  const auto src = to_host<int32_t>(d_src, size_t(L) * MR);
  const auto layout = to_host<int64_t>(d_layout, size_t(L) * R);
  const auto recv = to_host<uint8_t>(d_recv, size_t(L) * MR * row_bytes);
  const auto scales = c.use_fp8 ? to_host<float>(d_scales, size_t(L) * MR * G) : std::vector<float>();
  const auto wait = to_host<int64_t>(d_wait, R);
  for (int r = 0; r < R; ++r) EXPECT(wait[r] >= 0, "dispatch_wait_recv_cost_stats[%d] = %lld", r, (long long)wait[r]);

  // Rows in canonical order, compared bitwise; the expert outputs laid out as the GPU placed the rows.
  std::vector<uint16_t> y(size_t(L) * MR * H, 0x7fc0);  // NaN past recv_count
  for (int l = 0; l < L; ++l) {
    const auto& rows = want.experts[l];
    EXPECT(count[l] == want.recv_count[l], "recv_count[%d] = %d, reference %d", l, count[l], want.recv_count[l]);
    EXPECT(cumulative[l] == want.recv_count[l], "cumulative_local_expert_recv_stats[%d] = %d, reference %d", l,
           cumulative[l], want.recv_count[l]);
    for (int s = 0; s < R; ++s)
      EXPECT((layout[l * R + s] & 0xffffffff) == (want.layout_range[l * R + s] & 0xffffffff),
             "layout_range[%d, %d] counts %lld rows, reference %lld", l, s, (long long)(layout[l * R + s] & 0xffffffff),
             (long long)(want.layout_range[l * R + s] & 0xffffffff));
    std::vector<int32_t> perm;
    try {
      perm = ref::low_latency_canonical_order(std::span<const int32_t>(src).subspan(size_t(l) * MR, MR),
                                              std::span<const int64_t>(layout).subspan(size_t(l) * R, R), count[l]);
    } catch (const std::invalid_argument& e) {
      EXPECT(false, "expert %d: src_info / layout_range are no valid layout: %s", l, e.what());
    }
    for (size_t i = 0; i < perm.size(); ++i) {
      const size_t row = size_t(l) * MR + perm[i];
      EXPECT(src[row] == rows.src_token[i], "expert %d row %zu: src_info %d, reference %d", l, i, src[row],
             rows.src_token[i]);
      const uint8_t* got = &recv[row * row_bytes];
      const void* expected = c.use_fp8 ? static_cast<const void*>(&rows.x_fp8[i * H]) : &rows.x[i * H];
      EXPECT(std::memcmp(got, expected, row_bytes) == 0, "expert %d canonical row %zu differs from the reference", l,
             i);
      for (int g = 0; c.use_fp8 && g < G; ++g) {
        const float scale = scales[size_t(l) * MR * G + size_t(g) * MR + perm[i]];  // column-major
        EXPECT(std::memcmp(&scale, &rows.scales[i * G + g], 4) == 0, "expert %d row %zu scale %d: %g, reference %g", l,
               i, g, scale, rows.scales[i * G + g]);
      }
      const uint16_t* source = &all[rows.src_rank[i]].x[size_t(rows.src_token[i]) * H];
      for (int h = 0; h < H; ++h) y[row * H + h] = expert_output(source, h, rank * L + l);
    }
  }

  // Combine; the reference from every rank's expert outputs in canonical order.
  to_device(d_y, y);
  turnout::LowLatencyCombineArgs cb;
  cb.x = d_y.p;
  cb.topk_idx = d_topk.as<const int64_t>();
  cb.topk_weights = c.weights_at_dispatch ? d_other_w.as<const float>() : d_w.as<const float>();
  cb.num_tokens = T;
  cb.num_topk = K;
  cb.hidden = H;
  cb.num_max_tokens = M;
  cb.num_experts = E;
  cb.plan = d_plan.p;
  cb.out = d_out.p;
  if (c.split_phases) {
    buffer.low_latency_combine(cb, turnout::LowLatencyPhase::kSend, stream);
    buffer.low_latency_combine(cb, turnout::LowLatencyPhase::kReceive, stream);
  } else {
    buffer.low_latency_combine(cb, turnout::LowLatencyPhase::kSendAndReceive, stream);
  }
  buffer.synchronize(stream, "low_latency_combine");
  const auto out = to_host<uint16_t>(d_out, size_t(T) * H);

  std::vector<ref::LowLatencyCombineInput> in(R), in_abs(R);
  for (int r = 0; r < R; ++r) {
    in[r].expert_x.resize(L);
    in_abs[r].expert_x.resize(L);
    for (int l = 0; l < L; ++l) {
      const auto& rows = refs[r].experts[l];
      for (size_t i = 0; i < rows.src_token.size(); ++i) {
        const uint16_t* source = &all[rows.src_rank[i]].x[size_t(rows.src_token[i]) * H];
        for (int h = 0; h < H; ++h) {
          const uint16_t v = expert_output(source, h, r * L + l);
          in[r].expert_x[l].push_back(v);
          in_abs[r].expert_x[l].push_back(v & 0x7fff);
        }
      }
    }
    in[r].topk_idx = in_abs[r].topk_idx = all[r].topk_idx;
    in[r].topk_weights = in_abs[r].topk_weights = weights[r];  // >= 0 already
  }
  const auto combined = ref::low_latency_combine(in, refs, params)[rank];
  const auto magnitude = ref::low_latency_combine(in_abs, refs, params)[rank];
  // Tolerance (see tests/gpu/low_latency_cases.py): half a bf16 ulp of the
  // result, fp32 accumulation 2^-18 * S (S = sum |w * x|), and one bf16
  // rounding per expert rank's partial sum, at most 2^-8 * S in all.
  for (size_t i = 0; i < combined.size(); ++i) {
    const double got = ref::bf16_to_float(out[i]), expected = combined[i];
    int e = 0;
    std::frexp(std::max(std::fabs(got), std::fabs(expected)), &e);
    const double tol = std::ldexp(1.0, e - 9) + magnitude[i] * (std::ldexp(1.0, -18) + 1.0 / 256);
    EXPECT(std::fabs(got - expected) <= tol, "combined_x[%zu, %zu] = %.9g, reference %.9g (tolerance %.3g)", i / H,
           i % H, got, expected, tol);
  }
  return 0;
}

// Shrink mode's mask through the C++ API: update, query and clean on the
// stream, a bad rank refused by name, a buffer without shrink mode refusing
// the mask ops, and get_dispatch_layout leaving out a masked rank's experts.
int check_shrink(turnout::Bootstrap& bootstrap, int rank, int num_ranks) {
  turnout::BufferOptions options;
  options.num_nvl_bytes = 1 << 20;
  options.enable_shrink = true;
  options.shrink_timeout_s = 1.5;
  turnout::Buffer buffer(bootstrap, options);
  cudaStream_t stream = buffer.comm_stream();
  EXPECT(buffer.shrink_enabled() && buffer.shrink_timeout_s() == 1.5, "shrink_enabled() = %d, shrink_timeout_s() = %g",
         buffer.shrink_enabled(), buffer.shrink_timeout_s());
  int32_t* d_mask = nullptr;
  TURNOUT_CUDA_CHECK(cudaMalloc(reinterpret_cast<void**>(&d_mask), num_ranks * sizeof(int32_t)));
  std::vector<int32_t> mask(num_ranks, -1);
  const auto query = [&] {
    buffer.query_mask(d_mask, stream);
    TURNOUT_CUDA_CHECK(cudaStreamSynchronize(stream));
    TURNOUT_CUDA_CHECK(cudaMemcpy(mask.data(), d_mask, num_ranks * sizeof(int32_t), cudaMemcpyDeviceToHost));
  };
  query();
  EXPECT(std::count(mask.begin(), mask.end(), 0) == num_ranks, "a new buffer's mask is not all zero");
  const int masked = num_ranks - 1;
  buffer.update_mask(masked, true, stream);
  query();
  for (int r = 0; r < num_ranks; ++r)
    EXPECT(mask[r] == (r == masked), "mask[%d] = %d after masking rank %d", r, mask[r], masked);
  bool refused = false;
  try {
    buffer.update_mask(num_ranks, true, stream);
  } catch (const turnout::InvalidArgument& e) {
    refused = std::strstr(e.what(), "rank_to_mask") != nullptr;
  }
  EXPECT(refused, "update_mask(%d) was not refused naming rank_to_mask", num_ranks);
  if (check_layout(buffer, rank, stream, masked)) return 1;
  buffer.update_mask(masked, false, stream);
  query();
  EXPECT(std::count(mask.begin(), mask.end(), 0) == num_ranks, "the mask after unmasking is not all zero");
  buffer.update_mask(0, true, stream);
  buffer.clean_mask(stream);
  query();
  EXPECT(std::count(mask.begin(), mask.end(), 0) == num_ranks, "the mask after clean_mask is not all zero");
  cudaFree(d_mask);
  buffer.destroy();

  turnout::BufferOptions plain;
  plain.num_nvl_bytes = 1 << 20;
  turnout::Buffer without(bootstrap, plain);
  refused = false;
  try {
    without.clean_mask(without.comm_stream());
  } catch (const turnout::InvalidArgument& e) {
    refused = std::strstr(e.what(), "enable_shrink") != nullptr;
  }
  EXPECT(refused, "clean_mask on a buffer without enable_shrink was not refused");
  without.destroy();
  return 0;
}

// A Buffer of its own with low_latency_mode (collective), sized for the
// largest case, then each case's dispatch and combine. `nvl_domain_size` > 0
// declares NVL domains of that size: the group then spans domains and runs
// over NVSHMEM.
int check_low_latency(turnout::Bootstrap& bootstrap, int rank, int num_ranks, int nvl_domain_size = 0) {
  const LowLatencyCase cases[] = {
      {16, 1024, 4, 4, false, false, false}, {16, 1024, 4, 4, true, true, false},  {16, 1024, 4, 4, false, true, true},
      {16, 1024, 4, 4, true, false, true},   {16, 1024, 4, 4, false, true, false}, {16, 1024, 4, 4, true, true, true},
      {8, 512, 8, 9, true, false, false},
  };
  turnout::BufferOptions options;
  options.low_latency_mode = true;
  options.nvl_domain_size = nvl_domain_size;
  for (const auto& c : cases)
    options.num_rdma_bytes =
        std::max(options.num_rdma_bytes, turnout::low_latency_required_bytes(c.max_tokens, c.hidden, num_ranks, 16));
  turnout::Buffer buffer(bootstrap, options);
  EXPECT(buffer.num_low_latency_bytes() >= options.num_rdma_bytes, "num_low_latency_bytes() = %zu, asked for %zu",
         buffer.num_low_latency_bytes(), options.num_rdma_bytes);
  cudaStream_t stream = buffer.comm_stream();
  // A case that fails goes on to the next: its collective calls were made,
  // and every rank must make the next case's.
  int failed = 0;
  for (const auto& c : cases) {
    if (check_low_latency_case(buffer, rank, stream, c)) {
      std::fprintf(stderr,
                   "rank %d: low-latency case M=%d hidden=%d experts/rank=%d top-%d fp8=%d weights at dispatch=%d "
                   "split phases=%d failed\n",
                   rank, c.max_tokens, c.hidden, c.experts_per_rank, c.num_topk, c.use_fp8, c.weights_at_dispatch,
                   c.split_phases);
      failed = 1;
    }
  }
  buffer.destroy();
  return failed;
}

int run_rank(int rank, int num_ranks, uint16_t port, int nvl_domain_size) {
  try {
    // Ranks go round-robin over the visible GPUs; several may share one.
    int devices = 0;
    TURNOUT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    TURNOUT_CUDA_CHECK(cudaSetDevice(rank % devices));
    turnout::TcpBootstrap bootstrap(rank, num_ranks, "127.0.0.1", port, std::chrono::seconds(60));
    if (nvl_domain_size > 0) {
      // Across declared domains: low-latency mode only (normal mode stays in one domain).
      if (check_low_latency(bootstrap, rank, num_ranks, nvl_domain_size)) return 1;
      std::printf("rank %d: ok\n", rank);
      return 0;
    }
    turnout::BufferOptions options;
    options.num_nvl_bytes = turnout::Config(4, 8, 256).get_nvl_buffer_size_hint(256 * 2, num_ranks);
    turnout::Buffer buffer(bootstrap, options);
    int sharing = 0;
    for (int r = 0; r < num_ranks; ++r) sharing += r % devices == rank % devices;
    EXPECT(buffer.ranks_on_gpu() == sharing, "ranks_on_gpu() = %d, expected %d (%d ranks on %d GPUs)",
           buffer.ranks_on_gpu(), sharing, num_ranks, devices);
    EXPECT(buffer.sm_budget() >= 2 && buffer.sm_budget() % 2 == 0, "sm_budget() = %d", buffer.sm_budget());
    cudaStream_t stream = buffer.comm_stream();
    if (check_layout(buffer, rank, stream) || check_peer_memory(buffer, rank, stream) ||
        check_intranode(buffer, rank, num_ranks, stream, Input::kGood) ||
        check_intranode(buffer, rank, num_ranks, stream, Input::kBadExpertOnRank0) ||
        check_intranode(buffer, rank, num_ranks, stream, Input::kGood))
      return 1;
    buffer.destroy();
    if (check_low_latency(bootstrap, rank, num_ranks)) return 1;
    if (check_shrink(bootstrap, rank, num_ranks)) return 1;
    std::printf("rank %d: ok\n", rank);
    return 0;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "rank %d: %s\n", rank, e.what());
    return 1;
  }
}

}  // namespace

int main(int argc, char** argv) {
  int num_ranks = 0;
  if (argc > 1) {
    num_ranks = std::atoi(argv[1]);
  } else if (cudaGetDeviceCount(&num_ranks) != cudaSuccess) {
    std::fprintf(stderr, "no CUDA device\n");
    return 1;
  }
  const uint16_t port = argc > 2 ? static_cast<uint16_t>(std::atoi(argv[2])) : 29611;
  const int nvl_domain_size = argc > 3 ? std::atoi(argv[3]) : 0;
  if (num_ranks < 1) return 1;
  // No deadline of its own: the caller's timeout bounds the run.
  return turnout::fork_ranks::run(num_ranks, 0, [&](int r) { return run_rank(r, num_ranks, port, nvl_domain_size); });
}
