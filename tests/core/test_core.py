"""The ground floor: one registry type for everything a config selects by name, found without hand-kept lists, and
a layering in which `core/` imports nothing of the project and no Python lives in, or is imported from, `conf/`."""

from __future__ import annotations

import sys

import pytest
from helpers.config import REPO
from helpers.sources import imported_packages

from core.errors import ConfigError
from core.registry import Registry
from data._registry import KINDS
from models._registry import MODELS
from optim._registry import OPTIMIZERS
from train.tasks._registry import TASKS

PROJECT_PACKAGES = ("benchmarks", "core", "data", "models", "optim", "train", "conf")


def _write_package(root, name: str, modules: dict[str, str]) -> None:
    package = root / name
    package.mkdir()
    (package / "__init__.py").write_text("")
    for module, text in modules.items():
        path = package / f"{module}.py"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


def test_a_registry_finds_its_entries_by_where_their_modules_lie(tmp_path, monkeypatch):
    register = f"from {__name__} import FOUND\nFOUND.register('{{name}}', '{{name}} entry')\n"
    _write_package(tmp_path, "toy_entries", {"alpha": register.format(name="alpha"),
                                             "beta": register.format(name="beta"),
                                             "_private": "raise AssertionError('a private module is not imported')"})
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "FOUND", Registry("toy", "toy.name", "toy_entries"), raising=False)
    assert FOUND.names() == ["alpha", "beta"]  # noqa: F821 - set just above
    assert list(FOUND) == ["alpha entry", "beta entry"]  # noqa: F821


def test_a_registry_with_a_module_name_imports_that_module_of_each_subpackage(tmp_path, monkeypatch):
    register = f"from {__name__} import FOUND\nFOUND.register('{{name}}', None)\n"
    root = tmp_path / "toy_kinds"
    for sub, has_kinds in (("text", True), ("images", True), ("empty", False)):
        (root / sub).mkdir(parents=True)
        (root / sub / "__init__.py").write_text("")
        (root / sub / "other.py").write_text("raise AssertionError('only the kinds modules are imported')")
        if has_kinds:
            (root / sub / "kinds.py").write_text(register.format(name=sub))
    (root / "__init__.py").write_text("")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys.modules[__name__], "FOUND", Registry("toy", "toy.name", "toy_kinds", "kinds"),
                        raising=False)
    assert FOUND.names() == ["images", "text"]  # noqa: F821


def test_a_name_registered_twice_is_an_error_and_an_unknown_one_lists_the_known():
    registry = Registry("widget", "widget.name", "core")
    registry.register("a", 1)
    with pytest.raises(ValueError, match="widget 'a' is registered twice"):
        registry.register("a", 2)
    registry.register("b", 2)
    with pytest.raises(ConfigError, match=r"^widget\.name=c must be one of a, b$"):
        registry.get("c")


@pytest.mark.parametrize(("registry", "expected"), [
    (OPTIMIZERS, {"lamb", "slamb", "adamw"}), (MODELS, {"bert_pretraining", "swin"}),
    (TASKS, {"bert_pretraining", "question_answering", "image_classification"}), (KINDS, {"demo", "shards", "squad"}),
])
def test_every_registry_of_the_project_is_the_one_type_and_finds_its_entries(registry, expected):
    assert isinstance(registry, Registry)
    assert expected <= set(registry.names())


def test_core_imports_nothing_of_the_project_and_nothing_imports_from_conf():
    sources = [p for p in REPO.rglob("*.py") if not any(part.startswith(".") for part in p.relative_to(REPO).parts)]
    assert not [p for p in (REPO / "conf").rglob("*.py") if p.name != "__init__.py"], "conf/ holds YAML only"
    for path in (REPO / "core").glob("*.py"):
        assert not imported_packages(path) & (set(PROJECT_PACKAGES) - {"core"}), path
    offenders = [str(p.relative_to(REPO)) for p in sources if "conf" in imported_packages(p)]
    assert not offenders, f"import Python from conf/: {offenders}"
