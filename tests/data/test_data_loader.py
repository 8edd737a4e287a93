"""Resumable distributed sampler and the endless micro-batch loader: partitioning, exact resume, errors."""

import numpy as np
import pytest
import torch

from data import ResumableDistributedSampler, ResumableLoader
from data.sampler import epoch_permutation
from data.text.pretraining import BATCH_KEYS, build_demo_dataset
from data.text.tokenizer import load_tokenizer


def _ids_loader(n, batch, rank, world, seed=0, **kw):
    """A loader over ``range(n)``: any indexable collection works; each batch is the tensor of indices."""
    return ResumableLoader(list(range(n)), batch, rank, world, seed, collate_fn=torch.tensor, **kw)


def _take(loader, k):
    return [next(loader) for _ in range(k)]


def _assert_same_batches(xs, ys):
    assert len(xs) == len(ys)
    for x, y in zip(xs, ys, strict=True):
        if isinstance(x, dict):
            assert tuple(x) == tuple(y) == BATCH_KEYS
            assert all(torch.equal(x[k], y[k]) for k in x)
        else:
            assert torch.equal(x, y)


@pytest.fixture(scope="module")
def demo_ds():
    # Dynamic masking, so batches also depend on the epoch: resume must get that right too.
    return build_demo_dataset(load_tokenizer(), max_seq_len=32, max_predictions=5, dupe_factor=1, seed=11,
                              masking="dynamic")


# ----- sampler -------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("n", "world"), [(103, 4), (100, 4), (7, 7), (10, 1)])
def test_sampler_ranks_are_disjoint_and_cover_the_epoch(n, world):
    parts = [list(ResumableDistributedSampler(n, r, world, seed=3)) for r in range(world)]
    assert len({len(p) for p in parts}) == 1 and len(parts[0]) == n // world
    flat = [i for p in parts for i in p]
    assert len(set(flat)) == len(flat) == n - n % world  # disjoint; drop_last drops n % world
    order = epoch_permutation(n, 3, 0)
    assert set(flat) == set(order[:len(flat)].tolist())


def test_sampler_without_drop_last_pads_by_wrapping():
    parts = [list(ResumableDistributedSampler(10, r, 4, seed=1, drop_last=False)) for r in range(4)]
    assert [len(p) for p in parts] == [3, 3, 3, 3]
    assert set(i for p in parts for i in p) == set(range(10))


def test_sampler_reshuffles_every_epoch_and_advances_by_itself():
    s = ResumableDistributedSampler(50, 0, 2, seed=5)
    e0 = list(s)
    assert s.state_dict() == {"epoch": 1, "index": 0}
    e1 = list(s)
    assert sorted(e0) != e0 and e0 != e1
    assert list(ResumableDistributedSampler(50, 0, 2, seed=6)) != e0
    assert list(ResumableDistributedSampler(50, 0, 2, seed=5, shuffle=False)) == list(range(0, 50, 2))


def test_sampler_resumes_mid_epoch_without_replaying():
    full = list(ResumableDistributedSampler(40, 1, 2, seed=9))
    s = ResumableDistributedSampler(40, 1, 2, seed=9)
    it = iter(s)
    head = [next(it) for _ in range(7)]
    state = s.state_dict()
    assert state == {"epoch": 0, "index": 14}  # global offset: 7 samples on each of 2 ranks
    fresh = ResumableDistributedSampler(40, 1, 2, seed=9)
    fresh.load_state_dict(state)
    assert len(fresh) == 13
    assert head + list(fresh) == full


