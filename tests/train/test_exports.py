"""`export_pretrained`: stock class names, the tokenizer with vocab.txt and its length, readable files, and a
timm export whose pretrained_cfg carries the run's preprocessing."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
import torch
from helpers.config import compose
from transformers import AutoModelForPreTraining, AutoTokenizer, BertForPreTraining

from data.images.kinds import image_preprocessing as image_data_config
from data.text.tokenizer import DEFAULT_VOCAB_PATH
from models import create_model
from train.model_export import export_pretrained
from train.model_init import load_weights

BERT_SHAPE = dict(size="tiny", hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64)
TINY_SWIN = dict(arch="swin_tiny_patch4_window7_224", num_classes=10, img_size=32, patch_size=2, embed_dim=32,
                 depths=[2, 2], num_heads=[2, 4], window_size=4)
DIGITS_DATA = dict(mean=[0.5, 0.5, 0.5], std=[0.5, 0.5, 0.5], crop_pct=1.0, interpolation="bicubic", input_size=32)


@pytest.fixture
def umask():
    """Set the process umask for one test (the export's file modes follow it), restoring it afterwards."""
    previous = os.umask(0o022)

    def set_umask(mask: int) -> None:
        os.umask(mask)

    yield set_umask
    os.umask(previous)


def _modes(directory: Path) -> dict[str, int]:
    return {p.name: stat.S_IMODE(p.stat().st_mode) for p in directory.iterdir()}


def test_bert_export_is_stock_with_its_tokenizer(tmp_path, tokenizer, umask):
    model = create_model("bert_pretraining", **BERT_SHAPE)
    length_before = tokenizer.model_max_length
    out = export_pretrained(model, tokenizer, tmp_path / "hf_model")

    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForPreTraining"]
    assert (out / "vocab.txt").read_text(encoding="utf-8") == DEFAULT_VOCAB_PATH.read_text(encoding="utf-8")
    loaded_tokenizer = AutoTokenizer.from_pretrained(out)
    assert loaded_tokenizer.model_max_length == 512 == model.config.max_position_embeddings
    assert len(loaded_tokenizer) == len(tokenizer)
    assert tokenizer.model_max_length == length_before  # the run's tokenizer is left as it was
    stock = AutoModelForPreTraining.from_pretrained(out)
    assert type(stock) is BertForPreTraining
    assert torch.equal(stock.cls.predictions.decoder.weight, model.cls.predictions.decoder.weight)

    modes = _modes(out)
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "vocab.txt"} <= set(modes)
    assert all(mode == 0o644 for mode in modes.values()), {name: oct(mode) for name, mode in modes.items()}
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    assert json.loads((out / "export.json").read_text()) == {"source": None}  # what marks an export of ours
    assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]  # its staging directory is gone


def test_export_modes_follow_the_umask(tmp_path, tokenizer, umask):
    umask(0o027)
    out = export_pretrained(create_model("bert_pretraining", **BERT_SHAPE), tokenizer, tmp_path / "hf_model")
    assert set(_modes(out).values()) == {0o640}  # group-readable, as a plain open() would make them


def test_qa_export_names_bert_for_question_answering(tmp_path, tokenizer):
    out = export_pretrained(create_model("bert_question_answering", **BERT_SHAPE), tokenizer, tmp_path / "qa")
    assert json.loads((out / "config.json").read_text())["architectures"] == ["BertForQuestionAnswering"]
    assert (out / "vocab.txt").is_file() and AutoTokenizer.from_pretrained(out).model_max_length == 512


@pytest.mark.parametrize("described", [dict(data_config=DIGITS_DATA), dict(label_names=["a", "b"])])
def test_data_config_and_label_names_are_for_image_models_only(tmp_path, tokenizer, described):
    with pytest.raises(ValueError, match="timm models"):
        export_pretrained(create_model("bert_pretraining", **BERT_SHAPE), tokenizer, tmp_path / "x", **described)
    assert list(tmp_path.iterdir()) == []


def test_swin_export_carries_the_run_preprocessing(tmp_path, umask):
    import timm
    from timm.data import resolve_data_config

    model = create_model("swin", **TINY_SWIN).eval()
    out = export_pretrained(model, None, tmp_path / "hf_model", data_config=DIGITS_DATA)
    loaded = timm.create_model(f"local-dir:{out}", pretrained=True).eval()
    resolved = resolve_data_config({}, model=loaded)
    assert tuple(resolved["mean"]) == tuple(resolved["std"]) == (0.5, 0.5, 0.5)
    assert (resolved["crop_pct"], resolved["interpolation"], resolved["crop_mode"]) == (1.0, "bicubic", "center")
    assert tuple(resolved["input_size"]) == (3, 32, 32)
    pretrained_cfg = json.loads((out / "config.json").read_text())["pretrained_cfg"]
    assert "tag" not in pretrained_cfg and "license" not in pretrained_cfg  # timm's published weights, not ours
    assert model.pretrained_cfg["tag"] == "ms_in1k"  # the live model's own config is left alone
    images = torch.randn(2, 3, 32, 32)
    assert torch.equal(loaded(images), model(images))
    assert set(_modes(out).values()) == {0o644}

    again = create_model("swin", **TINY_SWIN).eval()
    load_weights(again, out)  # trainer.init_from=<export>
    assert torch.equal(again(images), model(images))


def test_swin_export_rejects_preprocessing_the_model_cannot_take(tmp_path):
    model = create_model("swin", **TINY_SWIN)
    with pytest.raises(ValueError, match="image size"):
        export_pretrained(model, None, tmp_path / "hf_model", data_config={**DIGITS_DATA, "input_size": 64})
    with pytest.raises(ValueError, match="unknown keys"):
        export_pretrained(model, None, tmp_path / "hf_model", data_config={**DIGITS_DATA, "img_size": 32})
    assert list(tmp_path.iterdir()) == []  # neither an export nor its staging directory


def test_a_failed_re_export_leaves_the_earlier_export_whole(tmp_path, tokenizer, monkeypatch):
    model = create_model("bert_pretraining", **BERT_SHAPE)
    out = export_pretrained(model, tokenizer, tmp_path / "hf_model")
    before = {p.name: p.read_bytes() for p in out.iterdir()}

    def killed(*args, **kwargs):  # the process dies once the weights of the new export are written
        raise KeyboardInterrupt

    monkeypatch.setattr("train.model_export.save_tokenizer", killed)
    with pytest.raises(KeyboardInterrupt):
        export_pretrained(create_model("bert_pretraining", **BERT_SHAPE), tokenizer, out)
    assert {p.name: p.read_bytes() for p in out.iterdir()} == before
    assert [p.name for p in tmp_path.iterdir()] == ["hf_model"]


def test_image_data_config_reads_the_run_config():
    digits = compose(["experiment=swin_demo"]).data
    assert image_data_config(digits) == DIGITS_DATA
    imagenet = compose(["experiment=swin_base_imagenet", "data.path=/datasets/imagenet"]).data
    assert image_data_config(imagenet) == {"mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225],
                                           "crop_pct": 0.875, "interpolation": "bicubic", "input_size": 224}
    assert image_data_config(compose([]).data) is None  # text data: no image preprocessing
