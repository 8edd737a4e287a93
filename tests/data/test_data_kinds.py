"""Data kinds: compose-time checks name the key, dry builds check files without writing, data/ stands alone."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.config import REPO, compose
from omegaconf import OmegaConf

from core.errors import ConfigError
from data import DataRequest, build_data, check_data, data_schemas, list_data_kinds

REQUEST = DataRequest(rank=0, world_size=1, micro_batch_size=4, seed=0)


def _files(root: Path) -> list[Path]:
    """Everything under `root` but bytecode caches (imports may compile modules)."""
    return sorted(p for p in root.rglob("*") if "__pycache__" not in p.parts) if root.exists() else []


def test_every_kind_is_listed_with_its_schema():
    assert list_data_kinds() == ["demo", "digits", "images", "shards", "squad"]
    assert set(data_schemas()) == {"text_schema", "images_schema", "squad_schema"}


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["data.masking=sometimes"], r"^data\.masking=sometimes must be one of static, dynamic$"),
        (["data.max_predictions=40"], r"^data\.max_predictions=40 must be below data\.max_seq_len=32$"),
        (["data.masked_lm_prob=2"], r"^data\.masked_lm_prob=2\.0 must be in \[0\.0, 1\.0\]$"),
        (["data=shards", "data.path=null"], r"^data\.path=None must name a prepared directory"),
        (["data=squad_demo", "data.train_file=null"], r"^data\.train_file=None must name a SQuAD"),
        (["data=squad_demo", "data.doc_stride=0"], r"^data\.doc_stride=0 must be positive$"),
        (["data=squad_demo", "data.max_query_len=125"], r"^data\.max_query_len=125 leaves no context"),
        (["data.name=nope"], r"^data\.name=nope must be one of demo, digits, images, shards, squad$"),
    ],
)
def test_check_data_names_the_key(overrides, message):
    cfg = compose(["data.max_seq_len=32", *overrides])
    with pytest.raises(ConfigError, match=message):
        check_data(cfg.data, cfg.trainer.micro_batch_size)


def test_image_check_wants_an_even_micro_batch_under_mixup():
    cfg = compose(["experiment=swin_demo", "data.mixup_alpha=0.8"])
    check_data(cfg.data, 8)
    with pytest.raises(ConfigError, match=r"trainer\.micro_batch_size=7 must be even with mixup"):
        check_data(cfg.data, 7)


@pytest.mark.parametrize(
    ("overrides", "missing"),
    [
        (["data=shards", "data.path={tmp}/nowhere"], "nowhere"),
        (["data=imagenet", "data.path={tmp}/nowhere"], "nowhere"),
        (["data=squad_demo", "data.dev_file={tmp}/nowhere.json"], "nowhere.json"),
        (["data.vocab_path={tmp}/nowhere.txt"], "nowhere.txt"),
    ],
)
def test_dry_build_fails_on_a_missing_path_naming_it(tmp_path, overrides, missing):
    cfg = compose([o.format(tmp=tmp_path) for o in overrides])
    with pytest.raises((ConfigError, FileNotFoundError), match=missing):
        build_data(cfg.data, REQUEST, dry=True)


@pytest.mark.parametrize("overrides", [[], ["data=squad_demo"], ["experiment=swin_demo"]])
def test_dry_build_of_good_data_returns_none_and_writes_nothing(tmp_path, overrides):
    cfg = compose(overrides)
    if cfg.data.name == "digits":
        cfg.data.path = str(tmp_path / "digits")  # written on first use, never by a dry build
    before = _files(tmp_path), _files(REPO / "data")
    assert build_data(cfg.data, REQUEST, dry=True) is None
    assert (_files(tmp_path), _files(REPO / "data")) == before


def test_dry_build_checks_the_shards_manifest_against_the_config(tmp_path):
    from helpers.corpora import small_config, write_corpus

    from data.corpus.pipeline import prepare

    prepare(small_config(write_corpus(tmp_path / "corpus"), tmp_path / "out", num_proc=1))
    phase = next(p for p in (tmp_path / "out").iterdir() if (p / "manifest.json").is_file())
    manifest = OmegaConf.create(json.loads((phase / "manifest.json").read_text()))
    keys = {k: manifest[k] for k in ("max_seq_len", "max_predictions", "masking", "masked_lm_prob",
                                     "short_seq_prob", "dupe_factor")}
    cfg = compose(["data=shards", f"data.path={phase}", *(f"data.{k}={v}" for k, v in keys.items())])
    before = _files(tmp_path)
    assert build_data(cfg.data, REQUEST, dry=True) is None
    assert _files(tmp_path) == before
    cfg.data.dupe_factor = keys["dupe_factor"] + 1
    with pytest.raises(ValueError, match=r"data\.dupe_factor="):
        build_data(cfg.data, REQUEST, dry=True)


@pytest.mark.parametrize("experiment", sorted(p.stem for p in (REPO / "conf" / "experiment").glob("bert_large_*")))
def test_cluster_recipes_verify_every_shard_before_training(experiment):
    data = compose([f"experiment={experiment}"]).data
    assert data.name != "shards" or data.verify_shards is True


def test_data_imports_neither_optim_nor_train():
    code = ("import sys, data, data.prepare, data.corpus.pipeline; data.list_data_kinds(); "
            "print(sorted(m for m in sys.modules if m.split('.')[0] in ('optim', 'train')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
    for path in (REPO / "data").rglob("*.py"):
        for line in path.read_text().splitlines():
            assert not line.lstrip().startswith(("from optim", "import optim", "from train", "import train")), path
