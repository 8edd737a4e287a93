"""`python -m train [overrides]` or `slamb-train`: the Hydra entry point (the demo by default; `experiment=...`)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig

from core.errors import compose_errors_exit, user_errors_exit
from train.config import register_configs
from train.run import run
from train.sweep import JobOutcome, run_job

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> JobOutcome | None:
    hydra_cfg = HydraConfig.get()

    def job() -> None:
        run(cfg, hydra_cfg.runtime.output_dir, overrides=list(hydra_cfg.overrides.task),
            choices=dict(hydra_cfg.runtime.choices))

    if hydra_cfg.mode == RunMode.MULTIRUN:  # one job of a sweep: its failure goes to the sweep's table (train.sweep)
        return run_job(job)
    with user_errors_exit():  # a bad value, data file or run directory: one line naming what to fix
        job()
    return None


def accept_appended_experiment(argv: list[str]) -> list[str]:
    """`+experiment=NAME` means `experiment=NAME`: the defaults list has an `experiment` slot (so Hydra alone would
    refuse to append one), and `+experiment=` is the spelling many recipes and scripts use."""
    return [arg[1:] if arg.startswith("+experiment=") else arg for arg in argv]


def cli() -> None:
    """`python -m train` and the `slamb-train` console script: one entry, so both accept the same arguments."""
    sys.argv = accept_appended_experiment(sys.argv)
    with compose_errors_exit():  # a bad override: one line, exit code 2
        main()


if __name__ == "__main__":
    cli()
