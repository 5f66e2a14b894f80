// libturnout_nvshmem.so, loaded on first need: the core never links NVSHMEM,
// so a process whose ranks all share one host never loads it.
#pragma once

#include <string>

#include "runtime/nvshmem_api.h"

namespace turnout {

using NvshmemApi = turnout_nvshmem_api_v1_t;

// Where the library is looked for: $TURNOUT_NVSHMEM_LIB if set and not empty,
// else libturnout_nvshmem.so in the folder of the object that holds the core
// (the Python module, or the program it is linked into).
std::string nvshmem_library_path();

// The library's table, loaded once per process (thread-safe; the library
// stays loaded until exit). Throws NotSupported, saying what is missing and
// how to get it, when the library cannot be loaded, lacks its symbol, or
// comes from another version of turnout; a later call tries again.
const NvshmemApi& nvshmem_api();

// Throws Error naming `what` and the library's reason when `status` is not 0.
void nvshmem_check(const NvshmemApi& api, int status, const char* what);

}  // namespace turnout
