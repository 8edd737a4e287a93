"""A small real-English corpus that ships with every CPython: the ``pydoc`` topic help texts.

``pydoc_data.topics.topics`` holds 79 reference-manual topics (≈ 465 KB of prose, grammar and code
examples). Each topic becomes one document, so next-sentence pairs never cross topics. The text is part of
the interpreter, so the corpus is the same for a given Python version (it changes slightly between
versions, as the documentation does).

Sentence rule (documented because NSP splits A/B at sentence boundaries):

1. A topic is cut into blocks at blank lines.
2. Lines made only of punctuation (heading underlines such as ``*****`` or ``====``, table borders such as
   ``+----+----+``) are dropped.
3. A block is *code-ish* when a line holds a grammar rule (``::=``) or a prompt (``>>>``, ``...``), or when
   its last line does not end like a sentence (``.``, ``!``, ``?`` or ``:``, optionally followed by closing
   quotes or brackets). Each line of a code-ish block is one "sentence": code and tables are line-oriented,
   and joining them would glue unrelated statements together.
4. Otherwise the block is prose: its wrapped lines are joined with spaces and split after ``.``, ``!`` or
   ``?`` when whitespace and then an upper-case letter, a digit, or an opening quote, bracket or ``*``
   follows. Abbreviations such as "e.g." followed by a lower-case word therefore do not split.
   This regex stays for the demo corpus only, whose preparation must stay byte-stable; real corpora pass a
   trained splitter as ``split_prose`` (:mod:`data.corpus.sources`).

Whitespace inside each sentence is collapsed to single spaces; empty sentences are dropped.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from pydoc_data.topics import topics

_PUNCTUATION_ONLY = re.compile(r"^[\s*=\-~^+#|_`'\"]+$")
_BLOCK_SPLIT = re.compile(r"\n[ \t]*\n")
_SENTENCE_END = re.compile(r"[.!?:][\"'”’)\]]*$")
_CODE_MARKERS = re.compile(r"::=|^\s*(>>>|\.\.\.)(\s|$)")
# Split at the whitespace after ., ! or ? (optionally followed by one closing quote or bracket, which stays
# with its sentence) when the next sentence opens with a capital, a digit, or an opening quote/bracket/*.
_SENTENCE_SPLIT = re.compile(r"(?:(?<=[.!?])|(?<=[.!?][\"'”’)\]]))\s+(?=[\"'“‘(\[*]?[A-Z0-9])")


def _is_code_block(lines: list[str]) -> bool:
    if any(_CODE_MARKERS.search(line) for line in lines):
        return True
    return _SENTENCE_END.search(lines[-1].rstrip()) is None


def _split_prose_regex(prose: str) -> list[str]:
    return _SENTENCE_SPLIT.split(prose)


def split_sentences(text: str, split_prose: Callable[[str], list[str]] = _split_prose_regex) -> list[str]:
    """Split one document's text into sentences with the rule in the module docstring (rule 4 is `split_prose`)."""
    sentences: list[str] = []
    for block in _BLOCK_SPLIT.split(text):
        lines = [line for line in block.splitlines() if line.strip() and not _PUNCTUATION_ONLY.match(line)]
        if not lines:
            continue
        if _is_code_block(lines):
            pieces = lines
        else:
            pieces = split_prose(" ".join(line.strip() for line in lines))
        sentences.extend(" ".join(piece.split()) for piece in pieces if piece.strip())
    return sentences


def demo_documents() -> list[list[str]]:
    """Return the pydoc topics as documents (lists of sentences), in sorted topic order.

    Deterministic for a given Python version; empty documents are dropped.
    """
    documents = [split_sentences(topics[name]) for name in sorted(topics)]
    return [doc for doc in documents if doc]
