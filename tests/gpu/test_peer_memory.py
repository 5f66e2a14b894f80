"""Peer-mapped NVL memory: SM stores (from 16 warps a block, and from 3; one,
two, four and eight words a lane in flight) and bulk copies into every peer, and SM
loads from every peer (likewise, this rank's own buffer read or left out), land
where they should, for every pair of ranks; a warp count or words in flight out
of range is refused."""
import torch

from harness import assert_equal, assert_raises, generator

# Not a power of two, so the copy loops' last partial round is exercised.
BYTES_PER_RANK = (1 << 20) + 16 * 37
NUM_SMS = 8


def rank_bytes(rank: int, n: int) -> torch.Tensor:
    """What rank `rank` stores in a group of n; every rank can rebuild it."""
    return torch.randint(0, 256, (BYTES_PER_RANK,), generator=generator("peer", n, rank), dtype=torch.uint8)


def test_store_to_and_load_from_every_peer(ctx):
    B = BYTES_PER_RANK
    for n, g in ctx.each_group():
        srcs = [rank_bytes(p, n) for p in range(n)]
        with ctx.buffer(g, num_nvl_bytes=n * B) as buf:
            stream = torch.cuda.current_stream().cuda_stream
            src = srcs[ctx.rank].to(ctx.device)
            local = buf.get_local_buffer_tensor(torch.uint8)[:n * B].view(n, B)
            for bulk, warps, words in ((False, 16, 1), (False, 3, 1), (False, 16, 2), (False, 3, 4), (False, 16, 8),
                                       (False, 3, 8), (True, 16, 1)):
                local.fill_(0xA5)  # what the other way stored must not pass for this one's
                buf._barrier()
                # Each rank writes its bytes into slot `rank` of every buffer, its own included.
                buf._native.store_to_peers(src.data_ptr(), B, 0, True, NUM_SMS, stream, bulk, warps, words)
                buf._barrier()
                how = "bulk copies" if bulk else f"SM stores, {warps} warps a block, {words} words a lane"
                for p in range(n):
                    assert_equal(local[p], srcs[p],
                                 f"n={n}, {how}: slot {p} of rank {ctx.rank}'s buffer (stored by rank {p})")

            # Refused before any store: the buffer is still as the last round left it.
            for warps in (0, 33):
                assert_raises(ValueError, lambda: buf._native.store_to_peers(src.data_ptr(), B, 0, True, NUM_SMS,
                                                                             stream, False, warps),
                              "warps_per_block", str(warps))
            for words in (0, 3, 16):
                assert_raises(ValueError, lambda: buf._native.store_to_peers(src.data_ptr(), B, 0, True, NUM_SMS,
                                                                             stream, False, 16, words),
                              "words_in_flight", str(words))

            # Slot p read from every peer q must hold rank p's bytes, whatever the warps and loads in flight; a
            # read that leaves this rank's own buffer out leaves its slot of dst as it was.
            dst = torch.empty(n * B, dtype=torch.uint8, device=ctx.device)
            for p in range(n):
                for include_self, warps, words in ((True, 16, 1), (True, 3, 2), (False, 16, 4), (False, 3, 8),
                                                   (True, 16, 16), (False, 5, 16)):
                    dst.fill_(0xA5)  # a stale read from the previous round would not pass
                    buf._native.load_from_peers(dst.data_ptr(), B, p * B, NUM_SMS, stream, include_self, warps, words)
                    torch.cuda.synchronize()
                    how = f"{warps} warps a block, {words} words a lane, own buffer {'read' if include_self else 'not'}"
                    for q, got in enumerate(dst.view(n, B)):
                        if q == ctx.rank and not include_self:
                            assert_equal(got, torch.full_like(got, 0xA5), f"n={n}, {how}: rank {ctx.rank}'s own slot")
                        else:
                            assert_equal(got, srcs[p],
                                         f"n={n}, {how}: rank {ctx.rank} read slot {p} of rank {q}'s buffer")
            # Sixteen words a lane only with at most 16 warps a block.
            for warps, words, bad, value in ((0, 1, "warps_per_block", 0), (33, 1, "warps_per_block", 33),
                                             (16, 3, "words_in_flight", 3), (16, 32, "words_in_flight", 32),
                                             (17, 16, "warps_per_block", 17)):
                load = buf._native.load_from_peers
                assert_raises(ValueError, lambda: load(dst.data_ptr(), B, 0, NUM_SMS, stream, True, warps, words),
                              bad, str(value))
