"""Convergence study (not a test): LAMB against SLAMB on a tiny BERT over 4 gloo ranks at equal steps.

    python -m benchmarks.slamb_convergence --steps 200
    python -m benchmarks.slamb_convergence --steps 100 --override optim.compress_ratio=0.05

Each optimizer runs the real trainer, `python -m train trainer.nproc_per_node=4 optim=<name> ...`, in a
subprocess from the same seed and data, and the numbers come from its metrics.jsonl: the final losses (mean of
the last `--tail` logged steps) and the measured communication, in bits per parameter per step, side by side.
LAMB's bits are DDP's fp32 gradient all-reduce; SLAMB's are its masked momentum plus the dense parameter
average every sync_interval steps.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from train.metrics import read_metrics

REPO = Path(__file__).resolve().parents[1]
COMMON = [
    "trainer.nproc_per_node=4",
    "trainer.micro_batch_size=8",  # the demo's global batch of 32 over 4 ranks
    "trainer.device=cpu",
    "trainer.log_every=1",
    "trainer.checkpoint_every=0",
    "logger.progress_bar=false",
    "logger.tensorboard=false",
    "logger.wandb=disabled",
]


def run(optimizer: str, steps: int, overrides: list[str], run_dir: Path) -> tuple[list[dict], float]:
    """Train with `optimizer` for `steps` steps; returns (metrics records, wall seconds)."""
    args = [*COMMON, f"optim={optimizer}", f"trainer.max_steps={steps}", *overrides, f"hydra.run.dir={run_dir}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "WANDB_MODE": "disabled"}
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise SystemExit(f"{optimizer} run failed:\n{result.stderr[-3000:]}")
    return read_metrics(run_dir), time.perf_counter() - start


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--tail", type=int, default=10, help="final loss = mean over this many last steps")
    parser.add_argument("--optimizers", nargs="+", default=["lamb", "slamb"])
    parser.add_argument("--override", action="append", default=[], help="extra Hydra override (repeatable)")
    args = parser.parse_args(argv)

    rows = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.optimizers:
            rows[name] = run(name, args.steps, args.override, Path(tmp) / name)
    print(f"tiny BERT (conf/model/bert_tiny.yaml), demo corpus, 4 gloo ranks on CPU, {args.steps} steps, "
          f"same seed and data; overrides: {' '.join(args.override) or 'none'}")
    print(f"{'optimizer':<10} {'loss':>8} {'mlm_loss':>9} {'nsp_loss':>9} {'bits/param/step':>16} "
          f"{'collectives/step':>17} {'wall s':>7}")
    for name, (records, wall) in rows.items():
        tail = records[-args.tail:]
        loss, mlm, nsp = (sum(r[key] for r in tail) / len(tail) for key in ("loss", "mlm_loss", "nsp_loss"))
        bits = sum(r["comm_bits_per_param"] for r in records) / len(records)
        collectives = sum(r["comm_collectives_per_step"] for r in records) / len(records)
        print(f"{name:<10} {loss:>8.4f} {mlm:>9.4f} {nsp:>9.4f} {bits:>16.3f} "
              f"{collectives:>17.2f} {wall:>7.0f}")
    first = {name: records[0]["loss"] for name, (records, _) in rows.items()}
    print("first-step loss: " + ", ".join(f"{name} {loss:.4f}" for name, loss in first.items()))


if __name__ == "__main__":
    main()
