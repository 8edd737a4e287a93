"""`trainer.init_from`: weights of another model family or shape are refused in one line before the run is recorded,
naming what they hold and what the run wants; what loads and what starts fresh is one line of ours, and
transformers' own progress bar and load report are silenced (on a terminal and off)."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from helpers.config import REPO, TINY
from helpers.models import TINY_BERT
from helpers.runs import run_train
from safetensors.torch import load_file, save_file
from transformers import BertModel

from core.errors import ConfigError
from models import create_model, export_names, export_timm_model, pretrained_state, quiet_transformers
from optim.comm import Comm
from train.checkpoint import Checkpointer
from train.model_init import check_init_from

SWIN = dict(arch="swin_tiny_patch4_window7_224", num_classes=10, img_size=32, patch_size=4, embed_dim=32,
            depths=[2, 2], num_heads=[2, 4], window_size=4)
TRANSFORMERS_OUTPUT = ("Loading weights", "LOAD REPORT", "\x1b[", "MISSING", "UNEXPECTED")


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> Path:
    """Tiny exports of each kind: BERT pretraining and QA (transformers), a base BertModel with BERT's first tensor
    names (LayerNorm gamma/beta, no `bert.` prefix), and a Swin (timm)."""
    root = tmp_path_factory.mktemp("exports")
    with quiet_transformers():  # save_pretrained's own bar
        create_model("bert_pretraining", **TINY_BERT).save_pretrained(root / "bert")
        create_model("bert_question_answering", **TINY_BERT).save_pretrained(root / "qa")
        base = BertModel(create_model("bert_pretraining", **TINY_BERT).config, add_pooling_layer=False)
        base.save_pretrained(root / "base")
    legacy = {key.replace("LayerNorm.weight", "LayerNorm.gamma").replace("LayerNorm.bias", "LayerNorm.beta"): value
              for key, value in base.state_dict().items()}
    save_file({key: value.contiguous() for key, value in legacy.items()}, str(root / "base" / "model.safetensors"))
    export_timm_model(create_model("swin", **SWIN), root / "swin")
    return root


@pytest.fixture(scope="module")
def swin_run(tmp_path_factory) -> Path:
    """A run directory of a Swin model: a checkpoint and its recorded config."""
    run_dir = tmp_path_factory.mktemp("swin_run")
    Checkpointer(run_dir / "checkpoints", keep_last=1, comm=Comm()).save(
        2, {"model": {"layers.0.blocks.0.attn.qkv.weight": torch.zeros(3, 3)}}, {})
    (run_dir / ".hydra").mkdir()
    (run_dir / ".hydra" / "config.yaml").write_text("model:\n  name: swin\n")
    return run_dir


@pytest.mark.parametrize(("model", "options", "source", "holds", "wants"), [
    ("bert_pretraining", TINY_BERT, "swin", "a timm swin_tiny_patch4_window7_224 export (swin weights)", "bert"),
    ("swin", SWIN, "bert", "a transformers BertForPreTraining export (bert weights)", "swin"),
    ("bert_question_answering", TINY_BERT, "swin", "a timm swin_tiny_patch4_window7_224 export (swin weights)", "bert"),
])
def test_an_export_of_another_family_is_refused_naming_both(exports, model, options, source, holds, wants):
    with pytest.raises(ConfigError) as info:
        check_init_from(model, options, str(exports / source))
    assert str(info.value) == (f"trainer.init_from={exports / source} holds {holds}, and model.name={model} starts "
                               f"from {wants} weights: give a {wants} run or export, or a {holds.split()[-2][1:]} "
                               "model")


def test_a_run_of_another_family_is_refused_naming_its_model(swin_run):
    with pytest.raises(ConfigError, match=rf"^trainer\.init_from={swin_run} holds a run of model\.name=swin \(swin "
                                          r"weights\), and model\.name=bert_pretraining starts from bert weights"):
        check_init_from("bert_pretraining", TINY_BERT, str(swin_run))


def test_an_export_of_another_shape_is_refused_naming_the_key(exports):
    with pytest.raises(ConfigError) as info:
        check_init_from("bert_question_answering", {**TINY_BERT, "hidden_size": 64}, str(exports / "bert"))
    assert str(info.value) == (
        f"trainer.init_from={exports / 'bert'} holds a transformers BertForPreTraining export with hidden_size=32, "
        f"and this run's model has hidden_size=64: set model.hidden_size=32, or model.config_from={exports / 'bert'} "
        "to take the export's whole shape")


def test_the_command_refuses_a_swin_export_for_bert_in_one_line_before_recording(exports, tmp_path):
    result = run_train([*TINY, f"trainer.init_from={exports / 'swin'}", f"hydra.run.dir={tmp_path / 'run'}"])
    assert result.returncode == 2, result.stderr
    assert result.stderr.splitlines() == [
        f"config error: trainer.init_from={exports / 'swin'} holds a timm swin_tiny_patch4_window7_224 export (swin "
        "weights), and model.name=bert_pretraining starts from bert weights: give a bert run or export, or a swin "
        "model"]
    assert not (tmp_path / "run" / ".hydra").exists()


@pytest.mark.parametrize(("model", "source", "line"), [
    ("bert_question_answering", "bert", "21 of 23 tensors load; starting fresh: qa_outputs (2); not used: "
                                        "bert.pooler (2), cls.predictions (5), cls.seq_relationship (2)"),
    ("bert_pretraining", "bert", "all 32 tensors load"),
    ("bert_pretraining", "qa", "22 of 32 tensors load; starting fresh: bert.pooler (2), cls.predictions (6), "
                               "cls.seq_relationship (2); not used: qa_outputs (2)"),
    # the names transformers maps as it loads: the `bert.` prefix added, LayerNorm gamma/beta renamed
    ("bert_question_answering", "base", "21 of 23 tensors load; starting fresh: qa_outputs (2)"),
])
def test_the_plan_says_in_one_line_what_loads_and_what_starts_fresh(exports, model, source, line):
    assert check_init_from(model, TINY_BERT, str(exports / source)) == f"trainer.init_from={exports / source}: {line}"


def test_a_base_model_with_old_names_maps_as_transformers_maps_it(exports):
    model = create_model("bert_question_answering", **TINY_BERT)
    state = pretrained_state(model, exports / "base")
    assert set(state) == set(model.state_dict())
    assert export_names(model, exports / "base") == set(model.state_dict()) - {"qa_outputs.weight", "qa_outputs.bias"}


def test_loading_an_export_prints_nothing_of_transformers(exports, capfd):
    model = create_model("bert_pretraining", **TINY_BERT)
    state = pretrained_state(model, exports / "qa")  # the pretraining heads start fresh: a report, unsilenced
    assert capfd.readouterr() == ("", "")
    assert torch.equal(state["bert.embeddings.word_embeddings.weight"],
                       load_file(exports / "qa" / "model.safetensors")["bert.embeddings.word_embeddings.weight"])


def test_loading_an_export_prints_nothing_on_a_terminal_either(exports):
    """transformers colours its report and draws its bar for a terminal: the same load, its output a pty."""
    controller, terminal = pty.openpty()
    code = ("from models import create_model, pretrained_state; "
            f"pretrained_state(create_model('bert_pretraining', **{TINY_BERT!r}), {str(exports / 'qa')!r}); "
            "print('done')")
    with subprocess.Popen([sys.executable, "-c", code], cwd=REPO, stdout=terminal, stderr=terminal) as proc:
        os.close(terminal)
        output = b""
        with contextlib.suppress(OSError):  # EIO once the child has closed the terminal
            while chunk := os.read(controller, 4096):
                output += chunk
    os.close(controller)
    assert proc.returncode == 0, output
    assert output.decode().split() == ["done"]


def test_loading_an_export_of_another_shape_is_one_line(exports):
    with pytest.raises(ConfigError) as info:
        pretrained_state(create_model("bert_pretraining", **{**TINY_BERT, "hidden_size": 64}), exports / "bert")
    assert str(info.value) == (f"{exports / 'bert'} does not fit the model: bert.embeddings.LayerNorm.bias has shape "
                               "(32,) there and (64,) here")
    with pytest.raises(ConfigError, match="holds a timm swin_tiny_patch4_window7_224 export: none of its weights"):
        pretrained_state(create_model("bert_pretraining", **TINY_BERT), exports / "swin")


@pytest.mark.slow
def test_fine_tuning_from_an_export_says_one_line_of_ours_into_a_pipe(exports, tmp_path):
    qa = ["experiment=squad_demo", "model.config_from=null", *[f"model.{k}={v}" for k, v in TINY_BERT.items()],
          "data.vocab_path=null", "data.max_seq_len=64", "data.doc_stride=32", "data.max_query_len=16",
          "trainer.epochs=null", "trainer.max_steps=1", "trainer.device=cpu", "logger.tensorboard=false"]
    result = run_train([*qa, f"trainer.init_from={exports / 'bert'}", f"hydra.run.dir={tmp_path}"])
    assert result.returncode == 0, result.stderr[-3000:]
    assert f"trainer.init_from={exports / 'bert'}: 21 of 23 tensors load; starting fresh: qa_outputs (2)" in \
        result.stdout
    assert not [text for text in TRANSFORMERS_OUTPUT if text in result.stdout + result.stderr]
    assert json.loads((tmp_path / "summary.json").read_text())["final"]
