"""The training frameworks' normal-mode call sequences, written the way each
framework writes them, shared by test_frameworks.py (one NVL domain) and the
internode domains job (across domains): the calls only, the checks are the
caller's (each against its own host reference)."""
import torch

from turnout.utils import EventHandle, EventOverlap


def megatron_calls(buf, x, topk_idx: torch.Tensor, topk_weights: torch.Tensor, num_experts: int, grad: torch.Tensor,
                   grad_out: torch.Tensor):
    """Megatron-LM's fused_a2a and torchtitan's DeepEP path, no config given
    (the buffer's defaults), every step async on the communication stream
    with deep_ep.utils events: the forward dispatch, the backward of
    dispatch (``grad`` combined, weighted by the received top-k weights) and
    the backward of combine (``grad_out`` dispatched with the handle,
    cached). Returns (dispatch's outputs, combine's, the cached dispatch's),
    each waited for on the current stream."""
    previous_event = EventOverlap(EventHandle())
    per_rank, per_rdma, per_expert, in_rank, event = buf.get_dispatch_layout(
        topk_idx, num_experts, previous_event=previous_event, async_finish=True, allocate_on_comm_stream=True)
    out = buf.dispatch(x, topk_idx=topk_idx, topk_weights=topk_weights, num_tokens_per_rank=per_rank,
                       num_tokens_per_rdma_rank=per_rdma, is_token_in_rank=in_rank, num_tokens_per_expert=per_expert,
                       previous_event=event, async_finish=True, allocate_on_comm_stream=True)
    out[5].current_stream_wait()
    back = buf.combine(grad, out[4], topk_weights=out[2], previous_event=EventOverlap(EventHandle()),
                       async_finish=True, allocate_on_comm_stream=True)
    back[2].current_stream_wait()
    cached = buf.dispatch(grad_out, handle=out[4], previous_event=EventOverlap(EventHandle()), async_finish=True,
                          allocate_on_comm_stream=True)
    cached[5].current_stream_wait()
    return out, back, cached
