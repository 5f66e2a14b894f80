"""Buffer: the communication buffer of one rank, with DeepEP V1's API. The
ops live in ``ops``, one module per mode; this class checks what every op
shares and hands each call to its mode."""
from typing import Optional

import torch

from . import _C, bootstrap
from .checks import check_config, check_int, fail
from .event import EventOverlap
from .ops import internode, intranode, layout, low_latency, rank_mask, streams
from .ops.context import OpContext, require_alive

# Every op's body runs with torch-function dispatch off: under a
# TorchFunctionMode (torch.set_default_device installs one) or with a Tensor
# subclass, each tensor access would otherwise run Python code, a few
# microseconds each and dozens per call. Every allocation inside names its
# device and dtype, so neither default applies there. An explicit block costs
# less than a wrapping decorator (one Python frame fewer) and keeps the
# methods' signatures as written.
_torch_function_off = torch._C.DisableTorchFunction

# The default configs the ops use, by (maker, group size, Buffer.num_sms): a
# Config is read-only, and making one is a native call per op otherwise.
_default_configs = {}


class Buffer:
    """The communication buffer of one rank of an expert-parallel group.

    Construction is collective: every rank of ``group`` (or ``comm``) creates its
    Buffer at the same time. ``timeout_s`` (ours) bounds every wait for a peer;
    default ``TURNOUT_TIMEOUT_S`` or 100 s. ``nvl_domain_size`` (ours) declares
    NVL domains smaller than a host (default ``TURNOUT_NVL_DOMAIN_SIZE``, else
    the host), to emulate several hosts on one; every rank declares the same.

    Without ``low_latency_mode``, a group that spans several NVL domains runs
    the normal ops in internode mode, over a network region of
    ``num_rdma_bytes`` (``Config.get_rdma_buffer_size_hint``) in NVSHMEM
    symmetric memory; within one NVL domain ``num_rdma_bytes`` is unused.

    ``low_latency_mode=True`` adds the low-latency region, ``num_rdma_bytes``
    bytes of it (from ``get_low_latency_rdma_size_hint``). When the group spans
    several NVL domains, peers in other domains are reached through NVSHMEM:
    ``num_qps_per_rank`` is its IBGDA queue pairs per peer,
    ``allow_nvlink_for_low_latency_mode=False`` sends every peer through
    NVSHMEM, those of this rank's domain too, and ``allow_mnnvl`` lets NVSHMEM
    use multi-node NVLink. Within one NVL domain these change nothing.
    """

    #: SMs the normal kernels use by default (``set_num_sms`` changes it).
    num_sms: int = _C.default_num_sms

    def __init__(self, group, num_nvl_bytes: int = 0, num_rdma_bytes: int = 0, low_latency_mode: bool = False,
                 num_qps_per_rank: int = 24, allow_nvlink_for_low_latency_mode: bool = True,
                 allow_mnnvl: bool = False, use_fabric: bool = False, explicitly_destroy: bool = False,
                 enable_shrink: bool = False, comm=None, *, timeout_s: Optional[float] = None,
                 nvl_domain_size: int = 0, shrink_timeout_s: Optional[float] = None) -> None:
        op = "Buffer"
        self._native = None
        self._context = None
        if group is None and comm is None:
            raise ValueError("Buffer: pass a torch.distributed process group (group) or an mpi4py communicator (comm)")
        check_int(op, "num_nvl_bytes", num_nvl_bytes, 0)
        check_int(op, "num_rdma_bytes", num_rdma_bytes, 0)
        check_int(op, "num_qps_per_rank", num_qps_per_rank, 1)
        check_int(op, "nvl_domain_size", nvl_domain_size, 0)
        for arg, value in (("timeout_s", timeout_s), ("shrink_timeout_s", shrink_timeout_s)):
            if value is not None and not (isinstance(value, (int, float)) and 0 < value < float("inf")):
                fail(op, arg, "a positive number of seconds", value)
        # num_rdma_bytes sizes the low-latency region, or without low_latency_mode
        # the network region of internode mode (opened only across NVL domains).
        if low_latency_mode and num_rdma_bytes == 0:
            fail(op, "num_rdma_bytes", "> 0 with low_latency_mode=True (size it with "
                 "Buffer.get_low_latency_rdma_size_hint)", 0)
        if use_fabric:
            raise NotImplementedError("Buffer: use_fabric=True (fabric memory handles) is not available in this "
                                      "version of turnout")
        if not torch.cuda.is_available():
            raise RuntimeError("Buffer: no CUDA device is visible to this process")

        rank, size, all_gather = bootstrap.from_group(group) if group is not None else bootstrap.from_mpi(comm)
        device = torch.cuda.current_device()
        # From PyTorch's pool: never destroyed, so tensors that recorded it stay safe after destroy().
        self._comm_stream = torch.cuda.Stream(device=device, priority=-1)
        self._native = _C.Buffer(rank=rank, size=size, all_gather=all_gather, device=device,
                                 num_nvl_bytes=num_nvl_bytes, num_rdma_bytes=num_rdma_bytes,
                                 low_latency_mode=low_latency_mode, timeout_s=float(timeout_s or 0.0),
                                 nvl_domain_size=nvl_domain_size, comm_stream=self._comm_stream.cuda_stream,
                                 enable_shrink=bool(enable_shrink),
                                 shrink_timeout_s=float(shrink_timeout_s or 0.0),
                                 num_qps_per_rank=num_qps_per_rank,
                                 allow_nvlink_for_low_latency_mode=bool(allow_nvlink_for_low_latency_mode),
                                 allow_mnnvl=bool(allow_mnnvl))
        self._context = OpContext(self._native, device, size, self._comm_stream)
        if low_latency_mode:
            ring = _C.EventRing(device=device, size=low_latency.EVENT_RING_SIZE)
            self._context.low_latency = low_latency.LowLatencyState(ring)
        self.rank = rank
        self.group_size = size
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self.enable_shrink = bool(enable_shrink)

    # -- life cycle ---------------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Free the buffer now (collective). Only for ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy: this buffer was created with explicitly_destroy=False; its "
                               "resources are released when it is collected")
        self._native.destroy()
        if self._context.low_latency is not None:
            self._context.low_latency.release()

    def check_errors(self) -> None:
        """Raises the error a kernel of this buffer recorded since the last one
        raised (ours). The ops raise these by themselves at their next call;
        this asks at once, for work that no later call follows, such as a
        CUDA-graph replay: call it once the replay has finished (after a
        synchronize of its stream). The message names the call that failed."""
        self._require_alive("Buffer.check_errors")
        self._native.check_errors(op="Buffer.check_errors")

    def _require_alive(self, op: str) -> None:
        require_alive(self._native, op)

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
        item = dtype.itemsize
        check_int(op, "offset", offset, 0, self.num_nvl_bytes)
        if offset % item:
            fail(op, "offset", f"a multiple of {dtype}'s size {item}", offset)
        tensor = self._native.local_buffer()[offset:].view(dtype) if self.num_nvl_bytes - offset >= item else \
            torch.empty(0, dtype=dtype, device=self._context.device)
        if size is None:
            return tensor
        numel = 1
        for n in size:
            numel *= n
        if numel > tensor.numel():
            fail(op, "size", f"at most {tensor.numel()} elements of {dtype} from offset {offset}", tuple(size))
        return tensor[:numel].view(size)

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
        with _torch_function_off():
            return layout.get_dispatch_layout(self._context, topk_idx, num_experts, previous_event, async_finish,
                                              allocate_on_comm_stream)

    def _config(self, op: str, config, default) -> "_C.Config":
        if config is not None:
            return check_config(op, config)
        key = (default, self.group_size, Buffer.num_sms)
        made = _default_configs.get(key)
        if made is None:
            made = _default_configs[key] = default(self.group_size)
        return made

    # The ops take their arguments positionally (a keyword call costs about
    # 0.1 us more), each passed as the variable of the parameter's name.

    def dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                 is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                 expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                 previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                 allocate_on_comm_stream: bool = False):
        """Sends each token to every rank in ``is_token_in_rank``. Returns
        ``(recv_x, recv_topk_idx, recv_topk_weights, num_recv_tokens_per_expert_list, handle, event)``;
        with ``handle`` given (cached mode) only ``recv_x`` and the event.

        The handle is a :class:`DispatchHandle`, or across NVL domains
        (internode mode) an :class:`InternodeHandle`. ``num_tokens_per_rank``
        and ``num_tokens_per_rdma_rank`` (needed across domains) are checked
        but not read: the counts come from ``is_token_in_rank``. Without ``num_worst_tokens`` the host
        waits for the receive counts (so such a dispatch cannot be captured in
        a CUDA graph); a bad input on any rank then raises on every rank.
        """
        with _torch_function_off():
            config = self._config("dispatch", config, Buffer.get_dispatch_config)
            if self._context.num_rdma_ranks > 1:
                return internode.dispatch(self._context, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                          is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                          expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                                          allocate_on_comm_stream)
            return intranode.dispatch(self._context, x, handle, num_tokens_per_rank, is_token_in_rank,
                                      num_tokens_per_expert, topk_idx, topk_weights, expert_alignment,
                                      num_worst_tokens, config, previous_event, async_finish, allocate_on_comm_stream)

    def combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                config=None, previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                allocate_on_comm_stream: bool = False):
        """Sends each row of ``x`` back to the rank its token came from and sums
        the rows of each token there (fp32), plus ``bias`` (a tensor or a tuple of
        two). Returns ``(combined_x, combined_topk_weights or None, event)``."""
        with _torch_function_off():
            config = self._config("combine", config, Buffer.get_combine_config)
            if self._context.num_rdma_ranks > 1:
                return internode.combine(self._context, x, handle, topk_weights, bias, config, previous_event,
                                         async_finish, allocate_on_comm_stream)
            return intranode.combine(self._context, x, handle, topk_weights, bias, config, previous_event,
                                     async_finish, allocate_on_comm_stream)

    # -- internode mode (DeepEP's names; dispatch and combine take this path by themselves) --------------------

    def internode_dispatch(self, x, handle=None, num_tokens_per_rank=None, num_tokens_per_rdma_rank=None,
                           is_token_in_rank=None, num_tokens_per_expert=None, topk_idx=None, topk_weights=None,
                           expert_alignment: int = 1, num_worst_tokens: int = 0, config=None,
                           previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                           allocate_on_comm_stream: bool = False):
        """:meth:`dispatch` across NVL domains; a ValueError on a buffer of one domain."""
        with _torch_function_off():
            config = self._config("dispatch", config, Buffer.get_dispatch_config)
            return internode.dispatch(self._context, x, handle, num_tokens_per_rank, num_tokens_per_rdma_rank,
                                      is_token_in_rank, num_tokens_per_expert, topk_idx, topk_weights,
                                      expert_alignment, num_worst_tokens, config, previous_event, async_finish,
                                      allocate_on_comm_stream)

    def internode_combine(self, x: torch.Tensor, handle, topk_weights: Optional[torch.Tensor] = None, bias=None,
                          config=None, previous_event: Optional[EventOverlap] = None, async_finish: bool = False,
                          allocate_on_comm_stream: bool = False):
        """:meth:`combine` across NVL domains; a ValueError on a buffer of one domain."""
        with _torch_function_off():
            config = self._config("combine", config, Buffer.get_combine_config)
            return internode.combine(self._context, x, handle, topk_weights, bias, config, previous_event,
                                     async_finish, allocate_on_comm_stream)

    # -- low-latency mode ---------------------------------------------------------------------------------------
    # DeepEP's signatures: an argument of a DeepEP fork (use_nvfp4, x_global_scale,
    # overlap signals, ...) is a TypeError that names it, Python's own.

    def low_latency_dispatch(self, x: torch.Tensor, topk_idx: torch.Tensor, num_max_dispatch_tokens_per_rank: int,
                             num_experts: int, cumulative_local_expert_recv_stats: Optional[torch.Tensor] = None,
                             dispatch_wait_recv_cost_stats: Optional[torch.Tensor] = None, use_fp8: bool = True,
                             round_scale: bool = False, use_ue8m0: bool = False, async_finish: bool = False,
                             return_recv_hook: bool = False, *, topk_weights: Optional[torch.Tensor] = None):
        """Sends each token of ``x`` ([T, H] bf16, T <= num_max_dispatch_tokens_per_rank)
        to the ranks of its experts. Returns ``(recv_x, recv_count, handle, event, hook)``:
        ``recv_x`` [L, M*R, H] per local expert (with ``use_fp8`` a tuple of e4m3 data
        and column-major scales), ``recv_count`` [L] int32 valid rows, the
        :class:`LowLatencyHandle` for combine.

        The outputs belong to the buffer and are reused by the second later
        dispatch of the same shape (double buffering). ``topk_weights`` (ours,
        [T, K] float32): combine then weighs with these (if every rank with
        tokens gave them) and neither publishes nor reads its own. With
        ``return_recv_hook`` only the send runs; ``hook()`` launches the
        receive on the stream current then.
        """
        with _torch_function_off():
            return low_latency.dispatch(self._context, x, topk_idx, num_max_dispatch_tokens_per_rank, num_experts,
                                        cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats, use_fp8,
                                        round_scale, use_ue8m0, async_finish, return_recv_hook, topk_weights)

    def low_latency_combine(self, x: torch.Tensor, topk_idx: torch.Tensor, topk_weights: torch.Tensor, handle,
                            use_logfmt: bool = False, zero_copy: bool = False, async_finish: bool = False,
                            return_recv_hook: bool = False, out: Optional[torch.Tensor] = None,
                            combine_wait_recv_cost_stats: Optional[torch.Tensor] = None):
        """Sends the expert outputs ``x`` ([L, M*R, H] bf16, in dispatch's rows) back
        and sums them per token, weighted by ``topk_weights`` (fp32, k ascending:
        deterministic): each expert rank sends one weighted sum per token, the
        token's rank adds those. Returns ``(combined_x [T, H] bf16, event, hook)``;
        ``combined_x`` is ``out`` when given, else a new tensor. ``zero_copy``: the
        rows were written into :meth:`get_next_low_latency_combine_buffer`.
        ``use_logfmt``: the sums cross as LogFMT-10 (10 bits a value where a
        128-channel group's magnitudes are below 1; lossy, see the README)."""
        with _torch_function_off():
            return low_latency.combine(self._context, x, topk_idx, topk_weights, handle, use_logfmt, zero_copy,
                                       async_finish, return_recv_hook, out, combine_wait_recv_cost_stats)

    def get_next_low_latency_combine_buffer(self, handle) -> torch.Tensor:
        """The [L, M*R, H] bf16 tensor a ``zero_copy`` combine of ``handle`` sends from."""
        with _torch_function_off():
            return low_latency.get_next_combine_buffer(self._context, handle)

    def clean_low_latency_buffer(self, num_max_dispatch_tokens_per_rank: int, hidden: int, num_experts: int) -> None:
        """Collective: resets the low-latency region (after a failed call, or
        normal-mode use of the same buffer). Every rank calls it."""
        with _torch_function_off():
            low_latency.clean(self._context, num_max_dispatch_tokens_per_rank, hidden, num_experts)

    # -- shrink mode ------------------------------------------------------------------------------------------

    def low_latency_update_mask_buffer(self, rank_to_mask: int, mask: bool = False) -> None:
        """Masks (``mask=True``) or unmasks ``rank_to_mask`` on this rank, in
        order on the current stream. A masked rank is neither sent to nor
        waited for. A rank that was masked by a timeout and comes back takes
        part again only once every rank has unmasked it and then called
        :meth:`clean_low_latency_buffer` (ours: that call puts every rank's
        call counters back in step)."""
        with _torch_function_off():
            rank_mask.update(self._context, rank_to_mask, mask)

    def low_latency_query_mask_buffer(self, mask_status: torch.Tensor) -> None:
        """Writes this rank's mask into ``mask_status`` (int32 ``[num_ranks]``
        on this GPU, 1 = masked), in order on the current stream."""
        with _torch_function_off():
            rank_mask.query(self._context, mask_status)

    def low_latency_clean_mask_buffer(self) -> None:
        """Unmasks every rank on this rank, in order on the current stream."""
        with _torch_function_off():
            rank_mask.clean(self._context)

    # -- test and bench hooks (ours) ----------------------------------------------------------------------------

    def _barrier(self) -> None:
        """All NVL peers meet (on the current stream), then the host waits for it."""
        stream = torch.cuda.current_stream().cuda_stream
        if self._context.tail != stream:
            streams.follow(self._context, stream)
        self._native.barrier(stream=stream)
        self._native.synchronize(stream=stream, op="Buffer._barrier")
