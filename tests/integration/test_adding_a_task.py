"""Adding a task takes the files docs/development.md lists and no others: a toy task (BERT's masked-LM loss without
next-sentence prediction, on the shipped model and data) is added by that list to a copy of the repository, where
the registry, the `--help` text, the experiment tests and a run of its preset must take it up with nothing else
edited."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import xml.etree.ElementTree as ET

import pytest
from helpers.config import REPO
from helpers.repo_copy import copy_sources, listed_files

NAME = "mlm_only"
PAGE = "bert"  # the docs page of its workload

MODULE = '''\
"""MLM only: BERT's masked-LM cross-entropy without next-sentence prediction (the example of "Adding a task")."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from train.tasks._registry import Task, register_task


def mlm_only_step(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    mlm_logits, _ = model(batch["input_ids"], batch["token_type_ids"], batch["attention_mask"],
                          batch["masked_lm_positions"])
    labels = batch["masked_lm_labels"].flatten()
    return {"loss": F.cross_entropy(mlm_logits.flatten(0, 1).float(), labels, ignore_index=-100)}


register_task(Task("mlm_only", mlm_only_step))
'''

TASK_PRESET = """\
# BERT's masked-LM loss alone, without next-sentence prediction.
name: mlm_only
"""

EXPERIMENT = """\
# @package _global_
# A tiny BERT trained on the masked-LM loss alone, on the embedded corpus (CPU):
#   python -m train experiment=mlm_only_demo
defaults:
  - override /task: mlm_only
  - override /model: bert_tiny
  - override /data: demo
  - override /optim: lamb
  - override /schedule: poly_warmup
  - override /precision: fp32

name: mlm_only_demo
"""

DOCS_ENTRY = """
## Masked LM alone
`task=mlm_only` trains on BERT's masked-LM loss without next-sentence prediction:

```bash
python -m train experiment=mlm_only_demo
```
"""

TESTS = '''\
"""MLM only: its loss is the masked positions' cross-entropy, and a tiny run trains with it."""

import json

import torch
import torch.nn.functional as F
from helpers.config import TINY, compose

from train.run import run
from train.tasks import get_task


def test_the_loss_is_the_cross_entropy_of_the_labelled_positions():
    logits = torch.tensor([[[2.0, 0.0, 0.0], [0.0, 1.0, 0.0]]])
    batch = {"input_ids": None, "token_type_ids": None, "attention_mask": None, "masked_lm_positions": None,
             "masked_lm_labels": torch.tensor([[0, -100]])}
    loss = get_task("mlm_only").step(lambda *inputs: (logits, None), batch)["loss"]
    assert torch.isclose(loss, F.cross_entropy(logits[0, :1], torch.tensor([0])))


def test_a_tiny_run_trains_with_it(tmp_path):
    run(compose([*TINY, "task=mlm_only", "trainer.max_steps=2"]), tmp_path)
    records = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records if "loss" in r] == [1, 2]
'''

# What the toy adds, by the docs' list: the text of each file.
TOY_FILES = {
    "train/tasks/<name>.py": MODULE,
    "conf/task/<name>.yaml": TASK_PRESET,
    "conf/experiment/<name>_demo.yaml": EXPERIMENT,
    "docs/workloads/<page>.md": DOCS_ENTRY,
    "tests/train/test_<name>.py": TESTS,
}

# The shared tests that take every task and experiment up: each is run whole, but for the parametrized cases of the
# shipped presets.
SHARED_TESTS = ["tests/train/test_help.py", "tests/integration/test_experiments.py"]

# A pytest plugin: deselect the parametrized cases that are not the toy's.
ONLY_THE_TOY = f"""
def pytest_collection_modifyitems(config, items):
    other = [item for item in items if hasattr(item, "callspec") and "{NAME}" not in item.callspec.id]
    config.hook.pytest_deselected(items=other)
    items[:] = [item for item in items if item not in other]
"""


def test_the_toy_is_added_by_the_docs_list():
    assert listed_files("Adding a task") == list(TOY_FILES)


@pytest.mark.slow
def test_adding_a_task_takes_the_listed_files_only(tmp_path):
    root = tmp_path / "repo"
    copy_sources(root)
    for pattern, text in TOY_FILES.items():
        path = root / pattern.replace("<name>", NAME).replace("<page>", PAGE)
        if pattern.startswith("docs/"):  # a section on an existing page
            path.write_text(path.read_text() + text)
        else:
            assert not path.exists(), path
            path.write_text(text)
    (tmp_path / "only_the_toy.py").write_text(ONLY_THE_TOY)
    report = tmp_path / "report.xml"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "only_the_toy",
         "-m", "not gpu", f"--junitxml={report}", *SHARED_TESTS, f"tests/train/test_{NAME}.py"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = {case.get("name") for case in ET.parse(report).iter("testcase") if case.find("skipped") is None}
    assert {f"test_experiment_composes_checks_and_constructs[{NAME}_demo]", "test_help_lists_every_experiment",
            "test_a_tiny_run_trains_with_it", "test_the_loss_is_the_cross_entropy_of_the_labelled_positions"} <= passed

    # The preset as the docs entry runs it, shortened.
    run = subprocess.run([sys.executable, "-m", "train", f"experiment={NAME}_demo", "trainer.max_steps=2"],
                         cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    summary = json.loads((root / "runs" / f"{NAME}_demo" / "summary.json").read_text())
    assert (summary["task"], summary["steps"]) == (NAME, 2)
    assert not (REPO / "train" / "tasks" / f"{NAME}.py").exists()  # the repository itself is left alone
