// NVSHMEM for one group of ranks, set up over turnout's Bootstrap: rank 0's
// unique id goes to every rank through one all-gather, then every rank
// initializes NVSHMEM with it on its current CUDA device. Memory comes from
// NVSHMEM's symmetric heap and is freed, collectively, before NVSHMEM is
// finalized.
//
// NVSHMEM is initialized at most once at a time per process: while a window
// or any of its allocations lives, a second window is refused (NotSupported)
// rather than shared, because its ranks would have to be the same group. A
// new window may be opened after the last one is gone, unless one was
// abandoned (a peer died: NVSHMEM cannot be finalized without it).
#pragma once

#include <cuda_runtime_api.h>

#include <cstddef>
#include <memory>

#include "runtime/nvshmem_env.hpp"
#include "turnout/bootstrap.hpp"

namespace turnout {

namespace detail {
class NvshmemSession;
}  // namespace detail

// Symmetric memory of one window: the same size at the same offset on every
// rank. Keeps NVSHMEM initialized while it lives.
class NvshmemAllocation {
 public:
  NvshmemAllocation() = default;
  ~NvshmemAllocation() { reset(); }
  NvshmemAllocation(const NvshmemAllocation&) = delete;
  NvshmemAllocation& operator=(const NvshmemAllocation&) = delete;
  NvshmemAllocation(NvshmemAllocation&& o) noexcept;
  NvshmemAllocation& operator=(NvshmemAllocation&& o) noexcept;

  void* get() const { return ptr_; }
  size_t size() const { return size_; }
  // Collective (nvshmem_free): every rank frees its allocations in the same
  // order, with no kernel still using them.
  void reset() noexcept;
  // Forgets the memory without freeing it (not collective): it stays in the
  // symmetric heap until the process exits. For when a peer is gone.
  void abandon() noexcept;

 private:
  friend class NvshmemWindow;
  NvshmemAllocation(std::shared_ptr<detail::NvshmemSession> session, void* ptr, size_t size);

  std::shared_ptr<detail::NvshmemSession> session_;
  void* ptr_ = nullptr;
  size_t size_ = 0;
};

class NvshmemWindow {
 public:
  static constexpr size_t kDefaultAlignment = 256;

  // Collective over `bootstrap`, on the calling thread's current CUDA device.
  // When any rank cannot take part (another window open in its process, no
  // libturnout_nvshmem.so, no CUDA device, NVSHMEM already initialized by
  // someone else, no unique id on rank 0), every rank throws before NVSHMEM
  // is initialized: the failing ranks say why, the others name them.
  // `settings` become defaults of NVSHMEM's environment (nvshmem_env.hpp);
  // variables the user set win.
  explicit NvshmemWindow(Bootstrap& bootstrap, const NvshmemSettings& settings = {});
  // Finalizes NVSHMEM once the last allocation is also gone (collective).
  ~NvshmemWindow();
  NvshmemWindow(const NvshmemWindow&) = delete;
  NvshmemWindow& operator=(const NvshmemWindow&) = delete;

  // NVSHMEM's PE numbers, which are the bootstrap's ranks.
  int rank() const;
  int size() const;
  // nvshmemx_init_status(): whether ranks sharing a GPU have NVSHMEM's full
  // support (MPS with active thread percentages summing to at most 100).
  int init_status() const;

  // Collective: every rank asks for the same sizes in the same order.
  NvshmemAllocation alloc(size_t bytes, size_t alignment = kDefaultAlignment);
  // `addr` (symmetric) of rank `pe` as a pointer this process can load and
  // store through, or nullptr where only NVSHMEM's transport reaches it.
  void* peer_ptr(const void* addr, int pe) const;
  // Enqueues a barrier of every rank on `stream`.
  void barrier(cudaStream_t stream);
  // Not collective: NVSHMEM stays initialized, never finalized, until the
  // process exits, and no other window can open in this process. For when a
  // peer is gone (shrink mode), whom NVSHMEM's collective free and finalize
  // would wait for forever. The window and its allocations may then go
  // (abandon those first) without calling NVSHMEM.
  void abandon() noexcept;

 private:
  std::shared_ptr<detail::NvshmemSession> session_;
};

}  // namespace turnout
