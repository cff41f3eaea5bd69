"""A distributed sampler that resumes mid-epoch at any world size.

Every epoch is one deterministic permutation of the dataset (``seed + epoch``). The
sampler's position is a single global number, ``samples_consumed``: the first
``samples_consumed`` indices of the epoch's permutation have been trained on. The
*remaining* indices are dealt round-robin to the current ranks (rank ``r`` gets
positions ``r, r + W, r + 2W, ...``), so after every rank has taken ``m`` samples the
consumed set is again exactly a prefix of the permutation, of length ``m * W``. That is
why a checkpoint taken at world size 4 can be resumed at world size 3 (or 7) with no
sample of the epoch lost or seen twice.

The end of an epoch rarely divides evenly by the world size. ``tail`` says what to do
with the last ``remaining % W`` samples:

- ``"pad"`` (default, like ``torch.utils.data.DistributedSampler``): every rank gets the
  same number of samples; ranks short of one repeat samples from the start of the
  remaining list (at most ``W - 1`` samples are seen twice in the epoch).
- ``"drop"`` (torch's ``drop_last=True``): every rank gets the same number of samples;
  up to ``W - 1`` samples are skipped this epoch (they are in the next one's permutation).
- ``"uneven"``: nothing repeated or skipped; ranks differ by at most one sample, so
  the training loop must tolerate ranks doing different numbers of steps (e.g.
  ``torch.distributed.algorithms.join.Join``). Use it for evaluation or exact coverage.

The loop tells the sampler what it trained on with :meth:`advance` (after each
optimizer step), and saves :meth:`state_dict` (plain JSON) with its checkpoint.

What happens to the rest of the epoch when a checkpoint is resumed at another world
size is ``redistribution`` (default: the launcher's ``--redistribution``, i.e.
``ELASTICRUN_REDISTRIBUTION``; ``incremental`` without a launcher):

- ``incremental``: the epoch keeps its order; the remaining indices are exactly those
  the uninterrupted run would have trained next, dealt to the new ranks. With a fixed
  global batch this makes an interrupted run train on the same batches in the same
  order as an uninterrupted one (docs/training.md, "Exactly once and the same model").
- ``full`` (FullReshuffle): the epoch's remaining indices are reshuffled (seeded by
  ``seed``, the epoch and the position), as a freshly created sampler would. Still
  exactly once per epoch; the order after the rescale differs from an uninterrupted run.
"""

from __future__ import annotations

import math
import os
from typing import Any, Dict, Iterator, List, Optional, Sized, Tuple, Union

import torch
from torch.utils.data import Sampler

from elasticrun.errors import ConfigError
from elasticrun.job import env as names
from elasticrun.job.hints import RedistributionType

TAIL_MODES = ("pad", "drop", "uneven")


def _resolve_world(num_replicas: Optional[int], rank: Optional[int]) -> Tuple[int, int]:
    import torch.distributed as dist

    if num_replicas is None:
        num_replicas = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if rank is None:
        rank = dist.get_rank() if dist.is_available() and dist.is_initialized() else 0
    return num_replicas, rank


def default_redistribution() -> RedistributionType:
    """The launcher's ``--redistribution`` (``ELASTICRUN_REDISTRIBUTION``), else incremental."""
    raw = os.environ.get(names.REDISTRIBUTION, "").strip()
    return parse_redistribution(raw) if raw else RedistributionType.INCREMENTAL


def parse_redistribution(value: Union[RedistributionType, str]) -> RedistributionType:
    """``"full"``/``"FullReshuffle"``/``"incremental"`` → :class:`RedistributionType`."""
    if isinstance(value, RedistributionType):
        return value
    key = str(value).strip().lower().replace("_", "").replace("-", "")
    if key in ("full", "fullreshuffle", "reshuffle"):
        return RedistributionType.FULL_RESHUFFLE
    if key == "incremental":
        return RedistributionType.INCREMENTAL
    raise ConfigError(f"redistribution {value!r} is not 'full' or 'incremental'")


