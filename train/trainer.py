"""The training loop: micro-batches, task loss, backward, gradient sync, overflow and clip, step, schedule,
then logging, evaluation and checkpointing, in that order."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import re
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from torch import nn

from core.errors import UserError
from data import atomic_write_json, build_data
from models import compiled_for_training
from optim import build_lr_schedule, build_optimizer, get_optimizer_spec
from optim.comm import Comm
from optim.memory import estimate_memory, memory_lines
from optim.schedule import warmup_steps_of
from train.checkpoint import Checkpointer, read_meta, release_mapped, reseed_rng, rng_state, set_rng_state
from train.distributed import pick_device
from train.grad_sync import build_grad_sync
from train.half_weights import HalfCopy
from train.metrics import MetricLogger, RunClock, RunTotals, format_bytes, read_metrics
from train.model_export import export_pretrained
from train.model_init import build_model
from train.plan import RunPlan
from train.precision import (
    half_weights_dtype,
    load_scaler_state,
    make_grad_scaler,
    set_deterministic,
    set_matmul_precision,
    training_autocast,
)
from train.replicas import averaged_copy
from train.run_dir import RunDir
from train.stop import DiskFull, RunStopped, StopRequest, is_disk_full, writing
from train.summary import build_summary, write_summary
from train.tasks import EvalShard, evaluate_model, get_task


class Trainer:
    """Composes model, data, task, optimizer, schedule, precision and logging from the run's plan."""

    def __init__(self, plan: RunPlan, comm: Comm) -> None:
        plan.confirm_world_size(comm.world_size)  # everything else was checked when the run was planned
        self.plan, self.run_dir, self.comm = plan, RunDir(plan.run_dir), comm
        self.is_main = comm.rank == 0
        settings, self.precision = plan.trainer, plan.precision
        set_deterministic(settings.deterministic)  # before any CUDA matmul: cuBLAS reads its workspace setting once
        self.device = pick_device(settings.device)
        self.geometry = plan.geometry
        # Each rank draws its own dropout stream; rank-agreed randomness uses private generators.
        torch.manual_seed(settings.seed + comm.rank)

        self.data = build_data(plan.data_config(), plan.data_request(comm.rank, pin_memory=self.device.type == "cuda"))
        self.loader, self.tokenizer = self.data.train, self.data.tokenizer
        self.max_steps = settings.max_steps or math.ceil(
            settings.epochs * self.loader.samples_per_epoch / self.geometry.global_batch_size
        )
        self.model = build_model(plan.model.name, plan.model.options, settings.init_from, self.tokenizer)
        self.model.to(self.device)
        self.num_params = sum(p.numel() for p in self.model.parameters() if p.requires_grad)
        self.spec = get_optimizer_spec(plan.optimizer.name)  # what the trainer asks of the optimizer (`OptimSpec`)
        self.optimizer = build_optimizer(self.model, plan.optimizer.name, plan.optimizer.options, comm=comm,
                                         checked=True)
        # The scaler skips the optimizer's step on an fp16 overflow; this hook tells the loop, with no device sync.
        self._stepped = False
        self.optimizer.register_step_post_hook(self._on_optimizer_step)
        self.peak_lr = plan.optimizer.lr
        self.lr_multiplier = build_lr_schedule(plan.schedule.name, total_steps=self.max_steps, **plan.schedule.kwargs)
        self.scaler = make_grad_scaler(self.precision, self.device)
        set_matmul_precision(self.precision.dtype)
        self.task = get_task(plan.task.name)
        # The one place that asks the optimizer how gradients become global.
        self.grad_sync = build_grad_sync(self.spec.grad_sync, comm, self.device, self._wire_dtype())
        self.half = self._build_half_copy()  # O2: forward and backward on it, the optimizer on self.model
        trained = self.model if self.half is None else self.half.module
        self.train_model = (compiled_for_training(plan.model.name, trained, self.grad_sync.wrap) if settings.compile
                            else self.grad_sync.wrap(trained))
        self.ema = self._build_ema(settings.ema_decay)  # after the set-up broadcast: it starts from the same weights
        self.checkpointer = Checkpointer(self.run_dir.checkpoints_dir, settings.keep_last, comm,
                                         keep_best=settings.keep_best, best_mode=settings.best_metric_mode)

        self.step = 0  # optimizer steps taken
        self._saved_step: int | None = None  # the step of this run's newest checkpoint
        self.skipped_steps = 0  # fp16 overflow steps (they do not count towards max_steps)
        self._overflow_streak = 0  # fp16 overflow steps in a row, the same on every rank (the ranks agree on each)
        self.clock, self.totals = RunClock(), RunTotals()  # both continue across resumes, for the summary
        resumed_from = self._resume() if settings.resume else None  # planning refused resume=false over checkpoints
        if resumed_from is None and plan.init_checkpoint is not None:
            self._continue_optimizer_state(plan.init_checkpoint)
        self.logger = MetricLogger(
            self.run_dir, enabled=self.is_main, total_steps=self.max_steps, start_step=self.step,
            progress_bar=plan.logger.progress_bar, tensorboard=plan.logger.tensorboard,
            wandb_mode=plan.logger.wandb, wandb_project=plan.logger.wandb_project, config=plan.config,
            clock=self.clock,
        )
        self.stop = StopRequest(comm)  # SIGTERM / SIGINT, agreed by the ranks between micro-batches
        self._announce(resumed_from)

    # ----------------------------------------------------------------------------------------- set-up
    def _build_half_copy(self) -> HalfCopy | None:
        """O2 (`precision.weights=half`): the half-precision copy of the fp32 masters, made from weights every rank
        agrees on (the masters are what checkpoints save and what the copy is refreshed from); None otherwise."""
        dtype = half_weights_dtype(self.precision)
        if dtype is None:
            return None
        self.grad_sync.agree_on_weights(self.model)
        return HalfCopy(self.model, dtype)

    def _wire_dtype(self) -> str:
        """The DDP gradient all-reduce's dtype, `trainer.grad_allreduce_dtype`; under O2 its fp32 (the default)
        sends the gradients in their own half dtype: they are half already, and upcasting them gains nothing."""
        wire, precision = self.plan.trainer.grad_allreduce_dtype, self.precision
        return precision.dtype if precision.weights == "half" and wire == "fp32" else wire

    def _announce(self, resumed_from: Path | None) -> None:
        g = self.geometry
        threads = f" ({torch.get_num_threads()} thread(s) each)" if self.device.type == "cpu" else ""
        self.logger.info(
            f"run dir {self.run_dir} | {self.comm.world_size} rank(s) on {self.device}{threads} | "
            f"model {self.num_params / 1e6:.1f}M params | optimizer {self.spec.name} (grad sync: {self.grad_sync.kind})"
        )
        self.logger.info(
            f"global batch {g.global_batch_size} = micro-batch {g.micro_batch_size} x {g.world_size} rank(s) "
            f"x {g.accumulation_steps} accumulation step(s) | precision {self.precision.dtype}"
            f"{' O2 (half weights, fp32 masters)' if self.half is not None else ''} | {self.max_steps} steps"
        )
        self.logger.info(f"data {self.data.source}")
        epochs = self.max_steps * g.global_batch_size / self.loader.samples_per_epoch
        schedule = self.plan.schedule
        warmup = warmup_steps_of(self.max_steps, schedule.kwargs.get("warmup_steps"),
                                 schedule.kwargs.get("warmup_fraction"))
        self.logger.info(
            f"peak lr {self.peak_lr:g} ({schedule.name}, warm-up {warmup} of {self.max_steps} "
            f"steps) | {epochs:.3g} epochs of data | seed {self.plan.trainer.seed} | commit {_source_commit()}"
        )
        estimate = estimate_memory(self.model, self.spec, self.plan.optimizer.options, self.comm.world_size,
                                   half_copy_bytes=0 if self.half is None else self.half.nbytes())
        device_total = (torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda"
                        else None)
        for line in memory_lines(estimate, device_total):
            self.logger.info(line)
        for warning in self._surprising_settings():
            self.logger.info(f"warning: {warning}")
        for notice in self.plan.notices:
            self.logger.info(notice)
        for line in self.checkpointer.passed_over:
            self.logger.info(line)
        if resumed_from is not None:
            self.logger.info(f"resumed from {resumed_from} at step {self.step}")
            change = self._schedule_change(resumed_from) if self.is_main else None
            if change is not None:
                self.logger.info(change)

    def _schedule_change(self, checkpoint: Path) -> str | None:
        """The line that says a resume with another max_steps than its checkpoint's re-derives the LR schedule: the
        step goes on, but the schedule (warm-up fraction, decay) is stretched or shrunk to the new length."""
        before = read_meta(checkpoint).get("max_steps")
        if before is None or before == self.max_steps or self.step >= self.max_steps:
            return None
        schedule, step = self.plan.schedule, self.step + 1
        planned = build_lr_schedule(schedule.name, total_steps=before, **schedule.kwargs)
        key = "trainer.max_steps" if self.plan.trainer.max_steps is not None else "max_steps (from trainer.epochs)"
        return (f"{key} {before} -> {self.max_steps}: the LR schedule is re-derived; the LR at step {step} goes "
                f"from {self.peak_lr * planned(step):.4g} to {self.peak_lr * self.lr_multiplier(step):.4g}")

    def _surprising_settings(self) -> list[str]:
        """Settings that work but rarely do what the user wants, each said once at start-up."""
        warnings = []
        if self.precision.dtype == "fp16" and self.device.type == "cpu":
            warnings.append("precision=fp16 on CPU is several times slower than fp32 there (autocast has few fp16 "
                            "CPU kernels); use precision=fp32 or bf16")
        if self.precision.dtype == "tf32" and self.device.type == "cpu":
            warnings.append("precision=tf32 changes only GPU matmuls (Ampere and newer): on CPU it is fp32")
        warmup_option = self.spec.warmup_option  # the 1-bit optimizers' last uncompressed step
        warmup = None if warmup_option is None else self.plan.optimizer.options[warmup_option]
        if warmup is not None and warmup >= self.max_steps:
            warnings.append(f"optim.{warmup_option}={warmup} is not below the run's {self.max_steps} steps: "
                            f"{self.spec.name} never compresses and sends 32 bits per parameter per step, like LAMB")
        return warnings

    # ----------------------------------------------------------------------------------------- loop
    def fit(self) -> None:
        """Train to `max_steps` (or `steps_this_run`, or a stop signal), checkpointing on the way and at the end,
        then write the run's summary.json.

        SIGTERM (a scheduler's notice) and SIGINT (Ctrl-C) both stop the run at the next micro-batch boundary
        (see `train.stop`): a partial step is abandoned and the last completed one saved, with its data position
        and random streams, so the resumed run repeats the series of the uninterrupted one.

        An error stops the run with a record too: its reason in train.log and as summary.json's `stopped`. One the
        user can act on (a non-finite loss, a collapsed fp16 loss scale, out of memory, a full or unwritable disk,
        bad data) is then raised as `RunStopped` (or as itself, when it is a user error already), its one line.
        """
        try:
            self._fit()
        except Exception as err:
            reason = self._stop_reason(err)
            # A full disk may refuse the record as well: the error itself is still reported.
            with contextlib.suppress(OSError, DiskFull):
                self.logger.info(f"stopped at step {self.step}: {reason}")
            with contextlib.suppress(OSError, DiskFull):
                self._write_summary(stopped=reason)
            if isinstance(err, UserError) and not is_disk_full(err):
                raise  # a data error, say: reported as itself
            if isinstance(err, FloatingPointError | OSError | torch.OutOfMemoryError) or is_disk_full(err):
                raise RunStopped(reason) from None
            raise

    def _stop_reason(self, err: Exception) -> str:
        """The line an error that stopped the run is recorded and reported with, naming what to do."""
        if isinstance(err, torch.OutOfMemoryError):
            return self._out_of_memory(err)
        if is_disk_full(err):
            full = err if isinstance(err, DiskFull) else DiskFull(self.run_dir.path)  # a write we did not name
            return f"{full}: free some space, then {self._rerun()}"
        if isinstance(err, OSError):
            return f"{err}: fix that, then {self._rerun()}"
        if isinstance(err, FloatingPointError | UserError):  # these name their own remedy
            return str(err)
        return f"{type(err).__name__}: {err}"

    def _out_of_memory(self, err: torch.OutOfMemoryError) -> str:
        """Out of device memory: the micro-batch is what to lower (the global batch, and so the run, stays)."""
        g, settings = self.geometry, self.plan.trainer
        tried = re.search(r"Tried to allocate [\d.]+ \w+", str(err))
        what = f" (t{tried.group(0)[1:]})" if tried else ""
        micro = ("trainer.micro_batch_size" if settings.micro_batch_size is not None
                 else "trainer.max_micro_batch_size (the micro-batch is derived from it)")
        return (f"out of memory on {self.device} at step {self.step + 1}{what}: lower {micro} from "
                f"{g.micro_batch_size} per rank (the accumulation steps grow to keep trainer.global_batch_size="
                f"{g.global_batch_size}), then {self._rerun()}")

    def _fit(self) -> None:
        settings = self.plan.trainer
        if self.step >= self.max_steps:
            if self._finished():
                self.logger.info(f"run already complete at step {self.step}; nothing to do (name=... starts a new run)")
            else:  # killed after its last checkpoint: evaluate and export now
                self.logger.info(f"run complete at step {self.step} but not evaluated and exported: doing that now")
                self._finish()
                self._write_summary()
            return
        stop_at = self.max_steps
        if settings.steps_this_run is not None:
            stop_at = min(stop_at, self.step + settings.steps_this_run)
        window = _Window(self.totals)
        mark = time.perf_counter()
        stopped = None  # what stopped the run before max_steps: a signal's name, or the time box
        with self.stop:
            while self.step < stop_at:
                metrics = self.train_step()
                if metrics is None:  # a stop signal, agreed by every rank
                    stopped = self._stop_for_signal(window)
                    break
                now = time.perf_counter()  # a step's time runs to the next step's end: logs, evals included
                self.totals.add(metrics, self.geometry.global_batch_size, now - mark)
                mark = now
                window.add(metrics)
                if metrics["skipped"]:  # fp16 overflow: the step number stays, and it folds into the next record
                    self._count_overflow()
                    continue
                self._overflow_streak = 0
                self.step += 1
                self._update_ema()
                self.logger.advance()
                if self.step % settings.log_every == 0 or self.step == stop_at:
                    self._log(window.flush())
                if settings.eval_every and self.step % settings.eval_every == 0 and self.step < self.max_steps:
                    self.evaluate()
                if settings.checkpoint_every and self.step % settings.checkpoint_every == 0:
                    self.save_checkpoint()
            if stopped is None and self.step < self.max_steps:
                stopped = self._time_box_reached()
            self.save_checkpoint()
            if self.step >= self.max_steps:
                self._finish()
        self._write_summary(stopped=stopped)

    def _stop_for_signal(self, window: _Window) -> str:
        """Record the steps done since the last record and say the stop (its checkpoint follows); returns its cause."""
        if window.steps:
            self._log(window.flush())
        stopped = self.stop.signal_name or "a stop signal on another rank"
        self.logger.info(f"{stopped}: stopping at step {self.step} with a checkpoint")
        return stopped

    def _time_box_reached(self) -> str:
        """Say that `trainer.steps_this_run` ends the run here (its checkpoint follows); returns the cause."""
        stopped = f"trainer.steps_this_run={self.plan.trainer.steps_this_run}"
        self.logger.info(f"{stopped}: stopping at step {self.step} of {self.max_steps} with a checkpoint; rerun the "
                         "same command to continue")
        return stopped

    def _count_overflow(self) -> None:
        """Stop a run whose fp16 steps keep overflowing: each halves the loss scale and the step never comes, so a
        diverged model would spin without a word. Every rank counts the same agreed skips and stops alike."""
        self._overflow_streak += 1
        limit = self.precision.max_consecutive_skips
        if limit is None or self._overflow_streak < limit:
            return
        raise FloatingPointError(
            f"loss scale collapsed: the {limit} fp16 steps after step {self.step} all overflowed (precision."
            f"max_consecutive_skips={limit}; the loss scale fell to {self.scaler.get_scale():g}), so the model has "
            f"diverged: {self._rerun()}, with a lower optim.lr, or precision=bf16 (no loss scale)"
        )

    @property
    def stop_signal(self) -> str | None:
        """The name of the SIGTERM / SIGINT this process received, if any."""
        return self.stop.signal_name

    def train_step(self) -> dict[str, Any] | None:
        """One optimizer step over `accumulation_steps` micro-batches on every rank; None if a stop was agreed.

        A stop agreed between micro-batches abandons the step: its gradients are dropped, and the data position
        and random streams go back to where the step began, which is the state the checkpoint must hold.
        """
        lr = self.peak_lr * self.lr_multiplier(self.step + 1)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        if self.spec.samples_layers:  # JointSpar: only this step's layers will compute weight gradients
            self.optimizer.begin_step()
            if self.half is not None:
                self.half.follow_trainable()
        accumulation = self.geometry.accumulation_steps
        step_start = (self.loader.state_dict(), rng_state()) if accumulation > 1 else None
        totals: dict[str, torch.Tensor] = {}
        for micro_step in range(accumulation):
            if self.stop.agreed():
                self._abandon_step(step_start if micro_step > 0 else None)
                return None
            batch = {k: v.to(self.device, non_blocking=True) for k, v in next(self.loader).items()}
            with self.grad_sync.micro_batch(last=micro_step == accumulation - 1):
                with training_autocast(self.precision, self.device):
                    out = self.task.step(self.train_model, batch)
                self.scaler.scale(out["loss"] / accumulation).backward()
            for key, value in out.items():  # metrics stay on the device: no sync per micro-batch
                totals[key] = totals.get(key, 0.0) + value.detach().float() / accumulation

        if self.half is not None:  # O2: the optimizer, the scaler and clipping see fp32 gradients on the masters
            self.half.grads_to_masters_()
        if self.scaler.is_enabled():
            self.grad_sync.agree_on_overflow([p.grad for p in self.model.parameters() if p.grad is not None])
        self.scaler.unscale_(self.optimizer)
        clip = self.plan.trainer.grad_clip or math.inf  # 0 switches clipping off
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        # Under fp16 the scaler reads its overflow flag (the step's one device sync) and skips the optimizer's
        # step on an overflow, lowering the scale; bf16 and fp32 always step and never sync here.
        self._stepped = False
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        if self.half is not None and self._stepped:
            self.half.pull_()
        return {"task": totals, "grad_norm": grad_norm.detach(), "lr": lr, "skipped": not self._stepped,
                **self.comm.take_counts()}

    def _abandon_step(self, step_start: tuple[dict[str, Any], dict[str, Any]] | None) -> None:
        """Forget a partial step: no gradients, and the data position and random streams of its start."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.half is not None:
            self.half.zero_grad()
        if step_start is not None:
            loader_state, rng = step_start
            self.loader.load_state_dict(loader_state)
            set_rng_state(rng)

    def _on_optimizer_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        self._stepped = True

    def _log(self, window: dict[str, Any]) -> None:
        """Turn the window's tensors into numbers (one device sync per log interval) and record them."""
        keys = sorted(window["task"])  # the same order on every rank
        values = self.comm.average_control(torch.stack([window["task"][k] for k in keys]))
        metrics = dict(zip(keys, values.tolist(), strict=True))
        if not math.isfinite(metrics["loss"]):
            raise FloatingPointError(self._non_finite(f"non-finite loss at step {self.step}"))
        sums: RunTotals = window["sums"]
        bytes_per_step = sums.bytes / sums.iterations
        metrics.update(
            lr=window["lr"],
            grad_norm=window["grad_norm"],
            seq_per_s=sums.samples / sums.seconds,
            comm_bytes_per_step=bytes_per_step,
            comm_bits_per_param=8 * bytes_per_step / self.num_params,
            comm_collectives_per_step=sums.collectives / sums.iterations,
            comm_bytes_total=self.totals.bytes,  # since step 0: the x of loss against data sent
            skipped_steps=self.skipped_steps + window["skipped"],
        )
        self.skipped_steps += window["skipped"]
        if self.scaler.is_enabled():
            metrics["loss_scale"] = self.scaler.get_scale()
        self.logger.log(metrics, self.step)

    # ----------------------------------------------------------------------------------------- state
    def state_dicts(self) -> tuple[dict[str, Any], dict[str, Any]]:
        """(shared, own): what every rank holds alike, and what is this rank's alone."""
        learner = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict()}
        if self.ema is not None:  # with the model: per rank when the model is
            learner["ema"] = self.ema.module.state_dict()
        shared_learner, own_learner = self.grad_sync.split_state(learner)
        shared = {"step": self.step, "skipped_steps": self.skipped_steps, "scaler": self.scaler.state_dict(),
                  "clock": self.clock.state_dict(), "totals": self.totals.state_dict()}
        own = {"rng": rng_state(), "data": self.loader.state_dict()}
        return {**shared, **shared_learner}, {**own, **own_learner}

    def load_state_dicts(self, shared: dict[str, Any], own: dict[str, Any]) -> None:
        """Restore a checkpoint (memory-mapped: see `train.checkpoint.load_torch`); once this returns, nothing
        refers to its tensors and the file is no longer mapped."""
        learner = self.grad_sync.learner_state(shared, own)
        self.model.load_state_dict(learner["model"])
        if self.half is not None:
            self.half.pull_()
        self.optimizer.load_state_dict(learner["optimizer"])
        release_mapped(learner["optimizer"], self.optimizer.state_dict())
        if self.ema is not None:  # a checkpoint from before EMA was switched on: start it from the weights
            self.ema.module.load_state_dict(learner.get("ema", self.model.state_dict()))
        load_scaler_state(self.scaler, shared["scaler"])  # the checkpoint may have another precision
        self.loader.load_state_dict(own["data"])
        self.step, self.skipped_steps = shared["step"], shared["skipped_steps"]
        self.clock.load_state_dict(shared["clock"])
        self.totals.load_state_dict(shared["totals"])
        # Last: building anything above must not shift the restored streams. A checkpoint of another world size
        # has none for this rank (see train/checkpoint.py): fresh ones, keyed by seed, rank and step.
        if "rng" in own:
            set_rng_state(own["rng"])
        else:
            reseed_rng(self.plan.trainer.seed, self.comm.rank, self.step)

    def save_checkpoint(self) -> None:
        # Decided from memory, not from listing the directory: every rank must take the same branch.
        if self._saved_step == self.step:
            return
        self._refuse_non_finite_weights()
        # What a later start checks its own plan against: the optimizer, and the length its LR schedule was for.
        meta = {"optimizer": self.spec.name, "max_steps": self.max_steps}
        with writing(self.checkpointer.directory):
            path = self.checkpointer.save(self.step, *self.state_dicts(), meta=meta)
        self._saved_step = self.step
        self.logger.info(f"checkpoint {path}")

    def _resume(self) -> Path | None:
        """Restore the newest intact checkpoint (damaged newer ones are passed over, and said at start-up)."""
        found = self.checkpointer.resume()
        if found is None:
            return None
        latest, shared, own = found
        self.load_state_dicts(shared, own)
        self._saved_step = self.step
        return latest

    def _continue_optimizer_state(self, checkpoint: Path) -> None:
        """`trainer.init_optimizer_state`: the moments of the checkpoint the weights came from, with every step count
        at 0 (NVIDIA BERT's phase 2); the trainer's own step and with it the LR schedule start at 0 too."""
        shared, own = self.checkpointer.load(checkpoint)  # this rank's own state when it is per rank
        saved = self.grad_sync.learner_state(shared, own)["optimizer"]
        self.spec.restart(self.optimizer, saved)
        release_mapped(saved, self.optimizer.state_dict())

    def _refuse_non_finite_weights(self) -> None:
        """Never write a checkpoint with a NaN or inf weight (one host read per checkpoint, not per step)."""
        # The max-norm: finite exactly when every element is (an L2 norm of huge finite weights would overflow).
        norms = torch._foreach_norm([p.detach() for p in self.model.parameters()], math.inf)
        if self.comm.any(not bool(torch.isfinite(torch.stack(norms)).all())):
            raise FloatingPointError(self._non_finite(f"non-finite weights at step {self.step}"))

    def _non_finite(self, what: str) -> str:
        """The error for a run that diverged: nothing was saved for it, and where to resume from."""
        return f"{what}; no checkpoint was written for it: {self._rerun()}, with a lower optim.lr or precision=bf16"

    def _rerun(self) -> str:
        """What a rerun continues from: the newest checkpoint, which every stop keeps (none holds a bad value)."""
        newest = self.checkpointer.latest()
        if newest is None:
            return "rerun to start over (no checkpoint was written before)"
        return f"rerun to resume from the newest checkpoint, {newest}"

    def evaluate(self, weights: EvalWeights | None = None) -> None:
        """The task's evaluation on held-out data, logged by rank 0 as eval/<metric>.

        The ranks share it (`EvalShard`: every rank evaluates every world_size-th batch, the task pools the
        results), so no GPU idles through it and it ends well within the collective timeout; the metrics are
        those of one rank evaluating everything. It evaluates `weights`, by default `agreed_weights()`: the
        replicas' average where they differ at this step. With an EMA its weights are evaluated too
        (eval/ema_<metric>). Every rank takes part in the barrier and in keeping a best checkpoint.
        """
        if self.task.evaluate is None or self.data.eval is None:  # alike on every rank: the same config
            return
        weights = self.agreed_weights() if weights is None else weights
        shard = EvalShard(self.comm.rank, self.comm.world_size, self.comm.group)
        results = {f"eval/{k}": v for k, v in self._evaluate_model(weights.model, shard).items()}
        if weights.ema is not None:
            results.update({f"eval/ema_{k}": v for k, v in self._evaluate_model(weights.ema, shard).items()})
        if self.is_main:
            self.logger.log(results, self.step)
            of = f" ({weights.what})" if weights.what else ""
            self.logger.info(f"eval at step {self.step}{of}: " + ", ".join(f"{k} {v:.4g}" for k, v in results.items()))
        self._keep_if_best(results)
        self.comm.barrier()

    def agreed_weights(self) -> EvalWeights:
        """The weights every rank evaluates and exports now: the model (and EMA) where the replicas agree after
        this step, else their average across the ranks in a copy (`train.replicas`); training is not disturbed."""
        ema = self.ema.module if self.ema is not None else None
        if not self.comm.distributed or self.spec.replicas_agree_after(self.optimizer, self.step):
            return EvalWeights(self.model, ema)
        model, ema = averaged_copy(self.model, self.comm), None if ema is None else averaged_copy(ema, self.comm)
        sent = self.comm.take_replica_average_bytes()
        self.totals.replica_average_bytes += sent  # on its own line of the summary, not in the steps' bytes
        return EvalWeights(model, ema, f"the average of the {self.comm.world_size} ranks' replicas, "
                                       f"{format_bytes(sent)} sent to average them")

    def _evaluate_model(self, model: nn.Module, shard: EvalShard) -> dict[str, float]:
        return evaluate_model(self.task, model, self.data.eval, self.run_dir, shard, self.precision.dtype,
                              self.device)

    # ----------------------------------------------------------------------------------------- EMA, best-K
    def _build_ema(self, decay: float | None) -> Any:
        """timm's ModelEmaV3 (a foreach lerp per step) over the unwrapped model, or None when off."""
        if decay is None:
            return None
        from timm.utils import ModelEmaV3

        return ModelEmaV3(self.model, decay=decay)

    def _update_ema(self) -> None:
        if self.ema is not None:
            self.ema.update(self.model)

    def _keep_if_best(self, results: dict[str, float]) -> None:
        """Checkpoint this step and protect it from pruning if its trainer.best_metric is among the best K."""
        metric, keep_best = self.plan.trainer.best_metric, self.plan.trainer.keep_best
        if not keep_best:
            return
        keep, value = False, None
        if self.is_main and results:
            if metric not in results:
                raise KeyError(f"trainer.best_metric={metric} is not logged; eval metrics: {sorted(results)}")
            value = float(results[metric])
            keep = self.checkpointer.is_among_best(value)
        keep, value = self.comm.broadcast_object((keep, value))  # rank 0 decides; saving is collective
        if not keep:
            return
        self.save_checkpoint()
        self.checkpointer.record_best(self.step, value)
        self.logger.info(f"{metric} {value:.4g} at step {self.step}: kept among the best {keep_best}")

    def _finish(self) -> None:
        """End-of-run work: the final evaluation and the exports (of the replicas' average where they differ),
        then the mark that they are done."""
        weights = self.agreed_weights()
        self.evaluate(weights)
        self._export(weights)
        if self.is_main:
            atomic_write_json(self.run_dir.finished_file, {"step": self.step})
        self.comm.barrier()

    def _finished(self) -> bool:
        """Whether this run's end-of-run work is done (rank 0 looks; every rank takes its answer)."""
        marker = self.run_dir.finished_file
        done = marker.is_file() and json.loads(marker.read_text()).get("step") == self.step if self.is_main else None
        return bool(self.comm.broadcast_object(done))

    def _export(self, weights: EvalWeights) -> None:
        if self.is_main:
            # What an image model was trained with and what its outputs mean, for timm's loaders and users.
            described = dict(data_config=self.data.preprocessing, label_names=self.data.class_names)
            path = export_pretrained(weights.model, self.tokenizer, self.run_dir.export_dir, **described)
            of = f" ({weights.what})" if weights.what else ""
            self.logger.info(f"final weights{of} exported with save_pretrained to {path}")
            if weights.ema is not None:
                path = export_pretrained(weights.ema, self.tokenizer, self.run_dir.ema_export_dir, **described)
                self.logger.info(f"EMA weights exported to {path}")
        self.comm.barrier()

    def _write_summary(self, stopped: str | None = None) -> None:
        """summary.json (rank 0): the run so far, whether it reached max_steps or was `stopped` early (why)."""
        if not self.is_main:
            return
        summary = build_summary(
            self.plan.config, read_metrics(self.run_dir.path), self.totals, steps=self.step, max_steps=self.max_steps,
            world_size=self.comm.world_size, global_batch_size=self.geometry.global_batch_size,
            num_params=self.num_params, device=self.device, samples_unit=f"{self.task.sample_unit}/s",
            elapsed_seconds=self.clock.elapsed(), stopped=stopped,
        )
        write_summary(self.run_dir, summary)
        self.logger.info(f"summary: {self.run_dir.summary_file}")

    def close(self) -> None:
        # The loader's worker processes and their queues go now: a signalled elastic worker leaves with os._exit
        # (train.run), which skips the queues' finalizers, and the resource tracker then warns of leaked semaphores.
        self.loader.close()
        with contextlib.suppress(OSError, DiskFull):  # a full disk stopped the run with its own line already
            if self.is_main:
                self.logger.info(_closing_line([r for r in read_metrics(self.run_dir.path) if "loss" in r]))
            self.logger.info(f"metrics: {self.logger.path} | checkpoints: {self.checkpointer.directory}")
        self.logger.close()


