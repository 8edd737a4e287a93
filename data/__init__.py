"""Text pretraining data: vendored WordPiece vocab, demo corpus, NSP pairs, MLM masking, resumable loader."""

from data.demo_corpus import demo_documents
from data.loader import PretrainingLoader, build_pretraining_loader
from data.masking import MLMMasker, masking_rng
from data.nsp import PretrainingInstance, create_nsp_instances
from data.pretraining import (
    BATCH_KEYS,
    PretrainingDataset,
    build_demo_dataset,
    build_pretraining_dataset,
    collate_pretraining_batch,
)
from data.sampler import ResumableDistributedSampler
from data.tokenizer import load_tokenizer

__all__ = [
    "BATCH_KEYS",
    "MLMMasker",
    "PretrainingDataset",
    "PretrainingInstance",
    "PretrainingLoader",
    "ResumableDistributedSampler",
    "build_demo_dataset",
    "build_pretraining_dataset",
    "build_pretraining_loader",
    "collate_pretraining_batch",
    "create_nsp_instances",
    "demo_documents",
    "load_tokenizer",
    "masking_rng",
]
