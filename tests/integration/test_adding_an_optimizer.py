"""Adding an optimizer takes the files docs/development.md lists and no others: a toy optimizer, and a variant of
it registered with `defaults` and no memory figure, are added by that list to a copy of the repository, where the
registry's tests, the `--help` text, the step benchmark and a tiny run must take them up with nothing else edited."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest
from helpers.config import REPO
from helpers.repo_copy import copy_sources, listed_files

NAME, VARIANT = "toy_sgd", "toy_sgd_nesterov"
PAGE = "lars-slowmo-jointspar"  # the docs page of its family (momentum SGD)

MODULE = '''\
"""Toy SGD: momentum SGD, `w <- w - lr b` with `b <- momentum b + g + weight_decay w` (heavy ball, or Nesterov's
`g + momentum b` in place of `b`), the example optimizer of "Adding an optimizer"."""

from __future__ import annotations

from typing import Any

import torch

from core.options import check_non_negative, require
from optim._registry import OptimSpec, register_optimizer, run_check


def check_toy_sgd_options(o: dict[str, Any]) -> None:
    check_non_negative("lr", o["lr"])
    check_non_negative("momentum", o["momentum"])
    require(o["momentum"] < 1, "momentum", o["momentum"], "must be < 1")
    require(isinstance(o["nesterov"], bool), "nesterov", o["nesterov"], "must be true or false")
    check_non_negative("weight_decay", o["weight_decay"])


class ToySGD(torch.optim.Optimizer):
    def __init__(self, params: Any, lr: float = 0.1, momentum: float = 0.0, nesterov: bool = False,
                 weight_decay: float = 0.0) -> None:
        options = dict(lr=lr, momentum=momentum, nesterov=nesterov, weight_decay=weight_decay)
        run_check("ToySGD", check_toy_sgd_options, options)
        super().__init__(params, options)

    @torch.no_grad()
    def step(self, closure: Any = None) -> None:
        for group in self.param_groups:  # one foreach op per list: the ops per step do not grow with the tensors
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            directions = torch._foreach_add([p.grad for p in params], params, alpha=group["weight_decay"])
            if group["momentum"]:
                for p in params:
                    if "momentum_buffer" not in self.state[p]:
                        self.state[p]["momentum_buffer"] = torch.zeros_like(p)
                buffers = [self.state[p]["momentum_buffer"] for p in params]
                torch._foreach_mul_(buffers, group["momentum"])
                torch._foreach_add_(buffers, directions)
                if group["nesterov"]:
                    torch._foreach_add_(directions, buffers, alpha=group["momentum"])
                else:
                    directions = buffers
            torch._foreach_add_(params, directions, alpha=-group["lr"])


def momentum_bytes(options: dict[str, Any], world_size: int) -> float:
    return 4.0 if options["momentum"] else 0.0  # the fp32 momentum buffer


register_optimizer(OptimSpec("toy_sgd", ToySGD, "ddp", check=check_toy_sgd_options, description="toy momentum SGD",
                             state_bytes_per_param=momentum_bytes))
register_optimizer(OptimSpec("toy_sgd_nesterov", ToySGD, "ddp", check=check_toy_sgd_options,
                             description="toy SGD, Nesterov momentum", defaults={"nesterov": True}))
'''

PRESET = """\
name: toy_sgd
lr: 0.1
momentum: 0.9
nesterov: false
weight_decay: 0.01
"""

VARIANT_PRESET = """\
name: toy_sgd_nesterov  # nesterov: true is the registry entry's
lr: 0.1
momentum: 0.9
weight_decay: 0.01
"""

DOCS_ENTRY = """
## Toy SGD
`optim=toy_sgd`: momentum SGD; `optim=toy_sgd_nesterov` is the same class with Nesterov momentum.
"""

TESTS = '''\
"""Toy SGD against its update rule, and a tiny run with optim=toy_sgd."""

import json

import torch
from helpers.config import TINY, compose

from optim.toy_sgd import ToySGD
from train.run import run


def test_two_steps_follow_the_heavy_ball_rule():
    w = torch.nn.Parameter(torch.tensor([1.0, -2.0]))
    optimizer = ToySGD([w], lr=0.1, momentum=0.5)
    for _ in range(2):
        w.grad = torch.tensor([1.0, 1.0])
        optimizer.step()
    assert torch.allclose(w.detach(), torch.tensor([1.0 - 0.1 - 0.15, -2.0 - 0.1 - 0.15]))


def test_a_tiny_run_steps_it(tmp_path):
    run(compose([*TINY, "optim=toy_sgd", "trainer.max_steps=2"]), tmp_path)
    steps = [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]
'''


# What the toy adds, by the docs' list: (name, text) per file; the variant's registration is in the class's module.
TOY_FILES = {
    "optim/<name>.py": [(NAME, MODULE)],
    "conf/optim/<name>.yaml": [(NAME, PRESET), (VARIANT, VARIANT_PRESET)],
    "docs/optimizers/<page>.md": [(NAME, DOCS_ENTRY)],
    "tests/optim/test_<name>.py": [(NAME, TESTS)],
}


def test_the_toy_is_added_by_the_docs_list():
    assert listed_files("Adding an optimizer") == list(TOY_FILES)


def _add_the_toy(root: Path) -> list[str]:
    """Write the toy's files by the docs' list; return the paths written, relative to `root`."""
    written = []
    for pattern, files in TOY_FILES.items():
        for name, text in files:
            relative = pattern.replace("<name>", name).replace("<page>", PAGE)
            path = root / relative
            if pattern.startswith("docs/"):  # a section on an existing page
                path.write_text(path.read_text() + text)
            else:
                assert not path.exists(), relative
                path.write_text(text)
            written.append(relative)
    return written


# The tests that take every optimizer from the registry and are quick: each is run whole, but for the cases of the
# shipped optimizers (the toy needs no more than they do). Slower ones that also do (test_config.py's command-line
# errors, test_reproduce.py's studies) are left out.
REGISTRY_TESTS = ["tests/optim/test_optim_registry.py", "tests/optim/test_memory_estimate.py",
                  "tests/train/test_help.py", "tests/benchmarks/test_optimizers_benchmark.py",
                  "tests/benchmarks/test_step_cost.py"]

# A pytest plugin: deselect the parametrized cases that name none of the toy's optimizers.
ONLY_THE_TOY = f"""
def pytest_collection_modifyitems(config, items):
    names = {{"{NAME}", "{VARIANT}"}}
    other = [item for item in items if hasattr(item, "callspec") and not names & set(item.callspec.id.split("-"))]
    config.hook.pytest_deselected(items=other)
    items[:] = [item for item in items if item not in other]
