"""The offline preparation pipeline behind `python -m data.prepare`: raw corpora to phase-1 / phase-2 shards.

The pipeline, per phase (phase 1: seq 128 / 20 predictions, phase 2: seq 512 / 80, as NVIDIA's recipe):

0. Held-out split (``heldout_sequences`` = N > 0, :mod:`data.text.heldout`): the first D documents of the stream
   are held out, D the smallest count whose NSP instances (dupe_factor 1, seed ``heldout_seed(seed)``) number at
   least N in every phase; each phase's first N, always statically masked with that seed, become
   ``<output_dir>/<phase>/heldout.parquet`` (written like a shard) and the manifest's ``"heldout"`` record. No
   sentence of those documents is in any shard.
1. The remaining documents of the sources (:mod:`data.corpus.sources`), read as one ordered stream, are cut into
   chunks of about ``chunk_mb`` MB of raw text (at least two documents each). Chunks depend only on the input (and
   the D it implies), never on the number of processes.
2. Each chunk is prepared by a worker process exactly as :func:`data.text.pretraining.build_pretraining_dataset` would
   prepare those documents with the seed ``chunk_seed(seed, chunk)``: sentences split, lower-cased
   WordPiece tokenisation, NSP pairs (``create_nsp_instances``: 50 % random B from another document *of the
   same chunk*, short_seq_prob, dupe_factor passes) and, with static masking, the 80/10/10 masks of
   ``masking_rng(chunk_seed, 0, i)``. With ``masking: dynamic`` the shards hold unmasked instances and the
   loader draws fresh masks every epoch. As in NVIDIA's sharded create_pretraining_data runs, random
   next segments come from the chunk, which is why chunks are tens of MB (thousands of documents).
3. Chunk ``c`` becomes ``<output_dir>/<phase>/shard-<c>.parquet`` (:mod:`data.text.shards`, atomic writes) in
   every phase; when all chunks are done each phase gets its ``manifest.json`` with the whole config,
   the input fingerprint, counts (of the training shards), the vocab checksum, every shard's sha256 and the
   held-out record (file, bytes, sha256, sequences N, documents D, seed).

Resuming: rerunning the same command recomputes the held-out set (deterministic: the same bytes), skips every chunk
whose shards and records are complete and intact (sha256 re-checked) and redoes the rest; the output (shards,
held-out files, records, manifests, vocabulary) is byte-identical to an uninterrupted run's (the preparation time is
logged, never written into a manifest). A rerun with a different config (``heldout_sequences`` included) or changed
inputs in the same ``output_dir`` is refused (``prepare_state.json``).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import random
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np
from tqdm import tqdm

from core.errors import ConfigError
from data.corpus.sources import (
    SENTENCE_SPLITTER,
    CorpusError,
    CorpusSource,
    Document,
    document_sentences,
    source_config,
)

log = logging.getLogger(__name__)

STATE_NAME = "prepare_state.json"


@dataclass
class PhaseConfig:
    max_seq_len: int = 128  # tokens per sequence, [CLS] A [SEP] B [SEP] included
    max_predictions: int = 20  # masked positions per sequence (static masking) / prediction slots


@dataclass
class PrepareConfig:
    """Every parameter of a preparation; all of it is recorded in each phase's manifest."""

    output_dir: str = "???"  # one subdirectory per phase is written here
    corpus_name: str = "custom"  # recorded in the manifest (wiki_books, python_docs, ...)
    sources: list[Any] = field(default_factory=list)  # data.corpus.sources.SourceConfig mappings, read in order
    phases: dict[str, PhaseConfig] = field(default_factory=lambda: {
        "phase1": PhaseConfig(128, 20), "phase2": PhaseConfig(512, 80)})
    masking: str = "static"  # static: masks fixed in the shards; dynamic: unmasked, the loader masks per epoch
    masked_lm_prob: float = 0.15
    short_seq_prob: float = 0.1  # chance of a shorter target length (Google's create_pretraining_data)
    dupe_factor: int = 5  # passes over each chunk with different pairings and masks
    seed: int = 12345  # the create_pretraining_data default
    heldout_sequences: int = 1000  # held-out sequences per phase, from the first documents (0: no held-out set)
    vocab_path: str | None = None  # null: the vendored bert-base-uncased vocab (ignored with train_vocab)
    train_vocab: bool = False  # train a WordPiece vocab on the corpus (tokenizers' BertWordPieceTokenizer)
    vocab_size: int = 30522  # train_vocab only
    vocab_min_frequency: int = 2  # train_vocab only
    chunk_mb: float = 32.0  # raw text per chunk (= per shard); random next segments come from the chunk
    num_proc: int = 0  # worker processes; 0: one per CPU core. The output does not depend on it
    progress_bar: bool = True


