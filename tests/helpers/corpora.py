"""A small local corpus of real English, and a preparation config for it that runs in seconds."""

from __future__ import annotations

from pathlib import Path
from pydoc_data.topics import topics

from data.corpus.pipeline import PhaseConfig, PrepareConfig

TOPICS = sorted(topics)


def write_corpus(directory: Path, num_docs: int = 40) -> Path:
    """A local corpus: one pydoc topic per .txt file (real English, ≈ 6 KB per document)."""
    directory.mkdir(parents=True, exist_ok=True)
    for name in TOPICS[:num_docs]:
        (directory / f"{name}.txt").write_text(topics[name], encoding="utf-8")
    return directory


def small_config(corpus: Path, output: Path, **overrides) -> PrepareConfig:
    """Two short phases, small chunks (several shards), dupe factor 2, 24 held-out sequences: seconds on one core."""
    cfg = dict(output_dir=str(output), corpus_name="test", sources=[{"kind": "files", "paths": [str(corpus)]}],
               phases={"phase1": PhaseConfig(64, 10), "phase2": PhaseConfig(128, 20)}, dupe_factor=2,
               chunk_mb=0.05, num_proc=1, progress_bar=False, seed=7, heldout_sequences=24)
    cfg.update(overrides)
    return PrepareConfig(**cfg)
