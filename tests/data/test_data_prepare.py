"""Corpus preparation: recipe properties of the shards, equivalence with the in-memory builder, determinism
across seeds and process counts, resume after interruption, input formats and input errors."""

from __future__ import annotations

import bz2
import importlib.metadata
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from helpers.config import REPO
from helpers.corpora import small_config, write_corpus

from data.corpus.pipeline import PhaseConfig, PrepareConfig, chunk_seed, iter_chunks, prepare
from data.corpus.sources import (
    SENTENCE_SPLITTER,
    CorpusError,
    CorpusSource,
    Document,
    SourceConfig,
    document_sentences,
    file_documents,
)
from data.text.masking import IGNORE_INDEX, MLMMasker
from data.text.nsp import RANDOM_SENTENCE
from data.text.pretraining import build_pretraining_dataset
from data.text.shards import MANIFEST_NAME, PARTS_DIR, ShardSet, shard_name


def shard_bytes(directory: Path) -> dict[str, bytes]:
    """Every output file that defines the dataset (shards, records, manifests, vocab), by relative path."""
    return {str(p.relative_to(directory)): p.read_bytes() for p in sorted(directory.rglob("*"))
            if p.is_file() and (p.suffix == ".parquet" or p.parent.name == PARTS_DIR
                                or p.name in ("vocab.txt", MANIFEST_NAME))}


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("prepared")
    prepare(small_config(corpus, out))
    return out


# ----- the recipe ----------------------------------------------------------------------------------------

@pytest.mark.parametrize(("phase", "max_seq_len", "max_predictions"), [("phase1", 64, 10), ("phase2", 128, 20)])
def test_shards_match_the_recipe(prepared, tokenizer, phase, max_seq_len, max_predictions):
    shards = ShardSet(prepared / phase)
    manifest = shards.manifest
    assert (manifest["max_seq_len"], manifest["max_predictions"]) == (max_seq_len, max_predictions)
    assert len(manifest["shards"]) >= 3 and len(shards) == manifest["counts"]["instances"]
    masker = MLMMasker.from_tokenizer(tokenizer, max_predictions=max_predictions)
    lengths, random_next, chosen, eligible, actions = [], 0, 0, 0, {"mask": 0, "random": 0, "keep": 0}
    for i in range(len(shards)):
        inst = shards[i]
        ids = inst.input_ids
        n = len(ids)
        lengths.append(n)
        assert ids[0] == tokenizer.cls_token_id and ids[-1] == tokenizer.sep_token_id
        b_start = int(np.argmax(inst.token_type_ids))
        assert ids[b_start - 1] == tokenizer.sep_token_id and (inst.token_type_ids[b_start:] == 1).all()
        used = inst.masked_lm_labels != IGNORE_INDEX
        k = int(used.sum())
        positions, labels = inst.masked_lm_positions[used], inst.masked_lm_labels[used]
        original = ids.copy()
        original[positions] = labels
        num_eligible = len(masker.eligible_positions(original))
        assert k == masker.num_predictions(num_eligible)  # round(15 %) of the eligible tokens, capped at P
        assert (np.diff(positions) > 0).all() and (inst.masked_lm_positions[~used] == 0).all()
        chosen, eligible = chosen + k, eligible + num_eligible
        actions["mask"] += int((ids[positions] == tokenizer.mask_token_id).sum())
        actions["keep"] += int((ids[positions] == labels).sum())
        random_next += inst.next_sentence_label == RANDOM_SENTENCE
    actions["random"] = chosen - actions["mask"] - actions["keep"]
    lengths = np.array(lengths)
    assert lengths.max() <= max_seq_len and (lengths == max_seq_len).mean() > 0.5  # most fill the target
    assert 0.02 < (lengths < max_seq_len).mean() < 0.5  # short targets (short_seq_prob) and document ends
    assert 0.45 < random_next / len(shards) < 0.6  # 50 % random B (+ single-sentence chunks, always random)
    assert abs(chosen / eligible - 0.15) < 0.01
    assert abs(actions["mask"] / chosen - 0.8) < 0.03
    assert abs(actions["random"] / chosen - 0.1) < 0.03  # a random token can equal the original: ≈ keep
    counts = manifest["counts"]
    assert counts["predictions"] == chosen and counts["random_next"] == random_next
    assert counts["tokens"] == lengths.sum()
    assert counts["documents"] + manifest["heldout"]["documents"] == 40  # the held-out documents are in no shard


