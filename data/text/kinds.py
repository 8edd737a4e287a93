"""The text-pretraining data kinds `demo` and `shards`: their schema, compose-time check and builder."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING, DictConfig

from core.options import check_choice, check_non_negative, check_positive, check_range, options_of, require
from data._registry import DataKind, DataRequest, TaskData, register_data_kind, require_file


@dataclass
class TextDataConfig:
    """Schema of the text-pretraining data options (conf/data/demo.yaml, shards.yaml, ...)."""

    name: str = MISSING  # demo: the embedded pydoc corpus; shards: `python -m data.prepare` output (data.path)
    max_seq_len: int = MISSING  # tokens per sequence (128 in phase 1, 512 in phase 2)
    max_predictions: int = MISSING  # masked positions per sequence (20 / 80)
    masked_lm_prob: float = MISSING
    short_seq_prob: float = MISSING
    dupe_factor: int = MISSING  # passes over the corpus with different masks and pairings
    masking: str = MISSING  # static (fixed at preparation) or dynamic (redrawn per epoch)
    vocab_path: str | None = MISSING  # null: the vendored bert-base-uncased vocab (shards: the one stored with them)
    num_workers: int = MISSING  # loader worker processes per rank
    # shards only: a prepared output_dir (the phase matching max_seq_len is picked) or one phase directory
    path: str | None = MISSING
    # shards only: check every shard's sha256 before training starts (else each when first read, maybe hours in)
    verify_shards: bool = MISSING
    # demo only: sequences in the held-out set (0: none); shards: null, the size was fixed at preparation
    heldout_sequences: int | None = MISSING
    eval_batch_size: int = MISSING  # held-out sequences per evaluation batch
    # most sequences packed into one row of max_seq_len (data.text.packing); 1: no packing, a row per sequence
    pack_sequences: int = MISSING


def check_text_data(data_cfg: DictConfig, micro_batch_size: int) -> None:
    """Values that cannot work: sizes, probabilities, the masking mode, and shards without a path."""
    with options_of("data"):
        for key in ("max_seq_len", "max_predictions", "dupe_factor", "eval_batch_size"):
            check_positive(key, data_cfg[key])
        require(data_cfg.pack_sequences >= 1, "pack_sequences", data_cfg.pack_sequences,
                "must be the most sequences per row: 1 (no packing) or more")
        check_choice("masking", data_cfg.masking, ("static", "dynamic"))
        check_range("masked_lm_prob", data_cfg.masked_lm_prob, 0.0, 1.0)
        check_range("short_seq_prob", data_cfg.short_seq_prob, 0.0, 1.0)
        require(data_cfg.max_predictions < data_cfg.max_seq_len, "max_predictions", data_cfg.max_predictions,
                f"must be below data.max_seq_len={data_cfg.max_seq_len}")
        if data_cfg.name == "shards":
            require(bool(data_cfg.path), "path", data_cfg.path,
                    "must name a prepared directory (python -m data.prepare output_dir=...)")
            require(data_cfg.heldout_sequences is None, "heldout_sequences", data_cfg.heldout_sequences,
                    "must be null for shards: the held-out set was fixed at preparation "
                    "(python -m data.prepare heldout_sequences=...)")
        else:
            check_non_negative("heldout_sequences", data_cfg.heldout_sequences)


def _loader(dataset, data_cfg: DictConfig, request: DataRequest, shard_sizes=None):
    """This rank's loader over `dataset`, its sequences packed into rows when data.pack_sequences > 1."""
    from data.loader import ResumableLoader

    if data_cfg.pack_sequences > 1:
        from data.text.packing import PackedPretrainingDataset

        dataset = PackedPretrainingDataset(dataset, data_cfg.pack_sequences, request.seed, shard_sizes)
        shard_sizes = dataset.shard_sizes if shard_sizes is not None else None  # rows per shard
    return ResumableLoader(dataset, request.micro_batch_size, request.rank, request.world_size, request.seed,
                           num_workers=data_cfg.num_workers, pin_memory=request.pin_memory, shard_sizes=shard_sizes)


