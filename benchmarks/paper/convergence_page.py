"""The convergence study's page, rendered from its per-run data: tables, figures and every figure quoted in a sentence.

A page is a template: Markdown in which `{{ expression }}` (or `{{ expression | format }}`, e.g. `| .3f`) is replaced
by the value of the expression over the study's `Results` (the names of `Results.namespace`). So no number on the
page is typed: a changed run changes the page when it is rendered again, and a test renders the shipped page from
the shipped data.
"""

from __future__ import annotations

import re
import statistics
from pathlib import Path
from typing import Any

from benchmarks.common import markdown_table
from benchmarks.paper.convergence_data import RunData, StudyData
from benchmarks.paper.paired import Comparison, compare, verdict
from core.errors import UserError

REFERENCE = "lamb"  # the baseline every difference is measured against (NVLAMB, as in NVIDIA's recipe)
DEFAULT_TEMPLATE = Path(__file__).with_name("convergence_template.md")
_PLACEHOLDER = re.compile(r"\{\{(.+?)\}\}", re.DOTALL)


class Results:
    """What a study's data says, per variant: means over seeds, paired comparisons, bytes."""

    def __init__(self, data: StudyData, reference: str = REFERENCE) -> None:
        self.data, self.reference = data, reference
        if reference not in data.variants():
            raise UserError(f"the study's data has no {reference} runs: every difference is measured against them")

    # ------------------------------------------------------------------------------------ per variant
    def _runs(self, variant: str) -> list[RunData]:
        runs = self.data.seeded(variant)
        if not runs and self.data.mean_run(variant) is None:
            raise UserError(f"the study has no variant {variant!r}; it has: {', '.join(self.data.variants())}")
        return runs

    def seeds(self, variant: str) -> int:
        return len(self._runs(variant))

    def steps(self, variant: str) -> list[int]:
        """The steps the variant was evaluated at."""
        runs = self._runs(variant) + [r for r in [self.data.mean_run(variant)] if r is not None]
        return sorted({p.step for run in runs for p in run.points if p.val_loss is not None})

    def final_step(self, variant: str) -> int:
        return self.steps(variant)[-1]

    def per_seed(self, variant: str, step: int | None = None) -> dict[int, float]:
        """seed -> validation loss at `step` (None: the final evaluation), for the seeds that hold it."""
        step = self.final_step(variant) if step is None else step
        return {run.seed: loss for run in self._runs(variant) if (loss := run.val_loss(step)) is not None}

    def val(self, variant: str, step: int | None = None) -> float:
        """The mean validation loss over the seeds at `step` (None: final); from the record of means where the
        study kept no per-seed value there."""
        per_seed = self.per_seed(variant, step)
        if per_seed and len(per_seed) == self.seeds(variant):
            return statistics.fmean(per_seed.values())
        mean_run = self.data.mean_run(variant)
        loss = mean_run.val_loss(self.final_step(variant) if step is None else step) if mean_run else None
        if loss is None:
            raise UserError(f"{variant!r} has no validation loss at step {step}")
        return loss

    def seed_val(self, variant: str, seed: int, step: int | None = None) -> float:
        return self.per_seed(variant, step)[seed]

    def _mean_of(self, variant: str, name: str) -> float | None:
        values = [getattr(run, name) for run in self._runs(variant) if getattr(run, name) is not None]
        if values:
            return statistics.fmean(values)
        mean_run = self.data.mean_run(variant)
        return getattr(mean_run, name) if mean_run else None

    def bits(self, variant: str) -> float | None:
        """Bits per parameter per step as sent."""
        return self._mean_of(variant, "bits_per_param_per_step")

    def bits_fp32(self, variant: str) -> float | None:
        """Bits per parameter per step with every value at 32 bits (None: not measured)."""
        return self._mean_of(variant, "bits_at_fp32")

    def share(self, variant: str, at_fp32: bool = False) -> float | None:
        """The variant's bits as a fraction of the reference's, as sent or both at 32 bits per value."""
        get = self.bits_fp32 if at_fp32 else self.bits
        own, reference = get(variant), get(self.reference)
        return own / reference if own is not None and reference else None

    def replica_bits(self, variant: str) -> float | None:
        """Bits per parameter per step of the replica averages for evaluation and export, counted apart."""
        return self._mean_of(variant, "replica_average_bits")

    def settings(self) -> list[tuple[str, str]]:
        """(variant, its optimizer's preset) for every variant that changes a setting of a preset in the data."""
        presets = set(self.data.variants())
        return [(v, run.optimizer) for v in self.data.variants() if (run := self._first(v)).optimizer != v
                and run.optimizer in presets]

    def _first(self, variant: str) -> RunData:
        return (self._runs(variant) or [self.data.mean_run(variant)])[0]

    def wall_minutes(self, variant: str) -> float | None:
        seconds = self._mean_of(variant, "wall_seconds")
        return seconds / 60 if seconds is not None else None

    def squad(self, variant: str) -> float | None:
        return self._mean_of(variant, "squad_f1")

    # ------------------------------------------------------------------------------------ against another
    def comparison(self, variant: str, reference: str | None = None, step: int | None = None) -> Comparison | None:
        """The variant against the reference (default LAMB), paired by seed, at `step` (None: final)."""
        reference = reference or self.reference
        return compare(self.per_seed(variant, step), self.per_seed(reference, step))

    def gap(self, variant: str, step: int | None = None, reference: str | None = None) -> float:
        """The mean paired difference to the reference at `step`; the difference of the means where the study kept
        only means there (the same thing over the same seeds)."""
        comparison = self.comparison(variant, reference, step)
        full = comparison is not None and len(comparison.seeds) == self.seeds(variant)
        return comparison.mean if full else self.val(variant, step) - self.val(reference or self.reference, step)

    def pairs(self, variant: str, reference: str | None = None, step: int | None = None) -> str:
        """Each seed's difference, e.g. "+0.061 and +0.070"."""
        differences = [f"{d:+.3f}" for d in self._compared(variant, reference, step).differences]
        return " and ".join([", ".join(differences[:-1]), differences[-1]]) if len(differences) > 1 else \
            differences[0]

    def verdict(self, variant: str, reference: str | None = None, step: int | None = None) -> str:
        return verdict(self._compared(variant, reference, step), reference or self.reference)

    def _compared(self, variant: str, reference: str | None, step: int | None) -> Comparison:
        comparison = self.comparison(variant, reference, step)
        if comparison is None:
            raise UserError(f"{variant!r} and {reference or self.reference!r} share no seed at step {step}")
        return comparison

    # ------------------------------------------------------------------------------------ tables
    def results_table(self) -> str:
        rows = []
        for variant in self.data.variants():
            row: dict[str, Any] = {"variant": variant, "seeds": self.seeds(variant)}
            row.update({f"val loss @{step}": _round(self.val(variant, step), 3) for step in self.steps(variant)})
            row["final per seed"] = " ".join(f"{v:.3f}" for v in self.per_seed(variant).values())
            row["wall min"] = _round(self.wall_minutes(variant), 1)
            row["SQuAD F1"] = _round(self.squad(variant), 1)
            rows.append(row)
        return markdown_table(rows)

    def paired_table(self) -> str:
        rows = []
        for variant in self.data.variants():
            if variant == self.reference:
                continue
            c = self.comparison(variant)
            if c is None:
                continue
            rows.append({
                "variant": variant, "seeds paired": len(c.seeds),
                "per-seed difference": " ".join(f"{d:+.3f}" for d in c.differences),
                "mean": f"{c.mean:+.3f}", "paired SE": f"{c.paired_se:.3f}",
                "mean / paired SE": "" if c.ratio is None else f"{c.ratio:+.1f}",
                "unpaired difference": f"{c.unpaired_difference:+.3f}", "unpaired SE": f"{c.unpaired_se:.3f}",
                "verdict": self.verdict(variant),
            })
        return markdown_table(rows)

    def bytes_table(self) -> str:
        rows = []
        for variant in sorted(self.data.variants(), key=lambda v: self.bits(v) or 0.0):
            rows.append({
                "variant": variant, "bits/param/step as sent": _round(self.bits(variant), 3),
                f"% of {self.reference}'s": _percent(self.share(variant)),
                "at 32 bits per value": _round(self.bits_fp32(variant), 3),
                f"% of {self.reference}'s at 32 bits": _percent(self.share(variant, at_fp32=True)),
                "replica averages (apart)": _round(self.replica_bits(variant), 3),
            })
        return markdown_table(rows)

    def settings_table(self, only: str | None = None, but: str | None = None) -> str:
        """Each setting against its own preset on the same seeds: of preset `only`, or of every preset but `but`."""
        rows = []
        for variant, preset in self.settings():
            if (only is not None and preset != only) or preset == but:
                continue
            rows.append({
                "setting": f"`{variant}`", "against": f"`{preset}`",
                "final per seed": " ".join(f"{v:.3f}" for v in self.per_seed(variant).values()),
                "mean": f"{self.val(variant):.3f}", "difference per seed": self.pairs(variant, preset),
                "verdict": self.verdict(variant, preset), "bits/param/step": _round(self.bits(variant), 3),
            })
        return markdown_table(rows) if rows else ""

    def verdicts(self) -> str:
        """One bullet per variant: its verdict against the reference at the final evaluation."""
        return "\n".join(f"- `{v}` {self.verdict(v)}." for v in self.data.variants()
                         if v != self.reference and self.comparison(v) is not None)

    # ------------------------------------------------------------------------------------ templates
    def namespace(self) -> dict[str, Any]:
        """The names a page template's expressions may use."""
        tables = {"results": self.results_table, "paired": self.paired_table, "bytes": self.bytes_table}
        return {
            "meta": self.data.meta, "reference": self.reference, "val": self.val, "seed_val": self.seed_val,
            "per_seed": self.per_seed, "replica_bits": self.replica_bits, "settings": self.settings,
            "gap": self.gap, "pairs": self.pairs, "verdict": self.verdict, "comparison": self.comparison,
            "bits": self.bits, "bits_fp32": self.bits_fp32, "share": self.share, "seeds": self.seeds,
            "steps": self.steps, "wall_minutes": self.wall_minutes, "squad": self.squad,
            "table": lambda name: tables[name](), "settings_table": self.settings_table, "verdicts": self.verdicts,
            "abs": abs, "len": len, "min": min, "max": max, "str": str, "sum": sum,
        }

    def render(self, template: str, **names: Any) -> str:
        """`template` with every `{{ expression | format }}` replaced by its value (see the module docstring);
        `names` join the namespace (the page's `figures` folder)."""
        # globals, not locals: a comprehension in an expression sees only the globals
        namespace = {"__builtins__": {}, **self.namespace(), **names}

        def value(match: re.Match) -> str:
            expression, _, spec = match.group(1).partition("|")
            try:
                result = eval(expression.strip(), namespace)  # a template of this repository, not user input
            except (NameError, KeyError, TypeError, SyntaxError, ValueError) as err:
                raise UserError(f"template placeholder {{{{{match.group(1)}}}}}: {err}") from None
            return format(result, spec.strip())

        return _PLACEHOLDER.sub(value, template)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def _percent(share: float | None) -> str | None:
    return None if share is None else f"{100 * share:.1f} %"


