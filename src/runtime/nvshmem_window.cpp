#include "runtime/nvshmem_window.hpp"

#include <concepts>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <exception>
#include <mutex>
#include <new>
#include <string>
#include <utility>
#include <vector>

#include "runtime/nvshmem_env.hpp"
#include "runtime/nvshmem_loader.hpp"
#include "turnout/error.hpp"

namespace turnout {
namespace {

// Whether NVSHMEM is in use in this process: by a window, or by allocations
// that outlive theirs.
class ProcessClaim {
 public:
  ProcessClaim() = default;
  ~ProcessClaim() { release(); }
  ProcessClaim(const ProcessClaim&) = delete;
  ProcessClaim& operator=(const ProcessClaim&) = delete;
  ProcessClaim(ProcessClaim&& o) noexcept : held_(std::exchange(o.held_, false)) {}
  ProcessClaim& operator=(ProcessClaim&& o) noexcept {
    if (this != &o) {
      release();
      held_ = std::exchange(o.held_, false);
    }
    return *this;
  }

  // Empty when another claim is held.
  static ProcessClaim take() {
    std::lock_guard<std::mutex> lock(mutex());
    if (claimed()) return {};
    claimed() = true;
    ProcessClaim claim;
    claim.held_ = true;
    return claim;
  }
  explicit operator bool() const { return held_; }

  // NVSHMEM was left initialized for good: every later claim is refused.
  static void mark_abandoned() noexcept {
    std::lock_guard<std::mutex> lock(mutex());
    abandoned() = true;
  }
  static bool was_abandoned() {
    std::lock_guard<std::mutex> lock(mutex());
    return abandoned();
  }

 private:
  static std::mutex& mutex() {
    static std::mutex m;
    return m;
  }
  static bool& claimed() {
    static bool c = false;
    return c;
  }
  static bool& abandoned() {
    static bool a = false;
    return a;
  }
  void release() noexcept {
    if (!held_) return;
    std::lock_guard<std::mutex> lock(mutex());
    claimed() = false;
    held_ = false;
  }

  bool held_ = false;
};

// Why a rank cannot take part, all-gathered so that every rank stops alike.
enum class Refusal : uint8_t {
  kNone,
  kWindowOpen,
  kNoDevice,
  kNoLibrary,
  kInitializedElsewhere,
  kNoUniqueId,
  kAbandoned
};

const char* describe(Refusal r) {
  switch (r) {
    case Refusal::kNone:
      return "none";
    case Refusal::kWindowOpen:
      return "another NVSHMEM window, or its allocations, is still alive in its process";
    case Refusal::kNoDevice:
      return "it has no CUDA device";
    case Refusal::kNoLibrary:
      return "it cannot load libturnout_nvshmem.so";
    case Refusal::kInitializedElsewhere:
      return "NVSHMEM was already initialized in its process, not by turnout (or could not say)";
    case Refusal::kNoUniqueId:
      return "it could not get NVSHMEM's unique id";
    case Refusal::kAbandoned:
      return "NVSHMEM was left initialized in its process after a peer was lost";
  }
  return "unknown";
}

constexpr size_t kIdBytes = TURNOUT_NVSHMEM_UNIQUE_ID_BYTES;
// One rank's part of the all-gather: its refusal, then (rank 0) the unique id.
constexpr size_t kRecordBytes = 1 + kIdBytes;

// Whether this rank can take part: the library's table, or the refusal and
// the error this rank throws for it.
struct Readiness {
  Refusal refusal = Refusal::kNone;
  std::exception_ptr failure;
  const NvshmemApi* api = nullptr;

