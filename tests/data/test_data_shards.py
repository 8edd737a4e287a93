"""Prepared shards at training time: verification errors, the shard-blocked order, and the resumable
distributed loader over shards (disjoint ranks, exact resume, changed world size, a resumed training run)."""

from __future__ import annotations

import json
import shutil
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from helpers.config import TINY
from helpers.corpora import small_config, write_corpus
from helpers.runs import run_train

from data import ResumableLoader
from data.corpus.pipeline import PhaseConfig, prepare
from data.sampler import ShardBlockedOrder
from data.text.masking import masking_rng
from data.text.pretraining import mask_instance
from data.text.shards import MANIFEST_NAME, ShardError, ShardSet, load_prepared_dataset, shard_name
from data.text.tokenizer import DEFAULT_VOCAB_PATH, load_tokenizer

EXPECTED = dict(max_seq_len=64, max_predictions=10, masking="static", masked_lm_prob=0.15, short_seq_prob=0.1,
                dupe_factor=2)


@pytest.fixture(scope="module")
def prepared(tmp_path_factory) -> Path:
    """One static phase (seq 64) and one dynamic-masking phase (seq 32, for tiny training runs)."""
    root = tmp_path_factory.mktemp("shards")
    corpus = write_corpus(root / "corpus", num_docs=30)
    prepare(small_config(corpus, root / "static", phases={"phase1": PhaseConfig(64, 10)}))
    prepare(small_config(corpus, root / "dynamic", phases={"seq32": PhaseConfig(32, 5)}, masking="dynamic",
                         dupe_factor=1))
    return root


def _dataset(directory, tokenizer, seed=0, **changes):
    return load_prepared_dataset(directory, tokenizer, DEFAULT_VOCAB_PATH, seed=seed, **{**EXPECTED, **changes})


def _copy(prepared: Path, tmp_path: Path) -> Path:
    shutil.copytree(prepared / "static" / "phase1", tmp_path / "phase1")
    return tmp_path / "phase1"


# ----- verification errors -------------------------------------------------------------------------------

def test_a_corrupt_shard_fails_when_read_naming_the_file(prepared, tokenizer, tmp_path):
    directory = _copy(prepared, tmp_path)
    path = directory / shard_name(1)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different bytes: only the checksum can tell
    path.write_bytes(bytes(data))
    dataset = _dataset(directory, tokenizer)
    dataset[0]  # shard 0 is intact
    with pytest.raises(ShardError, match=rf"shard .*{shard_name(1)} is corrupt: sha256"):
        dataset[dataset.instances.shard_sizes[0]]


def test_a_corrupt_shard_read_by_a_loader_worker_is_its_one_line_error(prepared, tokenizer, tmp_path):
    """The DataLoader wraps a worker's exception in the worker's traceback; the loader raises the error itself."""
    directory = _copy(prepared, tmp_path)
    path = directory / shard_name(0)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    dataset = _dataset(directory, tokenizer)
    loader = ResumableLoader(dataset, 4, 0, 1, seed=0, num_workers=1, shuffle=False)
    with pytest.raises(ShardError) as info:
        next(loader)
    assert str(info.value).splitlines() == [str(info.value)] and str(info.value).startswith(f"shard {path} is corrupt")
    assert loader.state_dict()["index"] == 0  # nothing was consumed


@pytest.mark.parametrize("verify", [True, False])
def test_verify_shards_checks_every_shard_before_training(prepared, tmp_path, verify):
    """data.verify_shards: the dry build (the launching process) finds a corrupt shard training would reach late."""
    from helpers.config import compose

    from data import DataRequest, build_data

    directory = _copy(prepared, tmp_path)
    path = directory / shard_name(len(ShardSet(directory).records) - 1)  # the last shard: read last
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    cfg = compose(["data=shards", f"data.path={directory}", f"data.verify_shards={verify}",
                   *(f"data.{key}={value}" for key, value in EXPECTED.items())])
    request = DataRequest(rank=0, world_size=1, micro_batch_size=2, seed=0)
    if verify:
        with pytest.raises(ShardError, match=rf"^shard {path} is corrupt: sha256"):
            build_data(cfg.data, request, dry=True)
    else:
        assert build_data(cfg.data, request, dry=True) is None


