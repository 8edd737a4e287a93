r"""Training throughput of BERT pretraining or Swin classification, with model FLOPs utilisation, beside the
published per-GPU figures.

    python -m benchmarks.throughput.training --task bert --size large --seq 128 --precision bf16 --micro-batch 64
    python -m benchmarks.throughput.training --task bert --size large --seq 512 --precision bf16 --micro-batch 16 \
        --compile
    python -m benchmarks.throughput.training --task bert --size large --seq 512 --padding 0.3
    python -m benchmarks.throughput.training --task bert --size large --seq 512 --lengths demo --pack 3
    python -m benchmarks.throughput.training --task bert --size large --seq 128 --precision bf16_o2 --micro-batch 64
    python -m benchmarks.throughput.training --task swin --size base --precision bf16 --micro-batch 64
    python -m benchmarks.throughput.training --size narrow --compile      # its first step's compile; --compile whole
    python -m benchmarks.throughput.training      # on CPU: tiny shapes, so the code path is exercised anywhere

A step is what the trainer runs per micro-batch on one device, built from the same parts: the model from
`models.create_model`, the task's loss (BERT: MLM on the masked positions only + NSP), autocast and the loss
scaler of `train.precision` (or, with `--precision bf16_o2` / `fp16_o2`, O2's half copy of `train.half_weights`:
half weights and activations, the optimizer on the fp32 masters), backward, and the optimizer from the registry
(LAMB for BERT, AdamW for Swin, `--optim` for another); `--compile` compiles it as `trainer.compile` does, and the
first warm-up step's time (its compile) is printed. Batches are already on the device, so data loading never
stalls it. BERT's rows are synthetic and full unless `--padding` pads each row's end, or, with `--lengths demo`, they
are the demo corpus's sequences at `--seq` as `data=demo` builds them (real lengths and masks; phase 2 pads about
30 %, `benchmarks.data.padding`), one a row or packed `--pack` a row by the training's own plan (`data.text.packing`).
The micro-batches cycle over the corpus in a seeded order, so every timed step sees its mix of lengths. Rows/s,
sequences/s and the real (non-pad) tokens per second are counted from the attention masks of the timed micro-batches.
FLOPs are counted, not estimated: `torch.utils.flop_counter` records one step's matmuls and attention
(forward and backward), and MFU is those FLOPs per second over the device's dense peak for the precision.
References: NVIDIA DeepLearningExamples BERT-Large pretraining, A100-80GB, mixed precision: 580 seq/s per GPU
at seq 128 and 210 at seq 512; Swin-B at 224 px: 278 img/s on a V100 (Liu et al. 2021, an inference figure).
"""

from __future__ import annotations

import argparse
import itertools
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import (
    bert_pretraining_batch,
    demo_pretraining_dataset,
    device_label,
    predictions_per_row,
    print_top_kernels,
    timed,
)
from models import compiled_for_training, create_model
from optim import build_optimizer
from train.half_weights import HalfCopy
from train.precision import PRECISIONS, half_weights_dtype, make_grad_scaler, set_matmul_precision, training_autocast
from train.tasks import get_task

# Published per-device throughput (sequences or images per second) to print beside ours.
REFERENCES = {
    ("bert", 128): ("NVIDIA BERT-Large, A100-80GB, mixed precision", 580.0),
    ("bert", 512): ("NVIDIA BERT-Large, A100-80GB, mixed precision", 210.0),
    ("swin", 224): ("Swin-B paper, V100 (inference)", 278.0),
}
# Dense tensor-core peaks in TFLOP/s by device-name substring: (fp16/bf16, tf32, fp32). SXM parts.
DEVICE_PEAKS = {
    "H200": (989.0, 494.7, 66.9),
    "H100": (989.0, 494.7, 66.9),
    "A100": (312.0, 156.0, 19.5),
    "V100": (125.0, 15.7, 15.7),  # no TF32 on Volta: fp32 rate
}
BERT_SIZES = {  # (hidden, layers, heads, feed-forward); `tiny` is the CPU demo's model, `narrow` BERT-Large's depth
    # at a width a CPU trains fast: what `--compile` costs to compile scales with the layers it traces
    "large": (1024, 24, 16, 4096), "base": (768, 12, 12, 3072), "tiny": (128, 2, 2, 512), "narrow": (64, 24, 2, 256),
}
SWIN_SIZES = {  # `tiny` shrinks Swin-B to a CPU-sized model with the same code path
    "base": {}, "tiny": {"img_size": 64, "embed_dim": 32, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 4, 8],
                         "window_size": 2},
}