  void refuse(Refusal r, std::exception_ptr e) {
    refusal = r;
    failure = std::move(e);
  }
  template <std::derived_from<Error> E>
  void refuse(Refusal r, E error) {
    refuse(r, std::make_exception_ptr(std::move(error)));
  }
};

Readiness check_readiness(const ProcessClaim& claim) {
  Readiness ready;
  if (!claim && ProcessClaim::was_abandoned()) {
    ready.refuse(Refusal::kAbandoned,
                 NotSupported("turnout: NVSHMEM stays initialized in this process to its end: a shrink-mode buffer "
                              "lost a peer, and NVSHMEM cannot be finalized without every rank; NVSHMEM is "
                              "available again in a new process"));
    return ready;
  }
  if (!claim) {
    ready.refuse(Refusal::kWindowOpen, NotSupported("turnout: an NVSHMEM window is already open in this process "
                                                    "(NVSHMEM is initialized once at a time): destroy it and its "
                                                    "allocations first"));
    return ready;
  }
  try {
    ready.api = &nvshmem_api();
  } catch (const NotSupported&) {
    ready.refuse(Refusal::kNoLibrary, std::current_exception());
    return ready;
  }
  // NVSHMEM's init exits the process when CUDA fails under it.
  int count = 0;
  cudaError_t rc = cudaGetDeviceCount(&count);
  if (rc == cudaSuccess && count == 0) rc = cudaErrorNoDevice;
  if (rc != cudaSuccess) {
    cudaGetLastError();
    const std::string why = std::string(cudaGetErrorName(rc)) + " (" + cudaGetErrorString(rc) + ")";
    ready.refuse(Refusal::kNoDevice, CudaError(rc, "turnout: an NVSHMEM window needs a CUDA device: " + why));
    return ready;
  }
  int status = 0;
  if (ready.api->init_status(&status) != 0) {
    ready.refuse(Refusal::kInitializedElsewhere,
                 Error(std::string("turnout: NVSHMEM init_status failed: ") + ready.api->last_error()));
  } else if (status != 0) {
    ready.refuse(
        Refusal::kInitializedElsewhere,
        NotSupported("turnout: NVSHMEM is already initialized in this process (status " + std::to_string(status) +
                     "), not by turnout; another library, such as PyTorch's symmetric memory, may use it"));
  }
  return ready;
}

}  // namespace

namespace detail {

// NVSHMEM initialized for one window; finalized when the window and its last
// allocation are gone.
class NvshmemSession {
 public:
  NvshmemSession(const NvshmemApi& api, ProcessClaim claim) : api_(api), claim_(std::move(claim)) {}
  ~NvshmemSession() {
    if (api_.finalize() != 0) std::fprintf(stderr, "turnout: NVSHMEM finalize failed: %s\n", api_.last_error());
  }
  NvshmemSession(const NvshmemSession&) = delete;
  NvshmemSession& operator=(const NvshmemSession&) = delete;

  const NvshmemApi& api() const { return api_; }

  // Keeps `session` past the end of the process: never finalized. At most
  // one session is ever abandoned, as no claim is granted after it.
  static void keep_forever(std::shared_ptr<NvshmemSession> session) noexcept {
    ProcessClaim::mark_abandoned();
    // Never destroyed, on purpose: a destructor at exit would finalize.
    alignas(std::shared_ptr<NvshmemSession>) static std::byte slot[sizeof(std::shared_ptr<NvshmemSession>)];
    new (slot) std::shared_ptr<NvshmemSession>(std::move(session));
  }

