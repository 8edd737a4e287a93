"""`python -m benchmarks.optim.optimizers`: a row per optimizer in each part, with numbers that follow from the
setup."""

from __future__ import annotations

import pytest

from benchmarks.optim.optimizers import main
from optim.apex import runnable_optimizers


def _rows(out: str, section: str) -> dict[str, list[str]]:
    """The table under the `## <section>` heading: first column -> the other columns."""
    block = out.split(f"## {section}")[1].split("\n## ")[0].strip().splitlines()[2:]
    return {line.split()[0]: line.split()[1:] for line in block if line.strip()}


def test_step_part_times_every_runnable_optimizer_against_lamb(capsys):
    main(["--part", "step", "--size", "tiny", "--repeats", "1", "--warmup", "1"])
    rows = _rows(capsys.readouterr().out, "step")
    assert set(rows) == {"lamb", *runnable_optimizers()}
    assert rows["lamb"][2:4] == ["1.00", "1.00"] and rows["lamb"][-1] == "1.00"
    assert float(rows["adamw"][-1]) == pytest.approx(1.0)  # two moments each, like LAMB
    assert float(rows["slowmo"][-1]) == pytest.approx(2.0)  # LAMB's moments + anchors + slow momenta
    assert float(rows["lars"][-1]) == pytest.approx(0.5)  # one momentum buffer
    assert 0 < float(rows["jointspar"][-1]) <= 1.0  # LAMB moments of the layers sampled so far


def test_backward_part_compares_jointspar_with_dense(capsys):
    main(["--part", "backward", "--backward-size", "tiny", "--sample-ratios", "0.5", "--repeats", "1",
          "--warmup", "0"])
    rows = _rows(capsys.readouterr().out, "backward")
    assert list(rows) == ["dense", "sample_ratio=0.5"]
    assert rows["dense"][1:] == ["1.00", "1.00"]
    assert 0 < float(rows["sample_ratio=0.5"][2]) < 1.0  # fewer backward FLOPs