def build_demo_data(data_cfg: DictConfig, request: DataRequest, dry: bool = False) -> TaskData | None:
    """The tokenizer, this rank's loader over the embedded corpus and the held-out set (data.heldout_sequences);
    every rank builds the same instances, and the held-out set does not depend on the run's seed."""
    from data.text.tokenizer import DEFAULT_VOCAB_PATH, load_tokenizer

    if dry:
        require_file(data_cfg.vocab_path or DEFAULT_VOCAB_PATH, "data.vocab_path: WordPiece vocabulary file")
        return None
    from data.text.demo_corpus import demo_documents
    from data.text.heldout import split_demo_documents
    from data.text.pretraining import build_pretraining_dataset

    tokenizer = load_tokenizer(data_cfg.vocab_path)
    documents, held_out = demo_documents(), None
    if data_cfg.heldout_sequences:
        held_out, documents = split_demo_documents(
            tokenizer, documents, data_cfg.heldout_sequences, data_cfg.eval_batch_size,
            max_seq_len=data_cfg.max_seq_len, max_predictions=data_cfg.max_predictions,
            masked_lm_prob=data_cfg.masked_lm_prob, short_seq_prob=data_cfg.short_seq_prob)
    dataset = build_pretraining_dataset(
        tokenizer, documents,
        max_seq_len=data_cfg.max_seq_len,
        max_predictions=data_cfg.max_predictions,
        dupe_factor=data_cfg.dupe_factor,
        seed=request.seed,
        masking=data_cfg.masking,
        masked_lm_prob=data_cfg.masked_lm_prob,
        short_seq_prob=data_cfg.short_seq_prob,
    )
    loader = _loader(dataset, data_cfg, request)
    source = "demo: the embedded pydoc corpus (a smoke test, not a pretraining corpus)"
    return TaskData(train=loader, eval=held_out, tokenizer=tokenizer, source=_described(source, loader, held_out))


def _described(source: str, loader, held_out) -> str:
    """The start-up line names the packing, if any, and the held-out set, or says there is none (evaluation is
    then skipped)."""
    packing = getattr(loader.dataset, "description", None)
    return "; ".join([source, *([packing] if packing else []),
                      held_out.description if held_out is not None else "no held-out set"])


def build_shards_data(data_cfg: DictConfig, request: DataRequest, dry: bool = False) -> TaskData | None:
    """This rank's loader over shards from `python -m data.prepare` (data.path), checked against the config, and
    the held-out set prepared with them (None for shards prepared without one, or by a version before it).

    data.vocab_path null means the vocabulary stored with the shards; an explicit one must match its sha256. The
    dry build (the launching process, before any worker) also checks every shard's sha256 with data.verify_shards.
    """
    from data.text.shards import (
        PREPARED_KEYS,
        VOCAB_NAME,
        ShardSet,
        check_prepared_keys,
        check_vocab,
        load_heldout,
        load_prepared_dataset,
        read_manifest,
        resolve_phase_dir,
    )
    from data.text.tokenizer import load_tokenizer

    require_file(data_cfg.path, "data.path: prepared data directory")
    directory = resolve_phase_dir(data_cfg.path, data_cfg.max_seq_len)
    vocab_path = data_cfg.vocab_path or directory / VOCAB_NAME
    expected = {key: data_cfg[key] for key in PREPARED_KEYS}
    if dry:
        manifest = read_manifest(directory)
        check_prepared_keys(manifest, directory, expected)
        require_file(vocab_path, "data.vocab_path: WordPiece vocabulary file")
        check_vocab(manifest, directory, vocab_path)
        if data_cfg.verify_shards:
            ShardSet(directory).verify()
        return None
    tokenizer = load_tokenizer(vocab_path)
    dataset = load_prepared_dataset(directory, tokenizer, vocab_path, seed=request.seed, **expected)
    # shard_sizes: shard-blocked shuffle, O(#shards) order memory
    loader = _loader(dataset, data_cfg, request, shard_sizes=dataset.instances.shard_sizes)
    held_out = load_heldout(dataset.instances, tokenizer.pad_token_id, data_cfg.eval_batch_size)
    return TaskData(train=loader, eval=held_out, tokenizer=tokenizer,
                    source=_described(f"shards: {directory}", loader, held_out))


register_data_kind(DataKind("demo", TextDataConfig, check_text_data, build_demo_data))
register_data_kind(DataKind("shards", TextDataConfig, check_text_data, build_shards_data))
