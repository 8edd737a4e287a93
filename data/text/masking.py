"""BERT masked-LM input corruption (the 80/10/10 rule) in a fixed-size output form.

The same masker serves static masking (applied once when instances are built) and dynamic masking (applied
per epoch and per sample in the loader). Its randomness always comes from a ``numpy.random.Generator``
handed in by the caller, usually :func:`masking_rng` keyed by ``(seed, epoch, sample index)``: the mask of a
sample is then a pure function of that key, so a resumed run, any number of loader workers and any world
size see exactly the same masks.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np

IGNORE_INDEX = -100  # label of unused prediction slots; ignored by torch.nn.CrossEntropyLoss


class MaskedLM(NamedTuple):
    input_ids: np.ndarray  # [n] int64, the corrupted sequence fed to the model
    masked_lm_positions: np.ndarray  # [P] int64, sorted; unused slots hold position 0
    masked_lm_labels: np.ndarray  # [P] int64, original token ids; unused slots hold IGNORE_INDEX


def masking_rng(seed: int, *key: int) -> np.random.Generator:
    """A private generator for one masking draw, e.g. ``masking_rng(seed, epoch, index)``.

    ``SeedSequence`` mixes the whole key, so neighbouring keys give independent streams.
    """
    if seed < 0 or any(k < 0 for k in key):
        raise ValueError(f"masking seed and key must be non-negative, got seed={seed}, key={key}")
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, *key])))


@dataclass(frozen=True)
class MLMMasker:
    """Choose ``masked_lm_prob`` of the eligible tokens and corrupt them with the 80/10/10 rule.

    Eligible tokens are all tokens except ``special_token_ids`` ([CLS], [SEP], [PAD], [UNK], [MASK]).
    The number of predictions is ``round(masked_lm_prob · #eligible)``, at least 1 and at most
    ``max_predictions``. Of the chosen positions, 80% become [MASK], 10% a random token and 10% stay
    unchanged (each decided independently). Random replacements are drawn uniformly from the
    vocabulary minus the special tokens. Differences from Google's ``create_pretraining_data``: the rate is
    taken over eligible tokens rather than all tokens, [UNK] is never a target, and a random replacement
    is never a special token.
    """

    vocab_size: int
    mask_token_id: int
    special_token_ids: tuple[int, ...]
    masked_lm_prob: float = 0.15
    max_predictions: int = 20
    mask_fraction: float = 0.8  # of the chosen tokens, replaced by [MASK]
    random_fraction: float = 0.1  # of the chosen tokens, replaced by a random token; the rest are kept
    _is_special: np.ndarray = field(init=False, repr=False, compare=False)  # [vocab_size] bool lookup
    _replacements: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 < self.masked_lm_prob < 1.0:
            raise ValueError(f"masked_lm_prob must be in (0, 1), got {self.masked_lm_prob}")
        if self.max_predictions < 1:
            raise ValueError(f"max_predictions must be >= 1, got {self.max_predictions}")
        if not (self.mask_fraction >= 0 and self.random_fraction >= 0
                and self.mask_fraction + self.random_fraction <= 1):
            raise ValueError(
                f"mask_fraction={self.mask_fraction} and random_fraction={self.random_fraction} must be "
                "non-negative and sum to at most 1"
            )
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id={self.mask_token_id} is outside the vocabulary [0, {self.vocab_size})"
            )
        special = np.unique(np.asarray([*self.special_token_ids, self.mask_token_id], dtype=np.int64))
        is_special = np.zeros(self.vocab_size, dtype=bool)
        is_special[special] = True
        object.__setattr__(self, "special_token_ids", tuple(int(i) for i in special))
        object.__setattr__(self, "_is_special", is_special)
        object.__setattr__(self, "_replacements", np.setdiff1d(np.arange(self.vocab_size), special))

    @classmethod
    def from_tokenizer(cls, tokenizer, masked_lm_prob: float = 0.15, max_predictions: int = 20) -> MLMMasker:
        """Build a masker from a Hugging Face tokenizer's vocabulary and special tokens."""
        return cls(
            vocab_size=len(tokenizer),
            mask_token_id=tokenizer.mask_token_id,
            special_token_ids=tuple(tokenizer.all_special_ids),
            masked_lm_prob=masked_lm_prob,
            max_predictions=max_predictions,
        )

    def eligible_positions(self, input_ids: np.ndarray) -> np.ndarray:
        """Positions that may be chosen for prediction (not special tokens, not padding)."""
        return np.flatnonzero(~self._is_special[input_ids])

    def num_predictions(self, num_eligible: int) -> int:
        if num_eligible == 0:
            return 0
        return min(self.max_predictions, max(1, round(num_eligible * self.masked_lm_prob)), num_eligible)

    def __call__(self, input_ids: Iterable[int] | np.ndarray, rng: np.random.Generator) -> MaskedLM:
        """Corrupt one sequence (padded or not); ``rng`` is the only source of randomness."""
        ids = np.array(input_ids, dtype=np.int64)  # a copy: the caller's array stays untouched
        eligible = self.eligible_positions(ids)
        k = self.num_predictions(len(eligible))
        # Draw a fixed number of variates per call so the stream layout does not depend on outcomes.
        chosen = np.sort(rng.choice(eligible, size=k, replace=False)) if k else eligible[:0]
        action = rng.random(k)
        random_ids = self._replacements[rng.integers(0, len(self._replacements), size=k)]

        positions = np.zeros(self.max_predictions, dtype=np.int64)
        labels = np.full(self.max_predictions, IGNORE_INDEX, dtype=np.int64)
        positions[:k] = chosen
        labels[:k] = ids[chosen]

        to_mask = action < self.mask_fraction
        to_random = (action >= self.mask_fraction) & (action < self.mask_fraction + self.random_fraction)
        ids[chosen[to_mask]] = self.mask_token_id
        ids[chosen[to_random]] = random_ids[to_random]
        return MaskedLM(ids, positions, labels)
