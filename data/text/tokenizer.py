"""Load the vendored lower-cased WordPiece tokenizer (the bert-base-uncased vocabulary)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from transformers import BertTokenizerFast

DEFAULT_VOCAB_PATH = Path(__file__).resolve().parent / "vocab" / "bert-base-uncased-vocab.txt"


def load_tokenizer(vocab_path: str | os.PathLike[str] | None = None) -> BertTokenizerFast:
    """Return a lower-casing WordPiece fast tokenizer for ``vocab_path`` (default: the vendored vocab).

    Works offline: it reads one ``vocab.txt``-style file (one token per line) and never touches the hub.
    """
    path = Path(vocab_path) if vocab_path is not None else DEFAULT_VOCAB_PATH
    if not path.is_file():
        raise FileNotFoundError(f"WordPiece vocabulary file not found: {path}")
    with path.open(encoding="utf-8") as f:
        num_lines = sum(1 for _ in f)

    # The path is passed positionally on purpose: in transformers 5, BertTokenizerFast(vocab_file=path)
    # ignores the file and silently builds a 5-token vocabulary. The size check below catches any such trap.
    tokenizer = BertTokenizerFast(str(path), do_lower_case=True)
    if num_lines <= 5 or len(tokenizer) != num_lines:
        raise RuntimeError(
            f"tokenizer built from {path} has {len(tokenizer)} tokens but the file has {num_lines} lines; "
            "the vocabulary file was not loaded correctly"
        )
    return tokenizer


def load_any_tokenizer(path: str | os.PathLike[str] | None = None) -> Any:
    """A vocab.txt (or the vendored vocab) through :func:`load_tokenizer`, or a tokenizer directory (any HF BERT).

    Fine-tuning may start from a published checkpoint whose tokenizer ships as a directory, not one vocab file.
    """
    if path is not None and Path(path).is_dir():
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    return load_tokenizer(path)
