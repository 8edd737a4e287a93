"""Raw-text corpus sources (files, Hugging Face datasets, the Python docs) as one ordered stream of documents.

A source yields :class:`Document` s in a fixed order (sorted paths, then file order), so that the corpus
pipeline can cut the stream into chunks that do not depend on how many processes prepare it. A document is
raw text plus how to split it into sentences; the splitting itself happens in the preparation workers.

Inputs understood by ``kind: files`` (a list of files and/or directories, walked recursively, sorted):

* plain text (``.txt``, ``.text`` and extensionless files such as WikiExtractor's ``wiki_00``): one document
  per file, or, with ``text_format: google``, Google's ``create_pretraining_data`` layout (one sentence per
  line, a blank line between documents);
* WikiExtractor's ``<doc id=... title=...>...</doc>`` files (detected by content): one document per
  ``<doc>``, the title line dropped;
* JSON lines (``.jsonl``, ``.json``, or detected by a leading ``{``; WikiExtractor ``--json``): one document
  per line, the text under ``text_key``;
* Parquet (``.parquet``) and Arrow IPC (``.arrow``, as in a Hugging Face cache): one document per row;
* any of the text formats compressed as ``.gz`` or ``.bz2``.

``kind: hf`` loads a dataset by name through ``datasets.load_dataset`` (network, e.g.
``wikimedia/wikipedia`` / ``20231101.en``) or a ``save_to_disk`` directory; ``rows_per_document`` groups
sentence-per-row datasets such as ``bookcorpus`` into documents. ``kind: python_docs`` fetches Debian's
``python3.11-doc`` (``apt-get download`` + ``dpkg-deb -x``, no root needed) into a cache directory and
reads its reStructuredText sources: ≈ 500 files, 11 MB, 1.4 M words of real English.

Nothing is skipped silently: a missing path, an unreadable file or a row without text raises
:class:`CorpusError` naming the file.
"""

from __future__ import annotations

import bz2
import gzip
import importlib.metadata
import json
import re
import shutil
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Any, Literal, NamedTuple

from core.errors import UserError
from data.text.demo_corpus import split_sentences

DocFormat = Literal["prose", "lines", "rst"]

_TEXT_SUFFIXES = {".txt", ".text", ""}
_JSON_SUFFIXES = {".jsonl", ".json"}
_TABLE_SUFFIXES = {".parquet", ".arrow"}
_COMPRESSED = {".gz": gzip.open, ".bz2": bz2.open}
_WIKI_DOC = re.compile(r"<doc\b([^>]*)>(.*?)</doc>", re.DOTALL)
_WIKI_TITLE = re.compile(r'title="([^"]*)"')
_RST_ROLE = re.compile(r":[\w:.+-]+:`~?([^`<]*?)(?:\s*<[^`>]*>)?`")  # :func:`~os.path.join <x>` -> os.path.join
_RST_DIRECTIVE = re.compile(r"^\s*\.\.(\s|$)")  # ".. note::", ".. _label:", comments
PYTHON_DOCS_PACKAGE = "python3.11-doc"
PYTHON_DOCS_SOURCES = "usr/share/doc/python3.11/html/_sources"


class CorpusError(UserError, ValueError):
    """Input that cannot become a corpus (missing, unreadable, empty); the message names the file."""


class Document(NamedTuple):
    text: str
    format: DocFormat  # prose: split_sentences; lines: one sentence per line; rst: markup removed, then prose


def __getattr__(name: str) -> str:
    """`SENTENCE_SPLITTER`, read when first asked for: only preparation splits sentences, so importing this module
    (the demo's held-out split does) needs no pysbd."""
    # pysbd: rule-based, pure Python, no data download (NLTK's punkt, which NVIDIA's formatter uses, needs one). Its
    # name and version go into every manifest, so shards split by another splitter are told apart.
    if name == "SENTENCE_SPLITTER":
        return f"pysbd {importlib.metadata.version('pysbd')}"
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


