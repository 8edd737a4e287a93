"""Agreement of our 1-bit Adam, 1-bit LAMB and 0/1 Adam with DeepSpeed 0.19.6's, on CPU over gloo.

    pip install --no-deps deepspeed==0.19.6 hjson msgpack ninja psutil py-cpuinfo einops   # DS_BUILD_OPS=0
    python -m benchmarks.optim.deepspeed_reference --steps 60 --world-size 2

DeepSpeed's optimizers cannot run on a CPU as shipped; a test-only adapter,
applied here and never in the product, makes them: (1) a pure-torch sign packer stands in for the
accelerator's `PackbitsBuilder`, (2) the compressed backend's `all_gather` gets its 0-dim scales as shape
(1,) (gloo's shape check). The optimizer code itself runs unmodified. Instead of DeepSpeed's engine a
small stand-in does what the engine does for these optimizers in fp32: average the gradients when the
optimizer leaves `enable_backward_allreduce` on, then call `step()`.

Both implementations start from the same weights and see the same per-rank batches; the script prints,
per optimizer, the largest parameter difference relative to the largest parameter, per stage, and the
loss of both at a few steps. It exits with status 1 when deepspeed is not installed.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

import torch
from torch import nn

from benchmarks.common import run_on_ranks

# Settings that visit every stage within 60 steps (each optimizer's boundaries are printed).
CASES: dict[str, dict[str, Any]] = {
    "onebit_adam": dict(lr=1e-2, weight_decay=0.01, freeze_step=20),
    "onebit_lamb": dict(lr=1e-2, weight_decay=0.01, freeze_step=20, max_coeff=0.3, min_coeff=0.01),
    "zero_one_adam": dict(lr=1e-2, weight_decay=0.01, var_freeze_step=30, var_update_scaler=4, local_step_scaler=5,
                          local_step_clipper=4),
}


def deepspeed_available() -> bool:
    try:
        import deepspeed
    except ImportError:
        return False
    return deepspeed.__version__ == "0.19.6"


class _TorchPacker:
    """What `PackbitsBuilder().load()` returns, in torch: bit 1 for x >= 0, MSB first, zero-padded to bytes."""

    @staticmethod
    def packbits(tensor: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
        from optim.compressed import pack_signs

        flat = tensor.reshape(-1)
        return pack_signs(torch.nn.functional.pad(flat, (0, (-flat.numel()) % 8), value=1.0))

    @staticmethod
    def unpackbits(tensor: torch.Tensor, numel: int, rank: int) -> torch.Tensor:
        from optim.compressed import unpack_signs

        return unpack_signs(tensor.to(torch.uint8))


class _PackbitsBuilder:
    def load(self) -> _TorchPacker:
        return _TorchPacker()


class _GlooScalarShapes:
    """Passes every attribute through to DeepSpeed's comm module; `all_gather` sends 0-dim tensors as (1,)."""

    def __init__(self, module: Any) -> None:
        self._module = module

    def __getattr__(self, name: str) -> Any:
        return getattr(self._module, name)

    def all_gather(self, tensor_list, tensor, *args, **kwargs):
        return self._module.all_gather(tensor_list, tensor.reshape(1) if tensor.dim() == 0 else tensor, *args,
                                       **kwargs)


def install_adapter() -> None:
    """The test-only adapter of the module docstring (call after `torch.distributed` is initialised)."""
    import deepspeed.comm
    import deepspeed.ops.op_builder as op_builder
    import deepspeed.runtime.comm.compressed as compressed

    op_builder.PackbitsBuilder = _PackbitsBuilder
    compressed.PackbitsBuilder = _PackbitsBuilder
    if not isinstance(compressed.dist, _GlooScalarShapes):
        compressed.dist = _GlooScalarShapes(compressed.dist)
    deepspeed.comm.init_distributed(dist_backend="gloo", verbose=False)


class _Engine:
    """The part of DeepSpeed's engine the onebit optimizers talk to."""

    mpu = None
    local_rank = 0

    def __init__(self) -> None:
        self.enable_backward_allreduce = True


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(104729 * step + rank)
    x = torch.randn(16, 16, generator=g)
    return x, torch.sin(x[:, :4] * 2) + 0.1 * torch.randn(16, 4, generator=g)


def _stage(name: str, t: int, settings: dict[str, Any]) -> str:
    from optim.zero_one_adam import zero_one_adam_step_kinds

    if name == "zero_one_adam":
        kinds = zero_one_adam_step_kinds(t, settings["var_freeze_step"], settings["var_update_scaler"],
                                         settings["local_step_scaler"], settings["local_step_clipper"])
        return {"variance": "phase 1", "onebit_grad": "phase 1", "sync": "phase 2 sync", "local": "phase 2 local",
                "init": "init"}[kinds[-1]]
    return "init" if t == 1 else "warm-up" if t <= settings["freeze_step"] else "compressed"