def test_sampler_state_is_global_across_world_sizes():
    n = 60
    old = [ResumableDistributedSampler(n, r, 3, seed=2) for r in range(3)]
    iters = [iter(s) for s in old]
    seen = [next(it) for _ in range(5) for it in iters]
    state = old[0].state_dict()
    assert all(s.state_dict() == state for s in old) and state["index"] == 15
    new = [ResumableDistributedSampler(n, r, 4, seed=2) for r in range(4)]
    for s in new:
        s.load_state_dict(state)
    rest = [i for s in new for i in s]
    assert len(rest) == 44  # 45 samples left for 4 ranks: 11 each, the last one dropped
    assert not set(seen) & set(rest)
    assert sorted(seen + rest) == sorted(epoch_permutation(n, 2, 0)[:59].tolist())


def test_sampler_bad_arguments():
    with pytest.raises(ValueError, match="rank"):
        ResumableDistributedSampler(10, 2, 2, seed=0)
    with pytest.raises(ValueError, match="num_samples=3 is smaller than world_size=4"):
        ResumableDistributedSampler(3, 0, 4, seed=0)
    with pytest.raises(ValueError, match="num_samples"):
        ResumableDistributedSampler(0, 0, 1, seed=0)


# ----- loader --------------------------------------------------------------------------------------------

def test_loader_yields_pretraining_batches_forever(demo_ds):
    loader = ResumableLoader(demo_ds, 8, 0, 2, seed=1)
    assert loader.batches_per_epoch == len(demo_ds) // 2 // 8
    assert loader.samples_per_epoch == loader.batches_per_epoch * 8 * 2
    batches = _take(loader, loader.batches_per_epoch + 3)
    assert loader.state_dict()["epoch"] == 1
    b = batches[-1]
    assert tuple(b) == BATCH_KEYS and all(t.dtype == torch.int64 for t in b.values())
    assert b["input_ids"].shape == (8, 32) and b["masked_lm_labels"].shape == (8, 5)
    assert b["next_sentence_label"].shape == (8,)


def test_loader_epochs_cover_each_rank_share_and_reshuffle():
    loader = _ids_loader(50, 4, 1, 3)
    assert (loader.batches_per_epoch, loader.samples_per_epoch) == (4, 48)
    e0 = torch.cat(_take(loader, 4))
    assert loader.state_dict()["epoch"] == 1 and loader.state_dict()["index"] == 0
    e1 = torch.cat(_take(loader, 4))
    assert len(set(e0.tolist())) == 16 and not torch.equal(e0, e1)
    ranks = [torch.cat(_take(_ids_loader(50, 4, r, 3), 4)).tolist() for r in range(3)]
    flat = [i for r in ranks for i in r]
    assert len(set(flat)) == 48 and set(flat) == set(epoch_permutation(50, 0, 0)[:48].tolist())


@pytest.mark.parametrize("k", [0, 1, 5, 19, 20, 23])  # 20 batches per epoch: also resume across the boundary
def test_loader_resume_gives_the_same_next_batches(demo_ds, k):
    world, rank, batch = 3, 2, 4
    reference = ResumableLoader(demo_ds, batch, rank, world, seed=4)
    bpe = reference.batches_per_epoch
    k = k * bpe // 20
    expected = _take(reference, k + 4)

    interrupted = ResumableLoader(demo_ds, batch, rank, world, seed=4)
    _take(interrupted, k)
    state = interrupted.state_dict()
    resumed = ResumableLoader(demo_ds, batch, rank, world, seed=4)
    resumed.load_state_dict(state)
    _assert_same_batches(_take(resumed, 4), expected[k:])
    assert resumed.state_dict() == reference.state_dict()


def test_loader_resume_at_exact_epoch_boundary_uses_new_epoch_masks(demo_ds):
    reference = ResumableLoader(demo_ds, 16, 0, 1, seed=2)
    bpe = reference.batches_per_epoch
    expected = _take(reference, bpe + 1)
    first = ResumableLoader(demo_ds, 16, 0, 1, seed=2)
    _take(first, bpe)
    state = first.state_dict()
    assert state["epoch"] == 1 and state["index"] == 0
    resumed = ResumableLoader(demo_ds, 16, 0, 1, seed=2)
    resumed.load_state_dict(state)
    _assert_same_batches(_take(resumed, 1), expected[bpe:])


