r"""Training throughput of BERT pretraining or Swin classification, with model FLOPs utilisation, beside the
published per-GPU figures.

    python -m benchmarks.throughput.training --task bert --size large --seq 128 --precision bf16 --micro-batch 64
    python -m benchmarks.throughput.training --task bert --size large --seq 512 --precision bf16 --micro-batch 16 \
        --compile
    python -m benchmarks.throughput.training --task bert --size large --seq 512 --padding 0.3
    python -m benchmarks.throughput.training --task bert --size large --seq 128 --precision bf16_o2 --micro-batch 64
    python -m benchmarks.throughput.training --task swin --size base --precision bf16 --micro-batch 64
    python -m benchmarks.throughput.training      # on CPU: tiny shapes, so the code path is exercised anywhere

A step is what the trainer runs per micro-batch on one device, built from the same parts: the model from
`models.create_model`, the task's loss (BERT: MLM on the masked positions only + NSP), autocast and the loss
scaler of `train.precision` (or, with `--precision bf16_o2` / `fp16_o2`, O2's half copy of `train.half_weights`:
half weights and activations, the optimizer on the fp32 masters), backward, and the optimizer from the registry
(LAMB for BERT, AdamW for Swin, `--optim` for another). Batches are synthetic and already on the device, so data
loading never stalls it; BERT's rows are full unless `--padding` pads each row's end, as prepared data does
(`benchmarks.data.padding` measures how much), and the real (non-pad) tokens per second are counted from the
attention mask beside the sequences.
FLOPs are counted, not estimated: `torch.utils.flop_counter` records one step's matmuls and attention
(forward and backward), and MFU is those FLOPs per second over the device's dense peak for the precision.
References: NVIDIA DeepLearningExamples BERT-Large pretraining, A100-80GB, mixed precision: 580 seq/s per GPU
at seq 128 and 210 at seq 512; Swin-B at 224 px: 278 img/s on a V100 (Liu et al. 2021, an inference figure).
"""

from __future__ import annotations

import argparse
import time
from dataclasses import dataclass

import torch
from omegaconf import DictConfig, OmegaConf
from torch.utils.flop_counter import FlopCounterMode

from benchmarks.common import bert_pretraining_batch, device_label, predictions_per_row, print_top_kernels
from models import create_model
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
BERT_SIZES = {  # (hidden, layers, heads, feed-forward); `tiny` is the CPU demo's model
    "large": (1024, 24, 16, 4096), "base": (768, 12, 12, 3072), "tiny": (128, 2, 2, 512),
}
SWIN_SIZES = {  # `tiny` shrinks Swin-B to a CPU-sized model with the same code path
    "base": {}, "tiny": {"img_size": 64, "embed_dim": 32, "depths": [1, 1, 1, 1], "num_heads": [1, 2, 4, 8],
                         "window_size": 2},
}


@dataclass
class Workload:
    model: torch.nn.Module
    batch: dict[str, torch.Tensor]
    task: str
    optim: str
    label: str


def bert_workload(size: str, seq: int, micro_batch: int, device: torch.device, padding: float = 0.0) -> Workload:
    """A BERT step on synthetic rows of `seq` positions whose last `padding` fraction is padding."""
    hidden, layers, heads, ffn = BERT_SIZES[size]
    model = create_model("bert_pretraining", size="large", hidden_size=hidden, num_hidden_layers=layers,
                         num_attention_heads=heads, intermediate_size=ffn)
    batch = bert_pretraining_batch(seq, micro_batch, padding)
    return Workload(model, {k: v.to(device) for k, v in batch.items()}, "bert_pretraining", "lamb",
                    f"BERT-{size} seq {seq}")


