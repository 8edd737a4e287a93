"""`python -m train.export <run dir | checkpoint dir> <out dir> [--best]`: a chosen checkpoint as the same stock
transformers or timm export a run writes of its final weights.

    python -m train.export runs/swin_demo exports/swin_demo_best --best   # the best checkpoint best.json keeps
    python -m train.export runs/demo exports/demo                         # the run's newest checkpoint
    python -m train.export runs/demo/checkpoints/step_00000200 exports/demo_200
"""

from __future__ import annotations

import argparse
from pathlib import Path

from conf.checks import UserError, user_errors_exit
from train.model_io import export_pretrained
from train.restore import find_weights, rebuild, weights_config


def export(source: str | Path, out: str | Path, *, best: bool = False) -> Path:
    """Write the export of the checkpoint `source` names into `out` (replaced once complete); returns `out`."""
    weights = find_weights(source, best=best)
    if not weights.is_checkpoint:
        raise UserError(f"{source} is already an export: give the run directory or checkpoint it came from")
    if weights.run_dir is None:
        raise UserError(f"{weights.path} is not inside a run directory with a recorded config (.hydra/config.yaml): "
                        "its model and data are unknown")
    model, data, _ = rebuild(weights_config(weights, []), weights.path, "cpu")
    return export_pretrained(model, data.tokenizer, Path(out), data_config=data.preprocessing,
                             label_names=data.class_names)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[3:]))
    parser.add_argument("source", metavar="RUN_OR_CHECKPOINT", help="a run directory or one of its checkpoints")
    parser.add_argument("out", type=Path, metavar="OUT_DIR", help="the export's directory (replaced)")
    parser.add_argument("--best", action="store_true",
                        help="the run's best kept checkpoint (trainer.keep_best) instead of its newest")
    args = parser.parse_args(argv)
    with user_errors_exit():
        weights = find_weights(args.source, best=args.best)
        path = export(weights.path, args.out)
    print(f"exported {weights.path} to {path}")


if __name__ == "__main__":
    main()
