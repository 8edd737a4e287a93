"""Pretraining shards on disk: atomic Parquet writing, the manifest, and verified random-access reading.

A prepared phase directory holds::

    manifest.json          config, counts, vocab checksum, and one record (rows, bytes, sha256) per shard
    vocab.txt              the WordPiece vocabulary the token ids refer to
    shard-00000.parquet    one shard per input chunk; rows are unpadded instances
    heldout.parquet        the held-out set (:mod:`data.text.heldout`), written like a shard and always masked;
                           the manifest's "heldout" record holds its sha256 (absent: no held-out set)
    .parts/shard-00000.json   the shard's record, written after the shard: the resume marker

Every file is written to a temporary name, fsynced, then renamed, so a killed writer leaves either no shard
or a complete one, and a record exists only for a shard whose bytes it describes. The manifest is written
last; a directory without one is unfinished and cannot be loaded.

Shard schema (one row per instance; the tokens of ``[CLS] A [SEP] B [SEP]`` with no padding):

=======================  ============  ===========================================================
column                   type          meaning
=======================  ============  ===========================================================
``input_ids``            list<int32>   the tokens; masked already when the shards are statically masked
``segment_b``            int32         index of the first token of B (token_type_ids = 1 from there)
``next_sentence_label``  int8          0: B continues A, 1: B is random
``masked_lm_positions``  list<int32>   static masking only: the predicted positions (k <= P, sorted)
``masked_lm_labels``     list<int32>   static masking only: the original ids at those positions
``length``               int32         tokens in ``input_ids``: what packing plans from, read alone
=======================  ============  ===========================================================

Reading (:class:`ShardSet`) checks at open that every shard exists with its recorded size, and checks each
shard's sha256 when it is first loaded (the bytes are read once anyway), so a corrupt, truncated or
swapped shard fails with an error naming the file before any of its rows is used (the held-out file alike, when
it is loaded). :meth:`ShardSet.verify` checks every shard's and the held-out file's sha256 up front
(``data.verify_shards``), so a long run cannot fail hours in on a shard it reaches late.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from core.atomic import atomic_write, atomic_write_json
from core.errors import UserError
from data.text.masking import IGNORE_INDEX
from data.text.nsp import RANDOM_SENTENCE, PretrainingInstance

MANIFEST_NAME = "manifest.json"
VOCAB_NAME = "vocab.txt"
HELDOUT_NAME = "heldout.parquet"
PARTS_DIR = ".parts"
FORMAT_NAME = "slamb-pretraining-shards"
FORMAT_VERSION = 1
_JSON_FORMAT = {"indent": 1, "sort_keys": True}  # how manifests and records are written (stable bytes)


class ShardError(UserError, ValueError):
    """A prepared dataset that cannot be used as is; the message names the file."""


def shard_name(index: int) -> str:
    return f"shard-{index:05d}.parquet"


def sha256_bytes(data: bytes | memoryview) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | os.PathLike[str]) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _list_array(arrays: Sequence[np.ndarray]) -> pa.ListArray:
    lengths = np.fromiter((len(a) for a in arrays), dtype=np.int32, count=len(arrays))
    offsets = np.zeros(len(arrays) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = np.concatenate(arrays).astype(np.int32) if arrays else np.zeros(0, np.int32)
    return pa.ListArray.from_arrays(pa.array(offsets), pa.array(values, type=pa.int32()))


def instances_table(instances: Sequence[PretrainingInstance], masked: bool) -> pa.Table:
    """The Arrow table of a shard (schema in the module docstring); masked slots keep only real predictions."""
    columns: dict[str, pa.Array] = {
        "input_ids": _list_array([inst.input_ids for inst in instances]),
        "segment_b": pa.array([int(np.argmax(inst.token_type_ids)) for inst in instances], type=pa.int32()),
        "next_sentence_label": pa.array([inst.next_sentence_label for inst in instances], type=pa.int8()),
        "length": pa.array([len(inst.input_ids) for inst in instances], type=pa.int32()),
    }
    if masked:
        used = [inst.masked_lm_labels != IGNORE_INDEX for inst in instances]
        pairs = list(zip(instances, used, strict=True))
        columns["masked_lm_positions"] = _list_array([inst.masked_lm_positions[u] for inst, u in pairs])
        columns["masked_lm_labels"] = _list_array([inst.masked_lm_labels[u] for inst, u in pairs])
    return pa.table(columns)


def shard_stats(instances: Sequence[PretrainingInstance], masked: bool) -> dict[str, int]:
    """Counts recorded per shard and summed in the manifest (the recipe checks read them)."""
    stats = {
        "instances": len(instances),
        "tokens": int(sum(len(inst.input_ids) for inst in instances)),
        "random_next": int(sum(inst.next_sentence_label == RANDOM_SENTENCE for inst in instances)),
    }
    if masked:
        stats["predictions"] = int(sum(int((inst.masked_lm_labels != IGNORE_INDEX).sum()) for inst in instances))
    return stats


def write_instances(directory: Path, name: str, instances: Sequence[PretrainingInstance], masked: bool,
                    extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write one Parquet file of instances atomically (shards and the held-out set); return its record."""
    sink = pa.BufferOutputStream()
    pq.write_table(instances_table(instances, masked), sink, compression="zstd", row_group_size=8192)
    data = sink.getvalue()
    atomic_write(directory / name, lambda handle: handle.write(memoryview(data)))
    return {"file": name, "bytes": data.size, "sha256": sha256_bytes(memoryview(data)),
            **shard_stats(instances, masked), **(extra or {})}


