"""`python -m benchmarks.gpu`: every part's command parses, a part that fails or hangs neither stops the others nor
outlives its limit, the page records what ran, and the dry run goes end to end on a machine that has only what a
bare GPU image has plus the carried wheels (no pysbd, datasets or wandb)."""

from __future__ import annotations

import importlib.metadata
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers.config import REPO
from helpers.doc_commands import check_command

import benchmarks.gpu as gpu

# What a bare GPU image lacks and the GPU command must not need (hydra-core, omegaconf and antlr4 are carried).
ABSENT = ("pysbd", "datasets", "wandb")
BARE_MACHINE = f"""
import importlib.abc, importlib.metadata, sys
ABSENT = {ABSENT!r}

class Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ABSENT:
            raise ModuleNotFoundError(f"No module named {{name!r}}", name=name)

sys.meta_path.insert(0, Absent())
_version = importlib.metadata.version

def version(name):
    if name in ABSENT:
        raise importlib.metadata.PackageNotFoundError(name)
    return _version(name)

importlib.metadata.version = version
"""


@pytest.fixture
def bare_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Every Python process started from here on runs without the ABSENT packages (through sitecustomize)."""
    site = tmp_path / "bare_site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BARE_MACHINE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")]))


@pytest.mark.parametrize("dry_run", [False, True], ids=["gpu", "dry-run"])
@pytest.mark.parametrize("part", gpu.PARTS, ids=lambda p: p.name)
def test_every_part_command_parses(part, dry_run, tmp_path, monkeypatch):
    check_command(list(gpu.command_line(part, dry_run, tmp_path)), monkeypatch)


def test_the_gpu_tests_part_runs_every_file_with_gpu_tests(tmp_path):
    files = gpu.gpu_test_files()
    assert {"tests/integration/test_gpu.py", "tests/train/test_gpu_resume.py"} <= set(files)
    (part,) = [p for p in gpu.PARTS if p.name == "gpu_tests"]
    assert gpu.command_line(part, False, tmp_path)[-len(files):] == files


def _python(code: str) -> tuple[str, ...]:
    return ("python", "-c", code)


FAKE_PARTS = [
    gpu.Part("fine", "prints a figure", _python("print('throughput 12.5 seq/s')"), 60, _python("print(1)"),
             r"[\d.]+ seq/s"),
    gpu.Part("broken", "fails", _python("import sys; print('about to fail'); sys.exit(3)"), 60, _python("")),
    # A hung part whose child would outlive it unless the whole process group is stopped.
    gpu.Part("hung", "hangs", _python(
        "import subprocess, sys, time; child = subprocess.Popen([sys.executable, '-c', 'import time; "
        "time.sleep(60)']); print(child.pid, flush=True); time.sleep(60)"), 2, _python("")),
    gpu.Part("after", "runs after the others", _python("print('still ran')"), 60, _python("")),
]


def _running(pid: int) -> bool:
    """Whether process `pid` exists and is not a zombie (a killed process not yet reaped)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_part_that_fails_or_hangs_stops_neither_the_others_nor_outlives_its_limit(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(gpu, "PARTS", FAKE_PARTS)
    start = time.monotonic()
    with pytest.raises(SystemExit) as exit_:
        gpu.main(["--out", str(tmp_path)])
    assert exit_.value.code == 1  # not every part was ok
    assert time.monotonic() - start < 30
    (page,) = tmp_path.glob("gpu-*.md")
    text = page.read_text()
    rows = dict(re.findall(r"^\| \[(\w+)\]\(#\w+\) \| ([^|]+?) \|", text, re.MULTILINE))
    assert rows == {"fine": "ok", "broken": "failed (exit 3)", "hung": "timed out after 2 s", "after": "ok"}
    assert "| 12.5 seq/s |" in text  # the headline figure
    assert "about to fail" in text and "still ran" in text  # output tails
    assert "| Commit | `" in text and "| torch | " in text and "| Device | " in text
    child = int(re.search(r"===== hung: .*\n(\d+)", page.with_suffix(".log").read_text()).group(1))
    assert not _running(child)  # the hung part's child was stopped with it
    assert "not ok: broken, hung" in capsys.readouterr().out


def test_parts_past_the_budget_are_recorded_not_run(tmp_path, monkeypatch):
    monkeypatch.setattr(gpu, "PARTS", FAKE_PARTS)
    with pytest.raises(SystemExit):
        gpu.main(["--out", str(tmp_path), "--budget", "0", "--only", "fine", "after"])
    text = next(tmp_path.glob("gpu-*.md")).read_text()
    assert text.count("| not run (budget spent) |") == 2


def test_an_optional_part_runs_only_when_named(tmp_path, monkeypatch):
    optional = gpu.Part("extra", "named only", _python("print('extra ran')"), 60, _python(""), optional=True)
    monkeypatch.setattr(gpu, "PARTS", [FAKE_PARTS[0], optional])
    for args, expected in (([], {"fine"}), (["--only", "extra"], {"extra"})):
        out = tmp_path / str(len(args))
        with pytest.raises(SystemExit):
            gpu.main(["--out", str(out), *args])
        rows = re.findall(r"^\| \[(\w+)\]\(#\w+\) \| ok \|", next(out.glob("gpu-*.md")).read_text(), re.MULTILINE)
        assert set(rows) == expected


def test_the_carried_wheels_are_pure_python_at_the_pinned_versions():
    """The `pip wheel` line of docs/results/README.md: pure-Python packages at requirements.txt's pins (omegaconf's
    antlr4 runtime, which it does not pin, at the version installed with omegaconf)."""
    line = next(line for line in (REPO / "docs" / "results" / "README.md").read_text().splitlines()
                if line.startswith("pip wheel"))
    carried = dict(arg.split("==") for arg in line.split() if "==" in arg)
    pins = dict(line.split("#")[0].strip().split("==") for line in (REPO / "requirements.txt").read_text().splitlines()
                if "==" in line.split("#")[0])
    assert {"hydra-core", "omegaconf", "antlr4-python3-runtime"} <= set(carried)
    for name, version in carried.items():
        assert version == pins.get(name, importlib.metadata.version(name)), name
        assert "Root-Is-Purelib: true" in importlib.metadata.distribution(name).read_text("WHEEL"), name


def test_the_corpus_sources_import_without_pysbd(bare_machine):
    """The demo's held-out split imports data.corpus.sources; only sentence splitting needs pysbd."""
    code = ("import data.corpus.sources as s, data.text.heldout\n"
            "try:\n    s.SENTENCE_SPLITTER\nexcept ModuleNotFoundError:\n    print('asked for pysbd')")
    result = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "asked for pysbd" in result.stdout


@pytest.mark.slow
def test_the_dry_run_goes_end_to_end_on_a_bare_machine(bare_machine, tmp_path):
    result = subprocess.run([sys.executable, "-m", "benchmarks.gpu", "--dry-run", "--out", str(tmp_path)], cwd=REPO,
                            capture_output=True, text=True, timeout=900)
    (page,) = tmp_path.glob("gpu-*.md")
    text = page.read_text()
    assert result.returncode == 0, text[-3000:]
    assert text.startswith("# GPU run: dry run on the CPU")
    for part in gpu.PARTS:  # the default parts, each ok; the optional ones only when named
        ran = re.search(rf"^\| \[{part.name}\]\(#{part.name}\) \| ok \|", text, re.MULTILINE)
        assert bool(ran) != part.optional, part.name
    assert "pysbd absent" in text
    assert re.search(r"^\| \[demo\].*eval/loss [\d.]+", text, re.MULTILINE)
