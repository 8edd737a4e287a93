"""Corpus preparation throughput per core, and the projected time for Wikipedia + BooksCorpus on a 64-core node.

    python -m benchmarks.data.prepare                        # pydoc topics (465 KB, offline), dupe factor 5
    python -m benchmarks.data.prepare --corpus python_docs   # the 11 MB medium corpus (fetched once)
    python -m benchmarks.data.prepare --dupe-factor 10

One worker process prepares both phases (seq 128 / 20 predictions and seq 512 / 80) with static masking,
exactly as `python -m data.prepare` does. The reference measured in the same run is the WordPiece
tokenisation alone (the Rust `tokenizers` fast path over the same sentences): the ratio says how much of
the time goes to NSP pairing, masking and Parquet writing, which scale with the dupe factor. Chunks are
independent, so the projection assumes linear scaling over cores (the pool keeps every core busy).
"""

from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path
from pydoc_data.topics import topics

from data.corpus.pipeline import PrepareConfig, iter_chunks, prepare
from data.corpus.sources import CorpusSource, document_sentences, source_config
from data.text.pretraining import tokenize_documents
from data.text.tokenizer import load_tokenizer

WIKI_BOOKS_BYTES = 20e9  # ≈ 2.5 B + 0.8 B words of raw text
NODE_CORES = 64


def corpus_source(name: str, workdir: Path) -> dict:
    if name == "python_docs":
        return {"kind": "python_docs"}
    directory = workdir / "pydoc"
    directory.mkdir()
    for topic in sorted(topics):
        (directory / f"{topic}.txt").write_text(topics[topic], encoding="utf-8")
    return {"kind": "files", "paths": [str(directory)]}


def tokenize_only(source: dict) -> tuple[float, int, int]:
    """Seconds, raw bytes and tokens for sentence splitting + tokenisation alone (the reference)."""
    tokenizer = load_tokenizer()
    chunks = list(iter_chunks([CorpusSource(source_config(source))], 2 * 2**20))
    start = time.perf_counter()
    tokens = sum(len(s) for chunk in chunks
                 for doc in tokenize_documents(tokenizer, [document_sentences(d) for d in chunk.documents])
                 for s in doc)
    return time.perf_counter() - start, sum(c.num_bytes for c in chunks), tokens


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", choices=["pydoc", "python_docs"], default="pydoc")
    parser.add_argument("--dupe-factor", type=int, default=5)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        source = corpus_source(args.corpus, Path(tmp))
        ref_seconds, raw_bytes, tokens = tokenize_only(source)
        cfg = PrepareConfig(output_dir=str(Path(tmp) / "out"), corpus_name=args.corpus, sources=[source],
                            dupe_factor=args.dupe_factor, chunk_mb=2.0, num_proc=1, progress_bar=False,
                            heldout_sequences=0)  # the training shards' cost: a small corpus holds too few 512s
        start = time.perf_counter()
        manifests = prepare(cfg)
        seconds = time.perf_counter() - start
    mb = raw_bytes / 1e6
    rows = [("tokenise only (reference)", ref_seconds), (f"full prepare, 2 phases, dupe {args.dupe_factor}", seconds)]
    print(f"corpus: {args.corpus}, {mb:.2f} MB raw text, {tokens:,} WordPiece tokens, 1 process")
    print(f"{'stage':<34} {'seconds':>8} {'MB/s/core':>10} {'tokens/s/core':>14} {'x reference':>12}")
    for name, t in rows:
        print(f"{name:<34} {t:8.2f} {mb / t:10.3f} {tokens / t:14,.0f} {t / ref_seconds:12.1f}")
    for phase, manifest in manifests.items():
        counts = manifest["counts"]
        print(f"  {phase}: {counts['instances']:,} instances ({manifest['max_seq_len']} tokens max), "
              f"{len(manifest['shards'])} shards, {counts['shard_bytes'] / 1e6:.1f} MB of Parquet "
              f"({counts['shard_bytes'] / raw_bytes:.2f} x raw text)")
    rate = mb / seconds  # MB/s per core
    hours = WIKI_BOOKS_BYTES / 1e6 / (rate * NODE_CORES) / 3600
    output_gb = WIKI_BOOKS_BYTES * sum(m["counts"]["shard_bytes"] for m in manifests.values()) / raw_bytes / 1e9
    print(f"projected: Wikipedia + BooksCorpus ({WIKI_BOOKS_BYTES / 1e9:.0f} GB raw) on a {NODE_CORES}-core node "
          f"at {rate:.3f} MB/s/core: {hours:.1f} h (dupe factor {args.dupe_factor}, both phases); "
          f"output ≈ {output_gb:.0f} GB of shards")


if __name__ == "__main__":
    main()
