// The one export of libturnout_nvshmem.so: NVSHMEM's host calls behind the C
// table of runtime/nvshmem_api.h. Each entry catches everything, so no C++
// exception reaches the core, and records why it failed for last_error().
#include <nvshmem_host.h>

#include <cstring>
#include <exception>
#include <stdexcept>
#include <string>

#include "nvshmem/internode.hpp"
#include "nvshmem/low_latency.hpp"
#include "nvshmem/ring_test.hpp"
#include "runtime/nvshmem_api.h"

namespace turnout::nvshmem {
namespace {

static_assert(sizeof(nvshmemx_uniqueid_t) == TURNOUT_NVSHMEM_UNIQUE_ID_BYTES,
              "TURNOUT_NVSHMEM_UNIQUE_ID_BYTES differs from NVSHMEM's unique id");

thread_local std::string last_error_text = "no error";

// Runs `body`, which throws on failure: 0, or 1 with the reason recorded.
template <class Body>
int guarded(const char* entry, Body&& body) noexcept {
  try {
    body();
    return 0;
  } catch (const std::exception& e) {
    try {
      last_error_text = std::string(entry) + ": " + e.what();
    } catch (...) {
      last_error_text.clear();
    }
  } catch (...) {
    last_error_text.clear();
  }
  return 1;
}

void check(int status, const char* call) {
  if (status != 0) throw std::runtime_error(std::string(call) + " returned " + std::to_string(status));
}

void require(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(what);
}

int get_unique_id(void* out, size_t bytes) {
  return guarded("get_unique_id", [&] {
    require(out != nullptr && bytes == sizeof(nvshmemx_uniqueid_t), "needs a buffer of the unique id's size");
    nvshmemx_uniqueid_t id = NVSHMEMX_UNIQUEID_INITIALIZER;
    check(nvshmemx_get_uniqueid(&id), "nvshmemx_get_uniqueid");
    std::memcpy(out, &id, sizeof id);
  });
}

int init(const void* unique_id, size_t bytes, int rank, int size) {
  return guarded("init", [&] {
    require(unique_id != nullptr && bytes == sizeof(nvshmemx_uniqueid_t), "needs a unique id of its size");
    require(size >= 1 && rank >= 0 && rank < size, "needs 0 <= rank < size");
    nvshmemx_uniqueid_t id;
    std::memcpy(&id, unique_id, sizeof id);
    nvshmemx_init_attr_t attr = NVSHMEMX_INIT_ATTR_INITIALIZER;
    check(nvshmemx_set_attr_uniqueid_args(rank, size, &id, &attr), "nvshmemx_set_attr_uniqueid_args");
    // nvshmemx_init_attr (an inline in NVSHMEM's header) is this call and
    // exit(-1) on failure; a library must report instead of ending the job.
    nvshmemi_version_t version = {NVSHMEM_VENDOR_MAJOR_VERSION, NVSHMEM_VENDOR_MINOR_VERSION,
                                  NVSHMEM_VENDOR_PATCH_VERSION};
    int provided = 0;
    check(nvshmemi_init_thread(NVSHMEM_THREAD_SERIALIZED, &provided, NVSHMEMX_INIT_WITH_UNIQUEID, &attr, version),
          "nvshmemi_init_thread with a unique id");
  });
}

int init_status(int* out) {
  return guarded("init_status", [&] {
    require(out != nullptr, "needs an output");
    *out = nvshmemx_init_status();
  });
}

int my_pe(int* out) {
  return guarded("my_pe", [&] {
    require(out != nullptr, "needs an output");
    *out = nvshmem_my_pe();
  });
}

int n_pes(int* out) {
  return guarded("n_pes", [&] {
    require(out != nullptr, "needs an output");
    *out = nvshmem_n_pes();
  });
}

int symmetric_alloc(size_t alignment, size_t bytes, void** out) {
  return guarded("alloc", [&] {
    require(out != nullptr, "needs an output");
    require(bytes > 0, "needs bytes > 0");
    require(alignment > 0 && (alignment & (alignment - 1)) == 0, "needs a power-of-two alignment");
    *out = nvshmem_align(alignment, bytes);
    if (*out == nullptr)
      throw std::runtime_error("nvshmem_align(" + std::to_string(alignment) + ", " + std::to_string(bytes) +
                               ") returned NULL: the symmetric heap (NVSHMEM_SYMMETRIC_SIZE) may be too small");
  });
}

int symmetric_free(void* ptr) {
  return guarded("free", [&] { nvshmem_free(ptr); });
}

int peer_ptr(const void* addr, int pe, void** out) {
  return guarded("peer_ptr", [&] {
    require(out != nullptr, "needs an output");
    *out = nvshmem_ptr(addr, pe);
  });
}

void check_cuda(cudaError_t rc, const char* call) {
  if (rc != cudaSuccess)
    throw std::runtime_error(std::string(call) + ": " + cudaGetErrorName(rc) + " (" + cudaGetErrorString(rc) + ")");
}

int barrier_all_on_stream(cudaStream_t stream) {
  return guarded("barrier_all_on_stream", [&] {
    nvshmemx_barrier_all_on_stream(stream);
    // It returns nothing; a launch it could not make stays the thread's
    // last CUDA error.
    check_cuda(cudaGetLastError(), "nvshmemx_barrier_all_on_stream");
  });
}

int finalize() {
  return guarded("finalize", [] { nvshmem_finalize(); });
}

const char* last_error() {
  return last_error_text.empty() ? "unknown error (its description could not be recorded)" : last_error_text.c_str();
}

int ring_test(int* value, uint64_t* signal, cudaStream_t stream) {
  return guarded("ring_test", [&] {
    require(value != nullptr && signal != nullptr, "needs symmetric value and signal");
    check_cuda(launch_ring_test(value, signal, stream), "ring test launch");
  });
}

int low_latency_dispatch(const void* args, const void* region, const void* group, int phase, cudaStream_t stream) {
  return guarded("low_latency_dispatch", [&] {
    require(args != nullptr && region != nullptr && group != nullptr, "needs args, region and group");
    launch_low_latency_dispatch(
        *static_cast<const LowLatencyDispatchArgs*>(args), *static_cast<const kernels::low_latency::Region*>(region),
        *static_cast<const kernels::low_latency::Group*>(group), static_cast<LowLatencyPhase>(phase), stream);
  });
}

int low_latency_combine(const void* args, const void* region, const void* group, int phase, cudaStream_t stream) {
  return guarded("low_latency_combine", [&] {
    require(args != nullptr && region != nullptr && group != nullptr, "needs args, region and group");
    launch_low_latency_combine(
        *static_cast<const LowLatencyCombineArgs*>(args), *static_cast<const kernels::low_latency::Region*>(region),
        *static_cast<const kernels::low_latency::Group*>(group), static_cast<LowLatencyPhase>(phase), stream);
  });
}

int low_latency_barrier(const void* args, const void* group, cudaStream_t stream) {
  return guarded("low_latency_barrier", [&] {
    require(args != nullptr && group != nullptr, "needs args and group");
    launch_low_latency_barrier(*static_cast<const kernels::low_latency::BarrierArgs*>(args),
                               *static_cast<const kernels::low_latency::Group*>(group), stream);
  });
}

int internode_notify(const void* params, cudaStream_t stream) {
  return guarded("internode_notify", [&] {
    require(params != nullptr, "needs params");
    launch_internode_notify(*static_cast<const kernels::internode::NotifyParams*>(params), stream);
  });
}

int internode_dispatch(const void* params, cudaStream_t stream) {
  return guarded("internode_dispatch", [&] {
    require(params != nullptr, "needs params");
    launch_internode_dispatch(*static_cast<const kernels::internode::DispatchParams*>(params), stream);
  });
}

int internode_combine(const void* params, cudaStream_t stream) {
  return guarded("internode_combine", [&] {
    require(params != nullptr, "needs params");
    launch_internode_combine(*static_cast<const kernels::internode::CombineParams*>(params), stream);
  });
}

}  // namespace
}  // namespace turnout::nvshmem

