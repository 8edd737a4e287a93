"""Loader throughput over prepared shards: sequences per second for one rank, beside what an A100 consumes.

    python -m benchmarks.data.loader                          # prepares the pydoc corpus in a temp dir
    python -m benchmarks.data.loader --path data/prepared/python_docs --workers 0 2

For seq 128 and 512 it times rank 0 of an 8-rank job (micro-batch 64 / 8, NVIDIA's V100 preset) reading
statically masked shards through `ResumableLoader` (shard-blocked shuffle, sha256-verified shard loads,
padding, collation; worker processes and pinned memory as configured), and the same with dynamic masking,
where the loader also draws the 80/10/10 masks. The reference is the published per-GPU consumption of
NVIDIA's BERT-Large LAMB run on A100-80G (fp16): 580 sequences/s at seq 128 and 210 at seq 512
(NVIDIA DeepLearningExamples' BERT results); a ratio above 1 means one rank's loader outruns its GPU.
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

from data import ResumableLoader
from data.corpus.pipeline import PhaseConfig, PrepareConfig, prepare
from data.text.shards import VOCAB_NAME, load_prepared_dataset, resolve_phase_dir
from data.text.tokenizer import load_tokenizer

A100_SEQ_PER_S = {128: 580, 512: 210}
MICRO_BATCH = {128: 64, 512: 8}
WORLD_SIZE = 8


def prepare_pydoc(workdir: Path, masking: str) -> Path:
    corpus = workdir / "pydoc"
    corpus.mkdir(exist_ok=True)
    for topic in sorted(topics):
        (corpus / f"{topic}.txt").write_text(topics[topic], encoding="utf-8")
    out = workdir / masking
    prepare(PrepareConfig(output_dir=str(out), corpus_name="pydoc",
                          sources=[{"kind": "files", "paths": [str(corpus)]}], masking=masking,
                          phases={"phase1": PhaseConfig(128, 20), "phase2": PhaseConfig(512, 80)},
                          chunk_mb=0.1, num_proc=1, progress_bar=False,
                          heldout_sequences=0))  # the loader reads training shards only
    return out


def sequences_per_second(path: Path, seq_len: int, workers: int, masking: str, seconds: float) -> float:
    directory = resolve_phase_dir(path, seq_len)
    tokenizer = load_tokenizer(directory / VOCAB_NAME)
    manifest_keys = {"max_seq_len": seq_len, "max_predictions": 20 if seq_len == 128 else 80, "masking": masking}
    dataset = load_prepared_dataset(directory, tokenizer, directory / VOCAB_NAME, seed=1, **manifest_keys)
    loader = ResumableLoader(dataset, MICRO_BATCH[seq_len], 0, WORLD_SIZE, seed=1, num_workers=workers,
                               pin_memory=False, shard_sizes=dataset.instances.shard_sizes)
    for _ in range(3):  # warm-up: worker start, first shard decode
        next(loader)
    count, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        count += next(loader)["input_ids"].shape[0]
    rate = count / (time.perf_counter() - start)
    loader.close()
    return rate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--path", type=Path, help="a static-masking prepare output_dir (default: pydoc, prepared)")
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--seconds", type=float, default=3.0)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        paths = {"static": args.path or prepare_pydoc(Path(tmp), "static"),
                 "dynamic": prepare_pydoc(Path(tmp), "dynamic")}
        print(f"rank 0 of {WORLD_SIZE}; reference: NVIDIA BERT-Large LAMB on A100-80G, sequences/s per GPU")
        print(f"{'seq':>4} {'masking':>8} {'workers':>7} {'micro':>6} {'seq/s/rank':>11} {'A100 seq/s':>11} "
              f"{'x A100':>7}")
        for seq_len in (128, 512):
            for masking, path in paths.items():
                for workers in args.workers:
                    rate = sequences_per_second(path, seq_len, workers, masking, args.seconds)
                    gpu = A100_SEQ_PER_S[seq_len]
                    print(f"{seq_len:>4} {masking:>8} {workers:>7} {MICRO_BATCH[seq_len]:>6} {rate:11,.0f} "
                          f"{gpu:11,} {rate / gpu:7.1f}")


if __name__ == "__main__":
    main()
