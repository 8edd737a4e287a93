"""`trainer.init_optimizer_state`: a new run (NVIDIA BERT's phase 2) continues another run's optimizer moments
with fresh step counts, or is refused in one line before anything starts."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from helpers.config import TINY, compose
from helpers.runs import run_train

from core.errors import ConfigError
from optim import build_optimizer
from optim.comm import Comm
from train.checkpoint import load_torch
from train.plan import plan_run
from train.run import run
from train.trainer import Trainer

CONTINUE = "trainer.init_optimizer_state=true"


@pytest.fixture(scope="module")
def phase1(tmp_path_factory) -> dict[str, Path]:
    """Finished 2-step runs, one per optimizer, made on first use and only read: `phase1[name]`."""

    class Runs(dict):
        def __missing__(self, optimizer: str) -> Path:
            run_dir = tmp_path_factory.mktemp(f"phase1_{optimizer}")
            run(compose([*TINY, f"optim={optimizer}", "trainer.max_steps=2"]), run_dir)
            self[optimizer] = run_dir
            return run_dir

    return Runs()


def _phase2(tmp_path: Path, *overrides: str) -> Trainer:
    """A new run's trainer, built as a worker builds it (single process)."""
    cfg = compose([*TINY, "trainer.max_steps=4", *overrides])
    return Trainer(plan_run(cfg, tmp_path / "phase2"), Comm())


def _saved_optimizer(run_dir: Path) -> dict[str, Any]:
    """The optimizer state of the run's final checkpoint (rank 0's)."""
    checkpoint = run_dir / "checkpoints" / "step_00000002"
    shared = load_torch(checkpoint / "shared.pt")
    return shared["optimizer"] if "optimizer" in shared else load_torch(checkpoint / "rank_00000.pt")["optimizer"]


def _step_counts(state_dict: dict[str, Any]) -> list[float]:
    """Every step count of an optimizer state_dict: per group, per parameter, optimizer-wide, and its base's."""
    counts = [group["step"] for group in state_dict["param_groups"] if "step" in group]
    counts += [float(entry["step"]) for entry in state_dict["state"].values() if "step" in entry]
    return counts + (_step_counts(state_dict["base"]) if "base" in state_dict else [])


def _moments(state_dict: dict[str, Any], prefix: str = "") -> dict[str, torch.Tensor]:
    """The per-parameter state tensors (m, v, momentum buffers, SlowMo's slow momentum), by path; step counts,
    SLAMB's step-relative freshness and SlowMo's anchors (positions, not moments) left out."""
    found = {f"{prefix}{key}.{name}": value for key, entry in state_dict["state"].items() for name, value in
             entry.items() if torch.is_tensor(value) and name not in ("step", "scaled_freshness", "anchor")}
    return found | (_moments(state_dict["base"], "base.") if "base" in state_dict else {})


def test_lamb_continues_the_moments_with_fresh_step_counts(phase1, tmp_path):
    saved = _saved_optimizer(phase1["lamb"])
    trainer = _phase2(tmp_path, f"trainer.init_from={phase1['lamb']}", CONTINUE, "optim.weight_decay=0.02")
    loaded = trainer.optimizer.state_dict()
    assert trainer.step == 0
    assert _step_counts(saved) and set(_step_counts(saved)) == {2}
    assert set(_step_counts(loaded)) == {0}  # bias corrections and the schedule start over
    moments = _moments(saved)
    assert {key.rsplit(".", 1)[1] for key in moments} == {"exp_avg", "exp_avg_sq"}
    for key, value in _moments(loaded).items():
        assert torch.equal(value, moments[key]), key
    assert _moments(loaded).keys() == moments.keys()
    # The new run's hyper-parameters, not the saved run's (the decay group had 0.01 in phase 1).
    assert max(group["weight_decay"] for group in trainer.optimizer.param_groups) == 0.02
    metrics = trainer.train_step()  # phase 2's first step: t = 1 for the bias corrections, LR at its warm-up start
    assert metrics["lr"] == pytest.approx(trainer.peak_lr * trainer.lr_multiplier(1))
    assert {group["step"] for group in trainer.optimizer.param_groups} == {1}
    trainer.close()


