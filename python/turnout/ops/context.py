"""What the ops of one Buffer read of it."""
import torch


def require_alive(native, op: str) -> None:
    """``native`` is None while the Buffer is being built."""
    if native is None or native.destroyed:
        raise RuntimeError(f"{op}: the buffer was destroyed")


class OpContext:
    """Built once with its Buffer: the native buffer, where it lives and the
    stream its ops run on. The ops see nothing else of the Buffer."""

    __slots__ = ("native", "device", "device_index", "num_ranks", "num_rdma_ranks", "comm_stream", "comm_raw",
                 "handle_owner", "low_latency", "tail")

    def __init__(self, native, device_index: int, num_ranks: int, comm_stream: torch.cuda.Stream) -> None:
        self.native = native
        self.device_index = device_index
        self.device = torch.device("cuda", device_index)
        self.num_ranks = num_ranks
        # Fixed at construction: read once rather than through the binding per call.
        self.num_rdma_ranks = native.num_rdma_ranks
        self.comm_stream = comm_stream
        self.comm_raw = comm_stream.cuda_stream
        # Marks the handles of this buffer's dispatches; a handle holding the
        # context instead would keep the native buffer alive.
        self.handle_owner = object()
        # The low-latency outputs and stream state (ops/low_latency.py); None
        # on a buffer built without low_latency_mode.
        self.low_latency = None
        # The raw stream this buffer's last op was issued on (ops/streams.py
        # follow): an op on another stream waits for it first. None until one is.
        self.tail = None
