"""Resuming on another world size: DDP optimizers continue (global batch kept, data re-partitioned), optimizers
with per-rank state are refused in one line."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from helpers.config import NO_DROPOUT, TINY, compose
from helpers.distributed_harness import run_on_ranks
from helpers.runs import run_train

from core.errors import ConfigError
from train.metrics import read_metrics
from train.run import run

# global batch 8: micro 4 x 2 ranks x 1 accumulation step, then micro 4 x 1 rank x 2 accumulation steps
LAMB = [*TINY, *NO_DROPOUT, "trainer.max_steps=6", "trainer.checkpoint_every=3"]
SLAMB = [*TINY, "optim=slamb", "trainer.max_steps=4"]

pytestmark = pytest.mark.slow  # two gloo ranks in spawned processes, then a `python -m train` process


def _first_steps_on_two_ranks(rank: int, world_size: int, tmp_path: Path) -> None:
    """The first half of a LAMB and of a SLAMB run on two ranks, each stopped with a checkpoint."""
    from optim.comm import Comm
    from train.plan import plan_run
    from train.trainer import Trainer

    for overrides, run_dir in ((LAMB, tmp_path / "lamb"), (SLAMB, tmp_path / "slamb")):
        cfg = compose([*overrides, "trainer.steps_this_run=3", f"trainer.nproc_per_node={world_size}"])
        trainer = Trainer(plan_run(cfg, run_dir), Comm())
        trainer.fit()
        trainer.close()


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory) -> Path:
    tmp_path = tmp_path_factory.mktemp("two_ranks")
    run_on_ranks(_first_steps_on_two_ranks, 2, tmp_path)
    return tmp_path


def _rank_files(checkpoint: Path) -> list[str]:
    return sorted(p.name for p in checkpoint.glob("rank_*.pt"))


def test_lamb_resumes_from_two_ranks_on_one_with_the_same_losses(two_rank_runs, tmp_path, capsys):
    run_dir = two_rank_runs / "lamb"
    assert _rank_files(run_dir / "checkpoints" / "step_00000003") == ["rank_00000.pt", "rank_00001.pt"]

    run(compose(LAMB), run_dir)  # one rank now: accumulation 2 instead of 1
    out = capsys.readouterr()
    assert f"resumed from {run_dir / 'checkpoints' / 'step_00000003'} at step 3" in out.out + out.err
    assert "micro-batch 4 x 1 rank(s) x 2 accumulation step(s)" in out.out + out.err
    assert _rank_files(run_dir / "checkpoints" / "step_00000006") == ["rank_00000.pt"]

    # The data position went on from the global offset 3 x 8: the sampler's consumed set is always
    # order[:index], so every sample of the epoch so far was read exactly once.
    own = torch.load(run_dir / "checkpoints" / "step_00000006" / "rank_00000.pt", weights_only=False)
    assert (own["data"]["epoch"], own["data"]["index"]) == (0, 6 * 8)

    # The same global batches in the same order: the loss series is the uninterrupted one (one rank here,
    # which computes the 2-rank run's steps up to float rounding). A repeated or skipped sample would change it.
    run(compose(LAMB), tmp_path / "reference")
    resumed, reference = read_metrics(run_dir), read_metrics(tmp_path / "reference")
    assert [r["step"] for r in resumed] == list(range(1, 7))
    for got, want in zip(resumed, reference, strict=True):
        assert got["loss"] == pytest.approx(want["loss"], rel=1e-4)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-3)


def test_slamb_refuses_another_world_size_in_one_line(two_rank_runs):
    run_dir = two_rank_runs / "slamb"
    checkpoint = run_dir / "checkpoints" / "step_00000003"
    with pytest.raises(ConfigError, match=r"written by 2 ranks but this run has 1, and optim=slamb keeps per-rank "
                                          r"state \(model, optimizer\)"):
        run(compose(SLAMB), run_dir)

    result = run_train([*SLAMB, f"hydra.run.dir={run_dir}"])
    assert result.returncode == 2
    assert result.stderr.strip() == (
        f"config error: checkpoint {checkpoint} was written by 2 ranks but this run has 1, and optim=slamb keeps "
        f"per-rank state (model, optimizer) that does not re-partition: resume with 2 ranks, or start a new run "
        f"(another name=...) with trainer.init_from={checkpoint} to keep only the weights"
    )
    assert not (checkpoint.parent / "step_00000004").exists()
