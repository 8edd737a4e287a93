"""Every shipped experiment composes, passes the compose-time checks and constructs: a broken preset fails here.

Construction is real but cheap: the model is built on the meta device (no weights are allocated), the optimizer
over the model's real parameter groups, and the data in its dry mode (paths and keys checked, nothing read).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from helpers.config import REPO, compose

from core.options import options_of
from data import DataRequest, build_data
from data.text.shards import (
    FORMAT_NAME,
    FORMAT_VERSION,
    MANIFEST_NAME,
    PREPARED_KEYS,
    VOCAB_NAME,
    sha256_file,
    write_shard,
)
from data.text.tokenizer import DEFAULT_VOCAB_PATH
from models import create_model
from optim import build_optimizer
from optim.comm import Comm
from train.config import ConfigError, check_trainer_config, validate

EXPERIMENTS = sorted(path.stem for path in (REPO / "conf" / "experiment").glob("*.yaml"))
SQUAD_DEMO = REPO / "data" / "squad" / "squad_demo.json"


def _stand_in_data(kind: str, tmp_path: Path) -> list[str]:
    """Stand-ins for the datasets the cluster recipes need: an empty ImageFolder root, the shipped SQuAD file."""
    if kind == "images":
        for split in ("train", "val"):
            (tmp_path / "imagenet" / split).mkdir(parents=True, exist_ok=True)
        return [f"data.path={tmp_path / 'imagenet'}"]
    if kind == "squad":
        return [f"data.train_file={SQUAD_DEMO}", f"data.dev_file={SQUAD_DEMO}"]
    return []


def _stand_in_shards(data_cfg, directory: Path) -> None:
    """A prepared-shards directory as far as a dry build looks: its manifest (prepared keys, vocab), vocab and one
    (empty) shard for data.verify_shards to check."""
    directory.mkdir(parents=True, exist_ok=True)
    shutil.copy(DEFAULT_VOCAB_PATH, directory / VOCAB_NAME)
    shard = write_shard(directory, 0, [], masked=data_cfg.masking == "static")
    manifest = {"format": FORMAT_NAME, "version": FORMAT_VERSION, "vocab": {"sha256": sha256_file(DEFAULT_VOCAB_PATH)},
                "shards": [shard], **{key: data_cfg[key] for key in PREPARED_KEYS}}
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))


def _compose_experiment(name: str, tmp_path: Path, *overrides: str):
    """The experiment with stand-in data; on CPU, a GPU recipe (after checking that it refuses to run there)."""
    first = compose([f"experiment={name}", *overrides])
    if first.trainer.device == "cuda" and not torch.cuda.is_available():
        with pytest.raises(ConfigError, match=r"^trainer\.device=cuda but no CUDA device is visible"):
            _check_trainer(first)
        overrides = ("trainer.device=cpu", *overrides)
        first = compose([f"experiment={name}", *overrides])
    if first.data.name == "shards":
        _stand_in_shards(first.data, tmp_path / "shards")
        return compose([f"experiment={name}", f"data.path={tmp_path / 'shards'}", *overrides])
    return compose([f"experiment={name}", *_stand_in_data(first.data.name, tmp_path), *overrides])


def _check_trainer(cfg) -> None:
    with options_of("trainer"):
        check_trainer_config(cfg.trainer)


def test_every_experiment_is_listed():
    assert {"demo", "bert_large_phase1", "bert_large_phase1_slamb", "swin_base_imagenet_slamb"} <= set(EXPERIMENTS)


@pytest.mark.parametrize("name", EXPERIMENTS)
def test_experiment_composes_checks_and_constructs(name: str, tmp_path: Path):
    cfg = _compose_experiment(name, tmp_path)
    geometry = validate(cfg).geometry
    model_kwargs = {k: v for k, v in cfg.model.items() if k != "name"}
    with torch.device("meta"):
        model = create_model(cfg.model.name, **model_kwargs)
    optim_kwargs = {k: v for k, v in cfg.optim.items() if k != "name"}
    optimizer = build_optimizer(model, cfg.optim.name, optim_kwargs, comm=Comm())
    assert sum(len(group["params"]) for group in optimizer.param_groups) == len(list(model.parameters()))
    request = DataRequest(rank=0, world_size=geometry.world_size, micro_batch_size=geometry.micro_batch_size,
                          seed=cfg.trainer.seed)
    assert build_data(cfg.data, request, dry=True) is None


def test_swin_slamb_preset_gets_slamb_options_only(tmp_path: Path):
    """The LAMB preset's boolean `bias_correction` used to leak into SLAMB and fail inside every worker."""
    cfg = _compose_experiment("swin_base_imagenet_slamb", tmp_path)
    assert cfg.optim.name == "slamb" and cfg.optim.beta3 == 0.999
    assert cfg.optim.bias_correction_form == "scalar" and "bias_correction" not in cfg.optim
    validate(cfg)


def test_leaked_sibling_option_fails_at_compose_time(tmp_path: Path):
    cfg = _compose_experiment("swin_base_imagenet_lamb", tmp_path, "optim=slamb", "+optim.trust_clip=true")
    with pytest.raises(ConfigError, match=r"^optim\.trust_clip ") as info:
        validate(cfg)
    assert "\n" not in str(info.value)
