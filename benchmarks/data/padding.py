"""How much of a BERT batch is padding: the share of phase-1 (seq 128) and phase-2 (seq 512) positions that hold no
token, for the demo corpus and a prepared corpus, beside what create_pretraining_data's rule implies for long
documents (Wikipedia + BooksCorpus, an estimate).

    python -m benchmarks.data.padding                                   # demo + python_docs (prepared in a temp dir)
    python -m benchmarks.data.padding --path data/prepared/python_docs  # a `python -m data.prepare` output_dir
    python -m benchmarks.data.padding --corpus demo

Rows are padded to max_seq_len, so the padding fraction is 1 - real tokens / (sequences x max_seq_len), counted over
every training sequence: the demo corpus as `data=demo` builds it, a prepared corpus from its shards' sequence lengths
(python_docs is prepared with `python -m data.prepare corpus=python_docs` into a temp dir: minutes). The "packed"
column is the padding left when `data.pack_sequences=3` (the phase-2 presets' value) packs the sequences into rows:
1 - real tokens / (rows x max_seq_len), with the plan training uses (data.text.packing).

The estimate runs the project's NSP pairing (Google's create_pretraining_data semantics, data.text.nsp) on documents
far longer than a sequence, as BooksCorpus' books are: a document pass fills every sequence to max_seq_len except
its last, unless (short_seq_prob = 0.1) it draws a shorter target, uniform in [2, max_seq_len - 3], for all its
sequences. Those are many and short, so they weigh more than 10 %. The two cases are run apart and weighted 0.9 /
0.1, which leaves no sampling noise in how many passes draw short. Sentence lengths are geometric with a mean of
17 WordPiece tokens (BooksCorpus: 13 words per sentence, Zhu et al. 2015) or 30 (longer, encyclopaedic sentences).
Wikipedia adds the ends of its documents, most of them shorter than 512 tokens: Krell et al. 2021 (sequence
packing) measured over 50 % padding at seq 512 on the Wikipedia set BERT is pretrained on.
"""

from __future__ import annotations

import argparse
import random
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from benchmarks.common import REPO, demo_pretraining_dataset, markdown_table
from data.text.nsp import create_nsp_instances
from data.text.packing import plan_rows
from data.text.shards import ShardSet, read_manifest, resolve_phase_dir

PHASES = {128: 20, 512: 80}  # max_seq_len: max_predictions, as the BERT phases prepare them
SHORT_SEQ_PROB = 0.1  # create_pretraining_data's default, and conf/prepare's
PACKING_THRESHOLD = 0.15  # phase 2 padding above this makes packing worth building (DESIGN: "pack when large")
SENTENCE_TOKENS = (17, 30)  # mean WordPiece tokens per sentence of the long-document estimate
PACK_SEQUENCES = 3  # most sequences per packed row: conf/experiment/bert_large_phase2.yaml's data.pack_sequences


@dataclass(frozen=True)
class Padding:
    corpus: str
    seq: int
    sequences: float  # the estimate's are expectations
    tokens: float  # real (non-pad) tokens, [CLS] and [SEP] included
    packed: float  # the padding fraction once packed, PACK_SEQUENCES a row

    @property
    def fraction(self) -> float:
        return 1 - self.tokens / (self.sequences * self.seq)

    def row(self) -> dict[str, object]:
        return {"corpus": self.corpus, "seq": self.seq, "sequences": f"{self.sequences:,.0f}",
                "real tokens per sequence": f"{self.tokens / self.sequences:.1f}", "padding": f"{self.fraction:.1%}",
                f"packed ({PACK_SEQUENCES} a row)": f"{self.packed:.1%}"}


def packed_padding(shards: list[np.ndarray], seq: int) -> float:
    """The padding left when each shard's sequences (their lengths) are packed into rows as training packs them."""
    rows = sum(len(plan_rows(lengths, seq, PACK_SEQUENCES, seed=0, key=key)) for key, lengths in enumerate(shards))
    return 1 - sum(int(lengths.sum()) for lengths in shards) / (rows * seq)


