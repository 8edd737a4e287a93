"""`python -m data.prepare corpus=<name> output_dir=<dir>`: the Hydra entry point of the corpus pipeline.

The config tree is conf/prepare/ (config.yaml + corpus/<name>.yaml); the work is :mod:`data.corpus.pipeline`.
A rerun of the same command resumes an interrupted preparation; a value or input to fix is one line on stderr
with exit code 2, and leaves no output directory the refused command made. The resolved config is recorded in
`<output_dir>/.hydra/` once the preparation has finished, so a refused rerun (another config in the same directory)
leaves the record of the shards' config as it was.
"""

from __future__ import annotations

import contextlib
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig


def register_prepare_configs() -> None:
    """Register the typed schema that conf/prepare/config.yaml extends (`prepare_schema`)."""
    from hydra.core.config_store import ConfigStore

    from data.corpus.pipeline import PrepareConfig

    ConfigStore.instance().store(name="prepare_schema", node=PrepareConfig)


def main() -> None:
    """Compose the preparation config from the command line and run the pipeline; user errors exit 2."""
    import hydra
    from hydra.core.hydra_config import HydraConfig
    from omegaconf import OmegaConf

    from core.errors import compose_errors_exit, user_errors_exit
    from core.options import refuse_unknown_keys
    from data.corpus.pipeline import prepare

    register_prepare_configs()

    @hydra.main(config_path="../conf/prepare", config_name="config", version_base="1.3")
    def _run(cfg: DictConfig) -> None:
        with user_errors_exit():  # inside the job too: Hydra would add a line of its own to a job's error
            refuse_unknown_keys(cfg)  # `+key=...` appends past the schema
            prepare(OmegaConf.to_object(cfg))
            record_config(cfg, list(HydraConfig.get().overrides.task))

    output_dir = _output_dir_given(sys.argv[1:])
    new_output_dir = output_dir is not None and not output_dir.exists()
    try:
        with compose_errors_exit():  # a bad or unknown key, or one left unset: one line, as `python -m train` says it
            _run()
    except SystemExit as stop:
        if stop.code not in (0, None) and new_output_dir:
            _remove_refused(output_dir)
        raise


LOG_NAME = "prepare.log"  # Hydra's job log in <output_dir> (conf/prepare/config.yaml)


def _output_dir_given(arguments: list[str]) -> Path | None:
    """The `output_dir=...` of the command line (it has no default), as the path Hydra makes; None without one."""
    for argument in arguments:
        key, equals, value = argument.partition("=")
        if equals and key.lstrip("+") == "output_dir":
            return Path(os.path.abspath(os.path.expanduser(value.strip("'\""))))
    return None


def _remove_refused(output_dir: Path) -> None:
    """A refused preparation leaves no output directory it made: Hydra made it for its log, which holds nothing."""
    log = output_dir / LOG_NAME
    if log.is_file() and log.stat().st_size == 0:
        log.unlink()
    with contextlib.suppress(OSError):  # something else is there: it is left as it is
        output_dir.rmdir()


def record_config(cfg: DictConfig, overrides: list[str]) -> None:
    """`<output_dir>/.hydra/config.yaml` and `overrides.yaml`: what the finished shards were prepared with."""
    from pathlib import Path

    from omegaconf import OmegaConf

    from core.atomic import atomic_write_text

    record = Path(cfg.output_dir).expanduser() / ".hydra"
    record.mkdir(exist_ok=True)
    atomic_write_text(record / "config.yaml", OmegaConf.to_yaml(cfg, resolve=True))
    atomic_write_text(record / "overrides.yaml", OmegaConf.to_yaml(OmegaConf.create(overrides)))


if __name__ == "__main__":
    main()
