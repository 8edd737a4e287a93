"""`python -m train [overrides]`: the Hydra entry point (the demo by default; `+experiment=...` for recipes)."""

from __future__ import annotations

import sys

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig

from train.config import ConfigError, register_configs
from train.run import run

register_configs()


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def main(cfg: DictConfig) -> None:
    try:
        run(cfg, HydraConfig.get().runtime.output_dir)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