@dataclass
class Workload:
    model_name: str  # the registry's, which says how `--compile` compiles it
    model: torch.nn.Module
    batches: list[dict[str, torch.Tensor]]  # the micro-batches, on the device, taken in turn
    task: str
    optim: str
    label: str


def bert_workload(size: str, seq: int, micro_batch: int, device: torch.device, padding: float = 0.0,
                  lengths: str = "synthetic", pack: int = 1) -> Workload:
    """A BERT step on synthetic rows of `seq` positions whose last `padding` fraction is padding, or on the demo
    corpus's sequences (`lengths="demo"`), packed `pack` a row."""
    hidden, layers, heads, ffn = BERT_SIZES[size]
    with torch.device(device):  # initialised where it trains: on a host its random init takes seconds
        model = create_model("bert_pretraining", size="large", hidden_size=hidden, num_hidden_layers=layers,
                             num_attention_heads=heads, intermediate_size=ffn)
    label = f"BERT-{size} seq {seq}"
    if lengths == "demo":
        batches = demo_micro_batches(seq, micro_batch, pack)
        label += ", the demo corpus's sequences" + (f" packed {pack} a row" if pack > 1 else "")
    else:
        batches = [bert_pretraining_batch(seq, micro_batch, padding)]
    return Workload("bert_pretraining", model, [{k: v.to(device) for k, v in batch.items()} for batch in batches],
                    "bert_pretraining", "lamb", label)


def demo_micro_batches(seq: int, micro_batch: int, pack: int = 1) -> list[dict[str, torch.Tensor]]:
    """The demo corpus's sequences at `seq`, one a row or packed `pack` a row as `data.pack_sequences` packs them
    (the same keys a packed loader yields), in one seeded order cut into micro-batches of `micro_batch` rows; the
    remainder, fewer rows than a micro-batch, is left out."""
    from data.text.packing import PackedPretrainingDataset  # here: synthetic runs skip the tokenizer's imports

    dataset = demo_pretraining_dataset(seq)
    if pack > 1:
        dataset = PackedPretrainingDataset(dataset, pack, seed=0)
    order = torch.randperm(len(dataset), generator=torch.Generator().manual_seed(0)).tolist()
    return [dataset.collate([dataset[i] for i in order[start:start + micro_batch]])
            for start in range(0, len(order) - micro_batch + 1, micro_batch)]


def swin_workload(size: str, micro_batch: int, device: torch.device) -> Workload:
    options = SWIN_SIZES[size]
    with torch.device(device):  # initialised where it trains, as BERT
        model = create_model("swin", arch="swin_base_patch4_window7_224", num_classes=1000, drop_path_rate=0.5,
                             **options)
    img = options.get("img_size", 224)
    g = torch.Generator().manual_seed(0)
    batch = {"image": torch.randn(micro_batch, 3, img, img, generator=g),
             "target": torch.softmax(torch.randn(micro_batch, 1000, generator=g), -1),
             "label": torch.randint(0, 1000, (micro_batch,), generator=g)}
    return Workload("swin", model, [{k: v.to(device) for k, v in batch.items()}], "image_classification", "adamw",
                    f"Swin-{size} {img} px")


