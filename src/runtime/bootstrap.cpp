#include "turnout/bootstrap.hpp"

#include <string>
#include <utility>

#include "turnout/error.hpp"

namespace turnout {

void Bootstrap::barrier() {
  // Nobody can return from an all-gather before every rank has entered it.
  const std::byte token{0};
  all_gather(std::span<const std::byte>(&token, 1));
}

FunctionBootstrap::FunctionBootstrap(int rank, int size, AllGather all_gather)
    : rank_(rank), size_(size), all_gather_(std::move(all_gather)) {
  if (size < 1) throw InvalidArgument("FunctionBootstrap: size must be >= 1, got " + std::to_string(size));
  if (rank < 0 || rank >= size)
    throw InvalidArgument("FunctionBootstrap: rank must be in [0, size) = [0, " + std::to_string(size) + "), got " +
                          std::to_string(rank));
  if (!all_gather_) throw InvalidArgument("FunctionBootstrap: all_gather function is empty");
}

std::vector<std::byte> FunctionBootstrap::all_gather(std::span<const std::byte> mine) {
  std::vector<std::byte> all = all_gather_(mine);
  // A wrong length here would otherwise surface much later as a misread
  // handle, far from the launcher that produced it.
  const size_t expected = static_cast<size_t>(size_) * mine.size();
  if (all.size() != expected)
    throw Error("FunctionBootstrap rank " + std::to_string(rank_) + ": all_gather function returned " +
                std::to_string(all.size()) + " bytes, expected " + std::to_string(expected) + " (size " +
                std::to_string(size_) + " x " + std::to_string(mine.size()) + " bytes per rank)");
  return all;
}

}  // namespace turnout
