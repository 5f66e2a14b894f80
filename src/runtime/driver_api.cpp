#include "runtime/driver_api.hpp"

#include <cuda_runtime_api.h>

#include <string>

namespace turnout {
namespace {

// The ABI the PFN_..._v typedefs above describe. Every driver that can run
// this CUDA 13 runtime is at least this new.
constexpr unsigned int kDriverAbiVersion = 12000;

template <typename Fn>
void resolve(const char* symbol, Fn& fn) {
  void* p = nullptr;
  cudaDriverEntryPointQueryResult found = cudaDriverEntryPointSymbolNotFound;
  const cudaError_t rc = cudaGetDriverEntryPointByVersion(symbol, &p, kDriverAbiVersion, cudaEnableDefault, &found);
  if (rc != cudaSuccess) {
    // Not sticky, but it would stay the thread's last error and fail the
    // next launch check.
    cudaGetLastError();
    throw CudaError(rc, std::string("cannot look up the CUDA driver function ") + symbol + ": " + cudaGetErrorName(rc) +
                            " (" + cudaGetErrorString(rc) + ")");
  }
  if (found != cudaDriverEntryPointSuccess || p == nullptr)
    throw NotSupported(std::string("the CUDA driver has no ") + symbol + " with the CUDA " +
                       std::to_string(kDriverAbiVersion / 1000) + "." + std::to_string(kDriverAbiVersion % 1000 / 10) +
                       " ABI");
  fn = reinterpret_cast<Fn>(p);
}

DriverApi load() {
  DriverApi api{};
  resolve("cuGetErrorName", api.cuGetErrorName);
  resolve("cuGetErrorString", api.cuGetErrorString);
  resolve("cuDeviceGet", api.cuDeviceGet);
  resolve("cuDeviceGetAttribute", api.cuDeviceGetAttribute);
  resolve("cuMemGetAllocationGranularity", api.cuMemGetAllocationGranularity);
  resolve("cuMemCreate", api.cuMemCreate);
  resolve("cuMemRelease", api.cuMemRelease);
  resolve("cuMemAddressReserve", api.cuMemAddressReserve);
  resolve("cuMemAddressFree", api.cuMemAddressFree);
  resolve("cuMemMap", api.cuMemMap);
  resolve("cuMemUnmap", api.cuMemUnmap);
  resolve("cuMemSetAccess", api.cuMemSetAccess);
  resolve("cuMemExportToShareableHandle", api.cuMemExportToShareableHandle);
  resolve("cuMemImportFromShareableHandle", api.cuMemImportFromShareableHandle);
  return api;
}

}  // namespace

const DriverApi& driver_api() {
  static const DriverApi api = load();
  return api;
}

namespace detail {

void throw_driver_error(CUresult code, const char* expr, const char* file, int line) {
  const char* name = "CUDA_ERROR_UNKNOWN";
  const char* text = "unknown error";
  // Only reached after driver_api() resolved, which is how `expr` got called.
  const DriverApi& api = driver_api();
  if (api.cuGetErrorName(code, &name) != CUDA_SUCCESS) name = "unrecognized CUresult";
  if (api.cuGetErrorString(code, &text) != CUDA_SUCCESS) text = "no description";
  throw DriverError(code, std::string("CUDA driver error ") + name + " " + std::to_string(static_cast<int>(code)) +
                              " (" + text + ") in " + expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace detail
}  // namespace turnout
