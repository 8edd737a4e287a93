"""Every registered optimizer against LAMB: step time and state memory, and JointSpar's backward saving.
(Training at equal steps, with measured bits per parameter: `python -m benchmarks.paper.reproduce`.)

    python -m benchmarks.optim.optimizers                               # both parts, every optimizer runnable here
    python -m benchmarks.optim.optimizers --part step --size base       # step time and memory, BERT-base parameters
    python -m benchmarks.optim.optimizers --part backward --size base   # JointSpar's forward + backward vs dense

step: each optimizer is built from its conf/optim YAML (what `optim=<name>` runs) over the same BERT parameters
and random gradients, in a world of one, and timed against LAMB in its own round (steps interleaved, one CPU
thread, best and median over the repeats, as ratios to LAMB's of the same round). A world of one is each
optimizer's own arithmetic without its collectives; SLAMB's and the 1-bit family's multi-rank paths are timed by
`benchmarks.optim.slamb_step` and `benchmarks.optim.onebit_step`. JointSpar's step includes drawing its layers and
steps only those, as in training. Memory is the bytes of the optimizer's persistent state tensors (a wrapper's base
included).

backward: forward + backward of a BERT pretraining batch with every layer computing its weight gradients (dense)
against JointSpar's sampled layers at several `sample_ratio`s (uniform probabilities), best over the repeats, and
the FLOPs autograd counted, both as ratios to dense.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import BertConfig, BertForPreTraining

from benchmarks.common import SIZES, bert_parameters, config_kwargs, optimizer_stepper
from optim import JointSpar, build_optimizer
from optim.apex import runnable_optimizers
from optim.memory import state_bytes

REFERENCE = "lamb"


# ------------------------------------------------------------------------------------------ step time and memory
def step_part(args: argparse.Namespace) -> None:
    torch.set_num_threads(1)
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    model = bert_parameters(args.size, torch.device("cpu"))
    grads = {p: p.grad for p in model.parameters()}
    numel = sum(p.numel() for p in grads)
    print(f"\n## step: BERT-{args.size}, {numel / 1e6:.1f}M fp32 parameters, a world of one, 1 CPU thread, "
          f"{args.repeats} interleaved steps after {args.warmup} warm-up ({args.clock} clock); x: ratio to lamb")
    print(f"{'optimizer':<18} {'best ms':>8} {'median ms':>10} {'best x':>7} {'median x':>9} {'state MB':>9} "
          f"{'memory x':>9}", flush=True)
    reference = build_optimizer(model, REFERENCE, config_kwargs(REFERENCE))
    for name in args.optimizers:
        if name == REFERENCE:
            continue
        optimizer = build_optimizer(model, name, config_kwargs(name))
        steppers = {REFERENCE: optimizer_stepper(REFERENCE, reference, grads, clock),
                    name: optimizer_stepper(name, optimizer, grads, clock)}
        times: dict[str, list[float]] = {key: [] for key in steppers}
        for round_ in range(args.warmup + args.repeats):
            for key, step in steppers.items():
                elapsed = step()
                if round_ >= args.warmup:
                    times[key].append(elapsed)
        if name == next(n for n in args.optimizers if n != REFERENCE):
            _step_row(REFERENCE, times[REFERENCE], times[REFERENCE], state_bytes(reference),
                      state_bytes(reference))
        _step_row(name, times[name], times[REFERENCE], state_bytes(optimizer), state_bytes(reference))
        del optimizer


def _step_row(label: str, values: list[float], reference: list[float], memory: int, reference_memory: int) -> None:
    best, median = min(values), statistics.median(values)
    print(f"{label:<18} {best * 1e3:>8.1f} {median * 1e3:>10.1f} {best / min(reference):>7.2f} "
          f"{median / statistics.median(reference):>9.2f} {memory / 2**20:>9.1f} {memory / reference_memory:>9.2f}",
          flush=True)


# ------------------------------------------------------------------------------------------ JointSpar's backward
BACKWARD_SIZES = {**SIZES, "small": dict(hidden_size=256, num_hidden_layers=4, num_attention_heads=4,
                                         intermediate_size=1024)}


def backward_part(args: argparse.Namespace) -> None:
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = BertForPreTraining(BertConfig(**BACKWARD_SIZES[args.backward_size], hidden_dropout_prob=0.0,
                                          attention_probs_dropout_prob=0.0))
    batch, seq = 8, 128
    ids = torch.randint(0, model.config.vocab_size, (batch, seq))
    labels = torch.where(torch.rand(batch, seq) < 0.15, ids, -100)

    def forward_backward() -> tuple[float, int]:
        start = time.perf_counter()
        out = model(input_ids=ids, labels=labels, next_sentence_label=torch.zeros(batch, dtype=torch.long))
        with FlopCounterMode(display=False) as counter:
            out.loss.backward()
        return time.perf_counter() - start, counter.get_total_flops()

    ratios = [r for r in args.sample_ratios if r < 1.0]
    optimizers = {r: JointSpar(model.named_parameters(), lr=0.0, base="sgd", sample_ratio=r, p_min=min(0.1, r),
                               eta_p=0.0) for r in ratios}
    layers = len(next(iter(optimizers.values())).layers) if optimizers else 0
    print(f"\n## backward: BERT-{args.backward_size} pretraining, batch {batch} x seq {seq}, {args.threads} CPU "
          f"thread(s), {layers} JointSpar layers (granularity block), best of {args.repeats} after "
          f"{args.warmup} warm-up, interleaved")
    times: dict[str, list[float]] = {"dense": []} | {f"sample_ratio={r}": [] for r in ratios}
    flops: dict[str, list[int]] = {key: [] for key in times}
    for round_ in range(args.warmup + args.repeats):
        for key in times:
            optimizer = optimizers.get(float(key.split("=")[1])) if key != "dense" else None
            if optimizer is not None:
                optimizer.begin_step()
            elapsed, counted = forward_backward()
            if optimizer is None:
                model.zero_grad(set_to_none=True)
            else:
                optimizer.step()  # lr 0: the weights stay; the next round draws the next layer set
                optimizer.zero_grad()  # and every layer is trainable again
            if round_ >= args.warmup:
                times[key].append(elapsed)
                flops[key].append(counted)
    print(f"{'layers computed':<18} {'fwd+bwd ms':>11} {'time x':>7} {'bwd FLOPs x':>12}")
    for key in times:
        print(f"{key:<18} {min(times[key]) * 1e3:>11.1f} {min(times[key]) / min(times['dense']):>7.2f} "
              f"{statistics.mean(flops[key]) / statistics.mean(flops['dense']):>12.2f}", flush=True)


PARTS = {"step": step_part, "backward": backward_part}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=[*PARTS, "all"], default="all")
    parser.add_argument("--optimizers", nargs="+", default=None, help="registry names (default: all runnable here)")
    parser.add_argument("--size", choices=sorted(SIZES), default="base", help="step: BERT parameter set")
    parser.add_argument("--backward-size", choices=sorted(BACKWARD_SIZES), default="small", help="backward: BERT size")
    parser.add_argument("--sample-ratios", nargs="+", type=float, default=[0.25, 0.5, 0.75], help="backward")
    parser.add_argument("--threads", type=int, default=1, help="backward: CPU threads")
    parser.add_argument("--repeats", type=int, default=5, help="step, backward: timed repeats (best, median kept)")
    parser.add_argument("--warmup", type=int, default=2, help="step, backward: untimed repeats first")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="step: wall time, or this process's CPU time (steadier on a shared CPU)")
    args = parser.parse_args(argv)
    runnable = runnable_optimizers()
    args.optimizers = args.optimizers or runnable
    unknown = [name for name in args.optimizers if name not in runnable]
    if unknown:
        parser.error(f"--optimizers {' '.join(unknown)}: not runnable here; choose from {', '.join(runnable)}")
    if REFERENCE not in args.optimizers:
        args.optimizers = [REFERENCE, *args.optimizers]
    for part in PARTS if args.part == "all" else [args.part]:
        PARTS[part](args)


if __name__ == "__main__":
    main()
