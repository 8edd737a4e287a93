"""Everything a GPU is needed for, in one command: the GPU tests, the demo on CUDA, BERT-Large (autocast, and O2 with
torch.compile) and Swin-B training throughput, phase 2 on real sequence lengths padded and packed, and the optimizer
steps against their bandwidth bound with a kernel profile, written to one dated Markdown page.

    python -m benchmarks.gpu                          # one GPU, under 9 minutes; the page goes to docs/results/
    python -m benchmarks.gpu --out /tmp/gpu-run --only phase1 phase2
    python -m benchmarks.gpu --only phase1_o2 phase2_o2 phase1_compile phase2_compile step_cost step_compiled
    python -m benchmarks.gpu --dry-run                # the same orchestration on the CPU with tiny sizes

Each part runs in its own process (its own CUDA context and memory) under its own time limit, and all of them under
one budget (`--budget`, 9 minutes): a part that fails, hangs or finds the budget spent is recorded as such, and the
parts after it still run. The page, rewritten after every part, records the device, torch and library versions, the
commit, and per part its command, status, wall time, headline figures and output tail; the full output of every
part goes to a log beside it. No part reaches the network. On a bare GPU machine with torch, carry the project's
pure-Python dependencies as wheels (docs/results/README.md, "Taking the GPU figures").
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from benchmarks.common import REPO

THROUGHPUT = ("python", "-m", "benchmarks.throughput.training")
TIMED = ("--steps", "10", "--warmup", "2")  # half the benchmark's default: the budget holds every part
PHASE1 = (*THROUGHPUT, "--task", "bert", "--seq", "128", "--precision", "bf16", "--micro-batch", "256",
          "--accumulation", "4", *TIMED)
PHASE2 = (*THROUGHPUT, "--task", "bert", "--seq", "512", "--precision", "bf16", "--micro-batch", "32",
          "--accumulation", "8", *TIMED)
O2 = ("--precision", "bf16_o2")  # after PHASE1 / PHASE2's --precision bf16: argparse keeps the last
# O2 holds half the weights' and activations' bytes, so on an 80 GB GPU its micro-batches double: 61 GiB at 512 x 2
# (phase 1) and 128 x 2 (phase 2) on an H100, where phase 2 ran 369 seq/s at 64 x 4 and 378 at 128 x 2 (6f1393c).
O2_PHASE1 = (*PHASE1, *O2, "--micro-batch", "512", "--accumulation", "2")
O2_PHASE2 = (*PHASE2, *O2, "--micro-batch", "128", "--accumulation", "2")
TINY_BERT = ("--device", "cpu", "--steps", "1", "--warmup", "0", "--micro-batch", "2")
TINY_DEMO = ("trainer.device=cpu", "trainer.max_steps=2", "trainer.global_batch_size=4", "trainer.micro_batch_size=4",
             "model.num_hidden_layers=1", "data.dupe_factor=1", "data.heldout_sequences=8", "data.eval_batch_size=8",
             "logger.progress_bar=false")
COMPILED_OPTIMIZERS = ("lamb", "onebit_lamb", "zero_one_adam", "slamb")  # with `compiled=True`: the step_compiled part
THROUGHPUT_FIGURES = r"[\d.]+ (?:seq|img)/s|\d+ tokens/s|MFU [\d.]+%|first step +[\d.]+ s"


@dataclass(frozen=True)
class Part:
    """One measurement: a command run from the repository root, stopped after `limit_s` seconds.

    `smoke` is the same code path on the CPU with tiny sizes (`--dry-run`); `figures` a regular expression whose
    matches in the output are the part's headline. `{tmp}` in a command is a scratch directory of the run. An
    `optional` part runs only when `--only` names it: what measured no gain, or needs no GPU.
    """

    name: str
    what: str
    command: tuple[str, ...]
    limit_s: int
    smoke: tuple[str, ...]
    figures: str = ""
    optional: bool = False


PARTS = [  # in order of what matters most when the budget runs short
    # First the optimizer steps and the GPU tests: the presets take the Triton kernels on a GPU (`triton: null`), and
    # the GPU tests compare them with the aten ops there. Together 255 s on one H100 at d74660f (bandwidth 27 s,
    # step_triton 34 s, gpu_tests 194 s). Each step's top kernels follow its row: where the steps that their bytes
    # do not explain spend their time.
    Part("bandwidth", "optimizer steps against their memory-bandwidth bound, BERT-Large, with their top kernels",
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "large", "--profile", "15"), 90,
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "tiny", "--device", "cpu", "--optimizers",
          "lamb", "--warmup", "1", "--repeats", "1", "--profile", "5"), r"copy bandwidth \d+ GB/s"),
    # The Triton kernels (`triton=True`, the presets' choice on a GPU), beside the aten steps of `bandwidth`, with the
    # top kernels and the host's top functions (the steps a host bounds). On one H100 at d74660f (34 s), x the bound:
    # LAMB 6.95 (1.75 with the host's layout check fixed since), SLAMB 5.45 (its steps waited for a 13 ms mask draw;
    # since 217d325 three draws run at once and one Triton launch gathers w, m and v at S_t), 1-bit LAMB 3.22, 0/1
    # Adam 2.24; 1-bit Adam 2.46 after. AdamW's kernel (`triton: false` in its preset until this row is seen against
    # torch's fused kernel's in `bandwidth`, 1.32x there) is new since. The first step compiles the kernels (seconds).
    Part("step_triton", "LAMB, SLAMB, AdamW and the 1-bit family in their Triton kernels against the "
         "memory-bandwidth bound, BERT-Large",
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "large", "--triton", "--optimizers", "lamb",
          "slamb", "adamw", "onebit_lamb", "zero_one_adam", "onebit_adam", "--profile", "10", "--host-profile", "8"),
         150,
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "tiny", "--device", "cpu", "--triton",
          "--optimizers", "lamb", "--warmup", "0", "--repeats", "1"), r"copy bandwidth \d+ GB/s"),
    # The slowest tests listed (--durations). A test to each worker as it frees (`--dist load`, where the project's
    # pytest settings keep a file on one worker): at d74660f the part took 191 s, at least 152 s of them in
    # tests/integration/test_gpu.py's tests on one worker, with the two 52-55 s resume tests on another.
    Part("gpu_tests", "the GPU tests (`pytest -m gpu`)", ("python", "-m", "pytest", "-m", "gpu", "-q", "-rs", "-n",
                                                         "8", "--dist", "load", "--durations", "8", "{gpu_tests}"),
         240,
         ("python", "-m", "pytest", "-m", "gpu", "-q", "-n", "0", "{gpu_tests}"),
         r"\d+ (?:passed|failed|skipped|errors?)"),
    # autocast beside O2 with torch.compile, the recipes' setting. Compiling the whole model took about 75 s of each
    # part (64ad0e9); the trainer now compiles BERT's layers one by one, one compile for the 24 (the part's "first
    # step" figure holds it). On the CPU the smoke runs eagerly: a compile there takes minutes.
    Part("phase1", "BERT-Large phase 1 (seq 128), bf16 autocast, LAMB", PHASE1, 120,
         (*THROUGHPUT, *TINY_BERT), THROUGHPUT_FIGURES),
    Part("phase1_o2_compile", "BERT-Large phase 1, O2, torch.compile", (*O2_PHASE1, "--compile"), 180,
         (*THROUGHPUT, *O2, *TINY_BERT), THROUGHPUT_FIGURES),
    Part("phase2_o2_compile", "BERT-Large phase 2, O2, torch.compile", (*O2_PHASE2, "--compile"), 180,
         (*THROUGHPUT, "--seq", "512", *O2, *TINY_BERT), THROUGHPUT_FIGURES),
    # Phase 2 on real sequence lengths (the demo corpus's, about 30 % padding), one a row and packed 3 a row as the
    # phase-2 presets pack them: the same rows of 512 positions, so the gain is in sequences/s and real tokens/s.
    Part("phase2_o2_padded", "BERT-Large phase 2, O2, the demo corpus's sequences one a row (padded)",
         (*PHASE2, *O2, "--lengths", "demo"), 120, (*THROUGHPUT, "--seq", "512", *O2, *TINY_BERT, "--lengths", "demo"),
         THROUGHPUT_FIGURES),
    Part("phase2_o2_packed", "BERT-Large phase 2, O2, the same sequences packed 3 a row",
         (*PHASE2, *O2, "--lengths", "demo", "--pack", "3"), 120,
         (*THROUGHPUT, "--seq", "512", *O2, *TINY_BERT, "--lengths", "demo", "--pack", "3"), THROUGHPUT_FIGURES),
    Part("demo", "the demo (`python -m train`) on CUDA", ("python", "-m", "train", "trainer.device=cuda",
                                                          "hydra.run.dir={tmp}/demo"), 120,
         ("python", "-m", "train", "hydra.run.dir={tmp}/demo", *TINY_DEMO), r"eval/loss [\d.]+"),
    Part("swin", "Swin-B (224 px), bf16 autocast, AdamW", (*THROUGHPUT, "--task", "swin", "--precision", "bf16",
                                                           "--micro-batch", "128", *TIMED), 90,
         (*THROUGHPUT, "--task", "swin", *TINY_BERT), THROUGHPUT_FIGURES),
    # Run only when named (--only): O2 without torch.compile measured what compiling adds (+5.4 % and +4.0 % at
    # 64ad0e9); torch.compile under autocast measured no gain (at 6cc3f4d and 64ad0e9); and the step count needs no
    # GPU (docs/results/optimizer-step-cost.md takes it on the CPU).
    # Phase 2 under autocast: 277, 274 and 268 seq/s at 6cc3f4d, 4eaead7 and 64ad0e9; phase 1's autocast part stays
    # the same-run reference of what O2 gains.
    # The whole model compiled as one graph, as the trainer compiled it up to 7bea741 (1,719 and 1,720 seq/s at
    # 6f1393c): what compiling BERT layer by layer costs or gains, in the same run as phase1_o2_compile.
    Part("phase1_o2_compile_whole", "BERT-Large phase 1, O2, the whole model compiled as one graph",
         (*O2_PHASE1, "--compile", "whole"), 180, (*THROUGHPUT, *O2, *TINY_BERT), THROUGHPUT_FIGURES, optional=True),
    Part("phase2", "BERT-Large phase 2 (seq 512), bf16 autocast, LAMB", PHASE2, 120,
         (*THROUGHPUT, "--seq", "512", *TINY_BERT), THROUGHPUT_FIGURES, optional=True),
    Part("phase1_o2", "BERT-Large phase 1, O2 (bf16 weights and activations, fp32 masters), LAMB", O2_PHASE1,
         120, (*THROUGHPUT, *O2, *TINY_BERT), THROUGHPUT_FIGURES, optional=True),
    Part("phase2_o2", "BERT-Large phase 2, O2 (bf16 weights and activations, fp32 masters), LAMB", O2_PHASE2,
         120, (*THROUGHPUT, "--seq", "512", *O2, *TINY_BERT), THROUGHPUT_FIGURES, optional=True),
    Part("phase1_compile", "BERT-Large phase 1, bf16 autocast, torch.compile", (*PHASE1, "--compile"), 180,
         (*THROUGHPUT, *TINY_BERT), THROUGHPUT_FIGURES, optional=True),
    Part("phase2_compile", "BERT-Large phase 2, bf16 autocast, torch.compile", (*PHASE2, "--compile"), 180,
         (*THROUGHPUT, "--seq", "512", *TINY_BERT), THROUGHPUT_FIGURES, optional=True),
    # fp16 O2, as the recipes run it (NVIDIA's dtype, a V100's): the same kernels in fp16, with a dynamic loss scale.
    Part("phase1_fp16_o2_compile", "BERT-Large phase 1, fp16 O2 with loss scaling, torch.compile",
         (*O2_PHASE1, "--precision", "fp16_o2", "--compile"), 180,
         (*THROUGHPUT, "--precision", "fp16_o2", *TINY_BERT), THROUGHPUT_FIGURES, optional=True),
    # The steps compiled by inductor (`compiled=True`), against the bound and beside the eager steps of `bandwidth`:
    # optional, as they lost to the eager steps at 6f1393c on one H100 (LAMB and SLAMB; the 1-bit family won 13 and
    # 24 %), and their first compile took over 240 s there.
    Part("step_compiled", "optimizer steps compiled by inductor against their memory-bandwidth bound, BERT-Large",
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "large", "--compiled", "--optimizers",
          *COMPILED_OPTIMIZERS), 360,
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "tiny", "--device", "cpu", "--compiled",
          "--optimizers", "lamb", "--warmup", "1", "--repeats", "1"), r"copy bandwidth \d+ GB/s", optional=True),
    # The same with inductor's combo kernels (one launch runs many tensors' kernels), for the two steps that a kernel
    # per tensor and pass made slower: compiled LAMB launches about 550 kernels a step where its aten ops launch 313.
    Part("step_compiled_combo", "LAMB and SLAMB compiled with combo kernels against their memory-bandwidth bound",
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "large", "--compiled", "--optimizers", "lamb",
          "slamb", "--inductor", "combo_kernels=True"), 300,
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "tiny", "--device", "cpu", "--compiled",
          "--optimizers", "lamb", "--warmup", "1", "--repeats", "1", "--inductor", "combo_kernels=True"),
         r"copy bandwidth \d+ GB/s", optional=True),
    # The profile alone, of the three steps furthest from their bound (`bandwidth` profiles every step).
    Part("step_profile", "where the steps that their bytes do not explain spend their time: the top kernels",
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "large", "--optimizers", "slamb", "onebit_lamb",
          "zero_one_adam", "--repeats", "3", "--profile", "15"), 90,
         ("python", "-m", "benchmarks.optim.bandwidth_bound", "--size", "tiny", "--device", "cpu", "--optimizers",
          "onebit_lamb", "--warmup", "1", "--repeats", "1", "--profile", "5"), optional=True),
    Part("step_cost", "optimizer steps counted: ops and bytes against one fused pass, BERT-Large, 2 ranks",
         ("python", "-m", "benchmarks.optim.step_cost", "--size", "large", "--ranks", "2"), 90,
         ("python", "-m", "benchmarks.optim.step_cost", "--size", "tiny", "--ranks", "2", "--optimizers", "lamb"),
         optional=True),
]
BUDGET_S = 540  # the whole command's limit, 9 minutes. The default parts took 494 s on one H100 at d74660f: the GPU
# tests 194 s (57 tests), the two compiled parts 47 s each (their first steps, compiling by regions, 13-15 s), the
# other throughput parts 15-38 s, about 20 s of each BERT part building the model and starting up.
OFFLINE = {"HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "WANDB_MODE": "disabled", "PYTHONUNBUFFERED": "1"}
TAIL_LINES = 25
ENVIRONMENT = r"""
import importlib.metadata, json, platform, torch
def version(name):
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "absent"
cuda = torch.cuda.is_available()
print(json.dumps({
    "device": torch.cuda.get_device_name() if cuda else f"cpu ({platform.processor() or platform.machine()})",
    "cuda": torch.version.cuda if cuda else None, "torch": torch.__version__, "python": platform.python_version(),
    "libraries": {name: version(name) for name in ("transformers", "timm", "hydra-core", "pysbd", "apex")},
}))
"""


@dataclass
class Result:
    part: Part
    command: list[str]
    status: str  # ok, failed (exit N), timed out, not run (budget spent)
    seconds: float
    output: str

    @property
    def figures(self) -> str:
        return ", ".join(re.findall(self.part.figures, self.output)) if self.part.figures else ""


def gpu_test_files() -> list[str]:
    """The test files that hold `gpu` tests: `pytest -m gpu` over these alone, so that no other file's imports can
    stop the collection on a machine that has only the runtime packages."""
    return sorted(str(path.relative_to(REPO)) for path in (REPO / "tests").rglob("test_*.py")
                  if "pytest.mark.gpu" in path.read_text())


def command_line(part: Part, dry_run: bool, tmp: Path) -> list[str]:
    """The part's command with its placeholders filled in, as a user would type it (`python` first)."""
    args = []
    for arg in part.smoke if dry_run else part.command:
        args += gpu_test_files() if arg == "{gpu_tests}" else [arg.replace("{tmp}", str(tmp))]
    return args


