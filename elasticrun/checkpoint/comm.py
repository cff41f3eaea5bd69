"""Coordination between the ranks of a save or load: rank, world size, gather of small
Python objects. Works without ``torch.distributed`` (a world of one) and with any process
group whose backend moves CPU objects (gloo; pass a gloo group when training with NCCL).
"""

from __future__ import annotations

from typing import Any, Callable, List, Optional, TypeVar

from elasticrun.errors import CheckpointError

T = TypeVar("T")


class Comm:
    """A thin view of a process group (or of a single process)."""

    def __init__(self, process_group: Any = None) -> None:
        import torch.distributed as dist

        self.group = process_group
        self.distributed = dist.is_available() and dist.is_initialized()
        if process_group is not None and not self.distributed:
            raise ValueError("a process_group was given but torch.distributed is not initialised")
        if self.distributed:
            self.rank = dist.get_rank(process_group)
            self.world_size = dist.get_world_size(process_group)
            if self.rank < 0:
                raise ValueError("this process is not a member of the given process_group")
        else:
            self.rank, self.world_size = 0, 1

    @classmethod
    def local(cls, rank: int = 0, world_size: int = 1) -> Comm:
        """A single process acting as ``rank`` of ``world_size`` (offline resharding)."""
        c = cls.__new__(cls)
        c.group, c.distributed, c.rank, c.world_size = None, False, rank, world_size
        return c

    def all_gather(self, obj: Any) -> List[Any]:
        """Every rank's ``obj``, in rank order."""
        if not self.distributed:
            return [obj]
        import torch.distributed as dist

        out: List[Optional[Any]] = [None] * self.world_size
        try:
            dist.all_gather_object(out, obj, group=self.group)
        except RuntimeError as err:  # gloo: a peer died or the group was torn down
            first = (str(err).strip().splitlines() or [err.__class__.__name__])[0][:200]
            raise CheckpointError(
                f"lost contact with the other ranks during a checkpoint operation ({first}); nothing was committed"
            ) from None
        return out

    def broadcast(self, obj: Any) -> Any:
        """Rank 0's ``obj`` on every rank."""
        return obj if not self.distributed else self.all_gather(obj)[0]

    def barrier(self) -> None:
        if self.distributed:
            import torch.distributed as dist

            dist.barrier(group=self.group)


def on_rank0(fn: Callable[[], T], process_group: Any = None) -> T:
    """``fn()`` computed on rank 0 only, handed to every rank (collective when a process group
    exists). A CheckpointError raised on rank 0 is raised on every rank."""
    import torch.distributed as dist

    result: Any = None
    error: Optional[str] = None
    is_dist = dist.is_available() and dist.is_initialized()
    if not is_dist or dist.get_rank(process_group) == 0:
        try:
            result = fn()
        except CheckpointError as err:
            error = str(err)
    if is_dist and dist.get_world_size(process_group) > 1:
        box: List[Any] = [(result, error)]
        src = 0 if process_group is None else dist.get_global_rank(process_group, 0)
        dist.broadcast_object_list(box, src=src, group=process_group)
        result, error = box[0]
    if error is not None:
        raise CheckpointError(error)
    return result


def private_group(process_group: Any = None) -> Any:
    """A new gloo group with the same members, for collectives run on a background thread."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        return None
    ranks = None if process_group is None else dist.get_process_group_ranks(process_group)
    return dist.new_group(ranks=ranks, backend="gloo")
