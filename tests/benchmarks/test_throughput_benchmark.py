"""`python -m benchmarks.throughput.training` runs the trainer's step on CPU and counts FLOPs that match the model's
size; `python -m benchmarks.optim.bandwidth_bound` counts the bytes an optimizer step must touch."""

from __future__ import annotations

import re

import pytest
import torch

from benchmarks.optim.bandwidth_bound import main as bandwidth_bound
from benchmarks.throughput.training import count_sequences_and_tokens, demo_micro_batches, main
from data.text.packing import PACKED_BATCH_KEYS


def test_bert_step_is_timed_and_its_flops_counted(capsys):
    main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2"])
    out = capsys.readouterr().out
    rows = float(re.search(r"throughput\s+([\d.]+) rows/s", out).group(1))
    assert float(re.search(r"sequences\s+([\d.]+) seq/s  \(1.00 a row\)", out).group(1)) == rows
    per_sample = float(re.search(r"([\d.]+) GFLOP per sample", out).group(1))
    # 6 x (encoder params x 128 tokens + MLM decoder x 20 predictions) for the 128-hidden, 2-layer demo BERT:
    # fwd + bwd matmuls, plus attention; within 15 %.
    encoder = 2 * (4 * 128 * 128 + 2 * 128 * 512)
    expected = 6 * (encoder * 128 + (128 * 128 + 128 * 30528) * 20) / 1e9
    assert abs(per_sample - expected) / expected < 0.15
    assert "MFU n/a" in out  # no GPU peak for a CPU


def test_the_first_warm_up_step_is_timed_apart_and_a_compile_needs_one(capsys):
    main(["--device", "cpu", "--steps", "1", "--warmup", "1", "--micro-batch", "2"])
    assert re.search(r"^first step +[\d.]+ s$", capsys.readouterr().out, re.MULTILINE)
    with pytest.raises(SystemExit) as refused:  # its compile would be timed as a step
        main(["--device", "cpu", "--warmup", "0", "--compile"])
    assert refused.value.code == 2 and "--warmup 0 with --compile" in capsys.readouterr().err


def test_swin_step_runs():
    main(["--task", "swin", "--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2"])


def test_real_tokens_per_second_leave_the_padding_out(capsys):
    main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2", "--padding", "0.25"])
    out = capsys.readouterr().out
    rate = float(re.search(r"throughput\s+([\d.]+) rows/s", out).group(1))
    tokens = float(re.search(r"real tokens\s+(\d+) tokens/s  \(25.0% padding\)", out).group(1))
    assert tokens == pytest.approx(rate * 96, abs=2)  # 128 positions, 32 of them padding
    with pytest.raises(SystemExit):  # no room left for 20 predictions
        main(["--device", "cpu", "--padding", "0.9"])


def _sequences(batches: list[dict[str, torch.Tensor]]) -> list[tuple[int, ...]]:
    """Every sequence of these micro-batches as its token ids and NSP label, sorted: a row's attention mask numbers
    its sequences (1 in an unpacked row)."""
    found = []
    for batch in batches:
        for ids, mask, nsp in zip(batch["input_ids"], batch["attention_mask"],
                                  batch["next_sentence_label"].reshape(len(batch["input_ids"]), -1), strict=True):
            found += [(*ids[mask == number].tolist(), int(nsp[number - 1])) for number in range(1, int(mask.max()) + 1)]
    return sorted(found)


def test_packed_micro_batches_hold_the_unpacked_ones_sequences():
    padded, packed = demo_micro_batches(512, 1), demo_micro_batches(512, 1, pack=3)
    assert set(packed[0]) == set(PACKED_BATCH_KEYS)
    assert len(packed) < len(padded) * 0.8  # rows: phase 2 of the demo pads about 30 % unpacked
    assert _sequences(packed) == _sequences(padded)
    assert count_sequences_and_tokens(packed) == count_sequences_and_tokens(padded)
    # A micro-batch of several rows: the corpus's sequences in one seeded order, the remainder left out.
    assert len(demo_micro_batches(512, 64)) == len(padded) // 64


def _demo_run(capsys, *options: str) -> tuple[float, float, float]:
    """rows/s, seq/s and the padding printed by a tiny run on the demo's phase-2 sequences."""
    main(["--device", "cpu", "--seq", "512", "--steps", "1", "--warmup", "0", "--micro-batch", "4", "--lengths", "demo",
          *options])
    out = capsys.readouterr().out
    return (float(re.search(r"throughput\s+([\d.]+) rows/s", out).group(1)),
            float(re.search(r"sequences\s+([\d.]+) seq/s", out).group(1)),
            float(re.search(r"tokens/s  \(([\d.]+)% padding\)", out).group(1)))


