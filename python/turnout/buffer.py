"""Buffer: the communication buffer of one rank, with DeepEP V1's API."""
from typing import Optional, Tuple

import torch

from . import _C, bootstrap
from .checks import TOPK_IDX_DTYPE, check_aligned, check_config, check_int, check_tensor, check_x, fail
from .event import EventOverlap

# Kept under its old name: code outside the package imports it from here.
_check_aligned = check_aligned


# The caller's current stream as a raw handle. torch.cuda.current_stream()
# builds a Python object each call (microseconds); the raw getter is the same value.
_RAW_STREAM = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_raw_stream(device_index: int) -> int:
    if _RAW_STREAM is None:
        return torch.cuda.current_stream(device_index).cuda_stream
    return _RAW_STREAM(device_index)


class DispatchHandle(tuple):
    """What a dispatch returns for its cached dispatch and its combine: DeepEP's
    six entries, where they mean the same thing.

    - ``[0]`` rank_prefix_matrix, int32 ``[R, R]``: ``[i, j]`` = tokens ranks 0..i send rank j.
    - ``[1]`` source_num_tokens, int32 ``[R]``: tokens each rank dispatched, -1 after a dispatch
      that failed (DeepEP: channel_prefix_matrix).
    - ``[2]`` None (DeepEP: recv_channel_prefix_matrix).
    - ``[3]`` recv_src_idx, int32 ``[N]``: the source token of each received row, -1 on padding.
    - ``[4]`` is_token_in_rank, bool ``[T, R]``: the dispatch's input.
    - ``[5]`` None (DeepEP: send_head).

    A plain tuple or list of these entries is accepted too.
    """


