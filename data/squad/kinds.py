"""The question-answering data kind `squad`: its schema, compose-time check and builder."""

from __future__ import annotations

from dataclasses import dataclass

from omegaconf import MISSING, DictConfig

from core.options import check_positive, options_of, require
from data._registry import DataKind, DataRequest, TaskData, register_data_kind, require_file


@dataclass
class SquadDataConfig:
    """Schema of the question-answering data options (conf/data/squad*.yaml)."""

    name: str = MISSING  # squad
    train_file: str | None = MISSING  # SQuAD v1.1 JSON; null with hf_dataset set
    dev_file: str | None = MISSING
    hf_dataset: str | None = MISSING  # e.g. "squad": load train/validation with `datasets` (needs the network)
    vocab_path: str | None = MISSING  # a vocab.txt or a tokenizer directory; null: the vendored vocab
    max_seq_len: int = MISSING  # 384
    doc_stride: int = MISSING  # 128
    max_query_len: int = MISSING  # 64
    n_best_size: int = MISSING  # 20
    max_answer_len: int = MISSING  # 30
    eval_batch_size: int = MISSING
    num_workers: int = MISSING


def check_squad_data(data_cfg: DictConfig, micro_batch_size: int) -> None:
    """Window sizes that cannot work, and no data source (neither files nor a hub dataset)."""
    with options_of("data"):
        for key in ("max_seq_len", "doc_stride", "max_query_len", "n_best_size", "max_answer_len",
                    "eval_batch_size"):
            check_positive(key, data_cfg[key])
        if not data_cfg.hf_dataset:
            for key in ("train_file", "dev_file"):
                require(bool(data_cfg[key]), key, data_cfg[key],
                        "must name a SQuAD v1.1 JSON file (or set data.hf_dataset)")
        require(data_cfg.max_query_len + 3 < data_cfg.max_seq_len, "max_query_len", data_cfg.max_query_len,
                f"leaves no context in a window of data.max_seq_len={data_cfg.max_seq_len} ([CLS] q [SEP] ... [SEP])")


def build_squad_data(data_cfg: DictConfig, request: DataRequest, dry: bool = False) -> TaskData | None:
    """SQuAD windows for training (this rank's share) and the dev set for evaluation on rank 0."""
    from data.text.tokenizer import DEFAULT_VOCAB_PATH, load_any_tokenizer

    if dry:
        if not data_cfg.hf_dataset:
            require_file(data_cfg.train_file, "data.train_file: SQuAD file")
            require_file(data_cfg.dev_file, "data.dev_file: SQuAD file")
        require_file(data_cfg.vocab_path or DEFAULT_VOCAB_PATH, "data.vocab_path: vocabulary or tokenizer directory")
        return None
    from data.loader import ResumableLoader
    from data.squad.features import SquadDataset, SquadEvalData, build_features, load_squad, load_squad_hub

    tokenizer = load_any_tokenizer(data_cfg.vocab_path)
    if data_cfg.hf_dataset:
        train_examples = load_squad_hub(data_cfg.hf_dataset, "train")
        dev_examples = load_squad_hub(data_cfg.hf_dataset, "validation")
    else:
        train_examples, dev_examples = load_squad(data_cfg.train_file), load_squad(data_cfg.dev_file)
    windows = dict(max_seq_len=data_cfg.max_seq_len, doc_stride=data_cfg.doc_stride,
                   max_query_len=data_cfg.max_query_len)
    loader = ResumableLoader(
        SquadDataset(build_features(train_examples, tokenizer, **windows)), request.micro_batch_size, request.rank,
        request.world_size, request.seed, num_workers=data_cfg.num_workers, pin_memory=request.pin_memory,
    )
    evaluation = SquadEvalData(dev_examples, build_features(dev_examples, tokenizer, **windows),
                               data_cfg.eval_batch_size, data_cfg.n_best_size, data_cfg.max_answer_len)
    source = f"squad: {data_cfg.hf_dataset or data_cfg.train_file} (eval: {data_cfg.hf_dataset or data_cfg.dev_file})"
    return TaskData(train=loader, eval=evaluation, tokenizer=tokenizer, source=source)


register_data_kind(DataKind("squad", SquadDataConfig, check_squad_data, build_squad_data))