@dataclasses.dataclass(frozen=True)
class EvalWeights:
    """What an evaluation or export reads: the model, its EMA (None: no EMA), and which weights they are when
    they are not simply the trained model's (`what`, for the log)."""

    model: nn.Module
    ema: nn.Module | None = None
    what: str = ""


def _closing_line(records: list[dict[str, Any]]) -> str:
    """The run's losses from its first training record to its last (resumed parts included)."""
    if not records:
        return "no training record was logged"
    first, last = records[0], records[-1]
    losses = [key for key in first if key.endswith("loss")]
    if len(records) == 1:
        return f"one training record (step {first['step']}): " + ", ".join(f"{k} {first[k]:.4g}" for k in losses)
    return f"steps {first['step']} -> {last['step']}: " + ", ".join(
        f"{k} {first[k]:.4g} -> {last[k]:.4g}" for k in losses if k in last)


def _source_commit() -> str:
    """The git commit of the code that runs, so a log says which version produced it ("unknown" outside a clone)."""
    try:
        found = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=Path(__file__).parent,
                               capture_output=True, text=True, timeout=10, check=True)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return found.stdout.strip()


class _Window:
    """Sums per-step values between two log records without syncing the device; counts and times are the run's
    totals since the window began."""

    def __init__(self, totals: RunTotals) -> None:
        self.totals = totals
        self._reset()

    def _reset(self) -> None:
        self.task_sums: dict[str, torch.Tensor] = {}  # the task's metrics, still on the device
        self.steps = self.skipped = 0
        self.start = dataclasses.replace(self.totals)  # a copy

    def add(self, metrics: dict[str, Any]) -> None:
        self.steps += 1
        self.skipped += int(metrics["skipped"])
        for key, value in metrics["task"].items():
            self.task_sums[key] = self.task_sums.get(key, 0.0) + value
        self.last = metrics

    def flush(self) -> dict[str, Any]:
        out = dict(
            task={key: value / self.steps for key, value in self.task_sums.items()},
            sums=self.totals.since(self.start), skipped=self.skipped,
            lr=self.last["lr"], grad_norm=float(self.last["grad_norm"]),
        )
        self._reset()
        return out
