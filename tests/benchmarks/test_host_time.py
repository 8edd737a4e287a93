"""benchmarks.optim.host_time: both mask draws timed per optimizer on meta tensors, the GPU geometry left as found."""

from __future__ import annotations

from benchmarks.optim.host_time import main
from optim.slamb import _layout


def test_times_each_optimizer_with_the_draw_ahead_and_in_the_step(capsys):
    geometry = _layout.GEOMETRIES["cuda"]
    main(["--size", "tiny", "--optimizers", "slamb", "lamb", "--warmup", "0", "--repeats", "1", "--gap-ms", "1"])
    rows = [line.split() for line in capsys.readouterr().out.splitlines()[2:]]
    labels = [(name, draw) for name in ("slamb", "lamb") for draw in ("drawn ahead", "drawn in the step")]
    assert [(row[0], " ".join(row[2:-3])) for row in rows] == labels
    assert all(float(row[-3]) > 0 for row in rows) and [row[-1] for row in rows][1::2] == ["1.00", "1.00"]
    assert _layout.GEOMETRIES["cuda"] is geometry and geometry.draw_ahead
