#include "ops/peer_copy.hpp"

#include <cstdint>
#include <string>

#include "kernels/launch.hpp"
#include "ops/require.hpp"
#include "runtime/align.hpp"

namespace turnout::peer_copy {
namespace {

using ops::require;
using ops::str;

void check(const char* op, const void* local, size_t bytes, size_t offset, int nvl_ranks, size_t capacity,
           int num_sms) {
  require(is_aligned(local, 16) && bytes % 16 == 0 && offset % 16 == 0, op,
          "pointer, bytes and offset must be multiples of 16");
  require(num_sms >= 1 && num_sms <= 1024, op, [&] { return "num_sms must be in [1, 1024], got " + str(num_sms); });
  const size_t needed = offset + bytes * nvl_ranks;
  require(needed <= capacity, op,
          [&] { return std::to_string(needed) + " bytes needed, the NVL buffer holds " + std::to_string(capacity); });
}

}  // namespace

void check_sm_copy(const char* op, int warps_per_block, int words_in_flight, bool sixteen_words) {
  require(warps_per_block >= 1 && warps_per_block <= 32, op,
          [&] { return "warps_per_block must be in [1, 32], got " + str(warps_per_block); });
  const bool valid = words_in_flight == 1 || words_in_flight == 2 || words_in_flight == 4 || words_in_flight == 8 ||
                     (sixteen_words && words_in_flight == 16);
  require(valid, op, [&] {
    return std::string("words_in_flight must be 1, 2, 4, 8") + (sixteen_words ? " or 16" : "") + ", got " +
           str(words_in_flight);
  });
  require(words_in_flight < 16 || warps_per_block <= 16, op,
          [&] { return "warps_per_block must be at most 16 with 16 words_in_flight, got " + str(warps_per_block); });
}

void store_to_peers(BufferCore& core, const void* src, size_t bytes, size_t dst_offset, bool include_self, int num_sms,
                    int warps_per_block, int words_in_flight, bool bulk, cudaStream_t stream) {
  const char* op = "store_to_peers";
  core.require_alive(op);
  const Topology& t = core.topology();
  check(op, src, bytes, dst_offset, t.num_nvl_ranks, core.options().num_nvl_bytes, num_sms);
  check_sm_copy(op, warps_per_block, words_in_flight, false);
  if (bulk)
    kernels::launch_store_to_peers_bulk(core.peer_nvl_table(), t.nvl_rank(), t.num_nvl_ranks, src, bytes, dst_offset,
                                        include_self, num_sms, stream);
  else
    kernels::launch_store_to_peers(core.peer_nvl_table(), t.nvl_rank(), t.num_nvl_ranks, src, bytes, dst_offset,
                                   include_self, num_sms, warps_per_block * 32, words_in_flight, stream);
}

void load_from_peers(BufferCore& core, void* dst, size_t bytes, size_t src_offset, bool include_self, int num_sms,
                     int warps_per_block, int words_in_flight, cudaStream_t stream) {
  const char* op = "load_from_peers";
  core.require_alive(op);
  check(op, dst, bytes, src_offset, 1, core.options().num_nvl_bytes, num_sms);
  check_sm_copy(op, warps_per_block, words_in_flight, true);
  const Topology& t = core.topology();
  kernels::launch_load_from_peers(core.peer_nvl_table(), t.nvl_rank(), t.num_nvl_ranks, dst, bytes, src_offset,
                                  include_self, num_sms, warps_per_block * 32, words_in_flight, stream);
}

}  // namespace turnout::peer_copy
