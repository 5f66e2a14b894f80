// The C++ API alone, no Python: one process per rank (round-robin over the GPUs) bootstrapped over TCP,
// get_dispatch_layout against the host reference, peer stores and loads
// across every pair, and an intranode dispatch and combine. Exit status 0 when every rank passed.
//
//   turnout_gpu_cpp_test [num_ranks] [port]
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>

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

int check_layout(turnout::Buffer& buffer, int rank, cudaStream_t stream) {
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
  free_all();
  return 0;
}

int run_rank(int rank, int num_ranks, uint16_t port) {
  try {
    // Ranks go round-robin over the visible GPUs; several may share one.
    int devices = 0;
    TURNOUT_CUDA_CHECK(cudaGetDeviceCount(&devices));
    TURNOUT_CUDA_CHECK(cudaSetDevice(rank % devices));
    turnout::TcpBootstrap bootstrap(rank, num_ranks, "127.0.0.1", port, std::chrono::seconds(60));
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
  if (num_ranks < 1) return 1;
  // Fork before any CUDA call in this process: children own their GPUs.
  std::vector<pid_t> children;
  for (int r = 0; r < num_ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) _exit(run_rank(r, num_ranks, port));
    children.push_back(pid);
  }
  int failed = 0;
  for (pid_t pid : children) {
    int status = 0;
    waitpid(pid, &status, 0);
    failed += !(WIFEXITED(status) && WEXITSTATUS(status) == 0);
  }
  std::printf("%d passed, %d failed\n", num_ranks - failed, failed);
  return failed ? 1 : 0;
}