@pytest.mark.parametrize("optimizer", ["adamw", "slamb", "slowmo", "jointspar"])
def test_every_continuable_optimizer_restarts_its_step_counts(phase1, tmp_path, optimizer):
    saved = _saved_optimizer(phase1[optimizer])
    trainer = _phase2(tmp_path, f"optim={optimizer}", f"trainer.init_from={phase1[optimizer]}", CONTINUE)
    loaded = trainer.optimizer.state_dict()
    assert _step_counts(saved) and all(count > 0 for count in _step_counts(saved))
    assert _step_counts(loaded) and set(_step_counts(loaded)) == {0}
    moments = _moments(saved)
    assert moments and _moments(loaded).keys() == moments.keys()
    for key, value in _moments(loaded).items():
        assert torch.equal(value, moments[key]), key
    if optimizer == "slamb":  # each row's freshness r is kept, stored as SLAMB stores it at step 0
        reference = build_optimizer(trainer.model, "slamb", trainer.plan.optimizer.options, comm=Comm())
        reference.load_state_dict(saved)
        for ours, theirs in zip(trainer.optimizer.freshness(), reference.freshness(), strict=True):
            torch.testing.assert_close(ours, theirs, rtol=1e-3, atol=0)
    if optimizer == "slowmo":  # its anchors are where this run starts, not where phase 1's last average was
        params = [p for group in trainer.optimizer.param_groups for p in group["params"]]  # state_dict order
        anchors = [trainer.optimizer.state[p]["anchor"] for p in params]
        assert not all(torch.equal(anchor, saved["state"][i]["anchor"]) for i, anchor in enumerate(anchors))
        for p, anchor in zip(params, anchors, strict=True):
            assert torch.equal(anchor, p.detach())
    trainer.close()


def test_without_the_option_the_optimizer_starts_fresh(phase1, tmp_path):
    trainer = _phase2(tmp_path, f"trainer.init_from={phase1['lamb']}", "trainer.init_optimizer_state=false")
    assert trainer.optimizer.state_dict()["state"] == {}  # LAMB makes zero moments at its first step
    trainer.close()


def test_an_export_is_refused_in_one_line_before_anything_starts(phase1, tmp_path):
    result = run_train([*TINY, f"trainer.init_from={phase1['lamb'] / 'hf_model'}", CONTINUE,
                        f"hydra.run.dir={tmp_path / 'phase2'}"], timeout=120)
    assert result.returncode == 2, result.stderr
    line = result.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    assert line.startswith("config error: trainer.init_optimizer_state=true: trainer.init_from=")
    assert "not a run or checkpoint directory" in line and "trainer.init_optimizer_state=false" in line
    assert not (tmp_path / "phase2" / ".hydra").exists()  # refused before the run was accepted


@pytest.mark.parametrize(("overrides", "message"), [
    (["optim=adamw"], "was written with optim=lamb, this run has optim=adamw"),
    (["optim=onebit_lamb"], "optim=onebit_lamb keeps a stage-bound state"),
    (["trainer.init_from=null"], "needs trainer.init_from=<run directory or checkpoint directory>"),
])
def test_a_checkpoint_it_cannot_continue_is_refused(phase1, tmp_path, overrides, message):
    cfg = compose([*TINY, f"trainer.init_from={phase1['lamb']}", CONTINUE, *overrides])
    with pytest.raises(ConfigError, match=r"trainer\.init_optimizer_state=true") as refused:
        run(cfg, tmp_path / "phase2")
    assert message in str(refused.value)
    assert not (tmp_path / "phase2").exists()


def test_every_phase2_recipe_starts_from_phase1_weights_with_fresh_moments():
    phase2 = compose(["experiment=bert_large_phase2"])
    assert phase2.trainer.init_optimizer_state is False  # one recipe: SLAMB and 1-bit LAMB cannot continue theirs
    assert phase2.trainer.init_from == "runs/bert_large_phase1"  # the run directory: its export has no moments
    assert compose([]).trainer.init_optimizer_state is False  # the default: weights only, as before
    for variant in ("bert_large_phase2_slamb", "bert_large_phase2_onebit_lamb"):  # start from their exports
        assert compose([f"experiment={variant}"]).trainer.init_optimizer_state is False


def test_per_rank_state_of_another_number_of_ranks_is_refused(phase1, tmp_path):
    cfg = compose([*TINY, "optim=slamb", f"trainer.init_from={phase1['slamb']}", CONTINUE, "trainer.nproc_per_node=2"])
    with pytest.raises(ConfigError, match=r"bound to the 1 ranks that wrote it and this run has 2: run with 1 ranks"):
        run(cfg, tmp_path / "phase2")
    assert not (tmp_path / "phase2").exists()
