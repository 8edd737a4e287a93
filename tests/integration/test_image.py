"""The container image's install, replayed against each base's torch version (no Docker daemon or GPU needed).

docker/bases.json names every image's base and the torch it trains with; these tests check that torch against what
the pinned requirements demand, so a base whose torch transformers would disable fails here, not in a cluster job.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import re
import subprocess
import sys

import pytest
from helpers.config import REPO
from packaging.requirements import Requirement
from packaging.version import Version

BASES = json.loads((REPO / "docker" / "bases.json").read_text())
TODAYS_V100_TORCH = "2.6.0a0+df5bbc09d1"  # nvcr.io/nvidia/pytorch:24.12-py3's own torch

sys.path.insert(0, str(REPO / "docker"))
from lift_constraints import lift, pins  # noqa: E402


def image_torch(base: dict) -> str:
    """The torch an image trains with: the pinned pair installed over the base's, else the base's own."""
    if base["torch_requirements"] is None:
        return base["base_torch"]
    return pins([REPO / base["torch_requirements"]])["torch"]


def torch_refusals(torch_version: str) -> list[str]:
    """Each pinned runtime requirement whose own torch requirement `torch_version` does not meet."""
    refusals = []
    for name, pinned in pins([REPO / "requirements.txt"]).items():
        if importlib.metadata.version(name) != pinned:
            pytest.fail(f"{name} {importlib.metadata.version(name)} is installed, not the pinned {pinned}")
        for line in importlib.metadata.requires(name) or []:
            req = Requirement(line)
            applies = req.marker is None or any(req.marker.evaluate({"extra": extra}) for extra in ("", "torch"))
            if req.name == "torch" and applies and not req.specifier.contains(torch_version, prereleases=True):
                refusals.append(f"{name}=={pinned} needs {line}")
    return refusals


def transformers_accepts(torch_version: str, monkeypatch: pytest.MonkeyPatch) -> bool:
    """transformers' own import-time check (which disables PyTorch below its minimum) on `torch_version`."""
    from transformers.utils import import_utils

    monkeypatch.setattr(import_utils, "_is_package_available", lambda *args, **kwargs: (True, torch_version))
    return import_utils.is_torch_available.__wrapped__()


@pytest.mark.parametrize("image", sorted(BASES))
def test_every_image_torch_meets_the_pinned_requirements(image, monkeypatch):
    torch_version = image_torch(BASES[image])
    assert torch_refusals(torch_version) == []
    assert transformers_accepts(torch_version, monkeypatch)


def test_the_replay_rejects_todays_v100_base_torch(monkeypatch):
    assert BASES["v100"]["base_torch"] == TODAYS_V100_TORCH
    assert any(r.startswith("transformers==") for r in torch_refusals(TODAYS_V100_TORCH))
    assert not transformers_accepts(TODAYS_V100_TORCH, monkeypatch)


def test_a_base_keeping_its_torch_has_no_prerelease_below_the_minimum():
    """`2.6.0a0` sorts below 2.6.0: an NGC torch must be a pre-release of a later version than the minimum."""
    minimum = Version("2.6.0")
    for image, base in BASES.items():
        if base["torch_requirements"] is None:
            assert Version(base["base_torch"]) >= minimum, image


def test_only_the_conflicting_base_constraints_are_lifted():
    ngc = "numpy==2.4.6\nprotobuf==4.25.3\ntorch==2.6.0a0+df5bbc09d1\ntransformers==4.48.0\n# a comment\n"
    requirement_files = [REPO / "requirements.txt", REPO / BASES["v100"]["torch_requirements"]]
    kept, lifted = lift(ngc, pins(requirement_files))
    assert lifted == ["torch==2.6.0a0+df5bbc09d1", "transformers==4.48.0"]
    assert kept == "numpy==2.4.6\nprotobuf==4.25.3\n# a comment\n"


def test_dockerfile_and_docs_name_every_base():
    dockerfile = (REPO / "Dockerfile").read_text()
    docs = (REPO / "docs" / "cluster.md").read_text()
    default_base = re.search(r"^ARG BASE_IMAGE=(\S+)", dockerfile, re.MULTILINE).group(1)
    assert default_base == BASES["a100"]["base_image"]
    for base in BASES.values():
        assert base["base_image"] in dockerfile and base["base_image"] in docs
        assert image_torch(base) in docs
        if base["torch_requirements"]:
            assert f"TORCH_REQUIREMENTS={base['torch_requirements']}" in dockerfile
            assert f"TORCH_REQUIREMENTS={base['torch_requirements']}" in docs


def test_smoke_builds_and_steps_the_tiny_models():
    out = subprocess.run([sys.executable, str(REPO / "docker" / "smoke.py")], cwd=REPO, capture_output=True,
                         text=True, env={**os.environ, "PYTHONPATH": str(REPO)}, check=True)
    assert "tiny BERT and Swin stepped on CPU" in out.stdout