def test_a_truncated_or_missing_shard_fails_at_open(prepared, tokenizer, tmp_path):
    directory = _copy(prepared, tmp_path)
    with open(directory / shard_name(1), "r+b") as f:
        f.truncate(1000)
    with pytest.raises(ShardError, match=rf"{shard_name(1)} has 1000 bytes but the manifest records"):
        ShardSet(directory)
    (directory / shard_name(1)).unlink()
    with pytest.raises(ShardError, match=rf"shard .*{shard_name(1)} listed in the manifest is missing"):
        ShardSet(directory)


def test_an_unfinished_directory_says_so(prepared, tmp_path):
    directory = _copy(prepared, tmp_path)
    (directory / MANIFEST_NAME).unlink()
    with pytest.raises(ShardError, match="preparation unfinished"):
        ShardSet(directory)
    with pytest.raises(ShardError, match="does not exist"):
        ShardSet(tmp_path / "nowhere")


def test_a_vocab_that_does_not_match_the_shards_fails(prepared, tokenizer, tmp_path):
    other = tmp_path / "vocab.txt"
    lines = (prepared / "static" / "phase1" / "vocab.txt").read_text().splitlines()
    lines[1000], lines[1001] = lines[1001], lines[1000]
    other.write_text("\n".join(lines) + "\n")
    with pytest.raises(ShardError, match=r"vocabulary .*vocab\.txt .* does not match .*phase1"):
        load_prepared_dataset(prepared / "static" / "phase1", load_tokenizer(other), other, seed=0, **EXPECTED)


def test_training_config_must_agree_with_the_manifest(prepared, tokenizer):
    with pytest.raises(ShardError, match=r"data\.dupe_factor=5 but the shards .* dupe_factor=2"):
        _dataset(prepared / "static" / "phase1", tokenizer, dupe_factor=5)
    with pytest.raises(ShardError, match=r"no phase .* max_seq_len=512"):
        _dataset(prepared / "static", tokenizer, max_seq_len=512)
    assert len(_dataset(prepared / "static", tokenizer)) > 0  # the root picks the phase by max_seq_len


def test_dynamic_shards_are_masked_per_epoch_like_pretraining_dataset(prepared, tokenizer):
    directory = prepared / "dynamic" / "seq32"
    dataset = _dataset(directory, tokenizer, seed=5, max_seq_len=32, max_predictions=5, masking="dynamic",
                       dupe_factor=1)
    raw = dataset.instances[3]
    assert raw.masked_lm_positions is None
    for epoch in (0, 1):
        expected = mask_instance(raw, dataset.masker, masking_rng(5, epoch, 3))
        np.testing.assert_array_equal(dataset.get_item(3, epoch)["masked_lm_labels"], expected.masked_lm_labels)
    assert not np.array_equal(dataset.get_item(3, 0)["input_ids"], dataset.get_item(3, 1)["input_ids"])


# ----- the shard-blocked order ---------------------------------------------------------------------------

def test_shard_blocked_order_is_a_blocked_permutation():
    sizes = [5, 9, 1, 7, 3]
    starts = np.concatenate([[0], np.cumsum(sizes)])
    order = ShardBlockedOrder(sizes, seed=3, epoch=0)
    perm = order[np.arange(sum(sizes))]
    assert sorted(perm.tolist()) == list(range(sum(sizes)))
    shard_of = np.searchsorted(starts, perm, side="right") - 1
    assert (np.diff(shard_of) != 0).sum() == len(sizes) - 1  # each shard's rows are contiguous in the epoch
    assert shard_of[0] == order.shard_order[0] and list(dict.fromkeys(shard_of)) == order.shard_order.tolist()
    again = ShardBlockedOrder(sizes, seed=3, epoch=0)
    assert np.array_equal(again[np.array([20, 2, 11])], perm[[20, 2, 11]])  # any positions, in any order
    assert not np.array_equal(ShardBlockedOrder(sizes, seed=3, epoch=1)[np.arange(25)], perm)
    assert np.array_equal(ShardBlockedOrder(sizes, seed=3, epoch=0, shuffle=False)[np.arange(25)], np.arange(25))


# ----- the loader over shards ----------------------------------------------------------------------------

def _loader(dataset, rank, world, batch=4, **kw):
    return ResumableLoader(dataset, batch, rank, world, seed=9, shard_sizes=dataset.instances.shard_sizes, **kw)