def run_part(part: Part, args: list[str], limit_s: float, log) -> Result:
    """Run one part in its own process group, so that a time-out also stops the processes it started (pytest
    workers, ranks)."""
    if limit_s <= 0:
        return Result(part, args, "not run (budget spent)", 0.0, "")
    log.write(f"\n===== {part.name}: {' '.join(args)}\n")
    log.flush()
    start = time.monotonic()
    with tempfile.TemporaryFile("w+", errors="replace") as output:
        process = subprocess.Popen([sys.executable, *args[1:]], cwd=REPO, env={**os.environ, **OFFLINE},
                                   stdout=output, stderr=subprocess.STDOUT, start_new_session=True)
        try:
            code = process.wait(timeout=limit_s)
            status = "ok" if code == 0 else f"failed (exit {code})"
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
            status = f"timed out after {limit_s:.0f} s"
        output.seek(0)
        text = output.read()
    log.write(text)
    log.flush()
    return Result(part, args, status, time.monotonic() - start, text)


def environment() -> dict:
    """Device, CUDA, torch and library versions, read in a child process (this one never touches the GPU)."""
    result = subprocess.run([sys.executable, "-c", ENVIRONMENT], cwd=REPO, capture_output=True, text=True,
                            timeout=120)
    if result.returncode != 0:
        return {"device": f"not recorded ({(result.stderr.strip().splitlines() or ['no output'])[-1]})"}
    return json.loads(result.stdout)


