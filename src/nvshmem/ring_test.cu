// One thread per PE: the smallest kernel that needs NVSHMEM's device state
// (initialized by nvshmem init in this library's device-linked module),
// symmetric addressing, a remote put, its completion and a signal.
#include <nvshmem.h>
#include <nvshmemx.h>

#include "nvshmem/ring_test.hpp"

namespace turnout::nvshmem {
namespace {

__global__ void ring_test_kernel(int* value, uint64_t* signal) {
  const int me = nvshmem_my_pe();
  const int next = (me + 1) % nvshmem_n_pes();
  nvshmem_int_p(value, me + 1000, next);
  // The value must have landed before the peer sees the signal.
  nvshmem_quiet();
  nvshmemx_signal_op(signal, 1, NVSHMEM_SIGNAL_SET, next);
  nvshmem_signal_wait_until(signal, NVSHMEM_CMP_EQ, 1);
}

}  // namespace

cudaError_t launch_ring_test(int* value, uint64_t* signal, cudaStream_t stream) {
  ring_test_kernel<<<1, 1, 0, stream>>>(value, signal);
  return cudaGetLastError();
}

}  // namespace turnout::nvshmem
