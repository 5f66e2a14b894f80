// The device-path self-test behind the table's ring_test entry.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

namespace turnout::nvshmem {

// Enqueues the ring on `stream` (see runtime/nvshmem_api.h); returns the
// launch's error.
cudaError_t launch_ring_test(int* value, uint64_t* signal, cudaStream_t stream);

}  // namespace turnout::nvshmem