# Keys that do not change the output: a resumed run may use different values.
_RUNTIME_KEYS = ("num_proc", "progress_bar", "output_dir")


def chunk_seed(seed: int, chunk: int) -> int:
    """The seed of chunk ``chunk``: independent streams per chunk from one corpus seed."""
    return int(np.random.SeedSequence([seed, chunk]).generate_state(1)[0])


def validate_prepare_config(cfg: PrepareConfig) -> None:
    """Reject values that cannot work, naming the key, before anything is read or written."""
    def fail(key: str, why: str) -> None:
        raise ConfigError(f"{key}={getattr(cfg, key, None)!r} {why}")

    if cfg.output_dir in ("", "???"):
        fail("output_dir", "must be set (output_dir=/path/to/shards)")
    if not cfg.sources:
        raise ConfigError("corpus is not set: pick one (corpus=python_docs, corpus=wiki_books, or corpus=text_dir "
                          "'sources.0.paths=[DIR]'); python -m data.prepare --help lists them")
    if cfg.masking not in ("static", "dynamic"):
        fail("masking", "must be static or dynamic")
    if not 0.0 < cfg.masked_lm_prob < 1.0:
        fail("masked_lm_prob", "must be in (0, 1)")
    if not 0.0 <= cfg.short_seq_prob <= 1.0:
        fail("short_seq_prob", "must be in [0, 1]")
    for key in ("dupe_factor", "chunk_mb", "vocab_size", "vocab_min_frequency"):
        if getattr(cfg, key) <= 0:
            fail(key, "must be positive")
    if cfg.num_proc < 0:
        fail("num_proc", "must be >= 0 (0: one per CPU core)")
    if cfg.seed < 0:
        fail("seed", "must be non-negative")
    if cfg.heldout_sequences < 0:
        fail("heldout_sequences", "must be >= 0 (0: no held-out set)")
    if not cfg.phases:
        fail("phases", "is empty")
    for name, phase in cfg.phases.items():
        if phase.max_seq_len < 5 or not 0 < phase.max_predictions < phase.max_seq_len:
            raise ConfigError(f"phases.{name}: need max_seq_len >= 5 and 0 < max_predictions < max_seq_len, "
                             f"got {phase.max_seq_len} / {phase.max_predictions}")


# ----- chunking -------------------------------------------------------------------------------------------

@dataclass
class Chunk:
    index: int
    documents: list[Document]
    num_bytes: int


def iter_documents(sources: list[CorpusSource]) -> Iterator[Document]:
    """The document stream: every source's documents in order, blank ones dropped (they make no sentence)."""
    for source in sources:
        for doc in source.documents():
            if doc.text.strip():
                yield doc


def iter_chunks(sources: list[CorpusSource], chunk_bytes: int, skip: int = 0) -> Iterator[Chunk]:
    """Cut the document stream, after its first ``skip`` (held-out) documents, into chunks of >= ``chunk_bytes``
    and >= 2 documents (the last may be larger).

    A chunk is yielded only once the next one has two documents, so a short tail is merged into the last
    chunk instead of becoming a chunk that cannot form random next-sentence pairs.
    """
    held: Chunk | None = None
    current = Chunk(0, [], 0)
    for doc in islice(iter_documents(sources), skip, None):
        current.documents.append(doc)
        current.num_bytes += len(doc.text.encode("utf-8"))
        if held is not None and len(current.documents) == 2:
            yield held
            held = None
        if current.num_bytes >= chunk_bytes and len(current.documents) >= 2:
            held, current = current, Chunk(current.index + 1, [], 0)
    if held is not None:
        if len(current.documents) >= 2:
            yield held
            yield current
            return
        held.documents.extend(current.documents)
        held.num_bytes += current.num_bytes
        yield held
    elif current.documents:
        if len(current.documents) < 2:
            raise CorpusError(f"the corpus has {len(current.documents)} document; next-sentence pairs need at "
                              "least 2 (add documents, or use text_format: google for one file of many)")
        yield current


# ----- the worker ----------------------------------------------------------------------------------------

_TOKENIZERS: dict[str, Any] = {}


def _tokenizer(vocab_path: str):
    if vocab_path not in _TOKENIZERS:
        from data.text.tokenizer import load_tokenizer

        _TOKENIZERS[vocab_path] = load_tokenizer(vocab_path)
    return _TOKENIZERS[vocab_path]


