#include "runtime/vmm.hpp"

#include <cstdint>
#include <utility>

#include "runtime/driver_api.hpp"

namespace turnout {
namespace {

CUmemAllocationProp allocation_prop(int device) {
  CUmemAllocationProp prop{};
  prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
  prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
  prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
  prop.location.id = device;
  return prop;
}

size_t granularity(const DriverApi& cu, const CUmemAllocationProp& prop) {
  size_t g = 0;
  TURNOUT_CU_CHECK(cu.cuMemGetAllocationGranularity(&g, &prop, CU_MEM_ALLOC_GRANULARITY_RECOMMENDED));
  return g;
}

}  // namespace

std::string vmm_unsupported_reason(int device) {
  const DriverApi& cu = driver_api();
  CUdevice dev = 0;
  TURNOUT_CU_CHECK(cu.cuDeviceGet(&dev, device));
  int vmm = 0, posix_fd = 0;
  TURNOUT_CU_CHECK(cu.cuDeviceGetAttribute(&vmm, CU_DEVICE_ATTRIBUTE_VIRTUAL_MEMORY_MANAGEMENT_SUPPORTED, dev));
  TURNOUT_CU_CHECK(
      cu.cuDeviceGetAttribute(&posix_fd, CU_DEVICE_ATTRIBUTE_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR_SUPPORTED, dev));
  if (!vmm) return "device " + std::to_string(device) + " does not support virtual memory management";
  if (!posix_fd) return "device " + std::to_string(device) + " cannot export memory as a POSIX file descriptor";
  return "";
}

VmmMemory::VmmMemory(VmmMemory&& o) noexcept
    : ptr_(std::exchange(o.ptr_, 0)),
      size_(std::exchange(o.size_, 0)),
      handle_(std::exchange(o.handle_, 0)),
      owns_handle_(std::exchange(o.owns_handle_, false)),
      mapped_(std::exchange(o.mapped_, false)) {}

VmmMemory& VmmMemory::operator=(VmmMemory&& o) noexcept {
  if (this != &o) {
    reset();
    ptr_ = std::exchange(o.ptr_, 0);
    size_ = std::exchange(o.size_, 0);
    handle_ = std::exchange(o.handle_, 0);
    owns_handle_ = std::exchange(o.owns_handle_, false);
    mapped_ = std::exchange(o.mapped_, false);
  }
  return *this;
}

// Both builders fill `m` one step at a time, so that a failing step leaves
// reset() exactly the steps before it to undo.
VmmMemory VmmMemory::create(int device, size_t bytes) {
  const DriverApi& cu = driver_api();
  const CUmemAllocationProp prop = allocation_prop(device);
  const size_t g = granularity(cu, prop);
  VmmMemory m;
  m.size_ = (bytes + g - 1) / g * g;
  TURNOUT_CU_CHECK(cu.cuMemCreate(&m.handle_, m.size_, &prop, 0));
  m.owns_handle_ = true;
  m.map(g, prop.location);
  return m;
}

VmmMemory VmmMemory::import(int fd, size_t bytes, int device) {
  const DriverApi& cu = driver_api();
  const CUmemAllocationProp prop = allocation_prop(device);
  VmmMemory m;
  m.size_ = bytes;
  // A POSIX file descriptor travels as the pointer's value.
  TURNOUT_CU_CHECK(cu.cuMemImportFromShareableHandle(&m.handle_, reinterpret_cast<void*>(static_cast<intptr_t>(fd)),
                                                     CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR));
  m.owns_handle_ = true;
  m.map(granularity(cu, prop), prop.location);
  // The mapping holds the memory from here on; our handle would only keep it
  // alive past our unmap.
  m.owns_handle_ = false;
  TURNOUT_CU_CHECK(cu.cuMemRelease(m.handle_));
  m.handle_ = 0;
  return m;
}

void VmmMemory::map(size_t alignment, const CUmemLocation& location) {
  const DriverApi& cu = driver_api();
  TURNOUT_CU_CHECK(cu.cuMemAddressReserve(&ptr_, size_, alignment, 0, 0));
  TURNOUT_CU_CHECK(cu.cuMemMap(ptr_, size_, 0, handle_, 0));
  mapped_ = true;
  CUmemAccessDesc access{};
  access.location = location;
  access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
  TURNOUT_CU_CHECK(cu.cuMemSetAccess(ptr_, size_, &access, 1));
}

UniqueFd VmmMemory::export_fd() const {
  if (!owns_handle_) throw Error("VmmMemory::export_fd: only memory created in this process can be exported");
  int fd = -1;
  TURNOUT_CU_CHECK(
      driver_api().cuMemExportToShareableHandle(&fd, handle_, CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR, 0));
  return UniqueFd(fd);
}

void VmmMemory::reset() noexcept {
  if (!ptr_ && !owns_handle_) return;
  const DriverApi& cu = driver_api();  // resolved when this memory was made
  if (mapped_) cu.cuMemUnmap(ptr_, size_);
  if (owns_handle_) cu.cuMemRelease(handle_);
  if (ptr_) cu.cuMemAddressFree(ptr_, size_);
  ptr_ = 0;
  size_ = 0;
  handle_ = 0;
  owns_handle_ = false;
  mapped_ = false;
}

}  // namespace turnout
