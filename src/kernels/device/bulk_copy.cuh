// Bulk copies through shared memory (sm_90's cp.async.bulk, the SM's tensor
// memory accelerator): one thread moves kilobytes with one instruction, the
// load's arrival counted by a shared-memory mbarrier, the stores grouped so
// the issuing thread can tell when a staging buffer may be refilled.
#pragma once

#include <cstdint>

namespace turnout::device {

__device__ __forceinline__ uint32_t shared_address(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// An mbarrier that completes a phase once `arrivals` threads have arrived and
// the bytes they announced have landed.
__device__ __forceinline__ void mbarrier_init(uint64_t* bar, uint32_t arrivals) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(shared_address(bar)), "r"(arrivals) : "memory");
  // The bulk copies (async proxy) must see the initialised barrier.
  asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
}

// Arrives on `bar` and announces `bytes` that copies will complete on it.
__device__ __forceinline__ void mbarrier_expect_bytes(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(shared_address(bar)), "r"(bytes)
               : "memory");
}

// Spins until the phase of the given parity (0 for the first use, then
// alternating) has completed.
__device__ __forceinline__ void mbarrier_wait(uint64_t* bar, uint32_t parity) {
  uint32_t done = 0;
  do {
    asm volatile("{\n .reg .pred p;\n mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n selp.u32 %0, 1, 0, p;\n}"
                 : "=r"(done)
                 : "r"(shared_address(bar)), "r"(parity)
                 : "memory");
  } while (!done);
}

// Global -> shared, `bytes` a multiple of 16 and both addresses 16-byte
// aligned; completes on `bar`.
__device__ __forceinline__ void bulk_load(void* dst_shared, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile("cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
                   shared_address(dst_shared)),
               "l"(src), "r"(bytes), "r"(shared_address(bar))
               : "memory");
}

// Shared -> global (a peer's memory too), in the current bulk group.
__device__ __forceinline__ void bulk_store(void* dst, const void* src_shared, uint32_t bytes) {
  asm volatile("cp.async.bulk.global.shared::cta.bulk_group [%0], [%1], %2;" ::"l"(dst),
               "r"(shared_address(src_shared)), "r"(bytes)
               : "memory");
}

__device__ __forceinline__ void bulk_commit() {
  asm volatile("cp.async.bulk.commit_group;" ::: "memory");
}

// Until at most kPending of the committed groups still read shared memory.
template <int kPending>
__device__ __forceinline__ void bulk_wait_read() {
  asm volatile("cp.async.bulk.wait_group.read %0;" ::"n"(kPending) : "memory");
}

// Until every committed group's writes are done, and ordered before this
// thread's later ordinary (generic proxy) accesses.
__device__ __forceinline__ void bulk_wait_all() {
  asm volatile("cp.async.bulk.wait_group 0;" ::: "memory");
  asm volatile("fence.proxy.async.global;" ::: "memory");
}

}  // namespace turnout::device
