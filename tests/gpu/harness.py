"""What every GPU test gets: its rank, its GPU, process groups of every size the
machine allows, and comparison helpers that say what differed."""
import numpy as np
import torch
import torch.distributed as dist


class Context:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device("cuda", rank)
        # new_group is collective over WORLD: make every size once, up front.
        self.groups = {}
        for n in (2, 4, 8):
            if n < world_size:
                self.groups[n] = dist.new_group(list(range(n)))
        self.groups[world_size] = dist.group.WORLD

    def sizes(self):
        """Group sizes to test, smallest first (2 and 4 where the GPUs allow)."""
        return sorted(n for n in self.groups if n >= 2)

    def group(self, size: int):
        """The group of ranks [0, size), or None on ranks outside it."""
        return self.groups[size] if self.rank < size else None

    def all_gather(self, obj, group=None):
        group = group or dist.group.WORLD
        out = [None] * dist.get_world_size(group)
        dist.all_gather_object(out, obj, group=group)
        return out


def assert_equal(got, expected, what: str) -> None:
    """Bitwise equality of two tensors/arrays, with the first differing index."""
    g = got.cpu().numpy() if isinstance(got, torch.Tensor) else np.asarray(got)
    e = expected.cpu().numpy() if isinstance(expected, torch.Tensor) else np.asarray(expected)
    if g.shape != e.shape:
        raise AssertionError(f"{what}: shape {g.shape} != expected {e.shape}")
    if g.dtype != e.dtype and not (g.dtype.kind == e.dtype.kind == "b"):
        g = g.astype(e.dtype)
    diff = np.argwhere(g != e)
    if len(diff):
        i = tuple(diff[0])
        raise AssertionError(f"{what}: {len(diff)} elements differ; first at {i}: got {g[i]}, expected {e[i]}")


def assert_raises(kind, fn, *words):
    """Calls fn, which must raise `kind` with every word of `words` in its message."""
    try:
        fn()
    except kind as e:
        message = str(e)
        missing = [w for w in words if w not in message]
        if missing:
            raise AssertionError(f"{kind.__name__} raised, but its message lacks {missing}: {message!r}")
        return e
    except BaseException as e:
        raise AssertionError(f"expected {kind.__name__}, got {type(e).__name__}: {e}") from e
    raise AssertionError(f"expected {kind.__name__}, nothing was raised")
