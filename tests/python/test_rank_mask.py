"""Shrink mode's mask methods check their arguments before anything reaches
the native buffer, and refuse a buffer built without enable_shrink."""
import types

import pytest
import torch

from turnout.ops import rank_mask


class FakeNative:
    def __init__(self, shrink: bool) -> None:
        self.shrink_enabled = shrink
        self.calls = []

    def update_mask(self, **kwargs):
        self.calls.append(("update_mask", kwargs))

    def query_mask(self, **kwargs):
        self.calls.append(("query_mask", kwargs))

    def clean_mask(self, **kwargs):
        self.calls.append(("clean_mask", kwargs))


def context(shrink: bool, num_ranks: int = 4):
    return types.SimpleNamespace(native=FakeNative(shrink), num_ranks=num_ranks, device=torch.device("cuda", 0),
                                 tail=None)


@pytest.mark.parametrize("call", [
    lambda c: rank_mask.update(c, 1, True),
    lambda c: rank_mask.query(c, torch.zeros(4, dtype=torch.int32)),
    lambda c: rank_mask.clean(c),
])
def test_without_enable_shrink_every_method_refuses(call):
    c = context(shrink=False)
    with pytest.raises(RuntimeError, match="enable_shrink=True"):
        call(c)
    assert c.native.calls == []


@pytest.mark.parametrize("rank", [-1, 4, 100])
def test_update_refuses_a_rank_outside_the_group(rank):
    c = context(shrink=True)
    with pytest.raises(ValueError, match="rank_to_mask"):
        rank_mask.update(c, rank, True)
    assert c.native.calls == []


def test_update_refuses_a_mask_that_is_no_bool():
    c = context(shrink=True)
    with pytest.raises(TypeError, match="mask"):
        rank_mask.update(c, 1, 1)
    with pytest.raises(TypeError, match="rank_to_mask"):
        rank_mask.update(c, 1.0, True)
    assert c.native.calls == []


@pytest.mark.parametrize("status, words", [
    (torch.zeros(4, dtype=torch.int64), "dtype"),
    (torch.zeros(5, dtype=torch.int32), "on cuda:0"),
    (torch.zeros(2, 2, dtype=torch.int32), "on cuda:0"),
    ("not a tensor", "torch.Tensor"),
])
def test_query_refuses_a_wrong_mask_status(status, words):
    c = context(shrink=True)
    with pytest.raises((TypeError, ValueError), match="mask_status") as e:
        rank_mask.query(c, status)
    assert words in str(e.value)
    assert c.native.calls == []