extern "C" __attribute__((visibility("default"))) const turnout_nvshmem_api_v1_t* turnout_nvshmem_api_v1(void) {
  namespace n = turnout::nvshmem;
  static const turnout_nvshmem_api_v1_t table = {
      .version = TURNOUT_NVSHMEM_API_VERSION,
      .table_bytes = sizeof(turnout_nvshmem_api_v1_t),
      .get_unique_id = n::get_unique_id,
      .init = n::init,
      .init_status = n::init_status,
      .my_pe = n::my_pe,
      .n_pes = n::n_pes,
      .alloc = n::symmetric_alloc,
      .free = n::symmetric_free,
      .peer_ptr = n::peer_ptr,
      .barrier_all_on_stream = n::barrier_all_on_stream,
      .finalize = n::finalize,
      .last_error = n::last_error,
      .ring_test = n::ring_test,
      .low_latency_dispatch_args_bytes = sizeof(turnout::LowLatencyDispatchArgs),
      .low_latency_combine_args_bytes = sizeof(turnout::LowLatencyCombineArgs),
      .low_latency_region_bytes = sizeof(turnout::kernels::low_latency::Region),
      .low_latency_group_bytes = sizeof(turnout::kernels::low_latency::Group),
      .low_latency_dispatch = n::low_latency_dispatch,
      .low_latency_combine = n::low_latency_combine,
      .low_latency_barrier_args_bytes = sizeof(turnout::kernels::low_latency::BarrierArgs),
      .low_latency_barrier = n::low_latency_barrier,
      .internode_notify_params_bytes = sizeof(turnout::kernels::internode::NotifyParams),
      .internode_dispatch_params_bytes = sizeof(turnout::kernels::internode::DispatchParams),
      .internode_combine_params_bytes = sizeof(turnout::kernels::internode::CombineParams),
      .internode_notify = n::internode_notify,
      .internode_dispatch = n::internode_dispatch,
      .internode_combine = n::internode_combine,
  };
  return &table;
}