def device_peak_tflops(device: torch.device, precision: str) -> float | None:
    """The device's dense peak for `precision`, when it is a GPU this table knows."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    column = {"bf16": 0, "fp16": 0, "tf32": 1, "fp32": 2}[precision]
    return next((peaks[column] for key, peaks in DEVICE_PEAKS.items() if key in name), None)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=["bert", "swin"], default="bert")
    parser.add_argument("--size", default=None, help="bert: large|base|tiny|narrow; swin: base|tiny (default: the "
                        "published model on a GPU, tiny on CPU)")
    parser.add_argument("--seq", type=int, choices=[128, 512], default=128)
    parser.add_argument("--padding", type=float, default=0.0, metavar="FRACTION",
                        help="bert: the fraction of each synthetic row that is padding (default 0: full rows)")
    parser.add_argument("--lengths", choices=["synthetic", "demo"], default="synthetic",
                        help="bert: synthetic rows (full, or --padding), or the demo corpus's sequences at --seq, "
                        "with their real lengths")
    parser.add_argument("--pack", type=int, default=1, metavar="K",
                        help="with --lengths demo: pack up to K sequences a row, as data.pack_sequences=K does "
                        "(default 1: one a row)")
    parser.add_argument("--precision", choices=[*PRECISIONS, "bf16_o2", "fp16_o2"], default=None,
                        help="autocast, or O2 (_o2: half weights, fp32 masters); default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: 64 on GPU (16 at seq 512), 4 on CPU")
    parser.add_argument("--optim", default=None, help="a registered optimizer (default: lamb for bert, adamw for swin)")
    parser.add_argument("--accumulation", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step, as the recipes accumulate (NVIDIA's phase 1: 128 "
                        "per step on 8 GPUs at 64 per micro-batch); 1 steps the optimizer on every micro-batch")
    parser.add_argument("--compile", nargs="?", const="regions", choices=["regions", "whole"], default=None,
                        help="torch.compile the model as the trainer does (regions: BERT's layers one by one, one "
                        "compile for all of them), or whole (one graph of the model, to compare)")
    parser.add_argument("--steps", type=int, default=None, help="timed steps (default: 20 on GPU, 3 on CPU)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto")
    parser.add_argument("--profile", type=int, default=0, metavar="N",
                        help="after timing, profile 3 steps and print the N kernels (CPU: ops) that take most time")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device("cuda" if args.device != "cpu" and torch.cuda.is_available() else "cpu")
    gpu = device.type == "cuda"
    size = args.size or ({"bert": "large", "swin": "base"}[args.task] if gpu else "tiny")
    sizes = BERT_SIZES if args.task == "bert" else SWIN_SIZES
    if size not in sizes:
        parser.error(f"--size {size}: {args.task} sizes are {', '.join(sizes)}")
    if not 0 <= args.padding <= 1 - (predictions_per_row(args.seq) + 3) / args.seq:
        parser.error(f"--padding {args.padding}: give a fraction from 0 that leaves room for "
                     f"{predictions_per_row(args.seq)} predictions and [CLS] A [SEP] B [SEP] in {args.seq} positions")
    if args.lengths == "demo" and (args.task != "bert" or args.padding):
        parser.error("--lengths demo: BERT's rows only (--task bert), and their padding is the corpus's: leave out "
                     "--padding")
    if args.pack < 1 or (args.pack > 1 and args.lengths != "demo"):
        parser.error(f"--pack {args.pack}: give 1 or more sequences a row; packing needs --lengths demo")
    if args.compile and args.warmup < 1:
        parser.error(f"--warmup {args.warmup} with --compile: the first step compiles, so time from the second on "
                     "(give --warmup 1 or more)")
    if args.accumulation < 1:
        parser.error(f"--accumulation {args.accumulation}: give 1 or more micro-batches per optimizer step")
    precision = args.precision or ("bf16" if gpu else "fp32")
    micro_batch = args.micro_batch or ((64 if args.seq == 128 or args.task == "swin" else 16) if gpu else 4)
    steps = args.steps or (20 if gpu else 3)

    torch.manual_seed(0)
    if args.task == "bert":
        work = bert_workload(size, args.seq, micro_batch, device, args.padding, args.lengths, args.pack)
    else:
        work = swin_workload(size, micro_batch, device)
    if not work.batches:
        parser.error(f"--micro-batch {micro_batch}: the demo corpus makes fewer rows than that at --seq {args.seq}")
    model = work.model.to(device).train()
    optimizer = build_optimizer(model, args.optim or work.optim, {"lr": 1e-4})
    precision_cfg = _precision_config(precision)
    set_matmul_precision(precision_cfg.dtype)
    scaler = make_grad_scaler(precision_cfg, device)
    half_dtype = half_weights_dtype(precision_cfg)
    half = HalfCopy(model, half_dtype) if half_dtype is not None else None
    eager = model if half is None else half.module
    step_fn = get_task(work.task).step
    if args.compile == "whole":
        train_model = torch.compile(eager)
    elif args.compile:
        train_model = compiled_for_training(work.model_name, eager)
    else:
        train_model = eager
    micro_batches = itertools.cycle(work.batches)

    def step(forward: torch.nn.Module = train_model) -> None:
        for _ in range(args.accumulation):
            with training_autocast(precision_cfg, device):
                loss = step_fn(forward, next(micro_batches))["loss"]
            scaler.scale(loss / args.accumulation).backward()
        if half is not None:
            half.grads_to_masters_()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if half is not None:
            half.pull_()

    warmup_seconds = [timed(step, device) for _ in range(args.warmup)]  # the first one compiles
    # One more step, counted on the eager model (the same FLOPs): the counter's global module hooks would make a
    # compiled model warn that they fire twice.
    with FlopCounterMode(display=False) as counter:
        step(eager)
    flops_per_step = counter.get_total_flops()
    if gpu:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
    start = time.perf_counter()
    for _ in range(steps):
        step()
    if gpu:
        torch.cuda.synchronize(device)
    seconds = (time.perf_counter() - start) / steps

    samples_per_step = micro_batch * args.accumulation
    rate = samples_per_step / seconds
    achieved_tflops = flops_per_step / seconds / 1e12
    peak = device_peak_tflops(device, precision_cfg.dtype)
    where = device_label(device)
    params = sum(p.numel() for p in model.parameters())
    unit = "rows/s" if args.task == "bert" else "img/s"
    print(f"{work.label}, {params / 1e6:.1f}M params, micro-batch {micro_batch} x {args.accumulation}, {precision}"
          f"{f', compiled ({args.compile})' if args.compile else ''}, optimizer {args.optim or work.optim} | {where} | "
          f"torch {torch.__version__} | mean of {steps} steps after {args.warmup + 1} warm-up")
    print(f"throughput   {rate:10.2f} {unit}  ({seconds * 1e3:.1f} ms/step)")
    if warmup_seconds:
        print(f"first step   {warmup_seconds[0]:10.1f} s" + (f"  (compiling: {args.compile})" if args.compile else ""))
    if args.task == "bert":  # sequences and real (non-pad) tokens, as the attention masks count them
        rows = samples_per_step * steps
        timed_batches = timed_micro_batches(work.batches, (args.warmup + 1) * args.accumulation,
                                            steps * args.accumulation)
        sequences, tokens = count_sequences_and_tokens(timed_batches)
        sequence_rate = rate * sequences / rows
        print(f"sequences    {sequence_rate:10.2f} seq/s  ({sequences / rows:.2f} a row)")
        print(f"real tokens  {rate * tokens / rows:10.0f} tokens/s  ({1 - tokens / (rows * args.seq):.1%} padding)")
    print(f"model FLOPs  {flops_per_step / samples_per_step / 1e9:10.2f} GFLOP per sample, "
          f"{achieved_tflops:.2f} TFLOP/s, "
          + (f"MFU {achieved_tflops / peak:.1%} of {peak:g} TFLOP/s" if peak else "MFU n/a (no known peak here)"))
    if gpu:
        print(f"peak memory  {torch.cuda.max_memory_allocated(device) / 2**30:10.2f} GiB")
    reference = REFERENCES.get((args.task, args.seq if args.task == "bert" else 224))
    if reference and size in ("large", "base") and size == ("large" if args.task == "bert" else "base"):
        what, figure = reference
        measured, unit = (sequence_rate, "seq/s") if args.task == "bert" else (rate, unit)  # the figures' unit
        print(f"vs {what}: {figure:g} {unit} -> ratio {measured / figure:.3f}")
    else:
        print("no published figure for this shape (tiny shapes exercise the code path; CPU times are noise)")
    if args.profile:
        print_top_kernels(step, device, args.profile)


def timed_micro_batches(batches: list[dict[str, torch.Tensor]], start: int,
                        count: int) -> list[dict[str, torch.Tensor]]:
    """The `count` micro-batches the cycle over `batches` hands out from its `start`-th on."""
    return [batches[(start + i) % len(batches)] for i in range(count)]


def count_sequences_and_tokens(batches: list[dict[str, torch.Tensor]]) -> tuple[int, int]:
    """Sequences and real tokens in BERT micro-batches: a row's attention mask numbers its sequences 1..K (packed)
    or marks its tokens 1 (one sequence), and is 0 on padding."""
    masks = [batch["attention_mask"] for batch in batches]
    return sum(int(m.amax(-1).sum()) for m in masks), sum(int((m > 0).sum()) for m in masks)


def _precision_config(precision: str) -> DictConfig:
    """What `train.precision` reads of `--precision` (a start scale of 2^16 for fp16, where benchmarking wants no
    skipped steps)."""
    return OmegaConf.create({"dtype": precision.removesuffix("_o2"), "weights": "half" if precision.endswith("_o2")
                             else "fp32", "init_scale": 2.0**16, "growth_interval": 2000})


if __name__ == "__main__":
    main()