def test_loader_with_workers_matches_and_resumes_exactly(demo_ds):
    plain = _take(ResumableLoader(demo_ds, 8, 1, 2, seed=3), 9)
    workers = ResumableLoader(demo_ds, 8, 1, 2, seed=3, num_workers=2)
    first = _take(workers, 4)  # workers have prefetched more than 4 batches by now
    state = workers.state_dict()
    workers.close()
    _assert_same_batches(first, plain[:4])
    resumed = ResumableLoader(demo_ds, 8, 1, 2, seed=3, num_workers=2)
    resumed.load_state_dict(state)
    _assert_same_batches(_take(resumed, 5), plain[4:])
    resumed.close()


def test_loader_is_deterministic_per_seed_and_leaves_global_rng_alone(demo_ds):
    torch_state, np_state = torch.get_rng_state(), np.random.get_state()
    a = _take(ResumableLoader(demo_ds, 8, 0, 2, seed=5), 3)
    b = _take(ResumableLoader(demo_ds, 8, 0, 2, seed=5), 3)
    c = _take(ResumableLoader(demo_ds, 8, 0, 2, seed=6), 3)
    _assert_same_batches(a, b)
    assert not torch.equal(a[0]["input_ids"], c[0]["input_ids"])
    assert torch.equal(torch.get_rng_state(), torch_state)
    assert np.array_equal(np.random.get_state()[1], np_state[1])


@pytest.mark.parametrize("new_world", [1, 2, 5])
def test_loader_world_size_change_keeps_epoch_and_global_offset(new_world):
    n, batch, old_world, steps = 200, 4, 3, 5
    old = [_ids_loader(n, batch, r, old_world, seed=8) for r in range(old_world)]
    seen = [i for loader in old for b in _take(loader, steps) for i in b.tolist()]
    states = [loader.state_dict() for loader in old]
    assert all(s == states[0] for s in states)
    assert states[0]["index"] == steps * batch * old_world == len(seen)

    new = [_ids_loader(n, batch, r, new_world, seed=8) for r in range(new_world)]
    for loader in new:
        loader.load_state_dict(states[0])
    # The rest of epoch 0 is re-partitioned: global steps of batch * new_world samples until it runs out.
    remaining_steps = (n - len(seen)) // (batch * new_world)
    rest = [i for loader in new for b in _take(loader, remaining_steps) for i in b.tolist()]
    assert all(loader.state_dict() == {"epoch": 1, "index": 0, "seed": 8, "num_samples": n} for loader in new)
    order = epoch_permutation(n, 8, 0).tolist()
    assert not set(seen) & set(rest) and len(set(rest)) == len(rest)
    assert sorted(seen + rest) == sorted(order[:len(seen) + len(rest)])  # nothing skipped or repeated
    assert n - len(seen) - len(rest) < batch * new_world  # only the final partial step is dropped


def test_loader_state_too_close_to_epoch_end_rolls_over():
    loader = _ids_loader(100, 8, 0, 4)
    loader.load_state_dict({"epoch": 2, "index": 90})
    assert loader.state_dict()["epoch"] == 3 and loader.state_dict()["index"] == 0


def test_loader_clear_errors():
    with pytest.raises(ValueError, match=r"micro_batch_size=9 .* 34 samples // world_size=4 = 8"):
        _ids_loader(34, 9, 0, 4)
    with pytest.raises(ValueError, match="empty"):
        ResumableLoader([], 1, 0, 1, seed=0)
    loader = _ids_loader(30, 2, 0, 1, seed=1)
    with pytest.raises(ValueError, match="seed=2"):
        loader.load_state_dict({"epoch": 0, "index": 4, "seed": 2, "num_samples": 30})
    with pytest.raises(ValueError, match="num_samples=31"):
        loader.load_state_dict({"epoch": 0, "index": 4, "seed": 1, "num_samples": 31})
