r"""Bytes of dtype conversions per sequence in BERT-Large's forward and backward: bf16 autocast over fp32 weights
against O2's bf16 weights and activations, counted on shapes alone.

    python -m benchmarks.throughput.conversions                 # phase 1: seq 128, micro-batch 256
    python -m benchmarks.throughput.conversions --seq 512 --micro-batch 32

Autocast converts every matmul's fp32 weight and activations to bf16 and back, and runs LayerNorm, GELU, dropout
and the residual adds in fp32 between them; O2 keeps weights and activations in bf16, and converts only the logits
for the fp32 loss, plus, once per optimizer step, the gradients into the fp32 masters and the masters back. A
`TorchDispatchMode` adds up what each copy between floating dtypes (`aten._to_copy`, `aten.copy_`,
`aten._foreach_copy_`) reads and writes, while the step runs on fake CPU tensors (autocast's CPU casts apply; no
memory, no arithmetic): the traffic a GPU's unfused conversion kernels would move. The task's step is the trainer's
(`train.tasks`, MLM on the masked positions only + NSP); the O2 step is `train.half_weights.HalfCopy`'s.

Dropout is off while counting: a GPU applies attention dropout inside its bf16 SDPA kernel, while the CPU's SDPA
takes a math path with dropout that upcasts q, k, v and the mask to fp32 (about 0.2 GB per sequence in either mode,
which no GPU moves). Rows are full, as in the throughput benchmark.
"""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from benchmarks.common import bert_pretraining_batch, predictions_per_row
from models import create_model
from train.half_weights import HalfCopy
from train.precision import autocast
from train.tasks import get_task

_COPIES = {"aten::_to_copy": 0, "aten::copy_": 1, "aten::_foreach_copy_": 1}  # the source's argument


class Conversions(TorchDispatchMode):
    """Counts the bytes read and written by copies from one floating dtype to another while it is active (an
    integer mask made boolean, or a count made float, is no precision's conversion)."""

    def __init__(self) -> None:
        super().__init__()
        self.bytes = 0
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func._schema.name
        if name in _COPIES:
            sources = tree_leaves(args[_COPIES[name]])
            written = tree_leaves(args[0] if name == "aten::_foreach_copy_" else out)
            pairs = [(s, w) for s, w in zip(sources, written, strict=True)
                     if s.dtype != w.dtype and s.is_floating_point() and w.is_floating_point()]
            self.ops += bool(pairs)
            self.bytes += sum(s.nbytes + w.nbytes for s, w in pairs)
        return out


def count(step: Callable[[], None]) -> Conversions:
    counter = Conversions()
    with counter:
        step()
    return counter


def measure(seq: int, micro_batch: int, size: str = "large") -> dict[str, tuple[Conversions, Conversions]]:
    """Per mode, (the conversions of one micro-batch's forward and backward, those of one optimizer step's
    gradient and weight copies) at the shapes of BERT of `size` (`models.BERT_SIZES`)."""
    step = get_task("bert_pretraining").step
    cpu = torch.device("cpu")
    warnings.filterwarnings("ignore", "Accessing the data pointer of FakeTensor")  # deepcopy's check, harmless here
    results = {}
    with FakeTensorMode(allow_non_fake_inputs=True):
        model = create_model("bert_pretraining", size=size).eval()  # no dropout (the docstring says why)
        batch = bert_pretraining_batch(seq, micro_batch)

        def autocast_step() -> None:
            with autocast("bf16", cpu):
                loss = step(model, batch)["loss"]
            loss.backward()

        results["autocast"] = (count(autocast_step), Conversions())  # its optimizer reads fp32 gradients
        model.zero_grad(set_to_none=True)
        half = HalfCopy(model, torch.bfloat16)
        results["O2"] = (count(lambda: step(half.module, batch)["loss"].backward()),
                         count(lambda: (half.grads_to_masters_(), half.pull_())))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, choices=[128, 512], default=128)
    parser.add_argument("--micro-batch", type=int, default=None, help="default: 256 at seq 128, 32 at seq 512 "
                        "(the phase recipes' per-GPU micro-batches on an 80 GB GPU)")
    parser.add_argument("--accumulation", type=int, default=None, metavar="N",
                        help="micro-batches per optimizer step, over which O2's per-step copies spread (default: 4 "
                        "at seq 128, 8 at seq 512)")
    args = parser.parse_args(argv)
    micro_batch = args.micro_batch or (256 if args.seq == 128 else 32)
    accumulation = args.accumulation or (4 if args.seq == 128 else 8)
    sequences = micro_batch * accumulation
    print(f"BERT-Large seq {args.seq} ({predictions_per_row(args.seq)} masked positions), micro-batch {micro_batch} "
          f"x {accumulation} per optimizer step | dtype conversions counted on fake CPU tensors | torch "
          f"{torch.__version__}")
    print(f"{'mode':<10}{'per seq, fwd+bwd':>18}{'per seq, step copies':>22}{'per seq, total':>16}"
          f"{'ops/micro-batch':>17}")
    for mode, (micro, per_step) in measure(args.seq, micro_batch).items():
        forward_backward = micro.bytes / micro_batch
        step_copies = per_step.bytes / sequences
        print(f"{mode:<10}{forward_backward / 1e9:>15.3f} GB{step_copies / 1e9:>19.4f} GB"
              f"{(forward_backward + step_copies) / 1e9:>13.3f} GB{micro.ops:>17}")


if __name__ == "__main__":
    main()
