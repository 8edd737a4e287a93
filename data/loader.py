"""An endless, exactly resumable micro-batch loader for one rank of a data-parallel run (every data kind).

Positions are global, as in :mod:`data.sampler`: the loader's state is ``(epoch, index)`` where ``index`` is
how many samples of the epoch's order all ranks together have consumed *before the next micro-batch this
loader will yield*. One global micro-step covers the contiguous slice ``order[index : index + B·W]``;
rank ``r`` takes every ``W``-th element of it starting at ``r`` (the sampler's interleaving). The last
``< B·W`` samples of an epoch are dropped, then the epoch counter moves on and a new permutation starts.

The position advances only when a batch is handed to the caller, never when workers prefetch one, so
``state_dict()`` is exact with any ``num_workers``. After ``load_state_dict`` the next batch is the one an
uninterrupted loader would have yielded next.

Changed world size (or micro-batch size) on resume: the epoch and the global offset are kept and the rest
of the epoch is re-partitioned among the new ranks in steps of ``B'·W'`` samples. No sample of the epoch
is repeated or skipped, except the final ``< B'·W'`` remainder that every epoch drops. (If the offset is
already too close to the end for one more step, the loader starts the next epoch.) Dynamic masks depend
only on ``(dataset seed, epoch, sample index)``, so they do not change either.

Samples are fetched with ``dataset.get_item(index, epoch)`` when the dataset has it (so per-epoch dynamic
masking sees the epoch), otherwise with ``dataset[index]``; any indexable collection works. Samples are
stacked by ``collate_fn``, by default the dataset's own ``collate`` when it has one, else torch's
``default_collate``.

A user error the dataset raises (a corrupt shard, a missing file) reaches the caller as itself, from a worker
process too: the DataLoader would re-raise it wrapped in the worker's traceback, so a worker hands it back as the
batch instead (`_Failure`) and ``__next__`` raises it, for the command's one-line report.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from core.errors import USER_ERRORS
from data.sampler import ResumableDistributedSampler


class _Failure:
    """A user error raised while fetching a batch, carried to the main process as the batch itself."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class _EpochKeyedView(torch.utils.data.Dataset):
    """Turns the keys ``(epoch, index)`` produced by the batch plan into samples (runs inside workers)."""

    def __init__(self, dataset: Sequence[Any]) -> None:
        self.dataset = dataset
        self._get_item = getattr(dataset, "get_item", None)

    def __getitem__(self, key: tuple[int, int]) -> Any:
        epoch, index = key
        try:
            return self._get_item(index, epoch) if self._get_item is not None else self.dataset[index]
        except USER_ERRORS as error:
            return _Failure(error)


