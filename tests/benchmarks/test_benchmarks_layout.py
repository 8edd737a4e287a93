"""benchmarks/: the documented layout, scripts that share helpers through `benchmarks.common` only (no private
names, no import circle, no `sys.path` edits), and a `--help` that runs for every script."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.config import REPO

COMMON = "benchmarks.common"
LAYOUT = {  # the module names the docs use
    COMMON,
    "benchmarks.optim.bandwidth_bound", "benchmarks.optim.lamb_step", "benchmarks.optim.slamb_step",
    "benchmarks.optim.onebit_step", "benchmarks.optim.optimizers", "benchmarks.optim.deepspeed_reference",
    "benchmarks.optim.step_cost", "benchmarks.optim.host_time",
    "benchmarks.throughput.training", "benchmarks.throughput.swin_builder", "benchmarks.throughput.conversions",
    "benchmarks.data.loader", "benchmarks.data.prepare", "benchmarks.data.padding", "benchmarks.gpu",
    "benchmarks.paper.reproduce", "benchmarks.paper.convergence", "benchmarks.paper.report", "benchmarks.paper.plots",
    "benchmarks.paper.scaling", "benchmarks.paper.stages", "benchmarks.paper.paired",
    "benchmarks.paper.convergence_data", "benchmarks.paper.convergence_page",
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(REPO).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


TREES = {_module_name(path): ast.parse(path.read_text(), str(path))
         for path in sorted((REPO / "benchmarks").rglob("*.py"))}
PACKAGES = {name for name in TREES if (REPO / Path(*name.split(".")) / "__init__.py").is_file()}


def _is_script(tree: ast.Module) -> bool:
    """Whether the module runs as `python -m` (a module-level `if __name__ == "__main__":`)."""
    return any(isinstance(node, ast.If) and isinstance(node.test, ast.Compare)
               and isinstance(node.test.left, ast.Name) and node.test.left.id == "__name__" for node in tree.body)


SCRIPTS = sorted(name for name, tree in TREES.items() if _is_script(tree))


def _imports(name: str) -> list[tuple[str, str | None, int]]:
    """(module, name taken from it or None, line) of every import in module `name`, function-level and
    TYPE_CHECKING ones included; relative imports resolved; `from package import module` gives the module."""
    package = name if name in PACKAGES else name.rpartition(".")[0]
    found = []
    for node in ast.walk(TREES[name]):
        if isinstance(node, ast.Import):
            found += [(alias.name, None, node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([node.module] if node.module else [])])
            for alias in node.names:
                submodule = f"{base}.{alias.name}"
                found.append((submodule, None, node.lineno) if submodule in TREES else
                             (base, alias.name, node.lineno))
    return found


def test_the_layout_is_the_documented_one():
    assert set(TREES) - PACKAGES == LAYOUT
    for package in PACKAGES - {"benchmarks"}:  # one line saying what the group is for
        doc = ast.get_docstring(TREES[package])
        assert doc and "\n" not in doc, package


def test_scripts_share_helpers_through_common_only():
    """A module imports no benchmark script: what two scripts share lives in benchmarks.common."""
    bad = [f"{name}:{line} imports {module}" for name in TREES for module, _, line in _imports(name)
           if module in SCRIPTS and module != name]
    assert bad == []
    assert COMMON not in SCRIPTS


def test_no_private_name_crosses_benchmark_modules():
    bad = [f"{name}:{line} imports {module}.{imported}" for name in TREES
           for module, imported, line in _imports(name)
           if module in TREES and module != name and (imported or module.rpartition(".")[2]).startswith("_")]
    assert bad == []


def test_benchmark_modules_import_no_circle():
    graph = {name: {module for module, _, _ in _imports(name) if module in TREES and module not in PACKAGES}
             for name in TREES}

    def reachable(start: str) -> set[str]:
        seen, todo = set(), [start]
        while todo:
            for module in graph[todo.pop()] - seen:
                seen.add(module)
                todo.append(module)
        return seen

    assert [name for name in TREES if name in reachable(name)] == []


def test_no_benchmark_module_edits_sys_path():
    bad = [f"{name}:{node.lineno}" for name, tree in TREES.items() for node in ast.walk(tree)
           if isinstance(node, ast.Attribute) and node.attr == "path" and isinstance(node.value, ast.Name)
           and node.value.id == "sys"]
    bad += [f"{name}:{line} imports sys.path" for name in TREES for module, imported, line in _imports(name)
            if module == "sys" and imported == "path"]
    assert bad == []


HELP = """
import contextlib, io, json, runpy, sys

results = {}
for name in sys.argv[1:]:
    sys.argv, out, code = [name, "--help"], io.StringIO(), None
    try:
        with contextlib.redirect_stdout(out):
            runpy.run_module(name, run_name="__main__", alter_sys=True)
    except SystemExit as exit:
        code = exit.code
    results[name] = (code, out.getvalue())
sys.__stdout__.write(json.dumps(results))
"""


def test_every_script_prints_its_help():
    """Every script's `python -m ... --help`, all in one process (each would import torch again)."""
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled"}
    result = subprocess.run([sys.executable, "-c", HELP, *SCRIPTS], cwd=REPO, env=env, capture_output=True,
                            text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    helps = json.loads(result.stdout)
    libraries = {COMMON, "benchmarks.paper.plots", "benchmarks.paper.stages", "benchmarks.paper.paired",
                 "benchmarks.paper.convergence_data", "benchmarks.paper.convergence_page"}  # no --help
    assert set(SCRIPTS) == LAYOUT - libraries
    for name in SCRIPTS:
        code, text = helps[name]
        assert code == 0 and text.startswith("usage: "), (name, code, text[:300])