@lru_cache
def _segmenter():
    import pysbd  # here: only preparation workers split sentences

    return pysbd.Segmenter(language="en", clean=False)


def split_prose(prose: str) -> list[str]:
    """Sentences of running text by pysbd, which keeps abbreviations ("U.S.", "e.g.", "Fig. 3") inside them."""
    return _segmenter().segment(prose)


def document_sentences(doc: Document) -> list[str]:
    """The document's sentences, by the rule its format names: blocks and code as in :mod:`data.text.demo_corpus`,
    prose by :func:`split_prose`."""
    if doc.format == "lines":
        return [" ".join(line.split()) for line in doc.text.splitlines() if line.strip()]
    text = doc.text
    if doc.format == "rst":
        text = _RST_ROLE.sub(r"\1", text)
        text = "\n".join("" if _RST_DIRECTIVE.match(line) else line for line in text.splitlines())
    return split_sentences(text, split_prose)


@dataclass(frozen=True)
class SourceConfig:
    """One input of the corpus; a corpus is an ordered list of these (see the module docstring)."""

    kind: Literal["files", "hf", "python_docs"] = "files"
    paths: tuple[str, ...] = ()  # files: files and/or directories
    text_format: Literal["file", "google"] = "file"  # how plain-text files hold documents
    text_key: str = "text"  # JSON / Parquet / Arrow / HF column holding a document's text
    name: str | None = None  # hf: dataset name or a save_to_disk directory
    config: str | None = None  # hf: dataset configuration (e.g. "20231101.en")
    split: str = "train"  # hf
    rows_per_document: int | None = None  # hf: group this many sentence rows into a document (bookcorpus)
    cache_dir: str = "~/.cache/slamb-trainer/python-docs"  # python_docs: where the package is unpacked


def _open_text(path: Path):
    opener = _COMPRESSED.get(path.suffix)
    if opener is not None:
        return opener(path, "rt", encoding="utf-8")
    return path.open(encoding="utf-8")


def _base_suffix(path: Path) -> str:
    return Path(path.stem).suffix if path.suffix in _COMPRESSED else path.suffix


def _is_input_file(path: Path) -> bool:
    if path.name.startswith(".") or not path.is_file():
        return False
    return _base_suffix(path) in _TEXT_SUFFIXES | _JSON_SUFFIXES | (_TABLE_SUFFIXES if path.suffix not in
                                                                    _COMPRESSED else set())


def list_input_files(paths: tuple[str, ...] | list[str]) -> list[Path]:
    """The input files under ``paths`` in a fixed order; a missing path or an empty directory is an error."""
    if not paths:
        raise CorpusError("no input paths given (corpus.sources[].paths is empty)")
    files: list[Path] = []
    for raw in paths:
        path = Path(raw).expanduser()
        if path.is_file():
            files.append(path)
        elif path.is_dir():
            found = sorted(p for p in path.rglob("*") if _is_input_file(p))
            if not found:
                raise CorpusError(f"input directory {path} holds no text, JSON lines, Parquet or Arrow files")
            files.extend(found)
        else:
            raise CorpusError(f"input path does not exist: {path}")
    return files


def _table_documents(path: Path, text_key: str) -> Iterator[Document]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if path.suffix == ".parquet":
            batches = pq.ParquetFile(path).iter_batches(columns=[text_key])
        else:
            try:
                reader = pa.ipc.open_file(path)
                batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
            except pa.ArrowInvalid:
                batches = iter(pa.ipc.open_stream(path))
        for batch in batches:
            if text_key not in batch.schema.names:
                raise CorpusError(f"{path} has no column {text_key!r} (columns: {', '.join(batch.schema.names)})")
            for text in batch.column(text_key).to_pylist():
                if text is None:
                    raise CorpusError(f"{path} has a null {text_key!r} value")
                yield Document(text, "prose")
    except (pa.ArrowInvalid, OSError) as err:
        raise CorpusError(f"cannot read {path}: {err}") from err