def test_packing_the_demo_sequences_pads_less_and_fits_more_sequences_a_row(capsys):
    rows, sequences, padding = _demo_run(capsys)
    assert sequences == rows and padding > 15
    rows, sequences, packed_padding = _demo_run(capsys, "--pack", "3")
    assert sequences > 1.2 * rows and packed_padding < padding / 2
    for wrong in (["--pack", "3"], ["--lengths", "demo", "--padding", "0.3"], ["--lengths", "demo", "--pack", "0"],
                  ["--task", "swin", "--lengths", "demo"],
                  ["--seq", "512", "--lengths", "demo", "--micro-batch", "5000"]):  # more rows than the corpus makes
        with pytest.raises(SystemExit):
            main(["--device", "cpu", *wrong])



def _gflop_per_sample(out: str) -> float:
    return float(re.search(r"([\d.]+) GFLOP per sample", out).group(1))


def test_accumulation_counts_every_micro_batch_and_the_profile_names_ops(capsys):
    main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2"])
    single = _gflop_per_sample(capsys.readouterr().out)
    main(["--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2", "--accumulation", "2",
          "--profile", "3"])
    out = capsys.readouterr().out
    assert "micro-batch 2 x 2" in out
    assert _gflop_per_sample(out) == pytest.approx(single, rel=0.01)  # twice the samples, twice the FLOPs
    assert "top 3 of 3 profiled steps" in out and "aten::" in out


def test_bandwidth_bound_counts_the_bytes_a_fused_step_must_touch(capsys):
    bandwidth_bound(["--size", "tiny", "--device", "cpu", "--optimizers", "lamb", "adamw",
                     "--warmup", "1", "--repeats", "1"])
    out = capsys.readouterr().out
    numel = float(re.search(r"([\d.]+)M fp32 parameters", out).group(1)) * 1e6
    header = ["optimizer", "compiled", "triton", "GB touched", "bound ms", "min ms", "median ms", "host ms",
              "min x bound"]
    assert out.splitlines()[1].split() == " ".join(header).split()
    rows = {line.split()[0]: dict(zip(header, line.split(), strict=True)) for line in out.splitlines()[2:]}
    # fp32 LAMB and AdamW: parameters read and written, gradients read, two moments read and written.
    for name in ("lamb", "adamw"):
        assert float(rows[name]["GB touched"]) * 1e9 == pytest.approx(28 * numel, rel=0.01)
        assert float(rows[name]["min x bound"]) > 0 and rows[name]["compiled"] == rows[name]["triton"] == "False"


def test_bandwidth_bound_names_the_host_functions_a_step_spends_its_host_time_in(capsys):
    bandwidth_bound(["--size", "tiny", "--device", "cpu", "--optimizers", "lamb", "--warmup", "1", "--repeats", "1",
                     "--host-profile", "4"])
    out = capsys.readouterr().out
    assert "host profile of 3 steps, top 4 functions by their own time" in out
    assert "torch._fused_adam_" in out  # LAMB's moments: a host function of every step


@pytest.mark.parametrize(("settings", "says"), [
    (["--compiled", "--triton"], "choose one"),
    (["--inductor", "combo_kernels=True"], "add --compiled"),
    (["--compiled", "--inductor", "combo_kernels"], "give KEY=VALUE"),
    (["--compiled", "--inductor", "no_such_setting=1"], "is no torch._inductor.config setting"),
])
def test_bandwidth_bound_refuses_inductor_settings_it_cannot_apply_in_one_line(settings, says, capsys):
    with pytest.raises(SystemExit) as exit_info:
        bandwidth_bound(["--size", "tiny", "--device", "cpu", *settings])
    assert exit_info.value.code == 2 and says in capsys.readouterr().err


def test_bandwidth_bound_times_the_compiled_steps_under_the_inductor_settings_given(monkeypatch):
    import torch

    seen = []
    monkeypatch.setattr("benchmarks.optim.bandwidth_bound._time_optimizers",
                        lambda args, parser: seen.append(torch._inductor.config.combo_kernels))
    bandwidth_bound(["--size", "tiny", "--device", "cpu", "--compiled", "--inductor", "combo_kernels=True"])
    assert seen == [True] and torch._inductor.config.combo_kernels is False