def compare_on_rank(rank: int, world_size: int, steps: int) -> dict[str, Any]:
    """Run DeepSpeed's and our optimizer side by side on this rank; per step: max |dp| / max |p|, losses."""
    import deepspeed.runtime.fp16.onebit as ds_onebit

    from optim import OneBitAdam, OneBitLAMB, ZeroOneAdam
    from optim.comm import Comm

    install_adapter()
    comm = Comm()
    ours_classes = {"onebit_adam": OneBitAdam, "onebit_lamb": OneBitLAMB, "zero_one_adam": ZeroOneAdam}
    ds_classes = {"onebit_adam": ds_onebit.OnebitAdam, "onebit_lamb": ds_onebit.OnebitLamb,
                  "zero_one_adam": ds_onebit.ZeroOneAdam}
    results = {}
    for name, settings in CASES.items():
        ds_model, our_model = _model(), _model()
        engine = _Engine()
        ds_opt = ds_classes[name](ds_model.parameters(), deepspeed=engine, bias_correction=False,
                                  comm_backend_name="compressed", **settings)
        extra = {} if name == "onebit_lamb" else {"bucketing": "per_tensor"}  # DS fp32: one call per tensor
        ours = ours_classes[name](our_model.parameters(), mask_zero_variance=False, comm=comm, **extra, **settings)
        rows = []
        for t in range(1, steps + 1):
            x, y = _batch(rank, t)
            losses = []
            for model in (ds_model, our_model):
                model.zero_grad(set_to_none=True)
                loss = (model(x) - y).square().mean()
                loss.backward()
                losses.append(loss.item())
            if engine.enable_backward_allreduce:  # what DeepSpeed's engine does before step() in fp32
                for p in ds_model.parameters():
                    torch.distributed.all_reduce(p.grad)
                    p.grad.div_(world_size)
            ds_opt.step()
            ours.step()
            with torch.no_grad():
                ds_flat = torch.cat([p.reshape(-1) for p in ds_model.parameters()])
                our_flat = torch.cat([p.reshape(-1) for p in our_model.parameters()])
            rows.append(dict(step=t, stage=_stage(name, t, settings), ds_loss=losses[0], our_loss=losses[1],
                             rel_diff=float((ds_flat - our_flat).abs().max() / ds_flat.abs().max()),
                             ds_params=ds_flat.clone(), our_params=our_flat.clone()))
        results[name] = rows
    return results


def summarise(per_rank: list[dict[str, Any]]) -> list[str]:
    """Table lines: per optimizer and stage, the largest relative parameter difference over ranks and steps."""
    lines = ["| optimizer | stage | steps | max rel. param diff (ours vs DS) | DS replicas equal | ours equal |",
             "|---|---|---|---|---|---|"]
    for name in CASES:
        stages: dict[str, list[int]] = {}
        for row in per_rank[0][name]:
            stages.setdefault(row["stage"], []).append(row["step"])
        for stage, stage_steps in stages.items():
            worst = max(per_rank[r][name][t - 1]["rel_diff"] for r in range(len(per_rank)) for t in stage_steps)
            ds_same = all(torch.equal(per_rank[r][name][t - 1]["ds_params"], per_rank[0][name][t - 1]["ds_params"])
                          for r in range(len(per_rank)) for t in stage_steps)
            our_same = all(
                torch.equal(per_rank[r][name][t - 1]["our_params"], per_rank[0][name][t - 1]["our_params"])
                for r in range(len(per_rank)) for t in stage_steps)
            span = f"{stage_steps[0]}-{stage_steps[-1]}" + (f" ({len(stage_steps)})" if "phase 2" in stage else "")
            lines.append(f"| {name} | {stage} | {span} | {worst:.2e} | "
                         f"{'yes' if ds_same else 'no'} | {'yes' if our_same else 'no'} |")
    lines += ["", "| optimizer | step | DS loss (rank 0) | our loss (rank 0) |", "|---|---|---|---|"]
    for name in CASES:
        rows = per_rank[0][name]
        for t in sorted({2, len(rows) // 2, len(rows)}):
            lines.append(f"| {name} | {t} | {rows[t - 1]['ds_loss']:.6f} | {rows[t - 1]['our_loss']:.6f} |")
    return lines


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--world-size", type=int, default=2)
    args = parser.parse_args()
    if not deepspeed_available():
        sys.stderr.write("deepspeed==0.19.6 is not installed: pip install --no-deps deepspeed==0.19.6 hjson msgpack "
                         "ninja psutil py-cpuinfo einops (DS_BUILD_OPS=0)\n")
        return 1
    per_rank = run_on_ranks(compare_on_rank, args.world_size, args.steps)
    sys.stdout.write(f"DeepSpeed 0.19.6 vs ours, fp32, {args.world_size} gloo ranks, {args.steps} steps, "
                     f"settings {CASES}\n\n")
    sys.stdout.write("\n".join(summarise(per_rank)) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
