"""`python -m train.evaluate <run dir | checkpoint dir | export> [key=value ...]`: the task's evaluation of chosen
weights, on the held-out data of the run that trained them, written to eval.json.

    python -m train.evaluate runs/swin_demo --best                        # the best kept checkpoint
    python -m train.evaluate runs/swin_demo/hf_model data.eval_batch_size=64
    python -m train.evaluate exports/swin experiment=swin_demo --out evals/swin   # an export outside its run
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from torch import nn

from core.errors import UserError, user_errors_exit
from data import atomic_write_json
from models import export_names, init_summary
from train.restore import find_weights, rebuild, weights_config
from train.run_dir import RunDir
from train.tasks import EvalShard, evaluate_model, get_task


def evaluate(source: str | Path, overrides: list[str], *, best: bool = False,
             out: str | Path | None = None) -> tuple[Path, dict[str, Any]]:
    """Evaluate the weights `source` names and write `{"weights": ..., "metrics": ...}` to `eval.json` in `out`
    (by default the run directory that wrote them); returns the file and the record."""
    weights = find_weights(source, best=best)
    out_dir = RunDir(out) if out is not None else weights.run_dir
    if out_dir is None:
        raise UserError(f"{weights.path} is not inside a run directory: give --out DIR for its metrics")
    cfg = weights_config(weights, overrides)
    task = get_task(cfg.task.name)
    if task.evaluate is None:
        raise UserError(f"task {cfg.task.name} has no evaluation")
    model, data, device = rebuild(cfg, weights.path, cfg.trainer.device)
    if not weights.is_checkpoint:
        refuse_a_partial_export(model, weights.path, cfg.task.name)
    if data.eval is None:
        raise UserError(f"data {cfg.data.name} has no held-out split to evaluate on (images: data.eval_split; "
                        "prepared text: python -m data.prepare heldout_sequences=...)")
    out_dir.path.mkdir(parents=True, exist_ok=True)
    metrics = evaluate_model(task, model, data.eval, out_dir, EvalShard(), cfg.precision.dtype, device)
    record = {"weights": str(weights.path), "metrics": {f"eval/{k}": v for k, v in metrics.items()}}
    atomic_write_json(out_dir.eval_file, record, indent=1)
    return out_dir.eval_file, record


def refuse_a_partial_export(model: nn.Module, export: Path, task: str) -> None:
    """An export that lacks part of the model (a pretraining export evaluated as question answering) would be
    evaluated with that part at random: refused in one line that says what it lacks."""
    given = export_names(model, export)
    if given is not None and not given.issuperset(model.state_dict()):
        raise UserError(f"{export} does not hold the whole model ({init_summary(model.state_dict(), given)}): "
                        f"evaluate weights trained for task {task}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m train.evaluate", description=__doc__.split("\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog="\n".join(__doc__.splitlines()[3:]))
    parser.add_argument("source", metavar="WEIGHTS", help="a run directory, one of its checkpoints, or an export")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="changes to the run's recorded config (data.path=..., trainer.device=cpu)")
    parser.add_argument("--best", action="store_true",
                        help="the run's best kept checkpoint (trainer.keep_best) instead of its newest")
    parser.add_argument("--out", type=Path, default=None, help="where eval.json goes (default: the run directory)")
    args = parser.parse_args(argv)
    with user_errors_exit():
        path, record = evaluate(args.source, args.overrides, best=args.best, out=args.out)
    print(f"{record['weights']}: " + ", ".join(f"{k} {v:.4g}" for k, v in record["metrics"].items()))
    print(f"metrics: {path}")


if __name__ == "__main__":
    main()