@dataclass(frozen=True)
class _ChunkJob:
    chunk: Chunk
    output_dir: str
    vocab_path: str
    phases: dict[str, tuple[int, int]]  # phase name -> (max_seq_len, max_predictions)
    masking: str
    masked_lm_prob: float
    short_seq_prob: float
    dupe_factor: int
    seed: int


def build_chunk(job: _ChunkJob) -> dict[str, dict[str, Any]]:
    """Prepare one chunk for every phase and write its shards; returns each phase's shard record.

    The instances are those of ``build_pretraining_dataset(tokenizer, sentences, seed=chunk_seed(...))``:
    the same tokenisation, pairing and masking calls, in the same order.
    """
    from data.text.masking import MLMMasker, masking_rng
    from data.text.nsp import create_nsp_instances
    from data.text.pretraining import STATIC_MASKING_EPOCH, mask_instance, tokenize_documents
    from data.text.shards import write_shard

    chunk = job.chunk
    tokenizer = _tokenizer(job.vocab_path)
    documents = [document_sentences(doc) for doc in chunk.documents]
    tokens = tokenize_documents(tokenizer, documents)
    stats = {
        "chunk_documents": len(documents),
        "chunk_sentences": sum(len(d) for d in documents),
        "chunk_words": sum(len(doc.text.split()) for doc in chunk.documents),
        "chunk_raw_bytes": chunk.num_bytes,
        "chunk_corpus_tokens": sum(len(s) for d in tokens for s in d),  # WordPiece tokens of the text
    }
    seed = chunk_seed(job.seed, chunk.index)
    records = {}
    for name, (max_seq_len, max_predictions) in job.phases.items():
        try:
            instances = create_nsp_instances(
                tokens, max_seq_len, random.Random(seed), cls_id=tokenizer.cls_token_id,
                sep_id=tokenizer.sep_token_id, dupe_factor=job.dupe_factor, short_seq_prob=job.short_seq_prob,
            )
        except ValueError as err:
            raise CorpusError(f"chunk {chunk.index}: {err}") from err
        if job.masking == "static":
            masker = MLMMasker.from_tokenizer(tokenizer, masked_lm_prob=job.masked_lm_prob,
                                              max_predictions=max_predictions)
            instances = [mask_instance(inst, masker, masking_rng(seed, STATIC_MASKING_EPOCH, i))
                         for i, inst in enumerate(instances)]
        records[name] = write_shard(Path(job.output_dir) / name, chunk.index, instances,
                                    masked=job.masking == "static", extra={**stats, "chunk_seed": seed})
    return records


# ----- vocab and resume state ----------------------------------------------------------------------------

def train_vocab(sources: list[CorpusSource], path: Path, vocab_size: int, min_frequency: int) -> None:
    """Train a lower-cased WordPiece vocab on the corpus text and write ``vocab.txt`` atomically."""
    from tokenizers import BertWordPieceTokenizer

    from core.atomic import atomic_write_text

    tokenizer = BertWordPieceTokenizer(lowercase=True)
    texts = (doc.text for source in sources for doc in source.documents())
    tokenizer.train_from_iterator(texts, vocab_size=vocab_size, min_frequency=min_frequency,
                                  special_tokens=["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"])
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])
    atomic_write_text(path, "".join(f"{token}\n" for token, _ in vocab))


def _resolve_vocab(cfg: PrepareConfig, sources: list[CorpusSource], out: Path) -> Path:
    from data.text.tokenizer import DEFAULT_VOCAB_PATH

    if not cfg.train_vocab:
        path = Path(cfg.vocab_path).expanduser() if cfg.vocab_path else DEFAULT_VOCAB_PATH
        if not path.is_file():
            raise CorpusError(f"vocabulary file not found: {path} (vocab_path)")
        return path
    path = out / "vocab.txt"
    if not path.is_file():
        log.info("training a %d-token WordPiece vocab on the corpus", cfg.vocab_size)
        train_vocab(sources, path, cfg.vocab_size, cfg.vocab_min_frequency)
    return path


def _check_state(out: Path, state: dict[str, Any]) -> None:
    """Refuse to resume into ``out`` when it was started with another config or other inputs, naming the key."""
    path = out / STATE_NAME
    if not path.is_file():
        from core.atomic import atomic_write_json

        atomic_write_json(path, state, indent=1, sort_keys=True)
        return
    difference = _first_difference(json.loads(path.read_text()), state)
    if difference is not None:
        key, before, now = difference
        key = key.removeprefix("config.")  # config keys as the command line spells them
        raise CorpusError(
            f"{out} was prepared with {key}={json.dumps(before)}, this command has {key}={json.dumps(now)} ({path}): "
            "use another output_dir, rerun with the prepared value, or delete the directory to start over"
        )