def commit() -> tuple[str | None, bool]:
    """The checkout's short commit hash (None outside a git checkout) and whether tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()

    try:
        return git("rev-parse", "--short", "HEAD"), bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.CalledProcessError):
        return None, False


@dataclass(frozen=True)
class Run:
    """What a page's header records about the run."""

    env: dict  # environment()'s answer
    commit: tuple[str | None, bool]  # commit()'s answer
    started: datetime
    argv: list[str]  # the command's arguments
    dry_run: bool

    @property
    def stem(self) -> str:
        """The name of the page (.md) and of the full output beside it (.log): gpu-<date>-<commit>."""
        return f"gpu-{self.started:%Y-%m-%d}-{self.commit[0] or 'run'}"


def page(run: Run, results: list[Result]) -> str:
    """The Markdown page of a run, so far."""
    env, (head, dirty), started = run.env, run.commit, run.started
    recorded_commit = f"`{head}`" + (" with uncommitted changes" if dirty else "") if head else "not recorded"
    libraries = ", ".join(f"{name} {version}" for name, version in env.get("libraries", {}).items())
    cuda = f", CUDA {env['cuda']}" if env.get("cuda") else ""
    total = sum(r.seconds for r in results)
    title = "dry run on the CPU (tiny sizes; times and figures are not measurements)" if run.dry_run else env["device"]
    lines = [
        f"# GPU run: {title}, {started:%Y-%m-%d}", "",
        f"`{' '.join(['python -m benchmarks.gpu', *run.argv])}`", "",
        "| Recorded | |", "|---|---|",
        f"| Device | {env['device']}{cuda} |",
        f"| torch | {env.get('torch', 'not recorded')} (Python {env.get('python', '?')}) |",
        f"| Libraries | {libraries or 'not recorded'} |",
        f"| Commit | {recorded_commit} |",
        f"| Started | {started:%Y-%m-%d %H:%M} UTC |",
        f"| Wall time | {total:.0f} s for {len(results)} parts; full output in `{run.stem}.log` |", "",
        "| Part | Status | Wall time | Figures |", "|---|---|---|---|",
        *(f"| [{r.part.name}](#{r.part.name}) | {r.status} | {r.seconds:.0f} s of "
          f"{r.part.limit_s} s | {r.figures} |" for r in results), "",
    ]
    for r in results:
        tail = "\n".join(r.output.rstrip().splitlines()[-TAIL_LINES:])
        lines += [f"## {r.part.name}", r.part.what + ".", "", "```bash", " ".join(r.command), "```", "",
                  f"{r.status}, {r.seconds:.0f} s.", ""]
        if tail:
            lines += ["```text", tail, "```", ""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for the page and its log (default: docs/results; --dry-run: runs/gpu-dry-run)")
    parser.add_argument("--only", nargs="+", choices=[p.name for p in PARTS], help="run these parts (default: all)")
    parser.add_argument("--budget", type=float, default=BUDGET_S, metavar="SECONDS",
                        help=f"the whole run's limit; a part gets what is left of it if that is less than its own "
                        f"(default {BUDGET_S})")
    parser.add_argument("--dry-run", action="store_true", help="each part's tiny CPU version (minutes in all)")
    args = parser.parse_args(argv)
    if args.dry_run:  # Triton's kernels (LAMB's `triton=True`) run in its interpreter on host tensors, parts inherit it
        os.environ.setdefault("TRITON_INTERPRET", "1")
    deadline = time.monotonic() + args.budget
    out = args.out or REPO / ("runs/gpu-dry-run" if args.dry_run else "docs/results")
    out.mkdir(parents=True, exist_ok=True)
    run = Run(environment(), commit(), datetime.now(timezone.utc), sys.argv[1:] if argv is None else argv,
              args.dry_run)
    page_path, log_path = out / f"{run.stem}.md", out / f"{run.stem}.log"
    parts = [p for p in PARTS if p.name in args.only] if args.only else [p for p in PARTS if not p.optional]
    results: list[Result] = []
    print(f"{len(parts)} parts on {run.env['device']}; page: {page_path}", flush=True)
    with tempfile.TemporaryDirectory() as tmp, log_path.open("w") as log:
        for part in parts:
            limit = min(part.limit_s, deadline - time.monotonic())
            result = run_part(part, command_line(part, args.dry_run, Path(tmp)), limit, log)
            results.append(result)
            page_path.write_text(page(run, results))
            print(f"{part.name:<15} {result.status:<28} {result.seconds:6.0f} s  {result.figures}", flush=True)
    failed = [r.part.name for r in results if r.status != "ok"]
    print(f"page: {page_path}" + (f"; not ok: {', '.join(failed)}" if failed else "; every part ok"))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
