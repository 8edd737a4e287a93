"""optim.flat: the layout's slots, buckets, segments and chunks; the state's views, in-place loads and per-slot
reductions."""

from __future__ import annotations

import pytest
import torch

from optim.flat import FixedAddresses, FlatLayout, FlatState, Slot, pop_flat_entries, runs

SHAPES = [torch.Size((3, 5)), torch.Size((7,)), torch.Size((2, 2)), torch.Size((6,))]
GROUPS = [0, 0, 1, 0]  # tensor 2 is of group 1: it splits group 0's run


def _layout() -> FlatLayout:
    # two buckets, each padded to a multiple of 8: [0, 1, 2] (26 -> 32 elements), [3] (6 -> 8)
    return FlatLayout.packed(SHAPES, GROUPS, [[0, 1, 2], [3]], padded=lambda size: -(-size // 8) * 8)


def test_packed_layout_places_buckets_padded_and_segments_by_group():
    layout = _layout()
    assert [s.offset for s in layout.slots] == [0, 15, 22, 32]
    assert [(b.start, b.stop, b.end) for b in layout.buckets] == [(0, 26, 32), (32, 38, 40)]
    assert layout.numel == 40
    # group 0's first two tensors are one run; the same group after the padding is another (other bucket)
    assert layout.segments == [(0, 0, 22), (1, 22, 26), (0, 32, 38)]


def test_chunks_cover_every_segment_and_cut_tensors_into_pieces():
    layout = _layout()
    chunks = layout.chunks(10)
    assert [(c.group, c.start, c.stop) for c in chunks] == [(0, 0, 10), (0, 10, 20), (0, 20, 22), (1, 22, 26),
                                                            (0, 32, 38)]
    covered = torch.zeros(layout.numel, dtype=torch.int64)
    for chunk in chunks:
        for piece in chunk.pieces:
            slot = layout.slots[piece.slot]
            covered[slot.offset + piece.lo:slot.offset + piece.hi] += 1
            assert piece.whole == (piece.lo == 0 and piece.hi == slot.numel)
    assert covered[:26].eq(1).all() and covered[26:32].eq(0).all() and covered[32:38].eq(1).all()
    assert [len(c.pieces) for c in layout.chunks(None)] == [2, 1, 1]  # no limit: one chunk per segment, whole


def test_views_alias_one_buffer_and_pieces_match_the_tensors_they_cut():
    layout = _layout()
    params = [torch.randn(shape) for shape in SHAPES]
    state = {p: {} for p in params}
    flat = FlatState(layout, torch.device("cpu"), torch.float32)
    buffer = flat.add("exp_avg", params, state)
    for p, slot in zip(params, layout.slots, strict=True):
        assert state[p]["exp_avg"].shape == p.shape
        assert state[p]["exp_avg"].data_ptr() == buffer.data_ptr() + 4 * slot.offset
    for chunk, pieces in zip(layout.chunks(10), flat.pieces("exp_avg", 10), strict=True):
        torch._foreach_copy_(pieces, [piece.of(params[piece.slot]) for piece in chunk.pieces])
    for p in params:  # every element went through exactly one piece
        assert torch.equal(state[p]["exp_avg"], p)
    assert flat.pieces("exp_avg", 10) is flat.pieces("exp_avg", 10)  # built once: a step makes no views
    assert [v.numel() for v in flat.chunk_views("exp_avg", 10)] == [10, 10, 2, 4, 6]


def test_per_slot_combines_the_pieces_of_cut_tensors():
    layout = _layout()
    flat = FlatState(layout, torch.device("cpu"), torch.float32)
    buffer = flat.add("x")
    buffer.copy_(torch.arange(40.0))
    maxima = [t.max() for pieces in flat.pieces("x", 10) for t in pieces]
    sums = [t.sum() for pieces in flat.pieces("x", 10) for t in pieces]
    views = flat.views("x")
    assert torch.equal(flat.per_slot(maxima, 10, "amax"), torch.stack([v.max() for v in views]))
    assert torch.equal(flat.per_slot(sums, 10, "sum"), torch.stack([v.sum() for v in views]))


def test_load_copies_saved_tensors_in_place_casting_and_zeroing_what_is_missing():
    layout = _layout()
    params = [torch.randn(shape) for shape in SHAPES]
    state = {p: {} for p in params}
    flat = FlatState(layout, torch.device("cpu"), torch.float32)
    buffer = flat.add("exp_avg", params, state)
    buffer.fill_(5.0)
    saved = [torch.full(shape, float(i), dtype=torch.float64) for i, shape in enumerate(SHAPES)]
    saved[2] = None
    flat.load_("exp_avg", saved)
    assert flat["exp_avg"].data_ptr() == buffer.data_ptr()
    assert [v.unique().tolist() for v in flat.views("exp_avg")] == [[0.0], [1.0], [0.0], [3.0]]
    with pytest.raises(ValueError, match="saved 'exp_avg' of shape \\(4,\\) where this parameter's is \\(3, 5\\)"):
        flat.load_("exp_avg", [torch.zeros(4), None, None, None])


def test_pop_flat_entries_leaves_torch_the_small_state():
    state_dict = {"state": {0: {"exp_avg": torch.ones(2), "step": 3}, 2: {"exp_avg": torch.zeros(1)}, "global": 7},
                  "param_groups": [{"params": [0, 1]}, {"params": [2]}]}
    small, popped = pop_flat_entries(state_dict, ["exp_avg"])
    assert small["state"] == {0: {"step": 3}, 2: {}, "global": 7}
    assert small["param_groups"] is state_dict["param_groups"]
    assert [None if t is None else t.tolist() for t in popped["exp_avg"]] == [[1.0, 1.0], None, [0.0]]
    assert "exp_avg" in state_dict["state"][0]  # the given state is left as it was


def test_a_layout_of_given_slots_keeps_their_gaps():
    """An optimizer with its own placement (aligned offsets) passes its slots: gaps are neither segment nor chunk."""
    layout = FlatLayout([Slot(0, torch.Size((3,)), 0), Slot(8, torch.Size((2, 2)), 0)])
    assert layout.numel == 12 and layout.segments == [(0, 0, 3), (0, 8, 12)]
    assert [(c.start, c.stop) for c in layout.chunks(None)] == [(0, 3), (8, 12)]


def test_runs_cut_whole_tensors_by_group_and_limit_with_alignment():
    numels, groups = [5, 3, 20, 4, 4, 9], [0, 0, 0, 0, 1, 1]
    # tensor 1 starts at 8 (aligned to 8): 5 + gap 3 + 3 = 11 > 10 cuts; 20 > 10 is a run of its own
    align = [1, 8, 1, 1, 1, 1]
    assert runs(range(6), numels, groups, 10, align) == [[0], [1], [2], [3], [4], [5]]
    assert runs(range(6), numels, groups, 11, align) == [[0, 1], [2], [3], [4], [5]]
    assert runs([1, 0, 2, 3, 4, 5], numels, groups, None) == [[1, 0, 2, 3], [4, 5]]  # a whole group per run


def test_packed_alignment_members_and_rows_share_a_row_index():
    """Aligned slots leave gaps; per-row state keeps the elements' spacing inside a run of one kind and row size,
    so one index relative to the run addresses a row of elements and its row value alike."""
    shapes = [torch.Size((3,)), torch.Size((4, 4)), torch.Size((2, 8)), torch.Size((12,))]
    layout = FlatLayout.packed(shapes, [0, 0, 0, 0], [[0, 1, 2], [3]], padded=lambda n: -(-n // 8) * 8,
                               align=[1, 8, 8, 1])
    assert [s.offset for s in layout.slots] == [0, 8, 24, 40]
    assert layout.members() == [[0, 1, 2], [3]]
    rows = layout.rows([1, 4, 4, 4], ["always", "masked", "masked", "always"])
    # tensor 0: 3 rows of 1 at 0; tensors 1, 2: a run of rows of 4 from row 3 (element 8), tensor 2's first row
    # 16 elements later (4 rows); tensor 3: its bucket's rows follow with no gap
    assert [(s.offset, s.numel) for s in rows.slots] == [(0, 3), (3, 4), (7, 4), (11, 3)]
    assert [(b.start, b.end) for b in rows.buckets] == [(0, 11), (11, 14)]


def test_a_buffer_with_a_fill_loads_it_where_nothing_was_saved():
    layout = FlatLayout.packed([torch.Size((2,)), torch.Size((3,))], [0, 0])
    params = [torch.zeros(2), torch.zeros(3)]
    state = {p: {} for p in params}
    flat = FlatState(layout, torch.device("cpu"), torch.float16)
    assert flat.add("freshness", params, state, fill=1.0).eq(1).all()
    flat.load_("freshness", [torch.full((2,), 0.5), None])
    assert flat["freshness"].tolist() == [0.5, 0.5, 1.0, 1.0, 1.0]
    state = {p: {} for p in params}  # as torch's loader leaves it
    flat.expose("freshness", params, state)
    assert state[params[1]]["freshness"].data_ptr() == flat["freshness"].data_ptr() + 2 * 2


def test_fixed_addresses_give_the_kernels_the_table_of_the_tensors_they_hold():
    pytest.importorskip("triton")
    from optim._triton import address_table

    views = list(torch.zeros(40).split(4))
    fixed = FixedAddresses(views)
    part = fixed[2:5]
    assert isinstance(part, FixedAddresses) and list(part) == views[2:5] and fixed[3] is views[3]
    assert part.addresses == tuple(v.data_ptr() for v in views[2:5])
    grads = [torch.ones(4)]
    table, _ = address_table(torch.device("cpu"), grads, part)
    assert table.tolist() == [grads[0].data_ptr(), *part.addresses]
    moved = [torch.ones(4)]  # a plain list is read again: a gradient that moved gets its own table
    assert address_table(torch.device("cpu"), moved, part)[0].tolist() == [moved[0].data_ptr(), *part.addresses]
