/* The boundary between the core and libturnout_nvshmem.so, which the core
 * dlopens only when a rank needs NVSHMEM: a table of plain C function
 * pointers behind one exported function, so that neither NVSHMEM nor a C++
 * exception crosses it. Every entry returns 0 on success; on failure, a
 * nonzero status and last_error() says why (per thread, until the next
 * failing call). Plain C, so that the table's layout is the same on both
 * sides whatever the compilers.
 *
 * A change to the table is a new version: the loader refuses a library whose
 * version differs from the one it was built with. */
#ifndef TURNOUT_RUNTIME_NVSHMEM_API_H_
#define TURNOUT_RUNTIME_NVSHMEM_API_H_

#include <cuda_runtime_api.h>
#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* 7: low-latency call counters of 64 bits (the fixed area's layout). */
#define TURNOUT_NVSHMEM_API_VERSION 7
/* The exported function's name, for dlsym. */
#define TURNOUT_NVSHMEM_API_SYMBOL "turnout_nvshmem_api_v1"
/* The size of NVSHMEM's unique id (nvshmemx_uniqueid_t). */
#define TURNOUT_NVSHMEM_UNIQUE_ID_BYTES 128

typedef struct turnout_nvshmem_api_v1_t {
  /* TURNOUT_NVSHMEM_API_VERSION of the library's build. */
  uint32_t version;
  /* sizeof(turnout_nvshmem_api_v1_t) in the library's build. */
  uint32_t table_bytes;

  /* NVSHMEM's unique id, into `out` of TURNOUT_NVSHMEM_UNIQUE_ID_BYTES
   * bytes; one rank gets it and gives it to all before init. */
  int (*get_unique_id)(void* out, size_t bytes);
  /* Collective: every rank of the job, with the same unique id, on its CUDA
   * device (the current one). */
  int (*init)(const void* unique_id, size_t bytes, int rank, int size);
  /* nvshmemx_init_status(): 0 before init, else one of NVSHMEM's
   * NVSHMEM_STATUS_* (full or limited support of several PEs per GPU). */
  int (*init_status)(int* out);
  int (*my_pe)(int* out);
  int (*n_pes)(int* out);
  /* Collective (nvshmem_align / nvshmem_free): every PE, same sizes, same order. */
  int (*alloc)(size_t alignment, size_t bytes, void** out);
  int (*free)(void* ptr);
  /* `addr` of PE `pe` as a pointer this process can load from and store to,
   * or NULL in *out where only NVSHMEM's transport reaches it. */
  int (*peer_ptr)(const void* addr, int pe, void** out);
  /* Enqueues a barrier of every PE on `stream`. */
  int (*barrier_all_on_stream)(cudaStream_t stream);
  /* Collective; after every allocation is freed. */
  int (*finalize)(void);
  /* Why the last failing call of this thread failed; never NULL. */
  const char* (*last_error)(void);

  /* Self-test of the device path, enqueued on `stream`: PE p puts p + 1000
   * into `value` of PE (p + 1) % n, then sets `signal` there to 1, and waits
   * until its own `signal` is 1. Both symmetric; signal zeroed beforehand on
   * every PE, with a barrier between the zeroing and the launch. */
  int (*ring_test)(int* value, uint64_t* signal, cudaStream_t stream);

  /* The sizes of the structs below as this library was built; the core
   * refuses a library whose sizes differ from its own. */
  uint32_t low_latency_dispatch_args_bytes;
  uint32_t low_latency_combine_args_bytes;
  uint32_t low_latency_region_bytes;
  uint32_t low_latency_group_bytes;
  /* Low-latency dispatch and combine of a group some of whose ranks only
   * NVSHMEM reaches, enqueued on `stream`. `args`, `region` and `group`
   * point to the core's LowLatencyDispatchArgs (LowLatencyCombineArgs),
   * kernels::low_latency::Region and kernels::low_latency::Group; `phase`
   * is a LowLatencyPhase. */
  int (*low_latency_dispatch)(const void* args, const void* region, const void* group, int phase, cudaStream_t stream);
  int (*low_latency_combine)(const void* args, const void* region, const void* group, int phase, cudaStream_t stream);
  /* The group barrier (shrink mode aware, bounded) of such a group, enqueued
   * on `stream`: `args` points to a kernels::low_latency::BarrierArgs of
   * low_latency_barrier_args_bytes, `group` as above. */
  uint32_t low_latency_barrier_args_bytes;
  int (*low_latency_barrier)(const void* args, const void* group, cudaStream_t stream);

  /* Internode normal mode (version 4). The sizes of
   * kernels::internode::NotifyParams, DispatchParams and CombineParams in
   * the library's build (the core refuses a library whose sizes differ), and
   * the counts step, the dispatch data step and combine enqueued on
   * `stream`: `params` points to the core's struct. */
  uint32_t internode_notify_params_bytes;
  uint32_t internode_dispatch_params_bytes;
  uint32_t internode_combine_params_bytes;
  int (*internode_notify)(const void* params, cudaStream_t stream);
  int (*internode_dispatch)(const void* params, cudaStream_t stream);
  int (*internode_combine)(const void* params, cudaStream_t stream);
} turnout_nvshmem_api_v1_t;

/* The library's one export, named TURNOUT_NVSHMEM_API_SYMBOL. */
const turnout_nvshmem_api_v1_t* turnout_nvshmem_api_v1(void);
typedef const turnout_nvshmem_api_v1_t* (*turnout_nvshmem_api_v1_fn)(void);

#ifdef __cplusplus
}
#endif

#endif /* TURNOUT_RUNTIME_NVSHMEM_API_H_ */
