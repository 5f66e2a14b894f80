"""DispatchHandle: what a dispatch leaves for its cached dispatch and its
combine, and the checks a handle passes before any kernel reads it."""
from typing import Tuple

import torch

from ..checks import check_tensor, fail
from .context import OpContext


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

    ``_own_rows``: where this rank's rows from itself lie in the receive
    order, ``(begin, count)``, where the dispatch learned it on the host
    (``(-1, 0)`` elsewhere); combine skips them when it stages its input.
    """

    _own_rows = (-1, 0)


def new_handle(context: OpContext, rank_prefix_matrix: torch.Tensor, source_num_tokens: torch.Tensor,
               recv_src_idx: torch.Tensor, is_token_in_rank: torch.Tensor,
               own_rows: Tuple[int, int] = (-1, 0)) -> DispatchHandle:
    handle = DispatchHandle((rank_prefix_matrix, source_num_tokens, None, recv_src_idx, is_token_in_rank, None))
    handle._owner = context.handle_owner
    handle._own_rows = own_rows
    return handle


def check_handle(context: OpContext, op: str, handle) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The handle's tensors: (rank_prefix_matrix, source_num_tokens, recv_src_idx, is_token_in_rank).

    A DispatchHandle of this buffer's dispatch passes as it is: its tensors are
    that dispatch's outputs and its checked is_token_in_rank, in a tuple that
    cannot change. Any other handle has each entry checked."""
    if type(handle) is DispatchHandle and getattr(handle, "_owner", None) is context.handle_owner:
        return handle[0], handle[1], handle[3], handle[4]
    if not (isinstance(handle, (tuple, list)) and len(handle) == 6):
        fail(op, "handle", "the six-entry handle a dispatch of this buffer returned",
             f"a {type(handle).__name__}" + (f" of {len(handle)}" if isinstance(handle, (tuple, list)) else ""),
             TypeError)
    owner = getattr(handle, "_owner", None)
    if owner is not None and owner is not context.handle_owner:
        fail(op, "handle", "from a dispatch of this buffer", "the handle of another Buffer")
    num_ranks, device = context.num_ranks, context.device
    prefix, source_num_tokens, _, recv_src_idx, is_token_in_rank, _ = handle
    check_tensor(op, "handle[0] (rank_prefix_matrix)", prefix, dtype=torch.int32, shape=(num_ranks, num_ranks),
                 device=device)
    check_tensor(op, "handle[1] (source_num_tokens)", source_num_tokens, dtype=torch.int32, shape=(num_ranks,),
                 device=device)
    check_tensor(op, "handle[3] (recv_src_idx)", recv_src_idx, dtype=torch.int32, ndim=1, device=device)
    check_tensor(op, "handle[4] (is_token_in_rank)", is_token_in_rank, dtype=torch.bool, shape=(None, num_ranks),
                 device=device)
    return prefix, source_num_tokens, recv_src_idx, is_token_in_rank
