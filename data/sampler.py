"""A distributed sampler whose position is a global (epoch, offset) pair, so resuming is O(1).

Each epoch has one global order: a permutation of ``range(num_samples)`` drawn from a private generator
seeded with ``(seed, epoch)`` (or the identity when ``shuffle=False``). Ranks read it interleaved, exactly
like ``torch.utils.data.DistributedSampler``: from global offset ``o``, rank ``r`` reads the positions
``o + r, o + r + W, o + r + 2W, ...``. After every rank has drawn ``k`` samples, the consumed set is exactly
``order[:o + k·W]`` whatever the world size, which is why the state is global:

* ``epoch``: the epoch being read;
* ``index``: how many samples of that epoch's order all ranks together have consumed.

Resuming jumps to that position; nothing is replayed. If the world size changes between save and load, the
epoch and the global offset are kept and the rest of the epoch's order is re-partitioned among the new
ranks, so no sample is repeated or skipped within the epoch.

``drop_last=True`` drops the ``< W`` samples that would not give every rank one more sample;
``drop_last=False`` pads instead by wrapping around to the start of the order (as DistributedSampler does).
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np
import torch


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> np.ndarray:
    """The shuffled global order of one epoch, from a private generator keyed by ``(seed, epoch)``."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, epoch])))
    return rng.permutation(num_samples)


class ResumableDistributedSampler(torch.utils.data.Sampler[int]):
    """Yields this rank's disjoint share of a per-epoch permutation; resumable from ``state_dict()``.

    Iterating yields the rest of the current epoch and advances the state as each index is handed out;
    when the epoch is exhausted the sampler moves to the next epoch (new permutation) by itself.
    """

    def __init__(self, num_samples: int, rank: int, world_size: int, seed: int, shuffle: bool = True,
                 drop_last: bool = True) -> None:
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
        if seed < 0:
            raise ValueError(f"seed must be non-negative, got {seed}")
        if drop_last and num_samples < world_size:
            raise ValueError(
                f"num_samples={num_samples} is smaller than world_size={world_size}: with drop_last=True "
                "no rank would get a sample"
            )
        super().__init__()
        self.num_samples = num_samples
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        self.shuffle = shuffle
        self.drop_last = drop_last
        self.epoch = 0
        self.index = 0
        self._cached_epoch: int | None = None
        self._cached_order: np.ndarray | None = None

    def epoch_order(self, epoch: int) -> np.ndarray:
        """The global order of ``epoch`` (the last one is cached)."""
        if epoch != self._cached_epoch:
            if self.shuffle:
                order = epoch_permutation(self.num_samples, self.seed, epoch)
            else:
                order = np.arange(self.num_samples)
            self._cached_epoch, self._cached_order = epoch, order
        return self._cached_order

    def epoch_end(self, offset: int) -> int:
        """The global offset at which an epoch read from ``offset`` ends for this world size."""
        remaining = max(self.num_samples - offset, 0)
        per_rank = remaining // self.world_size if self.drop_last else -(-remaining // self.world_size)
        return offset + per_rank * self.world_size

    def rank_indices(self, epoch: int, offset: int, count: int) -> np.ndarray:
        """This rank's next ``count`` sample indices when all ranks have consumed ``offset`` of ``epoch``."""
        positions = offset + self.rank + self.world_size * np.arange(count)
        return self.epoch_order(epoch)[positions % self.num_samples]  # modulo: drop_last=False wraps

    def __len__(self) -> int:
        """How many indices the next ``iter()`` yields (the rest of the current epoch for this rank)."""
        return (self.epoch_end(self.index) - self.index) // self.world_size

    def __iter__(self) -> Iterator[int]:
        epoch, end = self.epoch, self.epoch_end(self.index)
        while self.epoch == epoch and self.index < end:
            (index,) = self.rank_indices(epoch, self.index, 1)
            self.index += self.world_size
            yield int(index)
        if self.epoch == epoch:  # not moved by load_state_dict/set_epoch while iterating
            self.set_epoch(epoch + 1)

    def set_epoch(self, epoch: int) -> None:
        """Start reading ``epoch`` from its beginning."""
        if epoch < 0:
            raise ValueError(f"epoch must be non-negative, got {epoch}")
        self.epoch, self.index = epoch, 0

    def state_dict(self) -> dict[str, int]:
        return {"epoch": self.epoch, "index": self.index}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Jump to a saved position in O(1); see the module docstring for a changed world size."""
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0:
            raise ValueError(f"invalid sampler state {state}: epoch and index must be non-negative")
        self.epoch, self.index = epoch, index