class Buffer:
    """The communication buffer of one rank of an expert-parallel group.

    Construction is collective: every rank of ``group`` (or ``comm``) creates its
    Buffer at the same time. ``timeout_s`` (ours) bounds every wait for a peer;
    default ``TURNOUT_TIMEOUT_S`` or 100 s. ``nvl_domain_size`` (ours) declares
    NVL domains smaller than a host.
    """

    #: SMs the normal kernels use by default (``set_num_sms`` changes it).
    num_sms: int = 20

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, timeout_s: Optional[float] = None,
                 nvl_domain_size: int = 0) -> None:
        op = "Buffer"
        self._native = None
        if group is None and comm is None:
            raise ValueError("Buffer: pass a torch.distributed process group (group) or an mpi4py communicator (comm)")
        check_int(op, "num_nvl_bytes", num_nvl_bytes, 0)
        check_int(op, "num_rdma_bytes", num_rdma_bytes, 0)
        check_int(op, "num_qps_per_rank", num_qps_per_rank, 1)
        check_int(op, "nvl_domain_size", nvl_domain_size, 0)
        if timeout_s is not None and not (isinstance(timeout_s, (int, float)) and 0 < timeout_s < float("inf")):
            fail(op, "timeout_s", "a positive number of seconds", timeout_s)
        if low_latency_mode:
            raise NotImplementedError("Buffer: low_latency_mode=True is not available in this version of turnout")
        if num_rdma_bytes > 0:
            raise NotImplementedError("Buffer: num_rdma_bytes > 0 (internode buffer) is not available in this "
                                      "version of turnout; pass num_rdma_bytes=0")
        if enable_shrink:
            raise NotImplementedError("Buffer: enable_shrink=True is not available in this version of turnout")
        if use_fabric:
            raise NotImplementedError("Buffer: use_fabric=True (fabric memory handles) is not available in this "
                                      "version of turnout")
        if not torch.cuda.is_available():
            raise RuntimeError("Buffer: no CUDA device is visible to this process")

        rank, size, all_gather = bootstrap.from_group(group) if group is not None else bootstrap.from_mpi(comm)
        device = torch.cuda.current_device()
        # From PyTorch's pool: never destroyed, so tensors that recorded it stay safe after destroy().
        self._comm_stream = torch.cuda.Stream(device=device, priority=-1)
        self._comm_raw = self._comm_stream.cuda_stream
        self._device_index = device
        self._native = _C.Buffer(rank=rank, size=size, all_gather=all_gather, device=device,
                                 num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                 low_latency_mode=low_latency_mode, timeout_s=float(timeout_s or 0.0),
                                 nvl_domain_size=nvl_domain_size, comm_stream=self._comm_stream.cuda_stream)
        self.rank = rank
        self.group_size = size
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._device = torch.device("cuda", device)
        # Marks the handles of this buffer's dispatches.
        self._handle_owner = object()

    # -- life cycle ---------------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Free the buffer now (collective). Only for ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy: this buffer was created with explicitly_destroy=False; its "
                               "resources are released when it is collected")
        self._native.destroy()

    def check_errors(self) -> None:
        """Raises the error a kernel of this buffer recorded since the last one
        raised (ours). The ops raise these by themselves at their next call;
        this asks at once, for work that no later call follows, such as a
        CUDA-graph replay: call it once the replay has finished (after a
        synchronize of its stream). The message names the call that failed."""
        self._require_alive("Buffer.check_errors")
        self._native.check_errors(op="Buffer.check_errors")

    def _require_alive(self, op: str) -> None:
        if self._native is None or self._native.destroyed:
            raise RuntimeError(f"{op}: the buffer was destroyed")

    # -- static helpers -----------------------------------------------------------------------------------------

    @staticmethod
    def set_num_sms(new_num_sms: int) -> None:
        check_int("Buffer.set_num_sms", "new_num_sms", new_num_sms, 2)
        if new_num_sms % 2 != 0:
            fail("Buffer.set_num_sms", "new_num_sms", "even", new_num_sms)
        Buffer.num_sms = new_num_sms

    @staticmethod
    def capture() -> EventOverlap:
        """An EventOverlap holding an event recorded on the current stream."""
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream())
        return EventOverlap(event)

    @staticmethod
    def is_sm90_compiled() -> bool:
        return _C.is_sm90_compiled()

    @staticmethod
    def get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank: int, hidden: int, num_ranks: int,
                                       num_experts: int) -> int:
        return _C.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank=num_max_dispatch_tokens_per_rank,
                                                 hidden=hidden, num_ranks=num_ranks, num_experts=num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> "_C.Config":
        return _C.get_dispatch_config(num_ranks=num_ranks, num_sms=Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> "_C.Config":
        return _C.get_combine_config(num_ranks=num_ranks, num_sms=Buffer.num_sms)

    # -- instance helpers ---------------------------------------------------------------------------------------

    def get_comm_stream(self) -> torch.cuda.Stream:
        return self._comm_stream

    def get_local_buffer_tensor(self, dtype: torch.dtype, size: Optional[torch.Size] = None, offset: int = 0,
                                use_rdma_buffer: bool = False) -> torch.Tensor:
        """A view of this rank's raw NVL buffer as ``dtype`` (``size`` elements
        from byte ``offset``; all of it when ``size`` is None)."""
        op = "get_local_buffer_tensor"
        self._require_alive(op)
        if use_rdma_buffer:
            fail(op, "use_rdma_buffer", "False (this buffer has no RDMA part)", use_rdma_buffer)
        if not isinstance(dtype, torch.dtype):
            fail(op, "dtype", "a torch.dtype", type(dtype).__name__, TypeError)
        item = torch.empty((), dtype=dtype).element_size()
        check_int(op, "offset", offset, 0, self.num_nvl_bytes)
        if offset % item:
            fail(op, "offset", f"a multiple of {dtype}'s size {item}", offset)
        tensor = self._native.local_buffer()[offset:].view(dtype) if self.num_nvl_bytes - offset >= item else \
            torch.empty(0, dtype=dtype, device=self._device)
        if size is None:
            return tensor
        numel = 1
        for n in size:
            numel *= n
        if numel > tensor.numel():
            fail(op, "size", f"at most {tensor.numel()} elements of {dtype} from offset {offset}", tuple(size))
        return tensor[:numel].view(size)

    # -- stream handling shared by the ops ----------------------------------------------------------------------

    def _enter_op(self, op: str, previous_event: Optional[EventOverlap], async_finish: bool,
                  allocate_on_comm_stream: bool):
        """Ops run on the communication stream. Returns the caller's stream
        (raw handle, and the torch object when it is needed), the stream the
        op's first native call makes the communication stream wait for (None:
        previous_event did that here), and the stream its last native call
        makes wait for the op (None with async_finish: the event does)."""
        self._require_alive(op)
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            fail(op, "previous_event", "an EventOverlap or None", type(previous_event).__name__, TypeError)
        if allocate_on_comm_stream and not (previous_event is not None and async_finish):
            fail(op, "allocate_on_comm_stream", "used with previous_event and async_finish=True",
                 f"previous_event={previous_event}, async_finish={async_finish}")
        compute_raw = _current_raw_stream(self._device_index)
        wait_for = compute_raw
        if previous_event is not None and previous_event.event is not None:
            self._comm_stream.wait_event(previous_event.event)
            wait_for = None
        compute = None
        if allocate_on_comm_stream:
            compute = torch.cuda.current_stream()
            torch.cuda.set_stream(self._comm_stream)
        return compute_raw, compute, wait_for, None if async_finish else compute_raw

    def _abort_op(self, state, allocate_on_comm_stream: bool) -> None:
        """Leaves the streams as _enter_op found them when an op fails."""
        compute_raw, compute, _, _ = state
        if allocate_on_comm_stream:
            torch.cuda.set_stream(compute)
        self._native.join(waiter=compute_raw, waited=self._comm_raw)

    def _exit_op(self, state, async_finish: bool, allocate_on_comm_stream: bool,
                 tensors: Tuple[Optional[torch.Tensor], ...]) -> EventOverlap:
        """Without async_finish the op's last native call has joined the streams."""
        _, compute, _, _ = state
        if allocate_on_comm_stream:
            torch.cuda.set_stream(compute)
        if not async_finish:
            return EventOverlap()
        event = torch.cuda.Event()
        event.record(self._comm_stream)
        # Inputs and outputs live on both streams until the op is done.
        for t in tensors:
            if t is not None:
                t.record_stream(self._comm_stream)
                if allocate_on_comm_stream:
                    t.record_stream(compute)
        return EventOverlap(event, tensors)

    # -- ops ----------------------------------------------------------------------------------------------------

    def get_dispatch_layout(self, topk_idx: torch.Tensor, num_experts: int,
                            previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                            allocate_on_comm_stream: bool = False):
        """Returns ``(num_tokens_per_rank [R] int32, num_tokens_per_rdma_rank or None,
        num_tokens_per_expert [E] int32, is_token_in_rank [T, R] bool, event)``.

        It never waits for the GPU. Expert ids outside ``[-1, num_experts)`` are
        found by the kernel: the next dispatch then fails on every rank, and
        the ValueError names this call.
        """
        op = "get_dispatch_layout"
        check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, ndim=2, device=self._device)
        check_int(op, "num_experts", num_experts, 1)
        if num_experts % self.group_size:
            fail(op, "num_experts", f"a multiple of the group size {self.group_size}", num_experts)
        num_tokens, num_topk = topk_idx.shape
        num_ranks, num_rdma_ranks = self.group_size, self._native.num_rdma_ranks
        has_rdma = num_rdma_ranks > 1
        streams = self._enter_op(op, previous_event, async_finish, allocate_on_comm_stream)
        try:
            counts = torch.empty(num_ranks + (num_rdma_ranks if has_rdma else 0) + num_experts, dtype=torch.int32,
                                 device=self._device)
            num_tokens_per_rank = counts[:num_ranks]
            num_tokens_per_rdma_rank = counts[num_ranks:num_ranks + num_rdma_ranks] if has_rdma else None
            num_tokens_per_expert = counts[counts.numel() - num_experts:]
            is_token_in_rank = torch.empty(num_tokens, num_ranks, dtype=torch.bool, device=self._device)
            self._native.get_dispatch_layout(
                topk_idx=topk_idx.data_ptr(), num_tokens=num_tokens, num_topk=num_topk, num_experts=num_experts,
                num_tokens_per_rank=num_tokens_per_rank.data_ptr(),
                num_tokens_per_rdma_rank=num_tokens_per_rdma_rank.data_ptr() if has_rdma else 0,
                num_tokens_per_expert=num_tokens_per_expert.data_ptr(), is_token_in_rank=is_token_in_rank.data_ptr(),
                stream=self._comm_raw, wait_for=streams[2], join_to=streams[3])
        except BaseException:
            self._abort_op(streams, allocate_on_comm_stream)
            raise
        event = self._exit_op(streams, async_finish, allocate_on_comm_stream, (topk_idx, counts, is_token_in_rank))
        return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event

    def _config(self, op: str, config, default) -> "_C.Config":
        return default(self.group_size) if config is None else check_config(op, config)

    def _check_handle(self, op: str, handle):
        """The handle's tensors, checked before any kernel reads them:
        (rank_prefix_matrix, source_num_tokens, recv_src_idx, is_token_in_rank)."""
        if not (isinstance(handle, (tuple, list)) and len(handle) == 6):
            fail(op, "handle", "the six-entry handle a dispatch of this buffer returned",
                 f"a {type(handle).__name__}" + (f" of {len(handle)}" if isinstance(handle, (tuple, list)) else ""),
                 TypeError)
        owner = getattr(handle, "_owner", None)
        if owner is not None and owner is not self._handle_owner:
            fail(op, "handle", "from a dispatch of this buffer", "the handle of another Buffer")
        R, dev = self.group_size, self._device
        prefix, source_tokens, _, src_idx, in_rank, _ = handle
        check_tensor(op, "handle[0] (rank_prefix_matrix)", prefix, dtype=torch.int32, shape=(R, R), device=dev)
        check_tensor(op, "handle[1] (source_num_tokens)", source_tokens, dtype=torch.int32, shape=(R,), device=dev)
        check_tensor(op, "handle[3] (recv_src_idx)", src_idx, dtype=torch.int32, ndim=1, device=dev)
        check_tensor(op, "handle[4] (is_token_in_rank)", in_rank, dtype=torch.bool, shape=(None, R), device=dev)
        return prefix, source_tokens, src_idx, in_rank

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Sends each token to every rank in ``is_token_in_rank``. Returns
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``;
        with ``handle`` given (cached mode) only ``recv_x`` and the event.

        The handle is a :class:`DispatchHandle`. ``num_tokens_per_rank`` and
        ``num_tokens_per_rdma_rank`` are checked but not needed: the counts
        come from ``is_token_in_rank``. Without ``num_worst_tokens`` the host
        waits for the receive counts (so such a dispatch cannot be captured in
        a CUDA graph); a bad input on any rank then raises on every rank.
        """
        op = "dispatch"
        config = self._config(op, config, Buffer.get_dispatch_config)
        data, scales = check_x(op, x, self._device)
        num_tokens, hidden = data.shape
        R = self.group_size
        check_int(op, "expert_alignment", expert_alignment, 1)
        check_int(op, "num_worst_tokens", num_worst_tokens, 0)
        cached = handle is not None
        num_experts = num_topk = 0
        if cached:
            rank_prefix_matrix, _, old_src_idx, is_token_in_rank = self._check_handle(op, handle)
            if topk_idx is not None or topk_weights is not None:
                fail(op, "topk_idx", "None with a handle (cached dispatch)", "a tensor")
            if is_token_in_rank.shape[0] != num_tokens:
                fail(op, "x", f"of {is_token_in_rank.shape[0]} rows, the tokens of the handle's dispatch",
                     f"{num_tokens} rows")
            num_recv = old_src_idx.shape[0]
        else:
            check_tensor(op, "is_token_in_rank", is_token_in_rank, dtype=torch.bool, shape=(num_tokens, R),
                         device=self._device)
            check_tensor(op, "num_tokens_per_rank", num_tokens_per_rank, dtype=torch.int32, shape=(R,),
                         device=self._device)
            check_tensor(op, "num_tokens_per_expert", num_tokens_per_expert, dtype=torch.int32, ndim=1,
                         device=self._device)
            num_experts = num_tokens_per_expert.shape[0]
            if num_experts == 0 or num_experts % R:
                fail(op, "num_tokens_per_expert", f"of a length that is a positive multiple of the group size {R}",
                     f"shape {tuple(num_tokens_per_expert.shape)}")
            if (topk_idx is None) != (topk_weights is None):
                fail(op, "topk_weights" if topk_weights is None else "topk_idx", "given with the other top-k tensor",
                     None)
            if topk_idx is not None:
                check_tensor(op, "topk_idx", topk_idx, dtype=TOPK_IDX_DTYPE, ndim=2, device=self._device)
                num_topk = topk_idx.shape[1]
                if topk_idx.shape[0] != num_tokens:
                    fail(op, "topk_idx", f"of {num_tokens} rows like x", f"shape {tuple(topk_idx.shape)}")
                check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, shape=(num_tokens, num_topk),
                             device=self._device)
        if scales is not None:
            num_scales = scales.shape[1]
            stride_token, stride_group = scales.stride()
        else:
            num_scales = stride_token = stride_group = 0

        streams = self._enter_op(op, previous_event, async_finish, allocate_on_comm_stream)
        wait_for, join_to = streams[2], streams[3]
        try:
            dev = self._device
            native = self._native
            stream = self._comm_raw
            in_rank_ptr = is_token_in_rank.data_ptr()
            topk_idx_ptr = topk_idx.data_ptr() if num_topk else 0
            if not cached:
                rank_prefix_matrix = torch.empty(R, R, dtype=torch.int32, device=dev)
                # Without num_worst_tokens this waits on the host for the receive sizes.
                num_recv, per_expert = native.dispatch_counts(
                    is_token_in_rank=in_rank_ptr, num_tokens=num_tokens,
                    num_tokens_per_expert=num_tokens_per_expert.data_ptr(), num_experts=num_experts,
                    topk_idx=topk_idx_ptr, num_topk=num_topk, expert_alignment=expert_alignment,
                    num_worst_tokens=num_worst_tokens, config=config, rank_prefix_matrix=rank_prefix_matrix.data_ptr(),
                    stream=stream, wait_for=wait_for)
                if num_worst_tokens:
                    num_recv, per_expert = num_worst_tokens, []
            else:
                # The counts are known: the notify step only refreshes the channel starts.
                native.dispatch_counts(
                    is_token_in_rank=in_rank_ptr, num_tokens=num_tokens, num_tokens_per_expert=0, num_experts=0,
                    topk_idx=0, num_topk=0, expert_alignment=1, num_worst_tokens=num_recv, config=config,
                    rank_prefix_matrix=rank_prefix_matrix.data_ptr(), stream=stream, wait_for=wait_for)
                per_expert = None
            # Sizes as separate ints: torch parses them ~1 us faster than a tuple.
            recv_x = torch.empty(num_recv, hidden, dtype=data.dtype, device=dev)
            recv_scales = torch.empty(num_recv, num_scales, dtype=scales.dtype, device=dev) \
                if scales is not None else None
            recv_topk_idx = torch.empty(num_recv, num_topk, dtype=TOPK_IDX_DTYPE, device=dev) if num_topk else None
            recv_topk_weights = torch.empty(num_recv, num_topk, dtype=torch.float32, device=dev) \
                if num_topk else None
            # One allocation: every source rank's token count, then recv_src_idx.
            source_info = None if cached else torch.empty(R + num_recv, dtype=torch.int32, device=dev)
            info_ptr = source_info.data_ptr() if source_info is not None else 0
            native.dispatch(
                x=data.data_ptr(), num_tokens=num_tokens, row_bytes=hidden * data.element_size(),
                x_scales=scales.data_ptr() if scales is not None else 0, num_scales=num_scales,
                scale_stride_token=stride_token, scale_stride_group=stride_group, topk_idx=topk_idx_ptr,
                topk_weights=topk_weights.data_ptr() if num_topk else 0, num_topk=num_topk, num_experts=num_experts,
                is_token_in_rank=in_rank_ptr, rank_prefix_matrix=rank_prefix_matrix.data_ptr(),
                num_recv_rows=num_recv, num_worst_tokens=0 if cached else num_worst_tokens, config=config,
                recv_x=recv_x.data_ptr(), recv_x_scales=recv_scales.data_ptr() if recv_scales is not None else 0,
                recv_topk_idx=recv_topk_idx.data_ptr() if num_topk else 0,
                recv_topk_weights=recv_topk_weights.data_ptr() if num_topk else 0,
                recv_src_idx=info_ptr + 4 * R if info_ptr else 0, source_num_tokens=info_ptr, stream=stream,
                join_to=join_to)
        except BaseException:
            self._abort_op(streams, allocate_on_comm_stream)
            raise
        event = self._exit_op(streams, async_finish, allocate_on_comm_stream,
                              (data, scales, topk_idx, topk_weights, is_token_in_rank, rank_prefix_matrix, recv_x,
                               recv_scales, recv_topk_idx, recv_topk_weights, source_info))
        out_x = (recv_x, recv_scales) if scales is not None else recv_x
        if cached:
            return out_x, None, None, None, None, event
        new_handle = DispatchHandle((rank_prefix_matrix, source_info[:R], None, source_info[R:], is_token_in_rank,
                                     None))
        new_handle._owner = self._handle_owner
        return out_x, recv_topk_idx, recv_topk_weights, per_expert, new_handle, event

    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                config=None, previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sends each row of ``x`` back to the rank its token came from and sums
        the rows of each token there (fp32), plus ``bias`` (a tensor or a tuple of
        two). Returns ``(combined_x, combined_topk_weights or None, event)``."""
        op = "combine"
        config = self._config(op, config, Buffer.get_combine_config)
        rank_prefix_matrix, source_tokens, src_idx, is_token_in_rank = self._check_handle(op, handle)
        num_rows = src_idx.shape[0]
        num_tokens = is_token_in_rank.shape[0]
        check_tensor(op, "x", x, dtype=torch.bfloat16, ndim=2, device=self._device)
        if x.shape[0] != num_rows:
            fail(op, "x", f"of {num_rows} rows (the handle's receive count)", f"shape {tuple(x.shape)}")
        hidden = x.shape[1]
        if hidden % 8:
            fail(op, "x", "of a hidden size that is a multiple of 8", f"shape {tuple(x.shape)}")
        check_aligned(op, "x", x)
        num_topk = 0
        if topk_weights is not None:
            check_tensor(op, "topk_weights", topk_weights, dtype=torch.float32, ndim=2, device=self._device)
            num_topk = topk_weights.shape[1]
            if topk_weights.shape[0] != num_rows:
                fail(op, "topk_weights", f"of {num_rows} rows like x", f"shape {tuple(topk_weights.shape)}")
        biases = bias if isinstance(bias, tuple) else (bias,)
        if len(biases) > 2:
            fail(op, "bias", "None, a tensor or a tuple of two tensors", f"a tuple of {len(biases)}", TypeError)
        biases = [b for b in biases if b is not None]
        for i, b in enumerate(biases):
            name = f"bias[{i}]" if isinstance(bias, tuple) else "bias"
            check_tensor(op, name, b, dtype=torch.bfloat16, shape=(num_tokens, hidden), device=self._device)
            check_aligned(op, name, b)
        bias0 = biases[0].data_ptr() if biases else 0
        bias1 = biases[1].data_ptr() if len(biases) > 1 else 0

        streams = self._enter_op(op, previous_event, async_finish, allocate_on_comm_stream)
        try:
            combined_x = torch.empty(num_tokens, hidden, dtype=torch.bfloat16, device=self._device)
            combined_w = torch.empty(num_tokens, num_topk, dtype=torch.float32, device=self._device) \
                if num_topk else None
            self._native.combine(
                x=x.data_ptr(), num_rows=num_rows, hidden=hidden,
                topk_weights=topk_weights.data_ptr() if num_topk else 0, num_topk=num_topk, bias0=bias0, bias1=bias1,
                rank_prefix_matrix=rank_prefix_matrix.data_ptr(), source_num_tokens=source_tokens.data_ptr(),
                recv_src_idx=src_idx.data_ptr(), is_token_in_rank=is_token_in_rank.data_ptr(), num_tokens=num_tokens,
                config=config, combined_x=combined_x.data_ptr(),
                combined_topk_weights=combined_w.data_ptr() if num_topk else 0, stream=self._comm_raw,
                wait_for=streams[2], join_to=streams[3])
        except BaseException:
            self._abort_op(streams, allocate_on_comm_stream)
            raise
        event = self._exit_op(streams, async_finish, allocate_on_comm_stream,
                              (x, topk_weights, *biases, rank_prefix_matrix, source_tokens, src_idx,
                               is_token_in_rank, combined_x, combined_w))
        return combined_x, combined_w, event

    # -- test and bench hooks (ours) ----------------------------------------------------------------------------

    def _barrier(self) -> None:
        """All NVL peers meet (on the current stream), then the host waits for it."""
        stream = torch.cuda.current_stream().cuda_stream
        self._native.barrier(stream=stream)
        self._native.synchronize(stream=stream, op="Buffer._barrier")