class ElasticDistributedSampler(Sampler[int]):
    """Yield this rank's share of the epoch's remaining indices; see the module docstring."""

    def __init__(
        self,
        dataset: Union[Sized, int],
        num_replicas: Optional[int] = None,
        rank: Optional[int] = None,
        *,
        shuffle: bool = True,
        seed: int = 0,
        tail: str = "pad",
        redistribution: Union[RedistributionType, str, None] = None,
    ) -> None:
        self.num_samples_total = dataset if isinstance(dataset, int) else len(dataset)
        if self.num_samples_total < 0:
            raise ConfigError(f"dataset size must be >= 0, got {self.num_samples_total}")
        world, rnk = _resolve_world(num_replicas, rank)
        if world < 1:
            raise ConfigError(f"num_replicas must be >= 1, got {world}")
        if not 0 <= rnk < world:
            raise ConfigError(f"rank {rnk} is outside 0..{world - 1}")
        if tail not in TAIL_MODES:
            raise ConfigError(f"tail must be one of {', '.join(TAIL_MODES)}, got {tail!r}")
        self.num_replicas = world
        self.rank = rnk
        self.shuffle = shuffle
        self.seed = int(seed)
        self.tail = tail
        self.redistribution = default_redistribution() if redistribution is None else parse_redistribution(
            redistribution)
        self.reshuffles: List[int] = []  # FullReshuffle: positions of this epoch where the rest was reshuffled
        self.epoch = 0
        self.samples_consumed = 0  # global, within self.epoch
        self._start = 0  # position the current/next iteration starts from

    # -- position -------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Move to ``epoch``. Staying on the current epoch keeps the resume position;
        any other epoch starts from its beginning."""
        if epoch != self.epoch:
            self.epoch = int(epoch)
            self.samples_consumed = 0
            self.reshuffles = []
        self._start = self.samples_consumed

    def advance(self, local_samples: int) -> int:
        """Record that every rank trained on ``local_samples`` more samples (one step's local
        batch); returns the new global ``samples_consumed`` (capped at the dataset size)."""
        if local_samples < 0:
            raise ValueError(f"local_samples must be >= 0, got {local_samples}")
        self.samples_consumed = min(
            self.num_samples_total, self.samples_consumed + local_samples * self.num_replicas
        )
        return self.samples_consumed

    @property
    def epoch_done(self) -> bool:
        """True once the whole epoch has been consumed."""
        return self.samples_consumed >= self.num_samples_total

    @property
    def remaining(self) -> int:
        """Global number of samples of this epoch not yet consumed."""
        return self.num_samples_total - self.samples_consumed

    # -- indices --------------------------------------------------------------------

    def permutation(self, epoch: Optional[int] = None) -> List[int]:
        """The epoch's full index order (identical on every rank and every world size)."""
        epoch = self.epoch if epoch is None else epoch
        if not self.shuffle:
            order = list(range(self.num_samples_total))
        else:
            g = torch.Generator()
            g.manual_seed(self.seed + int(epoch))
            order = torch.randperm(self.num_samples_total, generator=g).tolist()
        if epoch == self.epoch:
            for pos in self.reshuffles:  # FullReshuffle rescales: the rest was dealt anew
                g = torch.Generator()
                g.manual_seed(_mix(self.seed, int(epoch), pos))
                rest = order[pos:]
                order[pos:] = [rest[i] for i in torch.randperm(len(rest), generator=g).tolist()]
        return order

    def _share_len(self, remaining: int) -> int:
        w = self.num_replicas
        if self.tail == "pad":
            return math.ceil(remaining / w)
        if self.tail == "drop":
            return remaining // w
        return max(0, math.ceil((remaining - self.rank) / w))

    def indices(self) -> List[int]:
        """This rank's indices from the current start position (what ``iter`` yields)."""
        rest = self.permutation()[self._start:]
        w = self.num_replicas
        if not rest:
            return []
        if self.tail == "pad":
            total = math.ceil(len(rest) / w) * w
            pad = total - len(rest)
            while pad > 0:  # wrap around (repeatedly if fewer samples than ranks are left)
                take = rest[: min(pad, len(rest))]
                rest = rest + take
                pad -= len(take)
        elif self.tail == "drop":
            rest = rest[: (len(rest) // w) * w]
        return rest[self.rank :: w]

    def __iter__(self) -> Iterator[int]:
        self._start = self.samples_consumed
        return iter(self.indices())

    def __len__(self) -> int:
        return self._share_len(self.num_samples_total - self._start)

    # -- state ----------------------------------------------------------------------

    def state_dict(self) -> Dict[str, Any]:
        """Plain JSON: enough to resume at any world size."""
        return {
            "epoch": self.epoch,
            "samples_consumed": self.samples_consumed,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_samples": self.num_samples_total,
            "tail": self.tail,
            "world_size": self.num_replicas,
            "reshuffles": list(self.reshuffles),
        }

    def load_state_dict(self, state: Dict[str, Any]) -> None:
        """Resume from :meth:`state_dict` (or any dict with ``epoch`` and ``samples_consumed``,
        e.g. a checkpoint's TrainingState). The saving world size does not matter."""
        n = state.get("num_samples")
        if n is not None and int(n) != self.num_samples_total:
            raise ConfigError(
                f"sampler state is for a dataset of {n} samples but this dataset has "
                f"{self.num_samples_total}: the resume position would be meaningless"
            )
        for key in ("seed", "shuffle"):
            if key in state and state[key] != getattr(self, key):
                raise ConfigError(
                    f"sampler state was saved with {key}={state[key]!r} but this sampler has "
                    f"{key}={getattr(self, key)!r}: the epoch order would differ"
                )
        consumed = int(state.get("samples_consumed", 0))
        if not 0 <= consumed <= self.num_samples_total:
            raise ConfigError(
                f"samples_consumed={consumed} is outside 0..{self.num_samples_total} for this dataset"
            )
        self.epoch = int(state.get("epoch", 0))
        self.samples_consumed = consumed
        self._start = consumed
        self.reshuffles = [int(p) for p in state.get("reshuffles", [])]
        saved_world = int(state.get("world_size", self.num_replicas))
        if (self.redistribution is RedistributionType.FULL_RESHUFFLE and saved_world != self.num_replicas
                and 0 < consumed < self.num_samples_total and consumed not in self.reshuffles):
            self.reshuffles.append(consumed)


def _mix(seed: int, epoch: int, pos: int) -> int:
    from elasticrun.train.rng import derive_seed

    return derive_seed(seed, epoch, pos)


__all__ = ["ElasticDistributedSampler", "TAIL_MODES", "default_redistribution", "parse_redistribution"]
