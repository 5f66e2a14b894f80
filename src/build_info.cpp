// What this build holds.
#include <string>

#include "turnout/buffer.hpp"

namespace turnout {

bool is_sm90_compiled() {
  const std::string archs = TURNOUT_CUDA_ARCHS;
  size_t pos = 0;
  while (pos <= archs.size()) {
    const size_t end = archs.find(',', pos);
    const std::string arch = archs.substr(pos, end == std::string::npos ? std::string::npos : end - pos);
    if (arch.rfind("90", 0) == 0) return true;
    if (end == std::string::npos) break;
    pos = end + 1;
  }
  return false;
}

}  // namespace turnout
