// The few CUDA driver functions turnout calls (virtual memory management),
// looked up at run time through the runtime API instead of linking libcuda:
// the Python extension must import on a host with no GPU driver (CI).
#pragma once

#include <cuda.h>
#include <cudaTypedefs.h>

#include "turnout/error.hpp"

namespace turnout {

// Members are named after the driver functions, so call sites read like the
// CUDA documentation.
struct DriverApi {
  PFN_cuGetErrorName_v6000 cuGetErrorName;
  PFN_cuGetErrorString_v6000 cuGetErrorString;
  PFN_cuDeviceGet_v2000 cuDeviceGet;
  PFN_cuDeviceGetAttribute_v2000 cuDeviceGetAttribute;
  PFN_cuMemGetAllocationGranularity_v10020 cuMemGetAllocationGranularity;
  PFN_cuMemCreate_v10020 cuMemCreate;
  PFN_cuMemRelease_v10020 cuMemRelease;
  PFN_cuMemAddressReserve_v10020 cuMemAddressReserve;
  PFN_cuMemAddressFree_v10020 cuMemAddressFree;
  PFN_cuMemMap_v10020 cuMemMap;
  PFN_cuMemUnmap_v10020 cuMemUnmap;
  PFN_cuMemSetAccess_v10020 cuMemSetAccess;
  PFN_cuMemExportToShareableHandle_v10020 cuMemExportToShareableHandle;
  PFN_cuMemImportFromShareableHandle_v10020 cuMemImportFromShareableHandle;
};

// Resolved on the first call, once per process (thread-safe). Throws
// NotSupported when the driver lacks a function, CudaError when the lookup
// itself fails (no driver, no device); a later call tries again.
const DriverApi& driver_api();

// A driver call failed.
class DriverError : public Error {
 public:
  DriverError(CUresult code, const std::string& what) : Error(what), code_(code) {}
  CUresult code() const { return code_; }

 private:
  CUresult code_;
};

namespace detail {
[[noreturn]] void throw_driver_error(CUresult code, const char* expr, const char* file, int line);
}  // namespace detail

}  // namespace turnout

#define TURNOUT_CU_CHECK(expr)                                                              \
  do {                                                                                      \
    CUresult turnout_cu_status_ = (expr);                                                   \
    if (turnout_cu_status_ != CUDA_SUCCESS)                                                 \
      ::turnout::detail::throw_driver_error(turnout_cu_status_, #expr, __FILE__, __LINE__); \
  } while (0)
