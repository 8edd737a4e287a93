"""The convergence study's per-run data, one gzipped JSON-lines file beside its page: every figure of the page is
rendered from it, so anyone can check a sentence against the runs.

The first line is `{"meta": {...}}` (date, commit, command, set-up); each further line is `{"run": {...}}`: a
variant, its optimizer and overrides, its seed, its points (step, training loss, validation loss, bytes sent per rank
since step 0; null where that record has no such value), bits per parameter per step as sent, with every value at
32 bits and in the evaluations' replica averages (counted apart from the steps), wall time and SQuAD F1. A run with
seed null holds the mean over the variant's seeds: a study that kept no per-seed curves (its per-seed runs then
hold only what it kept of each seed).
"""

from __future__ import annotations

import gzip
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from core.atomic import atomic_write
from core.errors import UserError

DATA_NAME = "runs.jsonl.gz"


@dataclass(frozen=True)
class Point:
    step: int
    train_loss: float | None = None
    val_loss: float | None = None
    bytes_total: int | None = None  # sent by one rank since step 0


@dataclass(frozen=True)
class RunData:
    variant: str
    optimizer: str
    seed: int | None  # None: the mean over the variant's seeds
    points: tuple[Point, ...] = ()
    overrides: tuple[str, ...] = ()
    bits_per_param_per_step: float | None = None  # as sent
    bits_at_fp32: float | None = None  # every value at 32 bits: measured by a run with its 16-bit payloads in fp32
    replica_average_bits: float | None = None  # the evaluations' replica averages, per parameter per step, apart
    wall_seconds: float | None = None
    squad_f1: float | None = None

    def val_loss(self, step: int | None = None) -> float | None:
        """The validation loss at `step` (None: the last evaluation)."""
        evaluated = [p for p in self.points if p.val_loss is not None and (step is None or p.step == step)]
        return evaluated[-1].val_loss if evaluated else None


@dataclass
class StudyData:
    meta: dict[str, Any]
    runs: list[RunData] = field(default_factory=list)

    def write(self, path: Path) -> None:
        lines = [json.dumps({"meta": self.meta})] + [json.dumps({"run": asdict(run)}) for run in self.runs]
        text = "\n".join(lines) + "\n"
        # mtime 0: the same runs give the same bytes, so a rerender leaves the file unchanged
        atomic_write(path, lambda handle: handle.write(gzip.compress(text.encode(), mtime=0)))

    @classmethod
    def read(cls, path: Path) -> StudyData:
        if not path.is_file():
            raise UserError(f"{path} does not exist: run the study first, or name its data with --out")
        try:
            lines = [json.loads(line) for line in gzip.decompress(path.read_bytes()).decode().splitlines()]
            runs = [_run(line["run"]) for line in lines[1:]]
            return cls(lines[0]["meta"], runs)
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise UserError(f"{path} is not a study's data ({err!r}): rerun the study to write it again") from None

    def variants(self) -> list[str]:
        return list(dict.fromkeys(run.variant for run in self.runs))

    def seeded(self, variant: str) -> list[RunData]:
        """The variant's runs of one seed each, in seed order."""
        return sorted((r for r in self.runs if r.variant == variant and r.seed is not None), key=lambda r: r.seed)

    def mean_run(self, variant: str) -> RunData | None:
        """The variant's record of means over its seeds, where the study kept one instead of per-seed curves."""
        return next((r for r in self.runs if r.variant == variant and r.seed is None), None)


def _run(fields: dict[str, Any]) -> RunData:
    points = tuple(Point(**p) for p in fields.pop("points"))
    return RunData(**{**fields, "points": points, "overrides": tuple(fields["overrides"])})