def _padding(corpus: str, seq: int, shards: list[np.ndarray]) -> Padding:
    """The padding of sequences of these lengths (one array per shard), unpacked and packed."""
    return Padding(corpus, seq, sum(map(len, shards)), sum(int(s.sum()) for s in shards), packed_padding(shards, seq))


def demo_padding(seq: int) -> Padding:
    """The demo corpus as `data=demo` trains on it (dupe factor 5, short_seq_prob 0.1)."""
    instances = demo_pretraining_dataset(seq).instances
    return _padding("demo", seq, [np.array([len(inst.input_ids) for inst in instances])])


def prepared_padding(path: Path, seq: int) -> Padding:
    """A prepared phase's training shards, from their sequence lengths (each shard read once)."""
    directory = resolve_phase_dir(path, seq)
    shards = ShardSet(directory)
    lengths = [shards.sequence_lengths(shard) for shard in range(len(shards.records))]
    return _padding(read_manifest(directory)["corpus"], seq, lengths)


def prepare_python_docs(workdir: Path) -> Path:
    """`python -m data.prepare corpus=python_docs` into `workdir`, both phases (Debian's python3.11-doc, fetched
    once into the cache)."""
    out = workdir / "python_docs"
    command = [sys.executable, "-m", "data.prepare", "corpus=python_docs", f"output_dir={out}", "progress_bar=false"]
    print("preparing python_docs:", " ".join(command[1:]), flush=True)
    subprocess.run(command, cwd=REPO, check=True)
    return out


def long_document_padding(seq: int, sentence_tokens: int, documents: int = 40, sentences: int = 1000,
                          short_passes: int = 40) -> Padding:
    """Padding the create_pretraining_data rule implies for documents far longer than `seq` (module docstring):
    the sequences and tokens of one pass over the documents, expected over the short-target draws."""
    rng = np.random.default_rng(0)
    docs = [[[1000] * int(n) for n in rng.geometric(1 / sentence_tokens, sentences)] for _ in range(documents)]

    def lengths(short_seq_prob: float, passes: int) -> np.ndarray:
        instances = create_nsp_instances(docs, seq, random.Random(0), cls_id=101, sep_id=102, dupe_factor=passes,
                                         short_seq_prob=short_seq_prob)
        return np.array([len(inst.input_ids) for inst in instances])

    # Every pass full-length, then every pass short; the short targets drawn over several passes, as they vary most.
    full, short = lengths(0.0, 1), lengths(1.0, short_passes)
    weights = np.array([1 - SHORT_SEQ_PROB, SHORT_SEQ_PROB / short_passes])
    sequences, tokens = weights @ [[len(full), full.sum()], [len(short), short.sum()]]
    # Packed: the full pass repeated so that it weighs 0.9 against the short passes' 0.1, as one shard.
    mixed = np.concatenate([np.tile(full, round(short_passes * (1 - SHORT_SEQ_PROB) / SHORT_SEQ_PROB)), short])
    return Padding(f"long documents, {sentence_tokens} tokens per sentence (estimate)", seq, sequences, tokens,
                   packed_padding([mixed], seq))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", nargs="+", choices=["demo", "python_docs"], default=["demo", "python_docs"])
    parser.add_argument("--path", type=Path, help="a prepared output_dir to measure instead of preparing python_docs")
    args = parser.parse_args(argv)
    rows: list[Padding] = []
    with tempfile.TemporaryDirectory() as tmp:
        if "demo" in args.corpus:
            rows += [demo_padding(seq) for seq in PHASES]
        if args.path or "python_docs" in args.corpus:
            prepared = args.path or prepare_python_docs(Path(tmp))
            rows += [prepared_padding(prepared, seq) for seq in PHASES]
    rows += [long_document_padding(seq, tokens) for tokens in SENTENCE_TOKENS for seq in PHASES]
    print(markdown_table([r.row() for r in rows]), end="")
    over = [r.corpus for r in rows if r.seq == 512 and r.fraction > PACKING_THRESHOLD]
    print(f"phase 2 pads more than {PACKING_THRESHOLD:.0%}, past which packing sequences into rows pays, in: "
          f"{'; '.join(over) or 'none'}")


if __name__ == "__main__":
    main()