def test_each_shard_is_what_build_pretraining_dataset_builds_from_its_chunk(prepared, corpus, tokenizer):
    cfg = small_config(corpus, prepared)
    shards = ShardSet(prepared / "phase2")
    chunks = list(iter_chunks([CorpusSource(SourceConfig(paths=(str(corpus),)))], int(cfg.chunk_mb * 2**20),
                              skip=shards.heldout_record["documents"]))
    assert [len(c.documents) for c in chunks] == [r["chunk_documents"] for r in shards.records]
    start = 0
    for chunk in chunks[:2]:
        reference = build_pretraining_dataset(
            tokenizer, [document_sentences(doc) for doc in chunk.documents], max_seq_len=128,
            max_predictions=20, dupe_factor=2, seed=chunk_seed(7, chunk.index), masking="static")
        assert shards.shard_sizes[chunk.index] == len(reference)
        for i, expected in enumerate(reference.instances):
            got = shards[start + i]
            for field in ("input_ids", "token_type_ids", "masked_lm_positions", "masked_lm_labels"):
                np.testing.assert_array_equal(getattr(got, field), getattr(expected, field))
            assert got.next_sentence_label == expected.next_sentence_label
        start += len(reference)


def test_manifest_records_every_parameter_and_checksum(prepared):
    manifest = json.loads((prepared / "phase1" / MANIFEST_NAME).read_text())
    config = manifest["config"]
    for key in ("dupe_factor", "seed", "masking", "masked_lm_prob", "short_seq_prob", "chunk_mb", "phases",
                "sources", "vocab_path", "train_vocab"):
        assert key in config
    assert manifest["dupe_factor"] == 2 and manifest["masking"] == "static" and manifest["seed"] == 7
    assert manifest["sentence_splitter"] == SENTENCE_SPLITTER
    assert len(manifest["vocab"]["sha256"]) == 64 and manifest["vocab"]["tokens"] == 30522
    assert all(len(r["sha256"]) == 64 for r in manifest["shards"])
    assert manifest["inputs"][0]["files"][0][0].endswith(".txt")


# ----- determinism and resume ----------------------------------------------------------------------------

def test_same_seed_gives_identical_shards_and_another_seed_does_not(prepared, corpus, tmp_path):
    prepare(small_config(corpus, tmp_path / "again"))
    assert shard_bytes(tmp_path / "again") == shard_bytes(prepared)
    prepare(small_config(corpus, tmp_path / "other", seed=8, phases={"phase1": PhaseConfig(64, 10)}))
    assert shard_bytes(tmp_path / "other")["phase1/shard-00000.parquet"] != \
        shard_bytes(prepared)["phase1/shard-00000.parquet"]


@pytest.mark.slow
def test_output_does_not_depend_on_the_number_of_processes(prepared, corpus, tmp_path):
    prepare(small_config(corpus, tmp_path / "two", num_proc=2))
    assert shard_bytes(tmp_path / "two") == shard_bytes(prepared)


def test_rerun_after_interruption_redoes_only_what_is_missing_or_damaged(prepared, corpus, tmp_path):
    out = tmp_path / "resumed"
    shutil.copytree(prepared, out)
    for phase in ("phase1", "phase2"):
        (out / phase / MANIFEST_NAME).unlink()  # killed before the manifests were written
    (out / "phase1" / shard_name(2)).unlink()  # killed before shard 2 was renamed into place
    (out / "phase2" / PARTS_DIR / f"{shard_name(1)}.json").unlink()  # killed between shard 1 and its record
    with open(out / "phase1" / shard_name(0), "r+b") as f:  # damaged after it was finished
        f.truncate(100)
    (out / "phase1" / ".shard-00003.parquet.tmp-999").write_bytes(b"half a shard")
    prepare(small_config(corpus, out))
    assert shard_bytes(out) == shard_bytes(prepared)
    assert not list((out / "phase1").glob(".*.tmp-*"))


