"""What more than one benchmark script uses: parameter sets, optimizer configs, step timing, schedules, tables, ranks.

Scripts import shared helpers from here only, never from each other (tests/benchmarks/test_benchmarks_layout.py
checks it).
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import inspect
import io
import os
import tempfile
import time
import unittest.mock
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
import yaml
from torch import nn
from torch._prims_common import is_non_overlapping_and_dense_or_false
from torch.profiler import ProfilerActivity, profile
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from optim import get_optimizer_spec
from optim._math import FOREACH_CHUNK_NUMEL
from optim.memory import state_bytes
from optim.zero_one_adam import zero_one_adam_step_kinds

if TYPE_CHECKING:
    from data.text.pretraining import PretrainingDataset

REPO = Path(__file__).resolve().parents[1]
CONF_OPTIM = REPO / "conf" / "optim"

# ------------------------------------------------------------------------------------------ BERT parameter sets
SIZES = {  # BertConfig fields; base is BertConfig's defaults
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=2, intermediate_size=512),
    "base": dict(),
    "large": dict(hidden_size=1024, num_hidden_layers=24, num_attention_heads=16, intermediate_size=4096),
}


def chosen_device(parser: argparse.ArgumentParser, name: str) -> torch.device:
    """The `--device` a benchmark runs on; a CUDA device that is not visible is a usage error, not a traceback."""
    if name == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    return torch.device(name)


def device_label(device: torch.device) -> str:
    """The device as a benchmark's header names it: the GPU's name, or the CPU threads the timing uses."""
    return torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"


def bert_parameters(size: str, device: torch.device) -> nn.Module:
    """BertForPreTraining of `size` with random weights and gradients (built on `meta`, then filled; on the meta
    device itself: shapes only, for counting ops and bytes)."""
    from transformers import BertConfig, BertForPreTraining  # here: seconds of imports the table scripts skip

    with torch.device("meta"):
        model = BertForPreTraining(BertConfig(**SIZES[size]))
    model.to_empty(device=device)
    model.tie_weights()  # to_empty gives the tied decoder its own tensor; BERT shares it with the embeddings
    if device.type == "meta":
        for p in model.parameters():
            p.grad = torch.empty_like(p)
        return model
    g = torch.Generator(device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.02, generator=g)
            p.grad = torch.empty_like(p).normal_(0.0, 1e-3, generator=g)
    return model


# ------------------------------------------------------------------------------------------ optimizers
def predictions_per_row(seq: int) -> int:
    """The phase recipes' max_predictions: 20 at seq 128, 80 at seq 512."""
    return 20 if seq <= 128 else 80


