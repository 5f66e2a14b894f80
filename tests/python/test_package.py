"""The package surface a DeepEP user relies on, and the argument checks that
need no GPU."""
import pytest
import torch

import turnout
from turnout import Buffer, Config, EventOverlap, topk_idx_t
from turnout.checks import check_int, check_tensor, is_plain, is_plain_nd

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_public_names():
    assert {"Buffer", "Config", "DispatchHandle", "EventOverlap", "LowLatencyHandle",
            "topk_idx_t"} <= set(turnout.__all__)
    assert topk_idx_t is torch.int64
    assert Config is turnout._C.Config


def test_num_sms_default_and_set():
    assert Buffer.num_sms == 20
    Buffer.set_num_sms(24)
    assert Buffer.num_sms == 24
    Buffer.set_num_sms(20)
    assert Buffer.num_sms == 20


@pytest.mark.parametrize("bad", [23, 0, -2])
def test_set_num_sms_rejects_odd_or_too_small(bad):
    with pytest.raises(ValueError, match="new_num_sms"):
        Buffer.set_num_sms(bad)
    assert Buffer.num_sms == 20


def test_set_num_sms_rejects_non_int():
    with pytest.raises(TypeError, match="new_num_sms"):
        Buffer.set_num_sms(24.0)


def test_buffer_needs_a_group_or_comm():
    with pytest.raises(ValueError):
        Buffer(None)
    with pytest.raises(ValueError, match="group"):
        Buffer(None, comm=None)


def test_unsupported_modes_raise_before_any_gpu_use():
    # object() is no process group: these must fail on the arguments alone.
    with pytest.raises(NotImplementedError, match="use_fabric"):
        Buffer(object(), use_fabric=True)


def test_bad_sizes_raise_naming_the_argument():
    with pytest.raises(ValueError, match="num_nvl_bytes"):
        Buffer(object(), num_nvl_bytes=-5)
    with pytest.raises(TypeError, match="num_nvl_bytes"):
        Buffer(object(), num_nvl_bytes=1.5)
    with pytest.raises(ValueError, match="num_rdma_bytes"):
        Buffer(object(), num_rdma_bytes=-1)
    with pytest.raises(ValueError, match="timeout_s"):
        Buffer(object(), timeout_s=0)
    with pytest.raises(ValueError, match="shrink_timeout_s"):
        Buffer(object(), enable_shrink=True, shrink_timeout_s=-1.0)
    with pytest.raises(ValueError, match="num_rdma_bytes must be > 0 with low_latency_mode=True"):
        Buffer(object(), low_latency_mode=True)