 private:
  const NvshmemApi& api_;
  ProcessClaim claim_;  // released after the finalize above: members go after the destructor's body
};

}  // namespace detail

NvshmemAllocation::NvshmemAllocation(std::shared_ptr<detail::NvshmemSession> session, void* ptr, size_t size)
    : session_(std::move(session)), ptr_(ptr), size_(size) {}

NvshmemAllocation::NvshmemAllocation(NvshmemAllocation&& o) noexcept
    : session_(std::move(o.session_)), ptr_(std::exchange(o.ptr_, nullptr)), size_(std::exchange(o.size_, 0)) {}

NvshmemAllocation& NvshmemAllocation::operator=(NvshmemAllocation&& o) noexcept {
  if (this != &o) {
    reset();
    session_ = std::move(o.session_);
    ptr_ = std::exchange(o.ptr_, nullptr);
    size_ = std::exchange(o.size_, 0);
  }
  return *this;
}

void NvshmemAllocation::reset() noexcept {
  if (ptr_ != nullptr) {
    const NvshmemApi& api = session_->api();
    if (api.free(ptr_) != 0) std::fprintf(stderr, "turnout: NVSHMEM free failed: %s\n", api.last_error());
  }
  ptr_ = nullptr;
  size_ = 0;
  session_.reset();  // the last owner finalizes, after the free above
}

void NvshmemAllocation::abandon() noexcept {
  ptr_ = nullptr;
  size_ = 0;
  session_.reset();
}

NvshmemWindow::NvshmemWindow(Bootstrap& bootstrap, const NvshmemSettings& settings) {
  const int rank = bootstrap.rank();
  const int size = bootstrap.size();
  // Before init, which reads them. Not set: NVSHMEM_BOOTSTRAP, since the init
  // flag NVSHMEMX_INIT_WITH_UNIQUEID already picks the unique-id bootstrap.
  apply_nvshmem_env_defaults(settings);

  // A refusal is all-gathered before it is thrown, so that no rank is left
  // waiting in NVSHMEM's init for one that stopped.
  ProcessClaim claim = ProcessClaim::take();
  Readiness ready = check_readiness(claim);
  std::vector<std::byte> mine(kRecordBytes);
  if (ready.refusal == Refusal::kNone && rank == 0 && ready.api->get_unique_id(mine.data() + 1, kIdBytes) != 0)
    ready.refuse(Refusal::kNoUniqueId,
                 Error(std::string("turnout: NVSHMEM get_unique_id failed: ") + ready.api->last_error()));
  mine[0] = static_cast<std::byte>(ready.refusal);

  const std::vector<std::byte> all = bootstrap.all_gather(mine);
  if (all.size() != kRecordBytes * size)
    throw Error("turnout: NVSHMEM window: the bootstrap's all-gather returned " + std::to_string(all.size()) +
                " bytes, expected " + std::to_string(kRecordBytes * size));
  std::string refused;
  for (int r = 0; r < size; ++r) {
    const auto theirs = static_cast<Refusal>(all[r * kRecordBytes]);
    if (theirs != Refusal::kNone)
      refused += (refused.empty() ? "" : "; ") + ("rank " + std::to_string(r) + ": " + describe(theirs));
  }
  if (ready.failure) std::rethrow_exception(ready.failure);
  if (!refused.empty())
    throw Error("turnout: NVSHMEM window not opened, as other ranks cannot take part (" + refused +
                "); NVSHMEM was not initialized");

  const NvshmemApi& api = *ready.api;
  nvshmem_check(api, api.init(all.data() + 1, kIdBytes, rank, size), "init");
  session_ = std::make_shared<detail::NvshmemSession>(api, std::move(claim));
  if (this->rank() != rank || this->size() != size)
    throw Error("turnout: NVSHMEM gave rank " + std::to_string(this->rank()) + " of " + std::to_string(this->size()) +
                " to bootstrap rank " + std::to_string(rank) + " of " + std::to_string(size));
}

NvshmemWindow::~NvshmemWindow() = default;

int NvshmemWindow::rank() const {
  int pe = -1;
  nvshmem_check(session_->api(), session_->api().my_pe(&pe), "my_pe");
  return pe;
}

int NvshmemWindow::size() const {
  int n = 0;
  nvshmem_check(session_->api(), session_->api().n_pes(&n), "n_pes");
  return n;
}

int NvshmemWindow::init_status() const {
  int status = 0;
  nvshmem_check(session_->api(), session_->api().init_status(&status), "init_status");
  return status;
}

NvshmemAllocation NvshmemWindow::alloc(size_t bytes, size_t alignment) {
  if (bytes == 0) throw InvalidArgument("NvshmemWindow::alloc: bytes must be > 0");
  if (alignment == 0 || (alignment & (alignment - 1)) != 0)
    throw InvalidArgument("NvshmemWindow::alloc: alignment must be a power of two, got " + std::to_string(alignment));
  void* ptr = nullptr;
  nvshmem_check(session_->api(), session_->api().alloc(alignment, bytes, &ptr), "alloc");
  return NvshmemAllocation(session_, ptr, bytes);
}

void* NvshmemWindow::peer_ptr(const void* addr, int pe) const {
  const int n = size();
  if (pe < 0 || pe >= n)
    throw InvalidArgument("NvshmemWindow::peer_ptr: pe " + std::to_string(pe) + " is not in [0, " + std::to_string(n) +
                          ")");
  void* ptr = nullptr;
  nvshmem_check(session_->api(), session_->api().peer_ptr(addr, pe, &ptr), "peer_ptr");
  return ptr;
}

void NvshmemWindow::barrier(cudaStream_t stream) {
  nvshmem_check(session_->api(), session_->api().barrier_all_on_stream(stream), "barrier_all_on_stream");
}

void NvshmemWindow::abandon() noexcept {
  if (session_) detail::NvshmemSession::keep_forever(std::move(session_));
}

}  // namespace turnout
