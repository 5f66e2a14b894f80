"""Shrink mode as the tests drive it: low-latency round trips checked against
the host reference with the masked ranks' tokens and experts removed, and the
mask as a rank reads it. Shared by the in-runner tests (test_shrink.py) and
the job whose rank is killed (shrink_kill_job.py)."""
import time
from typing import Dict, FrozenSet, Iterable, Tuple

import torch

from harness import count_check
from low_latency_cases import (
    LLCase,
    LLInputs,
    MyRows,
    all_x,
    check_combine,
    check_dispatch,
    combine_call,
    dispatch,
    expert_outputs,
    inputs_of,
    reference_dispatch,
)

# Short, so that a test sees several timeouts; the default is seconds.
SHRINK_S = 1.0
CASES = (LLCase("uniform", 32, 32, 2048, 8, 64, "bf16"), LLCase("uniform", 32, 32, 2048, 8, 64, "fp8"))


def empty_inputs(inp: LLInputs) -> LLInputs:
    return LLInputs(inp.x[:0], inp.topk_idx[:0], inp.topk_weights[:0], inp.other_weights[:0])


def without_masked_experts(topk_idx: torch.Tensor, masked: Iterable[int], experts_per_rank: int) -> torch.Tensor:
    """topk_idx with -1 where the expert lives on a masked rank."""
    ids = topk_idx.clone()
    for r in masked:
        ids[(ids >= 0) & (ids // experts_per_rank == r)] = -1
    return ids


class References:
    """The inputs of every rank and the reference dispatch with a set of
    masked ranks sending nothing, per (case, masked set), made once."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._inputs: Dict[LLCase, list] = {}
        self._refs: Dict[Tuple[LLCase, FrozenSet[int]], list] = {}

    def inputs(self, case: LLCase) -> list:
        if case not in self._inputs:
            self._inputs[case] = [inputs_of(case, self.n, r) for r in range(self.n)]
        return self._inputs[case]

    def refs(self, case: LLCase, masked: FrozenSet[int]) -> list:
        key = (case, frozenset(masked))
        if key not in self._refs:
            inputs = [empty_inputs(i) if r in masked else i for r, i in enumerate(self.inputs(case))]
            self._refs[key] = reference_dispatch(case, self.n, inputs)
        return self._refs[key]


def mask_of(buf, n: int, device) -> set:
    status = torch.full((n,), -1, dtype=torch.int32, device=device)
    buf.low_latency_query_mask_buffer(status)
    values = status.cpu()
    count_check()
    if not bool(((values == 0) | (values == 1)).all()):
        raise AssertionError(f"low_latency_query_mask_buffer wrote {values.tolist()}, expected zeros and ones")
    return set(values.nonzero().flatten().tolist())


def assert_mask(buf, n: int, device, expected: set, what: str) -> None:
    got = mask_of(buf, n, device)
    assert got == expected, f"{what}: the mask holds ranks {sorted(got)}, expected {sorted(expected)}"


class Step:
    """One rank's low-latency calls of one case, each checked against the
    reference for the masked set the caller expects after the call."""

    def __init__(self, ctx, buf, refs: References, case: LLCase, weights_at_dispatch=False, hook=False,
                 logfmt=False) -> None:
        self.ctx, self.buf, self.refs, self.case = ctx, buf, refs, case
        self.weights_at_dispatch, self.hook, self.logfmt = weights_at_dispatch, hook, logfmt
        self.out = None
        self.canon = None
        self.finished_at = 0.0  # time.time() when the last call's work was done, before its checks

    def dispatch(self, masked: set, what: str) -> float:
        """Dispatch; checks the rows against the reference without `masked`'s
        tokens. Returns the seconds it took (the host waits)."""
        me, dev, case = self.ctx.rank, self.ctx.device, self.case
        inp = self.refs.inputs(case)[me]
        kwargs = {"return_recv_hook": self.hook}
        if self.weights_at_dispatch:
            kwargs["topk_weights"] = inp.topk_weights.to(dev)
        start = time.monotonic()
        self.out = dispatch(self.buf, case, inp, dev, **kwargs)
        if self.hook:
            self.out[4]()
        torch.cuda.synchronize()
        self.finished_at = time.time()
        elapsed = time.monotonic() - start
        self.canon = check_dispatch(self.out, self.refs.refs(case, masked)[me], case, self.refs.n, what, dev)
        return elapsed

    def combine(self, dispatch_masked: set, masked: set, what: str) -> float:
        """Combine of the expert outputs of the last dispatch (made with
        `dispatch_masked`); checks the result against the reference without
        the top-k slots of `masked`'s experts. Returns the seconds it took."""
        me, dev, case, n = self.ctx.rank, self.ctx.device, self.case, self.refs.n
        inputs = self.refs.inputs(case)
        inp = inputs[me]
        y = expert_outputs(self.canon, all_x(inputs, case), case, n, me, dev)
        weights = inp.other_weights if self.weights_at_dispatch else inp.topk_weights
        start = time.monotonic()
        combined, _, hook = combine_call(self.buf, y, self.out[2], inp.topk_idx.to(dev), weights.to(dev),
                                         use_logfmt=self.logfmt, return_recv_hook=self.hook)
        if self.hook:
            hook()
        torch.cuda.synchronize()
        self.finished_at = time.time()
        elapsed = time.monotonic() - start
        mine = MyRows(self.refs.refs(case, dispatch_masked), me, inp.x)
        ids = without_masked_experts(inp.topk_idx, masked, case.experts // n)
        check_combine(combined, mine, ids, inp.topk_weights, case, n, what, logfmt=self.logfmt)
        return elapsed


def variants(case: LLCase):
    """(weights_at_dispatch, hook, logfmt) of every call shape a step covers."""
    yield False, False, False
    yield True, False, False
    yield False, True, False
    if not case.use_fp8:
        yield False, False, True
