"""Bad input raises an exception that names the argument, and the buffer stays
usable: the next correct call gives the reference's answer."""
import gc
import re

import torch

import routing
import turnout
from harness import assert_layout_matches, assert_raises, generator

NVL_BYTES = 1 << 20


def assert_layout_correct(buf, topk_idx, n: int, num_experts: int, what: str) -> None:
    out = buf.get_dispatch_layout(topk_idx, num_experts)
    assert out[1] is None, f"{what}: num_tokens_per_rdma_rank must be None in one NVL domain"
    assert_layout_matches(out, topk_idx, n, num_experts, what)


def numbers_in(message: str):
    return {int(s) for s in re.findall(r"-?\d+", message)}


def test_bad_layout_arguments_raise_and_buffer_stays_usable(ctx):
    num_tokens, num_topk = 128, 4
    for n, g in ctx.each_group():
        num_experts = 8 * n
        good = routing.uniform(num_tokens, num_experts, num_topk, generator("bad", n, ctx.rank), ctx.device)
        wide = routing.uniform(num_tokens, num_experts, 2 * num_topk, generator("wide", n, ctx.rank), ctx.device)
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            layout = buf.get_dispatch_layout
            cases = [
                ("int32 ids", TypeError, lambda: layout(good.int(), num_experts), ("topk_idx", "int64")),
                ("1-D", ValueError, lambda: layout(good.flatten(), num_experts), ("topk_idx", "2-D")),
                ("3-D", ValueError, lambda: layout(good.unsqueeze(0), num_experts), ("topk_idx", "2-D")),
                ("on the CPU", ValueError, lambda: layout(good.cpu(), num_experts), ("topk_idx", "cuda")),
                ("column-major", ValueError, lambda: layout(good.t().contiguous().t(), num_experts),
                 ("topk_idx", "contiguous")),
                ("every other column", ValueError, lambda: layout(wide[:, ::2], num_experts),
                 ("topk_idx", "contiguous")),
                ("E not a multiple of n", ValueError, lambda: layout(good, num_experts + 1), ("num_experts",)),
                ("E = 0", ValueError, lambda: layout(good, 0), ("num_experts",)),
                ("E a float", TypeError, lambda: layout(good, float(num_experts)), ("num_experts",)),
                ("previous_event of the wrong type", TypeError,
                 lambda: layout(good, num_experts, previous_event=torch.cuda.Event()), ("previous_event",)),
                ("allocate_on_comm_stream alone", ValueError,
                 lambda: layout(good, num_experts, allocate_on_comm_stream=True), ("allocate_on_comm_stream",)),
            ]
            for what, kind, call, words in cases:
                assert_raises(kind, call, *words)
                assert_layout_correct(buf, good, n, num_experts, f"n={n}: the call after {what}")
                assert torch.cuda.current_stream() != buf.get_comm_stream(), f"after {what}: stream not restored"

            # Ids out of [-1, E) are found by the kernel: E and -2 in one row. The
            # call does not wait for it, so check_errors (or the next call) raises,
            # naming the call.
            bad = good.clone()
            bad[3, 0], bad[3, 1] = num_experts, -2
            layout(bad, num_experts)
            torch.cuda.synchronize()
            e = assert_raises(ValueError, buf.check_errors, "topk_idx", "get_dispatch_layout (call")
            assert numbers_in(str(e)) & {num_experts, -2}, f"the message must name the bad id: {e}"
            assert_layout_correct(buf, good, n, num_experts, f"n={n}: the call after bad ids")
            buf.check_errors()  # nothing left

            # Reported by the next call, then the buffer works again.
            out = layout(bad, num_experts, async_finish=True)
            out[4].current_stream_wait()
            torch.cuda.synchronize()
            assert_raises(ValueError, lambda: layout(good, num_experts), "topk_idx")
            assert_layout_correct(buf, good, n, num_experts, f"n={n}: the call after async bad ids")