def _json_documents(lines: Iterator[str], path: Path, text_key: str) -> Iterator[Document]:
    for line_no, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as err:
            raise CorpusError(f"{path}:{line_no} is not valid JSON: {err}") from err
        if not isinstance(record, dict) or not isinstance(record.get(text_key), str):
            raise CorpusError(f"{path}:{line_no} has no string field {text_key!r}")
        yield Document(record[text_key], "prose")


def _wiki_documents(text: str) -> Iterator[Document]:
    for match in _WIKI_DOC.finditer(text):
        body = match.group(2).strip("\n")
        title = _WIKI_TITLE.search(match.group(1))
        first, _, rest = body.partition("\n")
        if title is not None and first.strip() == title.group(1).strip():
            body = rest  # WikiExtractor repeats the title as the first line; it is not a sentence
        yield Document(body, "prose")


def file_documents(path: Path, text_format: str = "file", text_key: str = "text") -> Iterator[Document]:
    """The documents of one input file (format by suffix, or sniffed for plain-text names)."""
    if _base_suffix(path) in _TABLE_SUFFIXES:
        yield from _table_documents(path, text_key)
        return
    try:
        with _open_text(path) as f:
            if _base_suffix(path) in _JSON_SUFFIXES:
                yield from _json_documents(f, path, text_key)
                return
            text = f.read()
    except (OSError, UnicodeDecodeError, EOFError) as err:
        raise CorpusError(f"cannot read {path}: {err}") from err
    head = text.lstrip()[:5]
    if head.startswith("<doc"):
        yield from _wiki_documents(text)
    elif head.startswith("{"):
        yield from _json_documents(iter(text.splitlines()), path, text_key)
    elif text_format == "google":
        for block in re.split(r"\n[ \t]*\n", text):
            if block.strip():
                yield Document(block, "lines")
    elif text.strip():
        yield Document(text, "prose")


def _hf_dataset(cfg: SourceConfig):
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - datasets is pinned in requirements.txt
        raise CorpusError("kind: hf needs the `datasets` package (pip install datasets)") from err
    if cfg.name is None:
        raise CorpusError("a source with kind: hf needs `name` (a dataset name or a save_to_disk directory)")
    if Path(cfg.name).expanduser().is_dir():
        ds = datasets.load_from_disk(str(Path(cfg.name).expanduser()))
        return ds[cfg.split] if isinstance(ds, datasets.DatasetDict) else ds
    try:
        return datasets.load_dataset(cfg.name, cfg.config, split=cfg.split)
    except Exception as err:  # the hub raises many types (connection, missing config, offline mode)
        raise CorpusError(f"cannot load Hugging Face dataset {cfg.name!r} ({cfg.config}, {cfg.split}): {err}") from err


def fetch_python_docs(cache_dir: str | Path) -> Path:
    """Unpack Debian's ``python3.11-doc`` into ``cache_dir`` (once) and return its rst ``_sources`` directory.

    Uses ``apt-get download`` (no root: it only fetches the ``.deb`` into the working directory) and
    ``dpkg-deb -x``; the unpacked tree is moved into place only when complete.
    """
    cache = Path(cache_dir).expanduser()
    sources = cache / "root" / PYTHON_DOCS_SOURCES
    if sources.is_dir():
        return sources
    for tool in ("apt-get", "dpkg-deb"):
        if shutil.which(tool) is None:
            raise CorpusError(f"python_docs needs `{tool}` (Debian/Ubuntu) to fetch {PYTHON_DOCS_PACKAGE}")
    cache.mkdir(parents=True, exist_ok=True)
    staging = cache / "staging"
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    try:
        subprocess.run(["apt-get", "download", PYTHON_DOCS_PACKAGE], cwd=staging, check=True,
                       capture_output=True, text=True)
        (deb,) = staging.glob(f"{PYTHON_DOCS_PACKAGE}_*.deb")
        subprocess.run(["dpkg-deb", "-x", str(deb), str(staging / "root")], check=True,
                       capture_output=True, text=True)
    except subprocess.CalledProcessError as err:
        raise CorpusError(
            f"fetching {PYTHON_DOCS_PACKAGE} failed ({' '.join(err.cmd)}): {err.stderr.strip()}; "
            "run `apt-get update` first if the package is unknown"
        ) from err
    (staging / "root").rename(cache / "root")
    shutil.rmtree(staging, ignore_errors=True)
    return sources


