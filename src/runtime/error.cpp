#include "turnout/error.hpp"

#include <string>

namespace turnout::detail {

void throw_cuda_error(cudaError_t code, const char* expr, const char* file, int line) {
  throw CudaError(code, std::string("CUDA error ") + cudaGetErrorName(code) + " (" + cudaGetErrorString(code) +
                            ") in " + expr + " at " + file + ":" + std::to_string(line));
}

}  // namespace turnout::detail
