// Shared by the multi-process GPU test binaries: one child process per rank,
// forked before the parent makes any CUDA call (children own their GPUs).
#pragma once

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstdio>
#include <functional>
#include <thread>
#include <vector>

namespace turnout::fork_ranks {

// Runs run_rank(r) in a child per rank r < num_ranks, its return value the
// child's exit status. With timeout_s > 0, a rank still running past it (stuck
// in a collective whose peer failed) is killed and counted as failed. Prints
// "N passed, M failed"; returns 0 when every rank exited 0, else 1.
inline int run(int num_ranks, int timeout_s, const std::function<int(int)>& run_rank) {
  std::fflush(stdout);
  std::vector<pid_t> children;
  for (int r = 0; r < num_ranks; ++r) {
    const pid_t pid = fork();
    if (pid == 0) {
      const int rc = run_rank(r);
      std::fflush(stdout);
      _exit(rc);
    }
    children.push_back(pid);
  }
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
  std::vector<int> status(num_ranks, -1);
  int left = num_ranks;
  while (left > 0 && (timeout_s <= 0 || std::chrono::steady_clock::now() < deadline)) {
    for (int r = 0; r < num_ranks; ++r) {
      if (status[r] != -1) continue;
      int s = 0;
      if (waitpid(children[r], &s, WNOHANG) == children[r]) {
        status[r] = WIFEXITED(s) ? WEXITSTATUS(s) : 128 + (WIFSIGNALED(s) ? WTERMSIG(s) : 0);
        --left;
      }
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  int failed = 0;
  for (int r = 0; r < num_ranks; ++r) {
    if (status[r] == -1) {
      kill(children[r], SIGKILL);
      waitpid(children[r], nullptr, 0);
      std::fprintf(stderr, "rank %d: did not finish within %d s (killed)\n", r, timeout_s);
    } else if (status[r] != 0) {
      std::fprintf(stderr, "rank %d: exit status %d\n", r, status[r]);
    }
    failed += status[r] != 0;
  }
  std::printf("%d passed, %d failed\n", num_ranks - failed, failed);
  return failed ? 1 : 0;
}

}  // namespace turnout::fork_ranks
