"""InternodeHandle: what an internode dispatch leaves for its cached dispatch
and its combine (DeepEP's ten entries, index for index), and the checks a
handle passes before any kernel reads it."""
from typing import NamedTuple

import torch

from ..checks import check_tensor, fail
from .context import OpContext

#: The entries' names, index for index (DeepEP's).
ENTRY_NAMES = ("is_token_in_rank", "rdma_channel_prefix_matrix", "gbl_channel_prefix_matrix",
               "recv_rdma_channel_prefix_matrix", "recv_rdma_rank_prefix_sum", "recv_gbl_channel_prefix_matrix",
               "recv_gbl_rank_prefix_sum", "recv_src_meta", "send_rdma_head", "send_nvl_head")
#: The eleventh entry (ours) of a handle of a buffer built with enable_shrink=True.
LIVE_ENTRY_NAME = "live"


def shrink_mode(context: OpContext) -> bool:
    """Whether the buffer was built with enable_shrink=True (its internode
    handles then carry the live set, entry [10])."""
    return bool(getattr(context.native, "shrink_enabled", False))


class InternodeHandle(tuple):
    """What an internode dispatch returns for its cached dispatch and its
    combine. R ranks in N NVL domains of D, C channels (``num_sms / 2`` of the
    dispatch's config), T this rank's tokens; int32 unless said:

    - ``[0]`` is_token_in_rank, bool ``[T, R]``: the dispatch's input.
    - ``[1]`` rdma_channel_prefix_matrix ``[N, C]``: this rank's tokens of channels 0..c reaching domain e.
    - ``[2]`` gbl_channel_prefix_matrix ``[R, C]``: this rank's tokens of channels 0..c going to rank j.
    - ``[3]`` recv_rdma_channel_prefix_matrix ``[N, C]``: row s = ``[1]`` of the peer (s, my local
      index), its row for my domain.
    - ``[4]`` recv_rdma_rank_prefix_sum ``[N]``: prefix over s of the tokens that peer sends my
      domain; ``[4][-1]`` is the number of tokens this rank forwards.
    - ``[5]`` recv_gbl_channel_prefix_matrix ``[R, C]``: the row where source j's channel c starts here.
    - ``[6]`` recv_gbl_rank_prefix_sum ``[R]``: prefix over sources of the rows here (the entry
      DeepEP users read as ``handle[-4]``); source j's rows are ``[6][j - 1]`` to ``[6][j]``.
    - ``[7]`` recv_src_meta ``[rows, 2]``: per row (source token, bit j: the token reached local
      rank j of this domain). DeepEP's holds the source domain where this holds the token.
    - ``[8]`` send_rdma_head ``[T, N]``: token t's place in its channel's stream to domain e, -1
      where it does not reach e.
    - ``[9]`` send_nvl_head ``[forwarded, D]``: forwarded token i's place in its channel's stream to
      local rank j, -1 where it does not go to j (forward order: source domain, then token).

    On a buffer built with ``enable_shrink=True`` (docs/INTERNODE.md "Shrink across domains") an
    eleventh entry, ours:

    - ``[10]`` live ``[ceil(R / 32)]``: the dispatch's live set, bit r & 31 of word r >> 5 (the
      ranks not masked when it ran); its combine and cached dispatch use the same forwarders.
      ``[3]`` is then ``[N x P, C]`` and ``[4]`` ``[N x P]``, a row per (source domain, part), P the
      columns this rank forwards for (1 with every rank live: the shapes above). A dispatch with
      ``num_worst_tokens`` (no host wait, so P unknown to the host) makes them ``[N x D, C]`` and
      ``[N x D]``, a row per part a rank may have: the first N x P rows as above, the rest parts
      with no tokens (``[3]`` zeros, ``[4]`` the number of tokens this rank forwards).

    With eleven entries, indices from the end move by one: ``handle[-4]`` is then ``[7]``, so
    code that reads ``[6]`` as ``handle[-4]`` must read ``handle[6]`` in shrink mode.

    A plain tuple or list of these entries is accepted too.
    """


class HandleParts(NamedTuple):
    """A checked handle's entries and the sizes that follow from them."""
    entries: tuple
    num_tokens: int
    num_channels: int
    num_recv: int
    num_forward: int


def new_handle(context: OpContext, entries) -> InternodeHandle:
    handle = InternodeHandle(entries)
    handle._owner = context.handle_owner
    return handle


def check_handle(context: OpContext, op: str, handle, num_channels: int) -> HandleParts:
    """Checks every entry (type, dtype, shape, device) and that the handle
    was made with ``num_channels`` channels, the call's."""
    shrink = shrink_mode(context)
    if not (isinstance(handle, (tuple, list)) and len(handle) == (11 if shrink else 10)):
        fail(op, "handle", f"the {'eleven' if shrink else 'ten'}-entry handle an internode dispatch of this buffer "
             "returned",
             f"a {type(handle).__name__}" + (f" of {len(handle)}" if isinstance(handle, (tuple, list)) else ""),
             TypeError)
    owner = getattr(handle, "_owner", None)
    if owner is not None and owner is not context.handle_owner:
        fail(op, "handle", "from a dispatch of this buffer", "the handle of another Buffer")
    num_ranks, num_domains, device = context.num_ranks, context.num_rdma_ranks, context.device
    num_nvl_ranks = num_ranks // num_domains

    def arg(i: int) -> str:
        return f"handle[{i}] ({ENTRY_NAMES[i] if i < 10 else LIVE_ENTRY_NAME})"

    check_tensor(op, arg(0), handle[0], dtype=torch.bool, shape=(None, num_ranks), device=device)
    num_tokens = handle[0].shape[0]
    check_tensor(op, arg(1), handle[1], dtype=torch.int32, shape=(num_domains, None), device=device)
    channels = handle[1].shape[1]
    if channels != num_channels:
        fail(op, "config", f"of the dispatch's {channels} channels (num_sms {2 * channels}, within the SM budget)",
             f"{num_channels} channels")
    # A row of [3] and [4] per (source domain, part): one part each without shrink mode.
    rows = num_domains
    if shrink:
        check_tensor(op, arg(10), handle[10], dtype=torch.int32, shape=((num_ranks + 31) // 32,), device=device)
        check_tensor(op, arg(4), handle[4], dtype=torch.int32, ndim=1, device=device)
        rows = handle[4].shape[0]
        if rows % num_domains or not num_domains <= rows <= num_domains * num_nvl_ranks:
            fail(op, arg(4), f"of N x P rows (N = {num_domains} domains, P in [1, {num_nvl_ranks}] parts)",
                 f"shape {tuple(handle[4].shape)}")
    shapes = {2: (num_ranks, channels), 3: (rows, channels), 4: (rows,), 5: (num_ranks, channels),
              6: (num_ranks,), 7: (None, 2), 8: (num_tokens, num_domains), 9: (None, num_nvl_ranks)}
    for i, shape in shapes.items():
        check_tensor(op, arg(i), handle[i], dtype=torch.int32, shape=shape, device=device)
    return HandleParts(tuple(handle), num_tokens, channels, handle[7].shape[0], handle[9].shape[0])