def write_shard(directory: Path, index: int, instances: Sequence[PretrainingInstance], masked: bool,
                extra: dict[str, Any] | None = None) -> dict[str, Any]:
    """Write shard ``index`` and then its record (``.parts/``); return the record."""
    name = shard_name(index)
    record = write_instances(directory, name, instances, masked, extra)
    (directory / PARTS_DIR).mkdir(exist_ok=True)
    atomic_write_json(directory / PARTS_DIR / f"{name}.json", record, **_JSON_FORMAT)
    return record


def write_manifest(directory: Path, manifest: dict[str, Any]) -> Path:
    """Write a phase's manifest, last: its presence is what marks the directory finished and loadable."""
    path = directory / MANIFEST_NAME
    atomic_write_json(path, manifest, **_JSON_FORMAT)
    return path


def finished_shard(directory: Path, index: int) -> dict[str, Any] | None:
    """The record of shard ``index`` if it was written completely and its bytes still match, else None."""
    name = shard_name(index)
    part, shard = directory / PARTS_DIR / f"{name}.json", directory / name
    if not part.is_file() or not shard.is_file():
        return None
    record = json.loads(part.read_text())
    if shard.stat().st_size != record["bytes"] or sha256_file(shard) != record["sha256"]:
        return None
    return record


def read_manifest(directory: str | os.PathLike[str]) -> dict[str, Any]:
    """The manifest of a prepared phase directory; clear errors for a missing or unfinished one."""
    directory = Path(directory)
    path = directory / MANIFEST_NAME
    if not directory.is_dir():
        raise ShardError(f"prepared data directory does not exist: {directory}")
    if not path.is_file():
        hint = " (preparation unfinished: rerun the same `python -m data.prepare` command to complete it)" \
            if (directory / PARTS_DIR).is_dir() else ""
        raise ShardError(f"no {MANIFEST_NAME} in {directory}{hint}")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ShardError(f"{path} is not valid JSON: {err}") from err
    if manifest.get("format") != FORMAT_NAME or manifest.get("version") != FORMAT_VERSION:
        raise ShardError(f"{path} is not a {FORMAT_NAME} v{FORMAT_VERSION} manifest")
    return manifest


def check_vocab(manifest: dict[str, Any], directory: Path, vocab_path: str | os.PathLike[str]) -> None:
    """Fail when ``vocab_path`` is not the vocabulary the shards' token ids refer to."""
    digest = sha256_file(vocab_path)
    if digest != manifest["vocab"]["sha256"]:
        raise ShardError(
            f"vocabulary {vocab_path} (sha256 {digest[:12]}…) does not match the one the shards in {directory} "
            f"were prepared with ({directory / VOCAB_NAME}, sha256 {manifest['vocab']['sha256'][:12]}…); "
            "set data.vocab_path to that file or leave it null"
        )


class _DecodedShard:
    """One shard's columns as flat numpy arrays plus offsets, for O(1) row access."""

    def __init__(self, table: pa.Table) -> None:
        def flat(name: str) -> tuple[np.ndarray, np.ndarray]:
            column = table.column(name).combine_chunks()
            return (column.values.to_numpy().astype(np.int64),
                    column.offsets.to_numpy().astype(np.int64))

        self.ids, self.id_offsets = flat("input_ids")
        self.segment_b = table.column("segment_b").to_numpy()
        self.nsp = table.column("next_sentence_label").to_numpy()
        self.masked = "masked_lm_positions" in table.column_names
        if self.masked:
            self.positions, self.pred_offsets = flat("masked_lm_positions")
            self.labels, _ = flat("masked_lm_labels")

    def instance(self, row: int, max_predictions: int) -> PretrainingInstance:
        ids = self.ids[self.id_offsets[row]:self.id_offsets[row + 1]]
        token_type_ids = np.zeros(len(ids), dtype=np.int64)
        token_type_ids[self.segment_b[row]:] = 1
        if not self.masked:
            return PretrainingInstance(ids, token_type_ids, int(self.nsp[row]))
        lo, hi = self.pred_offsets[row], self.pred_offsets[row + 1]
        positions = np.zeros(max_predictions, dtype=np.int64)
        labels = np.full(max_predictions, IGNORE_INDEX, dtype=np.int64)
        positions[:hi - lo] = self.positions[lo:hi]
        labels[:hi - lo] = self.labels[lo:hi]
        return PretrainingInstance(ids, token_type_ids, int(self.nsp[row]), positions, labels)


