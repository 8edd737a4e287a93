"""Paired comparisons of seeded runs: runs that share a seed share their data order and initial weights, so the
per-seed difference, not the difference of two noisy means, says how far apart two optimizers are.

The rule that turns a comparison into words is here, once, so that every sentence of a results page follows it.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

# A mean paired difference at least this many paired standard errors from 0, with every seed's difference of the
# same sign, is called a lead or a lag; anything less is within the seeds' noise.
DECISIVE_ERRORS = 2.0


def mean_and_error(values: list[float]) -> tuple[float, float]:
    """The mean and its standard error (sample standard deviation / sqrt(n); 0 for one value)."""
    mean = statistics.fmean(values)
    return mean, statistics.stdev(values) / math.sqrt(len(values)) if len(values) > 1 else 0.0


@dataclass(frozen=True)
class Comparison:
    """A variant's losses against a reference's, seed by seed (lower loss is better)."""

    differences: tuple[float, ...]  # variant - reference, per shared seed in seed order
    seeds: tuple[int, ...]  # the shared seeds
    mean: float  # mean paired difference
    paired_se: float  # its standard error over the pairs
    unpaired_difference: float  # difference of the two means over all of each one's seeds
    unpaired_se: float  # both means' standard errors combined, as if the runs were independent

    @property
    def ratio(self) -> float | None:
        """The mean paired difference in paired standard errors (None without a spread)."""
        return self.mean / self.paired_se if self.paired_se else None


def compare(values: dict[int, float], reference: dict[int, float]) -> Comparison | None:
    """`values` and `reference` (seed -> loss) paired on their shared seeds; None when they share none."""
    seeds = tuple(sorted(set(values) & set(reference)))
    if not seeds:
        return None
    differences = tuple(values[s] - reference[s] for s in seeds)
    mean, paired_se = mean_and_error(list(differences))
    (own, own_se), (ref, ref_se) = mean_and_error(list(values.values())), mean_and_error(list(reference.values()))
    return Comparison(differences, seeds, mean, paired_se, own - ref, math.hypot(own_se, ref_se))


def verdict(comparison: Comparison, reference: str) -> str:
    """The comparison in words, by `DECISIVE_ERRORS`: "trails lamb by 0.066 (paired, 2 seeds)", "is ahead of lamb
    by ...", or "is within noise of lamb (+0.010 +- 0.020, paired, 2 seeds)"; one seed has no spread to judge by."""
    n = len(comparison.seeds)
    paired = f"paired, {n} seed{'s' if n > 1 else ''}"
    if n < 2:
        return f"differs from {reference} by {comparison.mean:+.3f} ({paired}: no spread to judge it by)"
    same_sign = all(d > 0 for d in comparison.differences) or all(d < 0 for d in comparison.differences)
    if same_sign and abs(comparison.mean) >= DECISIVE_ERRORS * comparison.paired_se:
        lead = "trails" if comparison.mean > 0 else "is ahead of"
        return f"{lead} {reference} by {abs(comparison.mean):.3f} ({paired})"
    return f"is within noise of {reference} ({comparison.mean:+.3f} \u00b1 {comparison.paired_se:.3f}, {paired})"