def _first_difference(old: Any, new: Any, key: str = "") -> tuple[str, Any, Any] | None:
    """The first dotted key (`config.dupe_factor`, `inputs.0.bytes`) whose value differs, with both values."""
    if isinstance(old, dict) and isinstance(new, dict):
        pairs = [(name, old.get(name), new.get(name)) for name in sorted(set(old) | set(new))]
    elif isinstance(old, list) and isinstance(new, list) and len(old) == len(new):
        pairs = [(str(i), o, n) for i, (o, n) in enumerate(zip(old, new, strict=True))]
    else:
        return None if old == new else (key, old, new)
    for name, o, n in pairs:
        found = _first_difference(o, n, f"{key}.{name}" if key else name)
        if found is not None:
            return found
    return None


def _clean_temporaries(directory: Path) -> None:
    for tmp in directory.glob(".*.tmp-*"):
        tmp.unlink()  # leftovers of a killed writer; never complete files


def _phase_manifest(cfg: PrepareConfig, name: str, phase: PhaseConfig, records: list[dict[str, Any]],
                    vocab: Path, inputs: list[Any], heldout: dict[str, Any] | None) -> dict[str, Any]:
    from data.text.shards import FORMAT_NAME, FORMAT_VERSION, sha256_file

    with vocab.open(encoding="utf-8") as f:
        vocab_tokens = sum(1 for _ in f)
    totals: dict[str, int] = {}
    for record in records:
        for key, value in record.items():
            if key not in ("file", "sha256", "chunk_seed") and isinstance(value, int):
                total = "shard_bytes" if key == "bytes" else key.removeprefix("chunk_")
                totals[total] = totals.get(total, 0) + value
    config = asdict(cfg)
    manifest = {
        "format": FORMAT_NAME,
        "version": FORMAT_VERSION,
        "corpus": cfg.corpus_name,
        "phase": name,
        "max_seq_len": phase.max_seq_len,
        "max_predictions": phase.max_predictions,
        "masking": cfg.masking,
        "masked_lm_prob": cfg.masked_lm_prob,
        "short_seq_prob": cfg.short_seq_prob,
        "dupe_factor": cfg.dupe_factor,
        "seed": cfg.seed,
        "sentence_splitter": SENTENCE_SPLITTER,
        "vocab": {"file": "vocab.txt", "sha256": sha256_file(vocab), "tokens": vocab_tokens, "lowercase": True,
                  "source": "trained on the corpus" if cfg.train_vocab else str(vocab)},
        "counts": totals,
        "random_next_fraction": totals["random_next"] / totals["instances"],
        "config": {k: v for k, v in config.items() if k not in _RUNTIME_KEYS},
        "inputs": inputs,
        "python": sys.version.split()[0],
        "shards": records,
    }
    if heldout is not None:
        manifest["heldout"] = heldout
    return manifest


# ----- the held-out set ---------------------------------------------------------------------------------

def prepare_heldout(cfg: PrepareConfig, sources: list[CorpusSource], vocab: Path,
                    out: Path) -> tuple[int, dict[str, dict[str, Any]]]:
    """Hold out the first documents (:mod:`data.text.heldout`), write each phase's ``heldout.parquet``; return D
    and each phase's manifest record. Recomputed on resume: it depends on the config and input only."""
    from data.text.heldout import check_training_documents, heldout_seed, select_heldout
    from data.text.pretraining import tokenize_documents
    from data.text.shards import HELDOUT_NAME, write_instances

    tokenizer = _tokenizer(str(vocab))
    seed = heldout_seed(cfg.seed)
    stream = iter_documents(sources)
    tokens = (tokenize_documents(tokenizer, [document_sentences(doc)])[0] for doc in stream)
    phases = {name: (p.max_seq_len, p.max_predictions) for name, p in cfg.phases.items()}
    count, sets = select_heldout(tokens, phases, cfg.heldout_sequences, seed, tokenizer,
                                 masked_lm_prob=cfg.masked_lm_prob, short_seq_prob=cfg.short_seq_prob)
    check_training_documents(sum(1 for _ in islice(stream, 2)), count, cfg.heldout_sequences)
    records = {name: write_instances(out / name, HELDOUT_NAME, instances, masked=True,
                                     extra={"sequences": len(instances), "documents": count, "seed": seed})
               for name, instances in sets.items()}
    log.info("held out the first %d documents: %d sequences per phase (seed %d)", count, cfg.heldout_sequences, seed)
    return count, records