class _CollateOrFail:
    """The loader's collate function, except that a batch with a failed sample becomes that `_Failure`."""

    def __init__(self, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        failure = next((s for s in samples if isinstance(s, _Failure)), None)
        return failure if failure is not None else self.collate_fn(samples)


class _BatchPlan:
    """Endless batches of ``(epoch, index)`` keys for one rank, starting from a global position."""

    def __init__(self, loader: ResumableLoader, epoch: int, index: int) -> None:
        self.loader, self.epoch, self.index = loader, epoch, index

    def __iter__(self) -> Iterator[list[tuple[int, int]]]:
        epoch, index = self.epoch, self.index
        sampler, batch_size = self.loader.sampler, self.loader.micro_batch_size
        while True:
            indices = sampler.rank_indices(epoch, index, batch_size)
            yield [(epoch, int(i)) for i in indices]
            epoch, index = self.loader.next_position(epoch, index)


class ResumableLoader:
    """Yields this rank's micro-batches forever, across epochs, with exact ``state_dict`` resume.

    ``samples_per_epoch`` counts samples consumed per full epoch by all ranks together
    (``batches_per_epoch · micro_batch_size · world_size``); ``batches_per_epoch`` counts this rank's
    micro-batches per full epoch. A ``torch.utils.data.DataLoader`` does the fetching (workers, pinning)
    with a private generator, so iterating never touches the global torch RNG.
    """

    def __init__(self, dataset: Sequence[Any], micro_batch_size: int, rank: int, world_size: int, seed: int,
                 *, shuffle: bool = True, num_workers: int = 0, pin_memory: bool = False,
                 collate_fn: Callable[[list[Any]], Any] | None = None,
                 shard_sizes: Sequence[int] | None = None) -> None:
        num_samples = len(dataset)
        if num_samples == 0:
            raise ValueError("the dataset is empty: a loader needs at least one sample")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        # shard_sizes (sharded datasets): shard-blocked epoch order, O(#shards) memory; see data/sampler.py.
        self.sampler = ResumableDistributedSampler(num_samples, rank, world_size, seed, shuffle=shuffle,
                                                   drop_last=True, shard_sizes=shard_sizes)
        share = num_samples // world_size
        if micro_batch_size > share:
            raise ValueError(
                f"micro_batch_size={micro_batch_size} is larger than each rank's share of the dataset: "
                f"{num_samples} samples // world_size={world_size} = {share} per rank"
            )
        self.dataset = dataset
        self.micro_batch_size = micro_batch_size
        self.num_workers = num_workers
        self.pin_memory = pin_memory
        self.collate_fn = collate_fn or getattr(dataset, "collate", None) or torch.utils.data.default_collate
        self.batches_per_epoch = share // micro_batch_size
        self.samples_per_epoch = self.batches_per_epoch * micro_batch_size * world_size
        self.epoch, self.index = 0, 0
        self._iterator: Iterator[Any] | None = None

    @property
    def global_batch_samples(self) -> int:
        """Samples consumed by one micro-step of all ranks together (``micro_batch_size · world_size``)."""
        return self.micro_batch_size * self.sampler.world_size

    def next_position(self, epoch: int, index: int) -> tuple[int, int]:
        """The position after the micro-step at ``(epoch, index)``; rolls over when the epoch runs out."""
        return self._normalize(epoch, index + self.global_batch_samples)

    def _normalize(self, epoch: int, index: int) -> tuple[int, int]:
        if index + self.global_batch_samples > self.sampler.num_samples:
            return epoch + 1, 0
        return epoch, index

    def __iter__(self) -> ResumableLoader:
        return self

    def __next__(self) -> Any:
        if self._iterator is None:
            self._iterator = iter(self._make_dataloader())
        batch = next(self._iterator)
        if isinstance(batch, _Failure):
            raise batch.error
        # Count only batches handed to the caller: workers may have fetched more, which a resume redoes.
        self.epoch, self.index = self.next_position(self.epoch, self.index)
        return batch

    def _make_dataloader(self) -> torch.utils.data.DataLoader:
        return torch.utils.data.DataLoader(
            _EpochKeyedView(self.dataset),
            batch_sampler=_BatchPlan(self, self.epoch, self.index),
            num_workers=self.num_workers,
            pin_memory=self.pin_memory,
            collate_fn=_CollateOrFail(self.collate_fn),
            # Private generator: DataLoader draws its worker base seed from here, not from the global RNG.
            generator=torch.Generator().manual_seed(self.sampler.seed),
        )

    def state_dict(self) -> dict[str, int]:
        """Position of the next micro-batch, plus the seed and dataset size it is only valid for."""
        return {"epoch": self.epoch, "index": self.index, "seed": self.sampler.seed,
                "num_samples": self.sampler.num_samples}

    def load_state_dict(self, state: dict[str, int]) -> None:
        """Jump to a saved position (O(1)); the next batch is the one that would have come next."""
        for key in ("seed", "num_samples"):
            mine = getattr(self.sampler, key)
            if key in state and int(state[key]) != mine:
                raise ValueError(
                    f"loader state was saved with {key}={state[key]} but this loader has {key}={mine}"
                )
        epoch, index = int(state["epoch"]), int(state["index"])
        if epoch < 0 or index < 0:
            raise ValueError(f"invalid loader state {state}: epoch and index must be non-negative")
        self.close()
        self.epoch, self.index = self._normalize(epoch, index)

    def close(self) -> None:
        """Stop prefetching (shuts worker processes down); iteration restarts lazily from the position."""
        self._iterator = None

