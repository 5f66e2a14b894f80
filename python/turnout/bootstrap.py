"""The all-gather the C++ core bootstraps through, from a torch.distributed
process group or an mpi4py communicator."""
from typing import Callable, Tuple

AllGather = Callable[[bytes], bytes]


def from_group(group) -> Tuple[int, int, AllGather]:
    import torch.distributed as dist

    def all_gather(mine: bytes) -> bytes:
        parts = [None] * group.size()
        dist.all_gather_object(parts, mine, group=group)
        return b"".join(parts)

    return group.rank(), group.size(), all_gather


def from_mpi(comm) -> Tuple[int, int, AllGather]:
    def all_gather(mine: bytes) -> bytes:
        return b"".join(comm.allgather(mine))

    return comm.Get_rank(), comm.Get_size(), all_gather
