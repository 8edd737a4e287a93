"""`python -m train.export <run dir | checkpoint dir> <out dir> [--best]`: a chosen checkpoint as the same stock
transformers or timm export a run writes of its final weights.

    python -m train.export runs/swin_demo exports/swin_demo_best --best   # the best checkpoint best.json keeps
    python -m train.export runs/demo exports/demo                         # the run's newest checkpoint
    python -m train.export runs/demo/checkpoints/step_00000200 exports/demo_200

The out dir is a new (or empty) directory or an earlier export, which is replaced whole once the new one is written
(an export carries export.json); anything else there, and any place inside the run or around it, is refused.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from core.errors import UserError, user_errors_exit
from train.model_export import EXPORT_MARKER, export_pretrained, is_export
from train.restore import find_weights, rebuild, weights_config


def export(source: str | Path, out: str | Path, *, best: bool = False) -> Path:
    """Write the export of the checkpoint `source` names into `out`; returns `out`. An earlier export there is
    replaced once the new one is complete; anything else there is refused (`check_out`)."""
    weights = find_weights(source, best=best)
    if not weights.is_checkpoint:
        raise UserError(f"{source} is already an export: give the run directory or checkpoint it came from")
    if weights.run_dir is None:
        raise UserError(f"{weights.path} is not inside a run directory with a recorded config (.hydra/config.yaml): "
                        "its model and data are unknown")
    out = Path(out)
    check_out(out, weights.run_dir.path)
    model, data, _ = rebuild(weights_config(weights, []), weights.path, "cpu")
    return export_pretrained(model, data.tokenizer, out, data_config=data.preprocessing,
                             label_names=data.class_names, source=weights.path.resolve())


def check_out(out: Path, run_dir: Path) -> None:
    """Refuse, in one line, an `out` whose replacement would lose what this command did not write: a file, a link,
    a folder that is not an export of this project (an empty one is fine), the run or a folder around it, or a
    place inside the run (whose files its trainer owns)."""
    where, run = out.resolve(), run_dir.resolve()
    if where == run:
        raise UserError(f"{out} is the run directory: export to a directory outside it")
    if where.is_relative_to(run):
        raise UserError(f"{out} is inside the run directory {run_dir}: export to a directory outside it")
    if run.is_relative_to(where):
        raise UserError(f"{out} holds the run directory {run_dir}: export to a new directory, e.g. exports/<name>")
    if out.is_symlink():
        raise UserError(f"{out} is a symbolic link: give a new directory or an earlier export, not a link")
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file: give a new directory or an earlier export")
    if out.is_dir() and not is_export(out) and any(out.iterdir()):
        raise UserError(f"{out} is a folder that is not an export of this project (no {EXPORT_MARKER}): export to a "
                        "new directory, or remove it first")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[3:]))
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run directory or one of its checkpoints")
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="a new directory, or an earlier export to replace")
    parser.add_argument("--best", action="store_true",
                        help="the run's best kept checkpoint (trainer.keep_best) instead of its newest")
    args = parser.parse_args(argv)
    with user_errors_exit():
        weights = find_weights(args.source, best=args.best)
        path = export(weights.path, args.out)
    print(f"exported {weights.path} to {path}")


if __name__ == "__main__":
    main()