class CorpusSource:
    """One configured input: its documents in a fixed order, their total size, and a fingerprint for resume."""

    def __init__(self, cfg: SourceConfig) -> None:
        if cfg.kind not in ("files", "hf", "python_docs"):
            raise CorpusError(f"unknown source kind {cfg.kind!r}; known: files, hf, python_docs")
        if cfg.text_format not in ("file", "google"):
            raise CorpusError(f"unknown text_format {cfg.text_format!r}; known: file, google")
        self.cfg = cfg
        self._files: list[Path] | None = None

    def files(self) -> list[Path]:
        if self._files is None:
            if self.cfg.kind == "files":
                self._files = list_input_files(self.cfg.paths)
            elif self.cfg.kind == "python_docs":
                self._files = sorted(fetch_python_docs(self.cfg.cache_dir).rglob("*.rst.txt"))
            else:
                self._files = []
        return self._files

    def total_bytes(self) -> int | None:
        """Size of the input on disk (None for Hugging Face datasets); drives the progress bar."""
        if self.cfg.kind == "hf":
            return None
        return sum(p.stat().st_size for p in self.files())

    def fingerprint(self) -> dict[str, Any]:
        """What identifies this input, so that a resumed preparation refuses changed inputs."""
        if self.cfg.kind == "hf":
            ds = _hf_dataset(self.cfg)
            return {"hf": self.cfg.name, "config": self.cfg.config, "split": self.cfg.split,
                    "rows": len(ds), "fingerprint": getattr(ds, "_fingerprint", None)}
        return {"files": [[str(p), p.stat().st_size] for p in self.files()]}

    def documents(self) -> Iterator[Document]:
        if self.cfg.kind == "hf":
            yield from self._hf_documents()
            return
        for path in self.files():
            if self.cfg.kind == "python_docs":
                with path.open(encoding="utf-8") as f:
                    yield Document(f.read(), "rst")
            else:
                yield from file_documents(path, self.cfg.text_format, self.cfg.text_key)

    def _hf_documents(self) -> Iterator[Document]:
        ds = _hf_dataset(self.cfg)
        if self.cfg.text_key not in ds.column_names:
            raise CorpusError(f"dataset {self.cfg.name!r} has no column {self.cfg.text_key!r} "
                              f"(columns: {', '.join(ds.column_names)})")
        group: list[str] = []
        for batch in ds.select_columns([self.cfg.text_key]).iter(batch_size=1000):
            for text in batch[self.cfg.text_key]:
                if self.cfg.rows_per_document is None:
                    yield Document(text, "prose")
                    continue
                group.append(text)
                if len(group) == self.cfg.rows_per_document:
                    yield Document("\n".join(group), "lines")
                    group = []
        if group:
            yield Document("\n".join(group), "lines")


def source_config(node: Any) -> SourceConfig:
    """A :class:`SourceConfig` from a mapping (Hydra node or dict); unknown keys are an error."""
    known = SourceConfig.__dataclass_fields__
    items = dict(node)
    unknown = sorted(set(items) - set(known))
    if unknown:
        raise CorpusError(f"unknown source option {unknown[0]!r}; options: {', '.join(known)}")
    if "paths" in items:
        items["paths"] = tuple(str(p) for p in items["paths"])
    return SourceConfig(**items)