class ShardSet(Sequence[PretrainingInstance]):
    """The instances of a prepared phase directory as one indexable sequence (global index over shards).

    Decoded shards are kept in a small LRU cache (``cache_shards``); with the loader's shard-blocked order
    (:mod:`data.sampler`) consecutive indices stay within one shard, so each shard is decoded about once
    per epoch per loader worker. Memory: ``cache_shards`` decoded shards (≈ 8 bytes per token).
    """

    def __init__(self, directory: str | os.PathLike[str], cache_shards: int = 2) -> None:
        self.directory = Path(directory)
        self.manifest = read_manifest(self.directory)
        self.records = self.manifest["shards"]
        if not self.records:
            raise ShardError(f"{self.directory / MANIFEST_NAME} lists no shards")
        self.heldout_record: dict[str, Any] | None = self.manifest.get("heldout")  # None: prepared without one
        # Every file the manifest vouches for: the shards, then the held-out set where there is one.
        self.file_records = self.records + ([self.heldout_record] if self.heldout_record else [])
        for record in self.file_records:
            path = self.directory / record["file"]
            if not path.is_file():
                raise ShardError(f"shard {path} listed in the manifest is missing")
            size = path.stat().st_size
            if size != record["bytes"]:
                raise ShardError(f"shard {path} has {size} bytes but the manifest records {record['bytes']} "
                                 "(truncated or replaced)")
        self.shard_sizes = [int(r["instances"]) for r in self.records]
        self._starts = np.concatenate([[0], np.cumsum(self.shard_sizes)])
        self.max_predictions = int(self.manifest["max_predictions"])
        self.cache_shards = max(1, cache_shards)
        self._cache: OrderedDict[int, _DecodedShard] = OrderedDict()

    def __len__(self) -> int:
        return int(self._starts[-1])

    def verify(self) -> None:
        """Check every shard's (and the held-out file's) bytes against its recorded sha256 now, not when training
        or the first evaluation reaches it."""
        for record in self.file_records:
            self._verified_bytes(record)

    def _verified_bytes(self, record: dict[str, Any]) -> bytes:
        """The bytes of one file, a `ShardError` naming it unless they are the ones the manifest records."""
        path = self.directory / record["file"]
        data = path.read_bytes()
        digest = sha256_bytes(data)
        if len(data) != record["bytes"] or digest != record["sha256"]:
            raise ShardError(f"shard {path} is corrupt: sha256 {digest[:12]}… ({len(data)} bytes) but the manifest "
                             f"records {record['sha256'][:12]}… ({record['bytes']} bytes)")
        return data

    def load_shard(self, shard: int) -> _DecodedShard:
        """Read, verify (sha256) and decode one shard; cached."""
        if shard in self._cache:
            self._cache.move_to_end(shard)
            return self._cache[shard]
        decoded = self._decode(self.records[shard])
        self._cache[shard] = decoded
        while len(self._cache) > self.cache_shards:
            self._cache.popitem(last=False)
        return decoded

    def _decode(self, record: dict[str, Any]) -> _DecodedShard:
        """Read, verify (sha256) and decode the file of one record (a shard or the held-out set)."""
        path = self.directory / record["file"]
        data = self._verified_bytes(record)
        try:
            table = pq.read_table(pa.BufferReader(data))
        except (pa.ArrowException, OSError) as err:
            raise ShardError(f"shard {path} cannot be decoded: {err}") from err
        if table.num_rows != record["instances"]:
            raise ShardError(f"shard {path} has {table.num_rows} rows, the manifest records {record['instances']}")
        return _DecodedShard(table)

    def sequence_lengths(self, shard: int) -> np.ndarray:
        """The token count of each row of one shard: what packing plans from, for every shard before training starts.

        Read from the shard's `length` column alone, a small part of the file, so a packed run does not read its
        data twice (its sha256 is checked when training loads the shard); shards written before that column are
        decoded whole (and verified).
        """
        record = self.records[shard]
        path = self.directory / record["file"]
        try:
            with pq.ParquetFile(path) as shard_file:  # its footer, read once: the schema, then the one column
                has_lengths = "length" in shard_file.schema_arrow.names
                if has_lengths:
                    lengths = shard_file.read(columns=["length"]).column("length").to_numpy().astype(np.int64)
        except (pa.ArrowException, OSError) as err:
            raise ShardError(f"shard {path} cannot be decoded: {err}") from err
        if not has_lengths:
            return np.diff(self._decode(record).id_offsets)
        if len(lengths) != record["instances"]:
            raise ShardError(f"shard {path} has {len(lengths)} rows, the manifest records {record['instances']}")
        return lengths

    def heldout_instances(self) -> list[PretrainingInstance] | None:
        """The held-out instances (verified), or None when the directory was prepared without a held-out set."""
        if self.heldout_record is None:
            return None
        decoded = self._decode(self.heldout_record)
        return [decoded.instance(row, self.max_predictions) for row in range(self.heldout_record["instances"])]

    def __getitem__(self, index: int) -> PretrainingInstance:  # type: ignore[override]
        if not 0 <= index < len(self):
            raise IndexError(f"index {index} out of range for {len(self)} instances")
        shard = int(np.searchsorted(self._starts, index, side="right")) - 1
        return self.load_shard(shard).instance(index - int(self._starts[shard]), self.max_predictions)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_cache"] = OrderedDict()  # loader workers start with an empty cache
        return state