def _ids(batch) -> list[tuple[int, ...]]:
    return [tuple(row.tolist()) for row in batch["input_ids"]]


def test_ranks_read_disjoint_parts_covering_the_epoch(prepared, tokenizer):
    dataset = _dataset(prepared / "static" / "phase1", tokenizer)
    world, batch = 3, 4
    loaders = [_loader(dataset, r, world, batch) for r in range(world)]
    steps = loaders[0].batches_per_epoch
    seen = [row for loader in loaders for _ in range(steps) for row in _ids(next(loader))]
    assert len(seen) == steps * batch * world == loaders[0].samples_per_epoch
    everything = [tuple(dataset[i]["input_ids"].tolist()) for i in range(len(dataset))]
    # Disjoint: no row is read twice beyond how often it occurs in the dataset (dupe passes can repeat text).
    assert not Counter(seen) - Counter(everything)
    assert all(loader.state_dict()["epoch"] == 1 for loader in loaders)


def test_state_round_trip_continues_with_the_exact_next_batch(prepared, tokenizer):
    dataset = _dataset(prepared / "static" / "phase1", tokenizer)
    reference = _loader(dataset, 1, 2)
    expected = [next(reference) for _ in range(reference.batches_per_epoch + 5)]  # crosses an epoch
    first = _loader(dataset, 1, 2, num_workers=1)
    for _ in range(7):
        next(first)
    state = first.state_dict()
    first.close()
    resumed = _loader(dataset, 1, 2, num_workers=2)
    resumed.load_state_dict(json.loads(json.dumps(state)))  # survives a JSON round trip
    for want in expected[7:]:
        got = next(resumed)
        assert all(torch.equal(got[k], want[k]) for k in want)


def test_changed_world_size_on_resume_repeats_nothing_within_the_epoch(prepared, tokenizer):
    dataset = _dataset(prepared / "static" / "phase1", tokenizer)
    batch = 2
    two = [_loader(dataset, r, 2, batch) for r in range(2)]
    consumed: set[int] = set()
    for loader in two:
        for step in range(5):
            consumed.update(loader.sampler.rank_indices(0, step * batch * 2, batch).tolist())
            next(loader)
    state = two[0].state_dict()
    assert state["index"] == 5 * batch * 2 and len(consumed) == state["index"]
    three = [_loader(dataset, r, 3, batch) for r in range(3)]
    for loader in three:
        loader.load_state_dict(state)
    expected = [dataset[i]["input_ids"] for i in three[1].sampler.rank_indices(0, state["index"], batch)]
    assert torch.equal(next(three[1])["input_ids"], torch.from_numpy(np.stack(expected)))
    rest: set[int] = set()
    index = state["index"]
    while index + batch * 3 <= len(dataset):
        for loader in three:
            rest.update(loader.sampler.rank_indices(0, index, batch).tolist())
        index += batch * 3
    assert not consumed & rest and len(consumed) + len(rest) == index  # disjoint, nothing repeated


@pytest.mark.slow
def test_training_on_shards_resumes_exactly(prepared, tmp_path):
    """A run stopped after 3 steps (checkpoint) and resumed gives the uninterrupted run's loss series."""
    args = [*TINY, "data=shards", "data.heldout_sequences=null", f"data.path={prepared / 'dynamic'}",
            "data.masking=dynamic", "data.max_seq_len=32", "data.max_predictions=5", "data.dupe_factor=1",
            "data.num_workers=1", "trainer.max_steps=6", "trainer.checkpoint_every=3"]
    reference = run_train([*args, f"hydra.run.dir={tmp_path / 'ref'}"])
    assert reference.returncode == 0, reference.stderr[-3000:]
    stopped = run_train([*args, f"hydra.run.dir={tmp_path / 'split'}", "trainer.steps_this_run=3"])
    assert stopped.returncode == 0, stopped.stderr[-3000:]
    resumed = run_train([*args, f"hydra.run.dir={tmp_path / 'split'}"])
    assert resumed.returncode == 0, resumed.stderr[-3000:]

    def series(run_dir: Path):
        records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
        return [(r["step"], r["loss"]) for r in records if "loss" in r]

    assert len(series(tmp_path / "ref")) == 6
    assert series(tmp_path / "split") == series(tmp_path / "ref")