# ----- the driver ----------------------------------------------------------------------------------------

def prepare(cfg: PrepareConfig) -> dict[str, dict[str, Any]]:
    """Prepare (or finish preparing) every phase of ``cfg``; returns the manifests by phase name."""
    from data.text.shards import VOCAB_NAME, finished_shard, sha256_file, write_manifest

    validate_prepare_config(cfg)
    start = time.perf_counter()
    sources = [CorpusSource(source_config(s)) for s in cfg.sources]
    inputs = [source.fingerprint() for source in sources]
    out = Path(cfg.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    vocab = _resolve_vocab(cfg, sources, out)
    config = {k: v for k, v in asdict(cfg).items() if k not in _RUNTIME_KEYS}
    _check_state(out, {"config": config, "inputs": inputs, "vocab_sha256": sha256_file(vocab),
                      "sentence_splitter": SENTENCE_SPLITTER})
    for name in cfg.phases:
        (out / name).mkdir(exist_ok=True)
        _clean_temporaries(out / name)
        _clean_temporaries(out / name / ".parts")
        shutil.copyfile(vocab, out / name / VOCAB_NAME)

    num_proc = cfg.num_proc or os.cpu_count() or 1
    total_bytes = [s.total_bytes() for s in sources]
    bar = tqdm(total=sum(total_bytes) if None not in total_bytes else None, unit="B", unit_scale=True,
               desc=f"prepare {cfg.corpus_name}", disable=not cfg.progress_bar, dynamic_ncols=True)
    records: dict[int, dict[str, dict[str, Any]]] = {}
    phases = {name: (p.max_seq_len, p.max_predictions) for name, p in cfg.phases.items()}

    def job(chunk: Chunk) -> _ChunkJob:
        return _ChunkJob(chunk, str(out), str(vocab), phases, cfg.masking, cfg.masked_lm_prob,
                         cfg.short_seq_prob, cfg.dupe_factor, cfg.seed)

    def done(index: int, chunk_records: dict[str, dict[str, Any]], num_bytes: int) -> None:
        records[index] = chunk_records
        bar.update(num_bytes)

    skip, heldout = prepare_heldout(cfg, sources, vocab, out) if cfg.heldout_sequences else (0, {})
    chunks = iter_chunks(sources, int(cfg.chunk_mb * 2**20), skip)
    reused = 0
    if num_proc == 1:
        for chunk in chunks:
            finished = {n: finished_shard(out / n, chunk.index) for n in phases}
            reused += all(finished.values())
            done(chunk.index, finished if all(finished.values()) else build_chunk(job(chunk)), chunk.num_bytes)
    else:
        # spawn: a fresh interpreter per worker (the parent may have used tokenizers' thread pool).
        with multiprocessing.get_context("spawn").Pool(num_proc) as pool:
            pending: deque[tuple[int, int, Any]] = deque()
            for chunk in chunks:
                finished = {n: finished_shard(out / n, chunk.index) for n in phases}
                if all(finished.values()):
                    reused += 1
                    done(chunk.index, finished, chunk.num_bytes)
                    continue
                pending.append((chunk.index, chunk.num_bytes, pool.apply_async(build_chunk, (job(chunk),))))
                while len(pending) >= 2 * num_proc:  # bounded: the corpus never sits in memory whole
                    index, num_bytes, result = pending.popleft()
                    done(index, result.get(), num_bytes)
            while pending:
                index, num_bytes, result = pending.popleft()
                done(index, result.get(), num_bytes)
    bar.close()
    if not records:
        names = "; ".join(json.dumps(s, default=str) for s in cfg.sources)
        raise CorpusError(f"the corpus is empty: no document with text in {names}")
    if reused:
        log.info("resumed: %d of %d chunks were already prepared", reused, len(records))

    manifests = {}
    for name, phase in cfg.phases.items():
        phase_records = [records[i][name] for i in range(len(records))]
        manifest = _phase_manifest(cfg, name, phase, phase_records, vocab, inputs, heldout.get(name))
        write_manifest(out / name, manifest)
        manifests[name] = manifest
        counts = manifest["counts"]
        log.info("%s: %d shards, %d instances, %d documents, %d words, %.1f MB raw text -> %s", name,
                 len(phase_records), counts["instances"], counts["documents"], counts["words"],
                 counts["raw_bytes"] / 1e6, out / name)
    # The time goes to the log, not the manifest: a resumed preparation writes the same bytes as an uninterrupted one.
    log.info("prepared in %.1f s", time.perf_counter() - start)
    return manifests
