#include "runtime/nvshmem_loader.hpp"

#include <dlfcn.h>
#include <limits.h>
#include <sys/auxv.h>
#include <unistd.h>

#include <cstdlib>
#include <memory>
#include <mutex>
#include <string>

#include "turnout/error.hpp"

namespace turnout {
namespace {

constexpr const char* kLibraryName = "libturnout_nvshmem.so";
constexpr const char* kHowToGet =
    "build turnout with NVSHMEM's wheel installed (pip install nvidia-nvshmem-cu13==3.4.5; CMake finds it, or "
    "NVSHMEM_HOME) and keep libturnout_nvshmem.so beside the module, or set TURNOUT_NVSHMEM_LIB to its path";

std::string executable_path() {
  char buf[PATH_MAX];
  const ssize_t n = readlink("/proc/self/exe", buf, sizeof buf - 1);
  return n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string();
}

// The file of the object this function is in: the Python module, a shared
// library, or the program itself.
std::string core_object_path() {
  Dl_info self{};
  if (dladdr(reinterpret_cast<void*>(&core_object_path), &self) == 0 || self.dli_fname == nullptr) return {};
  // For the program itself dladdr gives argv[0], which may be a bare name or
  // relative to a folder the process has left.
  Dl_info program{};
  const auto program_headers = getauxval(AT_PHDR);
  if (program_headers != 0 && dladdr(reinterpret_cast<void*>(program_headers), &program) != 0 &&
      program.dli_fbase == self.dli_fbase)
    return executable_path();
  return self.dli_fname;
}

NotSupported missing(const std::string& path, const std::string& what) {
  return NotSupported("turnout: the NVSHMEM transport (" + path + ") " + what +
                      "; NVSHMEM is needed only for ranks on other hosts. To get it: " + kHowToGet);
}

struct DlClose {
  void operator()(void* handle) const { dlclose(handle); }
};

const NvshmemApi* load() {
  const std::string path = nvshmem_library_path();
  // RTLD_LOCAL: NVSHMEM's symbols stay out of the process's global scope.
  // Closed only when it is refused; else kept to the end of the process, as
  // NVSHMEM and its CUDA module must outlive every window.
  std::unique_ptr<void, DlClose> handle(dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL));
  if (handle == nullptr) {
    const char* why = dlerror();
    throw missing(path, std::string("could not be loaded: ") + (why ? why : "no reason given"));
  }
  dlerror();
  void* symbol = dlsym(handle.get(), TURNOUT_NVSHMEM_API_SYMBOL);
  if (symbol == nullptr)
    throw missing(path, std::string("has no symbol ") + TURNOUT_NVSHMEM_API_SYMBOL + ": it is not turnout's library");
  const NvshmemApi* api = reinterpret_cast<turnout_nvshmem_api_v1_fn>(symbol)();
  if (api == nullptr) throw missing(path, std::string(TURNOUT_NVSHMEM_API_SYMBOL) + "() returned no table");
  if (api->version != TURNOUT_NVSHMEM_API_VERSION || api->table_bytes != sizeof(NvshmemApi))
    throw missing(path, "has table version " + std::to_string(api->version) + " of " +
                            std::to_string(api->table_bytes) + " bytes, this turnout needs version " +
                            std::to_string(TURNOUT_NVSHMEM_API_VERSION) + " of " + std::to_string(sizeof(NvshmemApi)) +
                            " bytes: it comes from another build of turnout");
  handle.release();
  return api;
}

}  // namespace

std::string nvshmem_library_path() {
  const char* forced = std::getenv("TURNOUT_NVSHMEM_LIB");
  if (forced != nullptr && forced[0] != '\0') return forced;
  const std::string object = core_object_path();
  const size_t slash = object.rfind('/');
  return slash == std::string::npos ? kLibraryName : object.substr(0, slash + 1) + kLibraryName;
}

const NvshmemApi& nvshmem_api() {
  // Only a loaded table is kept: after a failure the next call looks again.
  static std::mutex mutex;
  static const NvshmemApi* api = nullptr;
  std::lock_guard<std::mutex> lock(mutex);
  if (api == nullptr) api = load();
  return *api;
}

void nvshmem_check(const NvshmemApi& api, int status, const char* what) {
  if (status != 0) throw Error(std::string("turnout: NVSHMEM ") + what + " failed: " + api.last_error());
}

}  // namespace turnout