def test_tensor_on_another_gpu_raises(ctx):
    if ctx.num_devices < 2:
        ctx.skip(f"needs a second GPU for the tensor; {ctx.num_devices} visible")
    other = torch.device("cuda", (ctx.device.index + 1) % ctx.num_devices)
    for n, g in ctx.each_group():
        num_experts = 8 * n
        good = routing.uniform(128, num_experts, 4, generator("other gpu", n, ctx.rank), ctx.device)
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            assert_raises(ValueError, lambda: buf.get_dispatch_layout(good.to(other), num_experts), "topk_idx",
                          str(other))
            assert_layout_correct(buf, good, n, num_experts, f"n={n}: the call after a tensor on {other}")


def test_bad_constructor_arguments_raise(ctx):
    for _, g in ctx.each_group():
        # All of these fail before any collective, so no rank waits for another.
        assert_raises(ValueError, lambda: turnout.Buffer(None, comm=None), "group")
        assert_raises(ValueError, lambda: turnout.Buffer(g, low_latency_mode=True), "num_rdma_bytes",
                      "low_latency_mode")
        assert_raises(NotImplementedError, lambda: turnout.Buffer(g, use_fabric=True), "use_fabric")
        assert_raises(ValueError, lambda: turnout.Buffer(g, num_nvl_bytes=-1), "num_nvl_bytes")
        assert_raises(ValueError, lambda: turnout.Buffer(g, num_nvl_bytes=NVL_BYTES, timeout_s=-1), "timeout_s")


def test_mismatched_num_nvl_bytes_raises_on_every_rank(ctx):
    for _, g in ctx.each_group():
        assert_raises(ValueError, lambda: turnout.Buffer(g, num_nvl_bytes=NVL_BYTES + 16 * ctx.rank,
                                                         explicitly_destroy=True), "num_nvl_bytes")
        # Nothing was left half-built: a matching buffer works.
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            buf._barrier()


def test_destroy_rules(ctx):
    for n, g in ctx.each_group():
        buf = turnout.Buffer(g, num_nvl_bytes=NVL_BYTES)
        assert_raises(RuntimeError, buf.destroy, "explicitly_destroy")
        buf._barrier()  # still alive after the refused destroy
        del buf
        gc.collect()

        buf = turnout.Buffer(g, num_nvl_bytes=NVL_BYTES, explicitly_destroy=True)
        topk_idx = routing.uniform(16, 8 * n, 2, generator("destroy", n, ctx.rank), ctx.device)
        buf.destroy()
        assert_raises(RuntimeError, lambda: buf.get_dispatch_layout(topk_idx, 8 * n), "destroyed")
        assert_raises(RuntimeError, buf._barrier, "destroyed")
        assert_raises(RuntimeError, lambda: buf.get_local_buffer_tensor(torch.uint8), "destroyed")


def test_get_local_buffer_tensor_rejects_bad_views(ctx):
    for _, g in ctx.each_group():
        with ctx.buffer(g, num_nvl_bytes=NVL_BYTES) as buf:
            view = buf.get_local_buffer_tensor
            assert_raises(ValueError, lambda: view(torch.uint8, offset=NVL_BYTES + 16), "offset")
            assert_raises(ValueError, lambda: view(torch.float32, offset=2), "offset")
            assert_raises(ValueError, lambda: view(torch.float32, size=(NVL_BYTES // 4 + 1,)), "size")
            assert_raises(ValueError, lambda: view(torch.float32, size=(2, 16), offset=NVL_BYTES - 64), "size")
            t = view(torch.float32, size=(4, 16), offset=64)
            assert (tuple(t.shape), t.dtype, t.device) == ((4, 16), torch.float32, ctx.device), f"view {t}"
            whole = view(torch.uint8)
            assert t.data_ptr() == whole.data_ptr() + 64, "offset is in bytes from the buffer's start"


def test_set_num_sms_rejects_odd_values(ctx):
    before = turnout.Buffer.num_sms
    assert_raises(ValueError, lambda: turnout.Buffer.set_num_sms(3), "new_num_sms")
    assert turnout.Buffer.num_sms == before, "a refused set_num_sms must not change num_sms"