def write_figures(results: Results, out: Path) -> list[Path]:
    """The study's figures in `out`: validation loss against steps (the seeds' mean, their range shaded) and against
    bytes sent where the data holds them, and each variant's paired difference to the reference against steps, one
    panel per variant on its own scale, its seeds as dots."""
    from benchmarks.paper.plots import Line, write_lines, write_panels  # matplotlib only when drawing

    variants, reference = results.data.variants(), results.reference
    losses, sent, gaps = [], [], []
    for variant in variants:
        steps = results.steps(variant)
        seeds = [[results.per_seed(variant, s).get(run.seed) for s in steps] for run in results.data.seeded(variant)]
        full = [curve for curve in seeds if None not in curve]
        bands = (list(map(min, zip(*full, strict=True))), list(map(max, zip(*full, strict=True)))) if full else \
            (None, None)
        losses.append(Line(variant, steps, [results.val(variant, s) for s in steps], *bands))
        sent_at = _mean_bytes(results.data.seeded(variant), steps)
        if sent_at is not None:
            sent.append(Line(variant, sent_at, losses[-1].ys))
        if variant != reference:
            dots = [(s, d) for s in steps if (c := results.comparison(variant, step=s)) for d in c.differences]
            gaps.append(Line(variant, steps, [results.gap(variant, s) for s in steps], dots=dots))
    n = max(results.seeds(v) for v in variants)
    paths = [write_lines(losses, out / "val_loss_vs_step.png", "optimizer step", "BERT validation loss (MLM + NSP)",
                         f"validation loss, mean of each variant's seeds (up to {n}; their range shaded where kept)"),
             write_panels(gaps, out / "paired_difference_vs_step.png", "optimizer step", f"difference to {reference}",
                          f"validation loss minus {reference}'s: mean over shared seeds (line), each seed (dots)")]
    if sent:
        paths.append(write_lines(sent, out / "val_loss_vs_bytes.png", "bytes sent per rank since step 0",
                                 "BERT validation loss (MLM + NSP)", "validation loss against data sent", log_x=True))
    return paths


def _mean_bytes(runs: list[RunData], steps: list[int]) -> list[float] | None:
    """The seeds' mean bytes sent by each of `steps` (None: some run logged none there, or sent nothing)."""
    sent = [{p.step: p.bytes_total for p in run.points if p.bytes_total} for run in runs]
    if not sent or any(step not in by_step for by_step in sent for step in steps):
        return None
    return [statistics.fmean(by_step[step] for by_step in sent) for step in steps]
