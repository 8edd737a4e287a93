"""The held-out split of pretraining data: documents held out before pairing, a fixed size and seed, the manifest
record and its checksum, and the errors a user can cause (demo corpus and `python -m data.prepare` alike)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.config import compose
from helpers.corpora import small_config, write_corpus

from data import DataRequest, build_data
from data.corpus.pipeline import PhaseConfig, prepare
from data.corpus.sources import CorpusError, CorpusSource, SourceConfig, document_sentences
from data.text.demo_corpus import demo_documents
from data.text.heldout import DEMO_HELDOUT_SEED, heldout_seed
from data.text.pretraining import BATCH_KEYS, tokenize_documents
from data.text.shards import HELDOUT_NAME, MANIFEST_NAME, ShardError, ShardSet
from data.text.tokenizer import load_tokenizer

GRAM = 10  # a run of this many tokens from a held-out sentence must not occur in training unless the rest has it
DEMO = ["data.max_seq_len=64", "data.max_predictions=10", "data.dupe_factor=1", "data.masking=dynamic"]


def _request(seed: int) -> DataRequest:
    return DataRequest(rank=0, world_size=1, micro_batch_size=4, seed=seed)


def _grams(token_lists) -> set[tuple[int, ...]]:
    return {tuple(t[i:i + GRAM]) for t in token_lists for i in range(len(t) - GRAM + 1)}


def assert_no_heldout_text_in(training_ids, heldout_docs, training_docs) -> None:
    """No GRAM-token run of a held-out sentence is in a training sequence, unless the training documents hold it
    too (pydoc repeats some lines); checked over enough sentences to mean something."""
    trained = _grams(training_ids)
    shared = _grams([[t for s in doc for t in s] for doc in training_docs])
    checked = [tuple(s[:GRAM]) for doc in heldout_docs for s in doc if len(s) >= GRAM]
    checked = [gram for gram in checked if gram not in shared]
    assert len(checked) > 20
    assert not [gram for gram in checked if gram in trained]


def _batches(held_out) -> list[dict[str, torch.Tensor]]:
    return list(held_out.batches())


# ----- the demo corpus -----------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def demo_runs():
    """The demo data of two runs that differ in trainer.seed, with 96 held-out sequences."""
    cfg = compose([*DEMO, "data.heldout_sequences=96", "data.eval_batch_size=40"])
    return [build_data(cfg.data, _request(seed)) for seed in (1, 2)]


def test_demo_holds_out_whole_documents_that_training_never_sees(demo_runs):
    data = demo_runs[0]
    held_out = data.eval
    tokenizer = data.tokenizer
    documents = tokenize_documents(tokenizer, demo_documents())
    assert len(held_out.dataset) == 96 and 2 <= held_out.documents < len(documents) - 2
    assert held_out.description in data.source
    training = [inst.input_ids for inst in data.train.dataset.instances]  # dynamic masking: stored unmasked
    assert_no_heldout_text_in(training, documents[:held_out.documents], documents[held_out.documents:])


def test_demo_heldout_set_does_not_depend_on_the_trainer_seed_and_is_statically_masked(demo_runs):
    first, second = (_batches(data.eval) for data in demo_runs)
    assert [len(b["input_ids"]) for b in first] == [40, 40, 16]
    for a, b in zip(first, second, strict=True):
        assert list(a) == list(BATCH_KEYS)
        for key in BATCH_KEYS:
            assert torch.equal(a[key], b[key])
    assert all((b["masked_lm_labels"] != -100).any(dim=1).all() for b in first)  # masked although masking=dynamic
    assert str(DEMO_HELDOUT_SEED) not in demo_runs[0].eval.description  # a derived seed, not the run's
    assert str(heldout_seed(DEMO_HELDOUT_SEED)) in demo_runs[0].eval.description
    shard = [[0, 2], [5]]  # one rank's share: those samples, in order
    part = list(demo_runs[0].eval.batches(shard))
    assert torch.equal(part[0]["input_ids"], first[0]["input_ids"][[0, 2]])
    assert torch.equal(part[1]["input_ids"], first[0]["input_ids"][[5]])


def test_demo_without_heldout_sequences_has_no_eval():
    data = build_data(compose([*DEMO, "data.heldout_sequences=0"]).data, _request(1))
    assert data.eval is None and "no held-out set" in data.source


def test_demo_heldout_that_leaves_too_few_documents_is_an_error_naming_the_key():
    with pytest.raises(CorpusError, match=r"^heldout_sequences=100000"):
        build_data(compose([*DEMO, "data.heldout_sequences=100000"]).data, _request(1))


@pytest.mark.parametrize(("overrides", "message"), [
    (["data.heldout_sequences=-1"], r"^data\.heldout_sequences=-1 must be"),
    (["data.eval_batch_size=0"], r"^data\.eval_batch_size=0 must be positive"),
])
def test_bad_heldout_values_name_the_key(overrides, message):
    from data import check_data

    cfg = compose(overrides)
    with pytest.raises(ValueError, match=message):
        check_data(cfg.data, 4)


# ----- python -m data.prepare ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    return write_corpus(tmp_path_factory.mktemp("corpus"), num_docs=24)


@pytest.fixture(scope="module")
def prepared(corpus, tmp_path_factory) -> Path:
    """Static phase 1 (seq 64) and phase 2 (seq 128) with 40 held-out sequences, dynamic masking elsewhere."""
    out = tmp_path_factory.mktemp("prepared")
    prepare(small_config(corpus, out, heldout_sequences=40, dupe_factor=1))
    prepare(small_config(corpus, out / "dynamic", heldout_sequences=40, dupe_factor=1, masking="dynamic",
                         phases={"phase1": PhaseConfig(64, 10)}))
    return out


def test_prepared_heldout_is_recorded_and_never_in_a_shard(prepared, corpus):
    tokenizer = load_tokenizer()
    docs = list(CorpusSource(SourceConfig(paths=(str(corpus),))).documents())
    documents = tokenize_documents(tokenizer, [document_sentences(doc) for doc in docs])
    counts = set()
    for phase in ("phase1", "phase2"):
        manifest = json.loads((prepared / phase / MANIFEST_NAME).read_text())
        record = manifest["heldout"]
        assert record["file"] == HELDOUT_NAME and record["sequences"] == record["instances"] == 40
        assert record["seed"] == heldout_seed(7) and len(record["sha256"]) == 64
        assert record["bytes"] == (prepared / phase / HELDOUT_NAME).stat().st_size
        assert manifest["config"]["heldout_sequences"] == 40
        counts.add(record["documents"])
        shards = ShardSet(prepared / phase)
        assert len(shards.heldout_instances()) == 40
        assert manifest["counts"]["documents"] == len(docs) - record["documents"]
    assert len(counts) == 1  # one D for every phase
    training = ShardSet(prepared / "dynamic" / "phase1")  # unmasked: its own D (one phase only)
    held = training.heldout_record["documents"]
    training_ids = [training[i].input_ids for i in range(len(training))]
    assert_no_heldout_text_in(training_ids, documents[:held], documents[held:])


def test_prepared_heldout_is_the_same_for_any_trainer_seed_and_masked_with_dynamic_shards(prepared):
    phase = prepared / "dynamic" / "phase1"
    cfg = compose(["data=shards", f"data.path={phase}", "data.max_seq_len=64", "data.max_predictions=10",
                   "data.dupe_factor=1", "data.masking=dynamic", "data.eval_batch_size=16", "data.num_workers=0"])
    runs = [build_data(cfg.data, _request(seed)) for seed in (1, 2)]
    first, second = (_batches(data.eval) for data in runs)
    assert sum(len(b["input_ids"]) for b in first) == 40 and len(first) == 3
    for a, b in zip(first, second, strict=True):
        assert all(torch.equal(a[key], b[key]) for key in BATCH_KEYS)
    assert all((b["masked_lm_labels"] != -100).any(dim=1).all() for b in first)
    assert runs[0].eval.description in runs[0].source


def test_a_corrupt_heldout_file_fails_naming_it(prepared, tmp_path):
    directory = tmp_path / "phase1"
    shutil.copytree(prepared / "phase1", directory)
    path = directory / HELDOUT_NAME
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(ShardError, match=rf"^shard {path} is corrupt: sha256"):
        ShardSet(directory).verify()
    with pytest.raises(ShardError, match=rf"^shard {path} is corrupt: sha256"):
        ShardSet(directory).heldout_instances()
    path.unlink()
    with pytest.raises(ShardError, match=rf"{path} listed in the manifest is missing"):
        ShardSet(directory)


def test_a_directory_prepared_without_heldout_trains_with_no_eval(prepared, tmp_path):
    directory = tmp_path / "phase1"
    shutil.copytree(prepared / "phase1", directory)
    manifest = json.loads((directory / MANIFEST_NAME).read_text())
    del manifest["heldout"]  # as an older version wrote it
    (directory / MANIFEST_NAME).write_text(json.dumps(manifest))
    cfg = compose(["data=shards", f"data.path={directory}", "data.max_seq_len=64", "data.max_predictions=10",
                   "data.dupe_factor=1", "data.num_workers=0"])
    data = build_data(cfg.data, _request(1))
    assert data.eval is None and len(data.train.dataset) > 0


def test_heldout_sequences_zero_writes_no_heldout(corpus, tmp_path):
    manifests = prepare(small_config(corpus, tmp_path / "none", heldout_sequences=0,
                                     phases={"phase1": PhaseConfig(64, 10)}))
    assert "heldout" not in manifests["phase1"] and not (tmp_path / "none" / "phase1" / HELDOUT_NAME).exists()
    assert manifests["phase1"]["counts"]["documents"] == 24


def test_too_many_heldout_sequences_are_an_error_naming_the_key(tmp_path):
    corpus = write_corpus(tmp_path / "corpus", num_docs=3)
    with pytest.raises(CorpusError, match=r"^heldout_sequences=30 holds out 2 documents and leaves 1 to train on"):
        prepare(small_config(corpus, tmp_path / "out", heldout_sequences=30, phases={"phase1": PhaseConfig(64, 10)}))
    with pytest.raises(CorpusError, match=r"^heldout_sequences=100000: all 3 documents"):
        prepare(small_config(corpus, tmp_path / "out2", heldout_sequences=100000))
    with pytest.raises(ValueError, match=r"^heldout_sequences=-1 must be >= 0"):
        prepare(small_config(corpus, tmp_path / "out3", heldout_sequences=-1))


def test_a_resume_with_another_heldout_size_is_refused(prepared, corpus, tmp_path):
    out = tmp_path / "changed"
    shutil.copytree(prepared, out, ignore=shutil.ignore_patterns("dynamic"))
    with pytest.raises(CorpusError, match=r"was prepared with heldout_sequences=40, this command has "
                                          r"heldout_sequences=41"):
        prepare(small_config(corpus, out, heldout_sequences=41, dupe_factor=1))


def test_heldout_seed_depends_on_the_preparation_seed_only():
    assert heldout_seed(7) == heldout_seed(7) != heldout_seed(8)
    assert np.random.SeedSequence([7, 0]).generate_state(1)[0] != heldout_seed(7)  # not chunk 0's stream
