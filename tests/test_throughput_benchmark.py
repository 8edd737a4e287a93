"""`python -m benchmarks.throughput` runs the trainer's step on CPU and counts FLOPs that match the model's size."""

from __future__ import annotations

import re

from benchmarks.throughput import main


def test_bert_step_is_timed_and_its_flops_counted(capsys):
    main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2"])
    out = capsys.readouterr().out
    assert re.search(r"throughput\s+[\d.]+ seq/s", out)
    per_sample = float(re.search(r"([\d.]+) GFLOP per sample", out).group(1))
    # 6 x (encoder params x 128 tokens + MLM decoder x 20 predictions) for the 128-hidden, 2-layer demo BERT:
    # fwd + bwd matmuls, plus attention; within 15 %.
    encoder = 2 * (4 * 128 * 128 + 2 * 128 * 512)
    expected = 6 * (encoder * 128 + (128 * 128 + 128 * 30528) * 20) / 1e9
    assert abs(per_sample - expected) / expected < 0.15
    assert "MFU n/a" in out  # no GPU peak for a CPU


def test_swin_step_runs():
    main(["--task", "swin", "--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2"])