@pytest.mark.slow
def test_sigkill_during_preparation_then_rerun_gives_identical_output(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_docs=79)
    args = [f"sources.0.paths=[{corpus}]", "corpus_name=test", "chunk_mb=0.03",
            "num_proc=1", "dupe_factor=3", "progress_bar=false", "heldout_sequences=24"]

    def command(out: Path) -> list[str]:
        return [sys.executable, "-m", "data.prepare", "corpus=text_dir", *args, f"output_dir={out}"]

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    reference = subprocess.run(command(tmp_path / "ref"), cwd=REPO, env=env, capture_output=True, text=True,
                               timeout=300)
    assert reference.returncode == 0, reference.stderr[-3000:]
    out = tmp_path / "killed"
    proc = subprocess.Popen(command(out), cwd=REPO, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.monotonic() + 240
    while len(list((out / "phase2" / PARTS_DIR).glob("*.json"))) < 3:
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline
        time.sleep(0.02)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert not (out / "phase1" / MANIFEST_NAME).exists()
    rerun = subprocess.run(command(out), cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert "resumed:" in rerun.stdout + rerun.stderr
    assert shard_bytes(out) == shard_bytes(tmp_path / "ref")


def test_a_different_config_in_the_same_output_dir_is_refused_naming_the_key(prepared, corpus, tmp_path):
    out = tmp_path / "changed"
    shutil.copytree(prepared, out)
    with pytest.raises(CorpusError, match=rf"^{out} was prepared with dupe_factor=2, this command has dupe_factor=3 "):
        prepare(small_config(corpus, out, dupe_factor=3))


def test_the_command_records_its_config_and_a_refused_rerun_leaves_the_record(corpus, tmp_path):
    out = tmp_path / "out"
    args = [sys.executable, "-m", "data.prepare", "corpus=text_dir", f"sources.0.paths=[{corpus}]", "corpus_name=test",
            "chunk_mb=0.03", "num_proc=1", "dupe_factor=2", "progress_bar=false", "heldout_sequences=24",
            f"output_dir={out}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    done = subprocess.run(args, cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    record = {p.name: p.read_bytes() for p in (out / ".hydra").iterdir()}
    assert set(record) == {"config.yaml", "overrides.yaml"} and b"dupe_factor: 2" in record["config.yaml"]
    refused = subprocess.run([*args, "dupe_factor=3"], cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2
    assert refused.stderr.splitlines() == [f"error: {out} was prepared with dupe_factor=2, this command has "
                                           f"dupe_factor=3 ({out / 'prepare_state.json'}): use another output_dir, "
                                           "rerun with the prepared value, or delete the directory to start over"]
    assert {p.name: p.read_bytes() for p in (out / ".hydra").iterdir()} == record


def test_trained_vocab_is_used_and_recorded(corpus, tmp_path):
    manifests = prepare(small_config(corpus, tmp_path / "tv", train_vocab=True, vocab_size=800,
                                     phases={"phase1": PhaseConfig(64, 10)}, masking="dynamic"))
    manifest = manifests["phase1"]
    vocab_lines = (tmp_path / "tv" / "phase1" / "vocab.txt").read_text().splitlines()
    assert manifest["vocab"]["tokens"] == len(vocab_lines) <= 800 and vocab_lines[:5] == [
        "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"]
    shards = ShardSet(tmp_path / "tv" / "phase1")
    assert shards[0].masked_lm_positions is None  # dynamic masking: stored unmasked
    assert max(int(shards[i].input_ids.max()) for i in range(len(shards))) < len(vocab_lines)


# ----- inputs and input errors ---------------------------------------------------------------------------

def test_input_formats(tmp_path):
    wiki = tmp_path / "AA" / "wiki_00"
    wiki.parent.mkdir()
    wiki.write_text('<doc id="1" url="u" title="Alpha">\nAlpha\n\nAlpha is a letter. It is first.\n</doc>\n'
                    '<doc id="2" url="u" title="Beta">\nBeta\n\nBeta comes second.\n</doc>\n')
    assert [d.text.strip() for d in file_documents(wiki)] == ["Alpha is a letter. It is first.",
                                                              "Beta comes second."]
    jsonl = tmp_path / "docs.jsonl.bz2"
    with bz2.open(jsonl, "wt") as f:
        f.write(json.dumps({"text": "One. Two."}) + "\n\n" + json.dumps({"text": "Three."}) + "\n")
    assert [d.text for d in file_documents(jsonl)] == ["One. Two.", "Three."]
    table = tmp_path / "docs.parquet"
    pq.write_table(pa.table({"body": ["First doc.", "Second doc."]}), table)
    assert [d.text for d in file_documents(table, text_key="body")] == ["First doc.", "Second doc."]
    google = tmp_path / "google.txt"
    google.write_text("Sentence one.\nSentence two.\n\nOther doc.\n")
    docs = list(file_documents(google, text_format="google"))
    assert [document_sentences(d) for d in docs] == [["Sentence one.", "Sentence two."], ["Other doc."]]
    rst = Document("See :func:`os.path.join` for details.\n\n.. note::\n", "rst")
    assert document_sentences(rst) == ["See os.path.join for details."]


def test_missing_input_is_an_error_naming_it(tmp_path):
    with pytest.raises(CorpusError, match=r"does not exist: .*nowhere"):
        prepare(small_config(tmp_path / "nowhere", tmp_path / "out"))


def test_empty_corpus_is_an_error(tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("\n  \n")
    with pytest.raises(CorpusError, match="corpus is empty"):
        prepare(small_config(tmp_path / "empty", tmp_path / "out"))
    (tmp_path / "nothing").mkdir()
    with pytest.raises(CorpusError, match="holds no text"):
        prepare(small_config(tmp_path / "nothing", tmp_path / "out2"))


def test_bad_json_line_and_single_document_are_errors(tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "a.jsonl").write_text('{"text": "fine."}\n{"txt": "no text key"}\n')
    with pytest.raises(CorpusError, match=r"a\.jsonl:2 has no string field 'text'"):
        prepare(small_config(bad, tmp_path / "out"))
    one = tmp_path / "one"
    one.mkdir()
    (one / "a.txt").write_text("Only one document here. It has two sentences.")
    with pytest.raises(CorpusError, match="at least 2"):
        prepare(small_config(one, tmp_path / "out2"))


def test_bad_parameters_name_the_key(corpus, tmp_path):
    with pytest.raises(ValueError, match="dupe_factor=0"):
        prepare(small_config(corpus, tmp_path / "o", dupe_factor=0))
    with pytest.raises(ValueError, match=r"phases\.phase1"):
        prepare(small_config(corpus, tmp_path / "o", phases={"phase1": PhaseConfig(64, 64)}))


def test_real_corpora_split_sentences_with_pysbd_and_record_it():
    assert document_sentences(Document("The U.S. Army was founded in 1775.", "prose")) == [
        "The U.S. Army was founded in 1775."]
    assert document_sentences(Document("See e.g. Fig. 3 for details. Next sentence.", "prose")) == [
        "See e.g. Fig. 3 for details.", "Next sentence."]
    assert f"pysbd {importlib.metadata.version('pysbd')}" == SENTENCE_SPLITTER


def _prepare_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "data.prepare", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize(("args", "line"), [
    (["corpus=python_docs"], "config error: output_dir is not set: give output_dir=... on the command line"),
    ([], "config error: corpus is not set: pick one (corpus=python_docs, "),
    (["corpus=text_dir"], "config error: sources.0.paths is not set: give sources.0.paths=... on the command line"),
    (["corpus=python_docs", "dupe_factr=3"], "config error: Could not override 'dupe_factr': Key 'dupe_factr' not in "),
    (["corpus=python_docs", "+dupe_factr=3"], "config error: dupe_factr is not a key of the config; did you mean "
                                               "dupe_factor?"),
    (["corpus=python_docs", "dupe_factor=x"], "config error: Error merging override dupe_factor=x: Value 'x' of type "),
])
def test_cli_errors_are_one_line_naming_the_key_with_exit_code_2(tmp_path, args, line):
    output_dir = [] if args == ["corpus=python_docs"] else [f"output_dir={tmp_path / 'out'}"]
    result = _prepare_cli(*args, *output_dir)
    assert result.returncode == 2, result.stderr
    assert result.stderr.startswith(line) and len(result.stderr.splitlines()) == 1, result.stderr
    assert not (tmp_path / "out").exists()  # a refusal leaves no directory of its own (not even Hydra's empty log)


def test_a_refusal_leaves_an_existing_output_dir_as_it_was(tmp_path):
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "notes.txt").write_text("mine")
    result = _prepare_cli("corpus=text_dir", f"output_dir={tmp_path / 'out'}")
    assert result.returncode == 2, result.stderr
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["notes.txt", "prepare.log"]


def test_help_lists_every_corpus_and_key():
    result = _prepare_cli("--help")
    assert result.returncode == 0, result.stderr
    corpora, keys = (result.stdout.split(f"== {title}")[1].split("\n\n")[0] for title in ("Corpora", "Keys"))
    assert re.findall(r"^  (\w+) ", corpora, re.MULTILINE) == sorted(p.stem for p in (REPO / "conf" / "prepare" /
                                                                                     "corpus").glob("*.yaml"))
    assert sorted(re.findall(r"^  (\w+) ", keys, re.MULTILINE)) == sorted(f.name for f in fields(PrepareConfig))
