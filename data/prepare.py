"""`python -m data.prepare corpus=<name> output_dir=<dir>`: the Hydra entry point of the corpus pipeline.

The config tree is conf/prepare/ (config.yaml + corpus/<name>.yaml); the work is :mod:`data.corpus.pipeline`.
A rerun of the same command resumes an interrupted preparation; exit code 2 means a value or input to fix.
"""

from __future__ import annotations

import logging
import sys

log = logging.getLogger(__name__)


def register_prepare_configs() -> None:
    """Register the typed schema that conf/prepare/config.yaml extends (`prepare_schema`)."""
    from hydra.core.config_store import ConfigStore

    from data.corpus.pipeline import PrepareConfig

    ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)


def main() -> None:
    """Compose the preparation config from the command line and run the pipeline; user errors exit 2."""
    import hydra
    from omegaconf import DictConfig, OmegaConf

    from data.corpus.pipeline import prepare
    from data.corpus.sources import CorpusError

    register_prepare_configs()

    @hydra.main(config_path="../conf/prepare", config_name="config", version_base="1.3")
    def _run(cfg: DictConfig) -> None:
        try:
            prepare(OmegaConf.to_object(cfg))
        except (CorpusError, ValueError) as err:
            log.error("%s", err)
            sys.exit(2)

    _run()


if __name__ == "__main__":
    main()
