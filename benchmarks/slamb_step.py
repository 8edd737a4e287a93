"""SLAMB's optimizer step time and state memory as ratios to LAMB's, on BERT-base and BERT-Large parameter sets.

    python -m benchmarks.slamb_step --size base
    python -m benchmarks.slamb_step --size large --device cuda

Both optimizers are built by `optim.build_optimizer` from conf/optim/lamb.yaml and conf/optim/slamb.yaml (what
`optim=lamb` and `optim=slamb` run), over the same parameters and random gradients. SLAMB gets a loopback
communication layer: it takes every step of the multi-rank path (mask draw, gather of the synced momenta,
the bucketed all-reduce call, scatter back) with a collective that returns at once, so the times are the
optimizer's own work without the network. Steps are interleaved and each reports its best step after
warm-up, as in `benchmarks.optim_step`. Memory is the bytes of the optimizer's persistent tensors: LAMB's
m and v; SLAMB's m, v and freshness (state) plus its work buffers (scratch).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import yaml

from benchmarks.optim_step import SIZES, bert_parameters, best_step_times
from optim import build_optimizer
from optim.comm import Comm

CONF_OPTIM = Path(__file__).resolve().parents[1] / "conf" / "optim"


class LoopbackComm(Comm):
    """A `Comm` that takes the multi-rank code path but whose collectives return at once (bytes still counted)."""

    def __init__(self) -> None:
        super().__init__(None)

    @property
    def distributed(self) -> bool:
        return True

    def all_reduce(self, tensor: torch.Tensor, op=None, async_op: bool = False):
        self._count(tensor)
        return _Done() if async_op else None


class _Done:
    def wait(self) -> bool:
        return True


def config_kwargs(name: str, **overrides) -> dict:
    cfg = yaml.safe_load((CONF_OPTIM / f"{name}.yaml").read_text())
    cfg.pop("name")
    return cfg | overrides


def state_bytes(optimizer: torch.optim.Optimizer) -> int:
    """Bytes of the distinct storages behind the tensors in the optimizer's per-parameter state."""
    seen, total = set(), 0
    for entry in optimizer.state.values():
        for value in entry.values():
            if isinstance(value, torch.Tensor) and value.untyped_storage().data_ptr() not in seen:
                seen.add(value.untyped_storage().data_ptr())
                total += value.untyped_storage().nbytes()
    return total


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=sorted(SIZES), default="base")
    parser.add_argument("--repeats", type=int, default=5, help="timed steps per optimizer (best is kept)")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per optimizer first")
    parser.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    parser.add_argument("--variants", action="store_true", help="also time SLAMB's cyclic and naive-rescale variants")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible")
    device = torch.device(args.device)

    model = bert_parameters(args.size, device)
    params = list(model.parameters())
    numel = sum(p.numel() for p in params)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else f"cpu, {torch.get_num_threads()} threads"
    optimizers = {
        "LAMB (conf/optim/lamb.yaml, reference)": build_optimizer(model, "lamb", config_kwargs("lamb")),
        "SLAMB (conf/optim/slamb.yaml)": build_optimizer(model, "slamb", config_kwargs("slamb"), comm=LoopbackComm()),
    }
    if args.variants:
        optimizers["SLAMB mask=cyclic"] = build_optimizer(
            model, "slamb", config_kwargs("slamb", mask="cyclic"), comm=LoopbackComm())
        optimizers["SLAMB rescale=product_of_interpolations"] = build_optimizer(
            model, "slamb", config_kwargs("slamb", rescale="product_of_interpolations"), comm=LoopbackComm())
    print(f"optimizer step, BERT-{args.size}: {numel / 1e6:.1f}M fp32 parameters in {len(params)} tensors | {name} | "
          f"torch {torch.__version__} | best of {args.repeats} after {args.warmup} warm-up steps | SLAMB k=0.1 "
          "with a loopback collective")
    times = best_step_times(optimizers, device, args.warmup, args.repeats)
    reference_time = next(iter(times.values()))
    reference_bytes = state_bytes(next(iter(optimizers.values())))
    print(f"{'optimizer':<42} {'ms':>9} {'time x':>7} {'state MB':>9} {'state x':>8} {'+scratch MB':>12} "
          f"{'total x':>8}")
    for label, seconds in times.items():
        optimizer = optimizers[label]
        memory = optimizer.memory_bytes() if hasattr(optimizer, "memory_bytes") else {"state": state_bytes(optimizer),
                                                                                      "scratch": 0}
        total = memory["state"] + memory["scratch"]
        print(f"{label:<42} {seconds * 1e3:>9.1f} {seconds / reference_time:>7.2f} {memory['state'] / 2**20:>9.1f} "
              f"{memory['state'] / reference_bytes:>8.2f} {memory['scratch'] / 2**20:>12.1f} "
              f"{total / reference_bytes:>8.2f}")


if __name__ == "__main__":
    main()