def test_bad_internode_options_raise_naming_the_argument():
    with pytest.raises(ValueError, match="num_qps_per_rank"):
        Buffer(object(), num_qps_per_rank=0)
    with pytest.raises(TypeError, match="num_qps_per_rank"):
        Buffer(object(), num_qps_per_rank=2.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without a GPU")
def test_buffer_without_gpu_says_so():
    with pytest.raises(RuntimeError, match="CUDA"):
        Buffer(object(), num_nvl_bytes=1 << 20)


def test_is_sm90_compiled():
    assert Buffer.is_sm90_compiled() is True


def test_event_overlap_without_event():
    ev = EventOverlap()
    assert ev.event is None and ev.extra_tensors is None
    with ev as entered:
        assert entered is ev
    with pytest.raises(RuntimeError, match="no event"):
        ev.current_stream_wait()


@needs_gpu
def test_capture_records_an_event_on_the_current_stream():
    ev = Buffer.capture()
    assert isinstance(ev, EventOverlap) and isinstance(ev.event, torch.cuda.Event)
    ev.current_stream_wait()
    ev.event.synchronize()
    assert ev.event.query()


@needs_gpu
def test_comm_stream_is_its_own_cuda_stream(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/store", rank=0, world_size=1)
    try:
        buf = Buffer(dist.group.WORLD, num_nvl_bytes=1 << 20, explicitly_destroy=True)
        try:
            stream = buf.get_comm_stream()
            assert isinstance(stream, torch.cuda.Stream)
            assert stream != torch.cuda.current_stream()
        finally:
            buf.destroy()
    finally:
        dist.destroy_process_group()


class TestChecks:
    def test_dtype(self):
        with pytest.raises(TypeError, match=r"my_op: x must be of dtype torch\.int64, got torch\.int32"):
            check_tensor("my_op", "x", torch.zeros(2, 2, dtype=torch.int32), dtype=torch.int64)

    def test_not_a_tensor(self):
        with pytest.raises(TypeError, match="my_op: x must be a torch.Tensor, got list"):
            check_tensor("my_op", "x", [1, 2])

    def test_ndim_and_shape(self):
        t = torch.zeros(2, 3)
        with pytest.raises(ValueError, match=r"my_op: x must be 3-D, got shape \(2, 3\)"):
            check_tensor("my_op", "x", t, ndim=3)
        with pytest.raises(ValueError, match=r"my_op: x must be of shape \(2, 4\), got shape \(2, 3\)"):
            check_tensor("my_op", "x", t, shape=(2, 4))
        with pytest.raises(ValueError, match=r"my_op: x must be of shape .*3, 1\), got shape \(2, 3\)"):
            check_tensor("my_op", "x", t, shape=(None, 3, 1))
        assert check_tensor("my_op", "x", t, shape=(None, 3)) is t

    def test_device(self):
        # Compares devices only: no GPU needed.
        with pytest.raises(ValueError, match="my_op: x must be on cuda:0, got cpu"):
            check_tensor("my_op", "x", torch.zeros(2), device=torch.device("cuda", 0))

    def test_contiguity(self):
        t = torch.zeros(4, 3).t()
        with pytest.raises(ValueError, match="my_op: x must be contiguous, got strides"):
            check_tensor("my_op", "x", t)
        assert check_tensor("my_op", "x", t, contiguous=False) is t

    def test_int(self):
        assert check_int("my_op", "n", 5, 0, 10) == 5
        with pytest.raises(TypeError, match="my_op: n must be an int, got bool"):
            check_int("my_op", "n", True)
        with pytest.raises(TypeError, match="my_op: n must be an int, got float"):
            check_int("my_op", "n", 1.0)
        with pytest.raises(ValueError, match="my_op: n must be >= 0, got -1"):
            check_int("my_op", "n", -1, 0)
        with pytest.raises(ValueError, match="my_op: n must be <= 10, got 11"):
            check_int("my_op", "n", 11, 0, 10)


def test_rows_must_start_16_byte_aligned():
    from turnout.checks import check_aligned

    flat = torch.zeros(64 + 8, dtype=torch.bfloat16)
    check_aligned("dispatch", "x", flat[8:].view(8, 8))  # 16 bytes in: aligned when flat is
    with pytest.raises(ValueError, match=r"dispatch: x must be starting at a 16-byte aligned address"):
        check_aligned("dispatch", "x", flat[1:65].view(8, 8))


def test_buffer_can_live_in_a_weak_value_dictionary():
    """vLLM keeps its buffers in a weakref.WeakValueDictionary."""
    assert Buffer.__weakrefoffset__ != 0, "Buffer instances must accept weak references"


@needs_gpu
def test_event_handle_marks_the_current_stream():
    """EventOverlap(EventHandle()), as Megatron-LM builds it: the event follows
    the work issued so far on the current stream."""
    from turnout.utils import EventHandle, EventOverlap

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        torch.cuda._sleep(200_000_000)
        handle = EventHandle()
    assert isinstance(handle, torch.cuda.Event)
    assert not handle.query(), "the handle must follow the sleep issued before it"
    with EventOverlap(handle):
        pass  # leaving the block makes the current stream wait
    torch.cuda.current_stream().synchronize()
    assert handle.query(), "the current stream waited, so the handle's work is done"


def test_is_plain_holds_exactly_where_check_tensor_passes():
    """The hot paths' one-expression test: true only for a contiguous plain
    tensor of the dtype and shape on the device (a CPU tensor is device -1)."""
    t = torch.zeros(3, 4, dtype=torch.float32)
    assert is_plain(t, torch.float32, (3, 4), -1)
    check_tensor("op", "t", t, dtype=torch.float32, shape=(3, 4), device=torch.device("cpu"))
    assert not is_plain(t, torch.bfloat16, (3, 4), -1)
    assert not is_plain(t, torch.float32, (4, 3), -1)
    assert not is_plain(t, torch.float32, (3, 4, 1), -1)
    assert not is_plain(t, torch.float32, (3, 4), 0), "a CPU tensor is not on GPU 0"
    assert not is_plain(t.t(), torch.float32, (4, 3), -1), "a transposed view is not contiguous"
    assert not is_plain(torch.nn.Parameter(t), torch.float32, (3, 4), -1), "a subclass goes to the full check"
    assert not is_plain([[0.0] * 4] * 3, torch.float32, (3, 4), -1)


def test_is_plain_nd_holds_exactly_where_check_tensor_passes_with_ndim():
    t = torch.zeros(3, 4, dtype=torch.float32)
    assert is_plain_nd(t, torch.float32, 2, -1)
    check_tensor("op", "t", t, dtype=torch.float32, ndim=2, device=torch.device("cpu"))
    assert not is_plain_nd(t, torch.bfloat16, 2, -1)
    assert not is_plain_nd(t, torch.float32, 1, -1)
    assert not is_plain_nd(t, torch.float32, 2, 0), "a CPU tensor is not on GPU 0"
    assert not is_plain_nd(t.t(), torch.float32, 2, -1), "a transposed view is not contiguous"
    assert not is_plain_nd(torch.nn.Parameter(t), torch.float32, 2, -1), "a subclass goes to the full check"
    assert not is_plain_nd(None, torch.float32, 2, -1)