def bert_pretraining_batch(seq: int, micro_batch: int, padding: float = 0.0) -> dict[str, torch.Tensor]:
    """A synthetic BERT pretraining micro-batch (on the CPU) of rows of `seq` positions whose last `padding`
    fraction is padding, with the phase recipes' number of masked positions."""
    predictions = predictions_per_row(seq)
    real = seq - round(padding * seq)  # [CLS] A [SEP] B [SEP], then padding
    g = torch.Generator().manual_seed(0)
    positions = torch.sort(torch.rand(micro_batch, real, generator=g).argsort(-1)[:, :predictions], -1).values
    in_row = torch.arange(seq) < real
    return {
        "input_ids": torch.randint(0, 30522, (micro_batch, seq), generator=g) * in_row,  # pad id 0
        "token_type_ids": ((torch.arange(seq) >= real // 2) & in_row).long().expand(micro_batch, seq).contiguous(),
        "attention_mask": in_row.long().expand(micro_batch, seq).contiguous(),
        "masked_lm_positions": positions,
        "masked_lm_labels": torch.randint(0, 30522, (micro_batch, predictions), generator=g),
        "next_sentence_label": torch.randint(0, 2, (micro_batch,), generator=g),
    }


def demo_pretraining_dataset(seq: int) -> PretrainingDataset:
    """The demo corpus's sequences at `seq` positions as `data=demo` builds them (dupe factor 5, short_seq_prob 0.1,
    static masks, the phase recipes' max predictions), over every document: the training run holds out the first few
    for evaluation, which leaves the mix of lengths as it is."""
    from data.text.pretraining import build_demo_dataset  # here: the tokenizer's imports take seconds
    from data.text.tokenizer import load_tokenizer

    return build_demo_dataset(load_tokenizer(), max_seq_len=seq, max_predictions=predictions_per_row(seq))


def takes_option(name: str, option: str) -> bool:
    """Whether optimizer `name` takes `option`: `compiled` (its math compiled by inductor, `optim._compiled`) or
    `triton` (Triton kernels of its own: `optim._triton_lamb`, `optim.slamb._triton`, `optim._triton_compressed`)."""
    return option in inspect.signature(get_optimizer_spec(name).cls).parameters


def kernel_options(name: str, compiled: bool = False, triton: bool = False) -> dict[str, bool]:
    """`compiled` and `triton` set on or off where optimizer `name` takes them (absent where it does not): off
    explicitly, so that a row of aten ops stays one where a preset's `triton: null` takes the kernels on a GPU."""
    wanted = {"compiled": compiled, "triton": triton}
    return {option: on for option, on in wanted.items() if takes_option(name, option)}


# Options that put the 1-bit optimizers in their compressed stage from step 3 (their warm-up ends at step 2), so that
# a benchmark times or counts the stage they spend a run in.
COMPRESSED_FROM = {"onebit_lamb": {"freeze_step": 2}, "onebit_adam": {"freeze_step": 2},
                   "zero_one_adam": {"var_freeze_step": 2}}


@contextlib.contextmanager
def gpu_chunks() -> Iterator[None]:
    """Tensor lists chunked as on a GPU, whatever device counts the step."""
    saved = dict(FOREACH_CHUNK_NUMEL)
    FOREACH_CHUNK_NUMEL.update(cpu=saved["cuda"], meta=saved["cuda"])
    try:
        yield
    finally:
        FOREACH_CHUNK_NUMEL.clear()
        FOREACH_CHUNK_NUMEL.update(saved)


def meta_kernels(triton: bool) -> contextlib.AbstractContextManager:
    """Where `triton`, let optimizers over meta tensors take `triton=True` on any machine: they run no kernel, so the
    option's refusal on a machine without a GPU does not apply to them (Triton's interpreter is what it allows)."""
    return unittest.mock.patch.dict(os.environ, TRITON_INTERPRET="1") if triton else contextlib.nullcontext()


def config_kwargs(name: str, **overrides) -> dict:
    """The settings of conf/optim/<name>.yaml (what `optim=<name>` runs) as `build_optimizer` kwargs, overridden."""
    cfg = yaml.safe_load((CONF_OPTIM / f"{name}.yaml").read_text())
    cfg.pop("name")
    return cfg | overrides


def optimizer_stepper(name: str, optimizer: torch.optim.Optimizer, grads: dict[nn.Parameter, torch.Tensor],
                      clock: Callable[[], float]) -> Callable[[], float]:
    """One training step's optimizer work, returning its duration in `clock` seconds. For JointSpar that is the
    layer draw and the step; handing the sampled layers their gradients (backward's work) is not timed."""
    if not get_optimizer_spec(name).samples_layers:
        def step() -> float:
            for p, grad in grads.items():  # all of them: a JointSpar round's zero_grad dropped the model's
                p.grad = grad
            start = clock()
            optimizer.step()
            return clock() - start
        return step

    def sampled_step() -> float:
        optimizer.zero_grad()
        start = clock()
        optimizer.begin_step()
        drawn = clock() - start
        for p, grad in grads.items():
            if p.requires_grad:
                p.grad = grad
        start = clock()
        optimizer.step()
        return drawn + clock() - start
    return sampled_step


# ------------------------------------------------------------------------------------------ timing
def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work, so that a host clock read after it covers that work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def step_times(
    optimizers: dict[str, torch.optim.Optimizer], device: torch.device, warmup: int, repeats: int,
    clock: Callable[[], float] = time.perf_counter,
) -> dict[str, list[float]]:
    """Times of `repeats` `step()` calls per optimizer, in seconds of `clock`, measured in interleaved rounds.

    Interleaving spreads drifting machine load over all optimizers alike; callers keep the best (the least
    disturbed step) and the median (the typical one). On a shared CPU, `time.process_time` leaves out the time
    the process waits for a core (not the memory bandwidth other processes take).
    """
    for optimizer in optimizers.values():
        for _ in range(warmup):  # creates the state and warms caches and allocators
            optimizer.step()
    times: dict[str, list[float]] = {name: [] for name in optimizers}
    for _ in range(repeats):
        for name, optimizer in optimizers.items():
            times[name].append(timed(optimizer.step, device, clock))
    return times


def timed(work: Callable[[], object], device: torch.device, clock: Callable[[], float] = time.perf_counter) -> float:
    """Seconds of `clock` that one call of `work` takes, its queued device work included."""
    synchronize(device)
    start = clock()
    work()
    synchronize(device)
    return clock() - start


# ------------------------------------------------------------------------------------------ memory traffic
def bytes_touched(params: list[torch.Tensor], optimizer: torch.optim.Optimizer) -> int:
    """Minimum traffic of one fused step: parameters read and written, gradients read, state read and written
    (the parameters that have a gradient: those a layer-sampling step updates)."""
    stepped = [p for p in params if p.grad is not None]
    param_bytes = sum(p.nbytes for p in stepped)
    grad_bytes = sum(p.grad.nbytes for p in stepped)
    return 2 * param_bytes + grad_bytes + 2 * state_bytes(optimizer)


# Ops whose mutated tensor is overwritten, not read: they move its bytes once (the write), not twice.
_WRITE_ONLY = {"aten::copy_", "aten::zero_", "aten::fill_", "aten::_foreach_copy_", "aten::_foreach_zero_",
               "aten::normal_", "aten::uniform_", "aten::random_", "aten::bernoulli_"}
# Fused optimizer kernels mark the gradients mutable but write them only to unscale them (with a grad_scale).
_FUSED_STEPS = {"aten::_fused_adam_", "aten::_fused_adamw_", "aten::_fused_sgd_"}
# Indexed ops move only the slices of `self` that their index names (a gather reads its selected rows, a scatter
# writes them), at most `self` once (an index that repeats slices reads them from cache): those bytes are counted,
# read or not (index_copy_ and index_fill_ overwrite them).
_INDEXED = {"aten::index_select": True, "aten::index_add_": True, "aten::index_copy_": False,
            "aten::index_fill_": False}
# The project's Triton kernels (custom ops, `optim._triton`): arguments they write without reading them, and the
# gathers that read of each list of their `sources` only the coordinates they write to its output in `outs`.
_WRITE_ONLY_ARGUMENTS = {"slamb_optim::moments_and_block_sums": {"directions"},
                         "slamb_optim::always_directions": {"directions"},
                         "slamb_optim::sign_compress": {"packed"}, "slamb_optim::decode_signs": {"out"},
                         "slamb_optim::gather_rows": {"outs"}}
_ROW_GATHERS = {"slamb_optim::gather_rows"}

# Allocations return memory nobody has written: no traffic (the op that fills it counts its writes).
_ALLOCATIONS = {"aten::empty", "aten::empty_like", "aten::empty_strided", "aten::new_empty",
                "aten::new_empty_strided"}


# torch's CUDA multi-tensor kernels (`multi_tensor_apply`): tensors per launch by the number of tensor lists a kernel
# walks, and chunks of 65,536 elements per launch (320 blocks).
_TENSORS_PER_LAUNCH = {1: 110, 2: 64, 3: 48, 4: 36, 5: 30}
_CHUNK_NUMEL, _CHUNKS_PER_LAUNCH = 65536, 320


def cuda_launches(name: str, arguments: dict[str, Any]) -> int:
    """Kernels an op launches on a CUDA device, by torch's rules for its multi-tensor ops (`_foreach_*` and the fused
    optimizer kernels); one for any other op.

    A multi-tensor op takes torch's fast route, a launch per few dozen tensors, only when the tensors at each index
    of its lists have the same sizes and strides, each list one dtype (one for all lists but a copy's), and every
    tensor is dense. Otherwise it loops over the index, a kernel per tensor: a list of per-tensor 0-d factors (a
    trust ratio each) beside the tensors they scale takes that loop, whatever the count of ops says. The fused
    optimizer kernels read their step counts as per-tensor scalars, not as a list.
    """
    if not (name.startswith("aten::_foreach_") or name in _FUSED_STEPS):
        return 1
    lists = [list(v) for v in arguments.values()
             if isinstance(v, (list, tuple)) and v and all(isinstance(t, torch.Tensor) for t in v)]
    if name in _FUSED_STEPS:  # the step counts ride along as per-tensor scalars, not as a list walked
        lists = [tensors for tensors in lists if tensors[0].dim() > 0]
    if not lists:
        return 1
    count = len(lists[0])
    dtypes = [{t.dtype for t in tensors} for tensors in lists]
    fast = (all(len(tensors) == count for tensors in lists) and all(len(d) == 1 for d in dtypes)
            and (name == "aten::_foreach_copy_" or len(set().union(*dtypes)) == 1)
            and all(len({(t.shape, t.stride()) for t in alike}) == 1 and is_non_overlapping_and_dense_or_false(alike[0])
                    for alike in zip(*lists, strict=True)))
    if not fast:
        return count
    chunks = sum(-(-t.numel() // _CHUNK_NUMEL) for t in lists[0])
    return max(1, -(-count // _TENSORS_PER_LAUNCH[min(len(lists), 5)]), -(-chunks // _CHUNKS_PER_LAUNCH))


class StepTraffic(TorchDispatchMode):
    """Counts the ops dispatched while it is active, the kernels they would launch on a CUDA device
    (`cuda_launches`) and the bytes they read and write.

    An op reads every tensor it takes and writes every tensor it returns fresh or mutates (its schema says which),
    so `bytes` is the memory traffic of unfused kernels: what a GPU moves for the same ops, caches aside. Views move
    nothing and launch nothing, and allocations (`empty`) write nothing and launch nothing; collectives (c10d) are
    the network's, not the step's memory traffic, and are left out of every count.

    `host_tensors` counts the CPU tensors those ops take. Where the parameters live on another device (meta, a GPU's
    stand-in) that is host work the device waits for, and per tensor: a 0-d step count per parameter, added to in a
    foreach op, is one op but a host loop over every parameter.
    """

    def __init__(self) -> None:
        super().__init__()
        self.ops = 0
        self.launches = 0
        self.bytes = 0
        self.host_tensors = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        schema = func._schema
        if func.is_view or schema.name.startswith("c10d::"):
            return out
        self.ops += 1
        if schema.name in _ALLOCATIONS:
            return out
        write_only = schema.name in _WRITE_ONLY
        named = {a.name: args[i] if i < len(args) else kwargs.get(a.name) for i, a in enumerate(schema.arguments)}
        self.launches += cuda_launches(schema.name, named)
        for argument in schema.arguments:
            value = named[argument.name]
            tensors = [t for t in tree_leaves(value) if isinstance(t, torch.Tensor)]
            self.host_tensors += sum(t.device.type == "cpu" for t in tensors)
            size = sum(t.nbytes for t in tensors)
            mutated = argument.alias_info is not None and argument.alias_info.is_write
            reads = not ((write_only and mutated) or argument.name == "out"  # copy_ reads its source, not self
                         or argument.name in _WRITE_ONLY_ARGUMENTS.get(schema.name, ()))
            if schema.name in _FUSED_STEPS and argument.name == "grads" and kwargs.get("grad_scale") is None:
                mutated = False
            if schema.name in _INDEXED and argument.name == "self":
                size = min(size, size // max(value.size(named["dim"]), 1) * named["index"].numel())
                reads = _INDEXED[schema.name]
            if schema.name in _ROW_GATHERS and argument.name == "sources":
                per_list = len(value) // max(len(named["outs"]), 1)
                size = sum(out.numel() * value[j * per_list].element_size() for j, out in enumerate(named["outs"]))
            self.bytes += size * (int(reads) + int(mutated))
        fresh = [r.alias_info is None for r in schema.returns]
        results = out if isinstance(out, tuple) else (out,)
        for is_fresh, result in zip(fresh, results, strict=False):
            if is_fresh:
                self.bytes += sum(t.nbytes for t in tree_leaves(result) if isinstance(t, torch.Tensor))
        return out


# ------------------------------------------------------------------------------------------ 1-bit schedules
PHASE1_STEPS = 7038  # BERT-Large phase 1 (conf/experiment/bert_large_phase1.yaml)
PUBLISHED_STEPS = 152511  # the published BERT-Large schedule the 1-bit papers' step counts refer to
PHASE1_WARMUP = round(0.2843 * PHASE1_STEPS)  # the phase-1 LR warm-up of conf/experiment/bert_large_phase1.yaml


def freeze_kinds(steps: int, freeze_step: int) -> list[str]:
    """Step kinds of 1-bit Adam / LAMB: the no-op first step, full precision up to `freeze_step`, then compressed."""
    return ["init"] + ["dense" if t <= freeze_step else "compressed" for t in range(2, steps + 1)]


def scaled_to_phase1(n: int) -> int:
    """A step count of the published 152,511-step schedule at the same fraction of phase 1."""
    return round(n / PUBLISHED_STEPS * PHASE1_STEPS)


def phase1_schedules() -> dict[str, tuple[str, list[str]]]:
    """Registry name -> (settings, kind of each step) of the 1-bit family over BERT-Large phase 1."""
    return {
        "onebit_lamb": ("freeze_step 1000", freeze_kinds(PHASE1_STEPS, 1000)),
        "onebit_adam": (f"freeze_step {scaled_to_phase1(23000)} (23000/152511 of the run)",
                        freeze_kinds(PHASE1_STEPS, scaled_to_phase1(23000))),
        "zero_one_adam": (f"var_freeze_step {PHASE1_WARMUP} (end of warm-up), alpha 32678, H 16",
                          zero_one_adam_step_kinds(PHASE1_STEPS, PHASE1_WARMUP)),
    }


def stage_kinds(name: str, repeats: int) -> tuple[dict[str, Any], list[str]]:
    """Settings for 1-bit optimizer `name` ("1-bit Adam", "1-bit LAMB", "0/1 Adam") whose schedule visits each of
    its stages `repeats + 1` times, and the kinds.

    The first step of each stage is not timed (it allocates), so `repeats` steps of each stage are.
    """
    n = repeats + 1
    if name == "0/1 Adam":  # n variance steps at interval 1, then n more alternating with n 1-bit gradient steps;
        # phase 2 alternates syncs and local steps (the sync interval is 2 after one phase-2 step)
        settings = dict(var_freeze_step=3 * n, var_update_scaler=n, local_step_scaler=1, local_step_clipper=2)
        return settings, zero_one_adam_step_kinds(3 * n + 2 + 2 * n, **settings)
    return dict(freeze_step=1 + n), freeze_kinds(1 + 2 * n, 1 + n)


# ------------------------------------------------------------------------------------------ tables
def markdown_table(rows: list[dict[str, Any]]) -> str:
    """A Markdown table of `rows` (the first row's keys are the header); floats to 5 significant digits."""
    def cell(value: Any) -> str:
        return "" if value is None else f"{value:.5g}" if isinstance(value, float) else str(value)

    lines = ["| " + " | ".join(rows[0]) + " |", "|" + "---|" * len(rows[0])]
    lines += ["| " + " | ".join(cell(v) for v in row.values()) + " |" for row in rows]
    return "\n".join(lines) + "\n"


def csv_table(rows: list[dict[str, Any]]) -> str:
    """Full-precision values (floats as their repr, which parses back exactly); blanks for None."""
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=list(rows[0]), lineterminator="\n")
    writer.writeheader()
    writer.writerows({k: "" if v is None else v for k, v in row.items()} for row in rows)
    return out.getvalue()


# ------------------------------------------------------------------------------------------ ranks
def run_on_ranks(fn: Callable[..., Any], world_size: int, *args: Any) -> list[Any]:
    """`fn(rank, world_size, *args)` on `world_size` gloo ranks in spawned processes; results in rank order.

    `fn` must be a module-level function (the processes are spawned). No time limit: a loaded machine is only slow.
    """
    with tempfile.TemporaryDirectory() as tmp:
        torch.multiprocessing.spawn(_rank_entry, args=(world_size, os.path.join(tmp, "init"), tmp, fn, args),
                                    nprocs=world_size)
        return [torch.load(os.path.join(tmp, f"{rank}.pt"), weights_only=False) for rank in range(world_size)]


def _rank_entry(rank: int, world_size: int, init_file: str, out_dir: str, fn: Callable[..., Any],
                args: tuple) -> None:
    # The ranks share the machine's cores: one intra-op thread each.
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        torch.save(fn(rank, world_size, *args), os.path.join(out_dir, f"{rank}.pt"))
    finally:
        torch.distributed.destroy_process_group()


def print_top_kernels(step: Callable[[], None], device: torch.device, top: int, steps: int = 3) -> None:
    """The `top` kernels by total device time over `steps` steps: where a step's time goes."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    print(f"top {top} of {steps} profiled steps, by {sort_by}:")
    print(prof.key_averages().table(sort_by=sort_by, row_limit=top, max_name_column_width=70))
