// Host time of the sequences of calls an intranode op enqueues, against the
// sum of their calls each alone: does a launch cost more after a copy than
// after a launch? A staged combine enqueues its row copies, then the check
// launch and the data launch where ranks share a GPU (one launch otherwise).
// Built with the tests (turnout_call_costs_enqueue_sequences); the list
// `argv[1]` times over (default twice).
#include <cstdlib>
#include <string>

#include "call_timer.cuh"

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t copy_bytes = 50 << 20;  // rows of a combine at 4096 tokens, EP2
  char *src, *dst;
  CHECK(cudaMalloc(&src, 2 * copy_bytes));
  CHECK(cudaMalloc(&dst, 2 * copy_bytes));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  OpParams params{};
  auto launch = [&] { op_kernel<<<24, 768, 0, s>>>(params); };
  // A middle rank's two copies: the rows before its own and those after.
  auto copy = [&](int which) {
    const size_t at = which % 2 * copy_bytes;
    CHECK(cudaMemcpyAsync(dst + at, src + at, copy_bytes, cudaMemcpyDeviceToDevice, s));
  };
  // Each sequence as the names of its calls ('c' a copy, 'l' a launch).
  const char* sequences[] = {"l", "c", "ll", "cl", "lc", "ccl", "cll", "ccll"};
  for (int round = 0; round < rounds; ++round) {
    double launch_us = 0, copy_us = 0;
    for (const char* seq : sequences) {
      const std::string calls(seq);
      const HostTimes t = time_on_host(s, true, [&] {
        int copies = 0;
        for (char c : calls) {
          if (c == 'l')
            launch();
          else
            copy(copies++);
        }
      });
      if (calls == "l") launch_us = t.median;
      if (calls == "c") copy_us = t.median;
      double parts = 0;
      for (char c : calls) parts += c == 'l' ? launch_us : copy_us;
      printf("%-5s host us median %.2f p10 %.2f p90 %.2f; its calls alone %.2f\n", seq, t.median, t.p10, t.p90, parts);
    }
  }
  return 0;
}
