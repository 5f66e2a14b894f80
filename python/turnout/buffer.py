"""Buffer: the communication buffer of one rank, with DeepEP V1's API."""
import os
from typing import Optional, Tuple

import torch

from . import _C, bootstrap
from .checks import check_int, check_tensor, fail
from .event import EventOverlap

_TOPK_IDX_DTYPE = torch.int64


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
        self._native = _C.Buffer(rank, size, all_gather, device, num_nvl_bytes, num_rdma_bytes, low_latency_mode,
                                 float(timeout_s or 0.0), nvl_domain_size, self._comm_stream.cuda_stream)
        self.rank = rank
        self.group_size = size
        self.group = group
        self.comm = comm
        self.num_nvl_bytes = num_nvl_bytes
        self.num_rdma_bytes = num_rdma_bytes
        self.low_latency_mode = low_latency_mode
        self.explicitly_destroy = explicitly_destroy
        self._device = torch.device("cuda", device)

    # -- life cycle ---------------------------------------------------------------------------------------------

    def destroy(self) -> None:
        """Free the buffer now (collective). Only for ``explicitly_destroy=True``."""
        if not self.explicitly_destroy:
            raise RuntimeError("Buffer.destroy: this buffer was created with explicitly_destroy=False; its "
                               "resources are released when it is collected")
        self._native.destroy()

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
        return _C.get_low_latency_rdma_size_hint(num_max_dispatch_tokens_per_rank, hidden, num_ranks, num_experts)

    @staticmethod
    def get_dispatch_config(num_ranks: int) -> "_C.Config":
        return _C.get_dispatch_config(num_ranks, Buffer.num_sms)

    @staticmethod
    def get_combine_config(num_ranks: int) -> "_C.Config":
        return _C.get_combine_config(num_ranks, Buffer.num_sms)

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
                  allocate_on_comm_stream: bool) -> torch.cuda.Stream:
        """Makes the communication stream wait for its inputs; returns the
        caller's stream. Ops run on the communication stream."""
        self._require_alive(op)
        if previous_event is not None and not isinstance(previous_event, EventOverlap):
            fail(op, "previous_event", "an EventOverlap or None", type(previous_event).__name__, TypeError)
        if allocate_on_comm_stream and not (previous_event is not None and async_finish):
            fail(op, "allocate_on_comm_stream", "used with previous_event and async_finish=True",
                 f"previous_event={previous_event}, async_finish={async_finish}")
        compute = torch.cuda.current_stream()
        if previous_event is not None and previous_event.event is not None:
            self._comm_stream.wait_event(previous_event.event)
        else:
            self._comm_stream.wait_stream(compute)
        if allocate_on_comm_stream:
            torch.cuda.set_stream(self._comm_stream)
        return compute

    def _abort_op(self, compute: torch.cuda.Stream, allocate_on_comm_stream: bool) -> None:
        """Leaves the streams as _enter_op found them when an op fails."""
        if allocate_on_comm_stream:
            torch.cuda.set_stream(compute)
        compute.wait_stream(self._comm_stream)

    def _exit_op(self, compute: torch.cuda.Stream, async_finish: bool, allocate_on_comm_stream: bool,
                 tensors: Tuple[Optional[torch.Tensor], ...]) -> EventOverlap:
        if allocate_on_comm_stream:
            torch.cuda.set_stream(compute)
        if not async_finish:
            compute.wait_stream(self._comm_stream)
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

        Expert ids outside ``[-1, num_experts)`` raise ValueError: at once when
        the call is synchronous (it then waits for the kernel), else at the next
        call on this buffer.
        """
        op = "get_dispatch_layout"
        check_tensor(op, "topk_idx", topk_idx, dtype=_TOPK_IDX_DTYPE, ndim=2, device=self._device)
        check_int(op, "num_experts", num_experts, 1)
        if num_experts % self.group_size:
            fail(op, "num_experts", f"a multiple of the group size {self.group_size}", num_experts)
        num_tokens, num_topk = topk_idx.shape
        num_ranks, num_rdma_ranks = self.group_size, self._native.num_rdma_ranks
        has_rdma = num_rdma_ranks > 1
        compute = self._enter_op(op, previous_event, async_finish, allocate_on_comm_stream)
        try:
            counts = torch.empty(num_ranks + (num_rdma_ranks if has_rdma else 0) + num_experts, dtype=torch.int32,
                                 device=self._device)
            num_tokens_per_rank = counts[:num_ranks]
            num_tokens_per_rdma_rank = counts[num_ranks:num_ranks + num_rdma_ranks] if has_rdma else None
            num_tokens_per_expert = counts[counts.numel() - num_experts:]
            is_token_in_rank = torch.empty((num_tokens, num_ranks), dtype=torch.bool, device=self._device)
            stream = self._comm_stream.cuda_stream
            self._native.get_dispatch_layout(
                topk_idx.data_ptr(), num_tokens, num_topk, num_experts, num_tokens_per_rank.data_ptr(),
                num_tokens_per_rdma_rank.data_ptr() if has_rdma else 0, num_tokens_per_expert.data_ptr(),
                is_token_in_rank.data_ptr(), stream)
            if not async_finish and not torch.cuda.is_current_stream_capturing():
                self._native.synchronize(stream, op)
        except BaseException:
            self._abort_op(compute, allocate_on_comm_stream)
            raise
        event = self._exit_op(compute, async_finish, allocate_on_comm_stream, (topk_idx, counts, is_token_in_rank))
        return num_tokens_per_rank, num_tokens_per_rdma_rank, num_tokens_per_expert, is_token_in_rank, event

    # -- test and bench hooks (ours) ----------------------------------------------------------------------------

    def _barrier(self) -> None:
        """All NVL peers meet (on the current stream), then the host waits for it."""
        stream = torch.cuda.current_stream().cuda_stream
        self._native.barrier(stream)
        self._native.synchronize(stream, "Buffer._barrier")