def resolve_phase_dir(path: str | os.PathLike[str], max_seq_len: int) -> Path:
    """``path`` itself if it holds a manifest, else its phase subdirectory prepared for ``max_seq_len``."""
    path = Path(path).expanduser()
    if (path / MANIFEST_NAME).is_file() or not path.is_dir():
        return path
    found = {}
    for manifest_path in sorted(path.glob(f"*/{MANIFEST_NAME}")):
        found[manifest_path.parent] = read_manifest(manifest_path.parent)["max_seq_len"]
    for directory, seq_len in found.items():
        if seq_len == max_seq_len:
            return directory
    if found:
        raise ShardError(f"no phase in {path} was prepared for max_seq_len={max_seq_len} (found: "
                         + ", ".join(f"{d.name}={s}" for d, s in found.items()) + ")")
    return path  # read_manifest names what is missing


# Data-config keys that were fixed when the shards were prepared; the training config must agree.
PREPARED_KEYS = ("max_seq_len", "max_predictions", "masking", "masked_lm_prob", "short_seq_prob", "dupe_factor")


def check_prepared_keys(manifest: dict[str, Any], directory: Path, expected: dict[str, Any]) -> None:
    """Fail when the training config's :data:`PREPARED_KEYS` differ from what the shards were prepared with."""
    for key, value in expected.items():
        if key in PREPARED_KEYS and manifest[key] != value:
            raise ShardError(f"data.{key}={value} but the shards in {directory} were prepared with "
                             f"{key}={manifest[key]} ({directory / MANIFEST_NAME})")


def load_prepared_dataset(path: str | os.PathLike[str], tokenizer, vocab_path: str | os.PathLike[str], *,
                          seed: int, cache_shards: int = 2, **expected: Any):
    """A :class:`data.PretrainingDataset` over prepared shards, checked against the training config.

    ``expected`` holds the data config's values of :data:`PREPARED_KEYS`; any that differs from the manifest
    is an error (the shards cannot change after preparation; prep choices move accuracy, so they are never
    silently replaced). ``vocab_path`` must be the vocabulary the shards were prepared with. Dynamic-masking
    shards are masked per epoch with ``masking_rng(seed, epoch, index)``.
    """
    from data.text.masking import MLMMasker
    from data.text.pretraining import PretrainingDataset

    directory = resolve_phase_dir(path, int(expected.get("max_seq_len", 0)))
    shards = ShardSet(directory, cache_shards=cache_shards)
    manifest = shards.manifest
    check_prepared_keys(manifest, directory, expected)
    check_vocab(manifest, directory, vocab_path)
    if len(tokenizer) != manifest["vocab"]["tokens"]:
        raise ShardError(f"the tokenizer has {len(tokenizer)} tokens but {directory / VOCAB_NAME} has "
                         f"{manifest['vocab']['tokens']}")
    masker = MLMMasker.from_tokenizer(tokenizer, masked_lm_prob=manifest["masked_lm_prob"],
                                      max_predictions=manifest["max_predictions"])
    return PretrainingDataset(shards, manifest["max_seq_len"], manifest["max_predictions"], masker=masker,
                              seed=seed, pad_token_id=tokenizer.pad_token_id)


def load_heldout(shards: ShardSet, pad_token_id: int, batch_size: int):
    """The prepared held-out set as a :class:`data.text.heldout.HeldOutText`, or None when there is none (0
    ``heldout_sequences``, or a directory prepared before held-out sets existed: it still trains)."""
    from data.text.heldout import heldout_text

    instances = shards.heldout_instances()
    if instances is None:
        return None
    record = shards.heldout_record
    return heldout_text(instances, int(shards.manifest["max_seq_len"]), shards.max_predictions, pad_token_id,
                        batch_size, record["documents"], record["seed"])
