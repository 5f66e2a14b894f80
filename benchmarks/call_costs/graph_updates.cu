// Host time of an op's copies and launch enqueued one by one against the same
// work as a CUDA graph made once, its nodes' arguments set anew each call
// (cudaGraphExec*SetParams) before one cudaGraphLaunch: can a graph replace
// several enqueues by fewer, cheaper calls? Also the device time of each way
// (events around it after a sync), since a graph launch may start later.
// Built with the tests (turnout_call_costs_graph_updates); the list `argv[1]`
// times over (default twice).
#include <cstdlib>
#include <string>

#include "call_timer.cuh"

struct Way {
  const char* name;
  std::function<void(int)> call;  // the argument: which buffers, so that each call's arguments differ
};

int main(int argc, char** argv) {
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 2;
  const size_t copy_bytes = 2 << 20;  // a middle rank's rows at 128 tokens, about
  char *src, *dst;
  CHECK(cudaMalloc(&src, 4 * copy_bytes));
  CHECK(cudaMalloc(&dst, 4 * copy_bytes));
  cudaStream_t s;
  CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
  OpParams params{};
  void* kernel_args[] = {&params};
  const dim3 grid(24), block(768);
  auto at = [&](char* base, int call, int part) { return base + ((call + part) % 4) * copy_bytes; };

  // The graphs: the kernel alone, copy then kernel, and two copies then kernel.
  cudaKernelNodeParams kernel{};
  kernel.func = reinterpret_cast<void*>(op_kernel);
  kernel.gridDim = grid;
  kernel.blockDim = block;
  kernel.kernelParams = kernel_args;
  cudaGraph_t kernel_only, one_copy, two_copies;
  cudaGraphNode_t copy_a, copy_b, copy_c, kernel_a, kernel_b, kernel_k;
  CHECK(cudaGraphCreate(&kernel_only, 0));
  CHECK(cudaGraphAddKernelNode(&kernel_k, kernel_only, nullptr, 0, &kernel));
  CHECK(cudaGraphCreate(&one_copy, 0));
  CHECK(cudaGraphAddMemcpyNode1D(&copy_a, one_copy, nullptr, 0, dst, src, copy_bytes, cudaMemcpyDeviceToDevice));
  CHECK(cudaGraphAddKernelNode(&kernel_a, one_copy, &copy_a, 1, &kernel));
  CHECK(cudaGraphCreate(&two_copies, 0));
  CHECK(cudaGraphAddMemcpyNode1D(&copy_b, two_copies, nullptr, 0, dst, src, copy_bytes, cudaMemcpyDeviceToDevice));
  CHECK(cudaGraphAddMemcpyNode1D(&copy_c, two_copies, nullptr, 0, dst + copy_bytes, src + copy_bytes, copy_bytes,
                                 cudaMemcpyDeviceToDevice));
  const cudaGraphNode_t both[] = {copy_b, copy_c};
  CHECK(cudaGraphAddKernelNode(&kernel_b, two_copies, both, 2, &kernel));
  cudaGraphExec_t kernel_exec, one_exec, two_exec;
  CHECK(cudaGraphInstantiate(&kernel_exec, kernel_only, 0));
  CHECK(cudaGraphInstantiate(&one_exec, one_copy, 0));
  CHECK(cudaGraphInstantiate(&two_exec, two_copies, 0));

  auto copy = [&](int call, int part) {
    CHECK(cudaMemcpyAsync(at(dst, call, part), at(src, call, part), copy_bytes, cudaMemcpyDeviceToDevice, s));
  };
  auto launch = [&](int call) {
    params.bytes[0] = static_cast<char>(call);
    op_kernel<<<grid, block, 0, s>>>(params);
  };
  auto set_copy = [&](cudaGraphExec_t exec, cudaGraphNode_t node, int call, int part) {
    CHECK(cudaGraphExecMemcpyNodeSetParams1D(exec, node, at(dst, call, part), at(src, call, part), copy_bytes,
                                             cudaMemcpyDeviceToDevice));
  };
  auto set_kernel = [&](cudaGraphExec_t exec, cudaGraphNode_t node, int call) {
    params.bytes[0] = static_cast<char>(call);
    CHECK(cudaGraphExecKernelNodeSetParams(exec, node, &kernel));
  };
  const Way ways[] = {
      {"launch", [&](int c) { launch(c); }},
      {"graph of the kernel, set, launched",
       [&](int c) {
         set_kernel(kernel_exec, kernel_k, c);
         CHECK(cudaGraphLaunch(kernel_exec, s));
       }},
      {"copy, launch",
       [&](int c) {
         copy(c, 0);
         launch(c);
       }},
      {"graph of both, set, launched",
       [&](int c) {
         set_copy(one_exec, copy_a, c, 0);
         set_kernel(one_exec, kernel_a, c);
         CHECK(cudaGraphLaunch(one_exec, s));
       }},
      {"graph of both, launched as is", [&](int) { CHECK(cudaGraphLaunch(one_exec, s)); }},
      {"copy, copy, launch",
       [&](int c) {
         copy(c, 0);
         copy(c, 1);
         launch(c);
       }},
      {"graph of the three, set, launched",
       [&](int c) {
         set_copy(two_exec, copy_b, c, 0);
         set_copy(two_exec, copy_c, c, 1);
         set_kernel(two_exec, kernel_b, c);
         CHECK(cudaGraphLaunch(two_exec, s));
       }},
  };
  cudaEvent_t e0, e1;
  CHECK(cudaEventCreate(&e0));
  CHECK(cudaEventCreate(&e1));
  for (int round = 0; round < rounds; ++round) {
    for (const Way& way : ways) {
      int call = 0;
      const HostTimes t = time_on_host(s, true, [&] { way.call(call++); });
      // Device time: from an idle stream, events around the work alone.
      std::vector<float> device;
      for (int it = 0; it < 100; ++it) {
        CHECK(cudaStreamSynchronize(s));
        CHECK(cudaEventRecord(e0, s));
        way.call(call++);
        CHECK(cudaEventRecord(e1, s));
        CHECK(cudaEventSynchronize(e1));
        float ms = 0;
        CHECK(cudaEventElapsedTime(&ms, e0, e1));
        device.push_back(ms * 1000);
      }
      std::sort(device.begin(), device.end());
      printf("%-34s host us median %.2f p10 %.2f p90 %.2f | device us median %.1f\n", way.name, t.median, t.p10, t.p90,
             device[device.size() / 2]);
    }
  }
  return 0;
}