def swin_workload(size: str, micro_batch: int, device: torch.device) -> Workload:
    options = SWIN_SIZES[size]
    model = create_model("swin", arch="swin_base_patch4_window7_224", num_classes=1000, drop_path_rate=0.5,
                         **options)
    img = options.get("img_size", 224)
    g = torch.Generator().manual_seed(0)
    batch = {"image": torch.randn(micro_batch, 3, img, img, generator=g),
             "target": torch.softmax(torch.randn(micro_batch, 1000, generator=g), -1),
             "label": torch.randint(0, 1000, (micro_batch,), generator=g)}
    return Workload(model, {k: v.to(device) for k, v in batch.items()}, "image_classification", "adamw",
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
    parser.add_argument("--size", default=None, help="bert: large|base|tiny; swin: base|tiny (default: the "
                        "published model on a GPU, tiny on CPU)")
    parser.add_argument("--seq", type=int, choices=[128, 512], default=128)
    parser.add_argument("--padding", type=float, default=0.0, metavar="FRACTION",
                        help="bert: the fraction of each row that is padding (default 0: full rows)")
    parser.add_argument("--precision", choices=[*PRECISIONS, "bf16_o2", "fp16_o2"], default=None,
                        help="autocast, or O2 (_o2: half weights, fp32 masters); default: bf16 on GPU, fp32 on CPU")
    parser.add_argument("--micro-batch", type=int, default=None, help="default: 64 on GPU (16 at seq 512), 4 on CPU")
    parser.add_argument("--optim", default=None, help="a registered optimizer (default: lamb for bert, adamw for swin)")
    parser.add_argument("--accumulation", type=int, default=1, metavar="N",
                        help="micro-batches per optimizer step, as the recipes accumulate (NVIDIA's phase 1: 128 "
                        "per step on 8 GPUs at 64 per micro-batch); 1 steps the optimizer on every micro-batch")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model")
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
    if args.accumulation < 1:
        parser.error(f"--accumulation {args.accumulation}: give 1 or more micro-batches per optimizer step")
    precision = args.precision or ("bf16" if gpu else "fp32")
    micro_batch = args.micro_batch or ((64 if args.seq == 128 or args.task == "swin" else 16) if gpu else 4)
    steps = args.steps or (20 if gpu else 3)

    torch.manual_seed(0)
    if args.task == "bert":
        work = bert_workload(size, args.seq, micro_batch, device, args.padding)
    else:
        work = swin_workload(size, micro_batch, device)
    model = work.model.to(device).train()
    optimizer = build_optimizer(model, args.optim or work.optim, {"lr": 1e-4})
    precision_cfg = _precision_config(precision)
    set_matmul_precision(precision_cfg.dtype)
    scaler = make_grad_scaler(precision_cfg, device)
    half_dtype = half_weights_dtype(precision_cfg)
    half = HalfCopy(model, half_dtype) if half_dtype is not None else None
    eager = model if half is None else half.module
    step_fn = get_task(work.task).step
    train_model = torch.compile(eager) if args.compile else eager

    def step(forward: torch.nn.Module = train_model) -> None:
        for _ in range(args.accumulation):
            with training_autocast(precision_cfg, device):
                loss = step_fn(forward, work.batch)["loss"]
            scaler.scale(loss / args.accumulation).backward()
        if half is not None:
            half.grads_to_masters_()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad(set_to_none=True)
        if half is not None:
            half.pull_()

    for _ in range(args.warmup):
        step()
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
    unit = "seq/s" if args.task == "bert" else "img/s"
    print(f"{work.label}, {params / 1e6:.1f}M params, micro-batch {micro_batch} x {args.accumulation}, {precision}"
          f"{', compiled' if args.compile else ''}, optimizer {args.optim or work.optim} | {where} | "
          f"torch {torch.__version__} | mean of {steps} steps after {args.warmup + 1} warm-up")
    print(f"throughput   {rate:10.2f} {unit}  ({seconds * 1e3:.1f} ms/step)")
    if "attention_mask" in work.batch:  # BERT: real (non-pad) tokens, as the attention mask counts them
        real_per_sample = work.batch["attention_mask"].sum().item() / micro_batch
        print(f"real tokens  {rate * real_per_sample:10.0f} tokens/s  ({1 - real_per_sample / args.seq:.1%} padding)")
    print(f"model FLOPs  {flops_per_step / samples_per_step / 1e9:10.2f} GFLOP per sample, "
          f"{achieved_tflops:.2f} TFLOP/s, "
          + (f"MFU {achieved_tflops / peak:.1%} of {peak:g} TFLOP/s" if peak else "MFU n/a (no known peak here)"))
    if gpu:
        print(f"peak memory  {torch.cuda.max_memory_allocated(device) / 2**30:10.2f} GiB")
    reference = REFERENCES.get((args.task, args.seq if args.task == "bert" else 224))
    if reference and size in ("large", "base") and size == ("large" if args.task == "bert" else "base"):
        what, figure = reference
        print(f"vs {what}: {figure:g} {unit} -> ratio {rate / figure:.3f}")
    else:
        print("no published figure for this shape (tiny shapes exercise the code path; CPU times are noise)")
    if args.profile:
        print_top_kernels(step, device, args.profile)


def _precision_config(precision: str) -> DictConfig:
    """What `train.precision` reads of `--precision` (a start scale of 2^16 for fp16, where benchmarking wants no
    skipped steps)."""
    return OmegaConf.create({"dtype": precision.removesuffix("_o2"), "weights": "half" if precision.endswith("_o2")
                             else "fp32", "init_scale": 2.0**16, "growth_interval": 2000})


if __name__ == "__main__":
    main()