"""


@pytest.mark.slow
def test_adding_an_optimizer_takes_the_listed_files_only(tmp_path):
    root = tmp_path / "repo"
    copy_sources(root)
    _add_the_toy(root)
    (tmp_path / "only_the_toy.py").write_text(ONLY_THE_TOY)
    report = tmp_path / "report.xml"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONDONTWRITEBYTECODE": "1", "PYTHONPATH": str(tmp_path)}
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-n", "0", "-p", "no:cacheprovider", "-p", "only_the_toy",
         f"--junitxml={report}", *REGISTRY_TESTS, f"tests/optim/test_{NAME}.py"],
        cwd=root, env=env, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    passed = [case.get("name") for case in ET.parse(report).iter("testcase") if case.find("skipped") is None]
    for name in (NAME, VARIANT):
        ran = {case.split("[")[0] for case in passed if re.search(rf"\[(.*-)?{name}(-.*)?\]", case)}
        assert {"test_each_optimizer_has_its_preset_under_its_name", "test_each_optimizer_has_a_docs_entry",
                "test_each_config_builds_its_optimizer_and_steps", "test_each_config_passes_its_check",
                "test_each_option_is_checked_in_the_config_and_the_constructor_alike",
                "test_each_optimizer_constructs_over_meta_parameters", "test_bytes_per_step_within_the_ceiling",
                "test_ops_per_step_do_not_grow_with_the_number_of_tensors"} <= ran, (name, ran)
        # the toy declares its bytes per parameter, the variant leaves them unknown (the field is optional)
        assert ("test_bytes_per_param_of_any_other_optimizer_matches_its_preset" in ran) == (name == NAME)
    assert {"test_a_tiny_run_steps_it", "test_help_lists_the_user_groups_with_their_options_default_first",
            "test_step_part_times_every_runnable_optimizer_against_lamb"} <= set(passed)
    assert not (REPO / "optim" / f"{NAME}.py").exists()  # the repository itself is left alone
