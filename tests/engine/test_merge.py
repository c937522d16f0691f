"""The pure algorithm: partitions, matching, pooling and level grids, against hand-worked values."""
from __future__ import annotations

import pytest
import torch
from tomesd.merge import bipartite_soft_matching_random2d as tomesd_matching

from tome_core import (bipartite_soft_matching, grid_for_tokens, kv_pick_index, kv_pool_window, make_partition,
                       pool_tokens)
from tome_core import ToMeConfig, TokenMerger
from tome_core.engine.merge import match_tokens
from tome_core.engine.plan import partition_seed


def test_partition_has_one_destination_per_full_cell_and_border_tokens_are_sources():
    choice = torch.tensor([[0, 3], [1, 2]])  # 2x2 cells of a 5x5 grid (last row/column ragged)
    part = make_partition(5, 5, 2, 2, choice)
    # cell (0,0) pick 0 -> (0,0); (0,1) pick 3 -> (1,3); (1,0) pick 1 -> (2,1); (1,1) pick 2 -> (3,2)
    assert part.dst_idx.tolist() == [0, 8, 11, 17]
    assert sorted(part.src_idx.tolist() + part.dst_idx.tolist()) == list(range(25))


def test_merge_averages_the_most_similar_pairs_and_unmerge_copies_back():
    # 2x2 grid, one cell: token 0 is the destination; token 3 equals it up to scale, 1 and 2 point elsewhere.
    x = torch.tensor([[[1.0, 0.0], [0.0, 1.0], [0.0, -1.0], [3.0, 0.0]]])
    merge, unmerge = bipartite_soft_matching(x, make_partition(2, 2, 2, 2), r=1)
    merged = merge(x)
    assert merged.shape == (1, 3, 2)
    assert torch.equal(merged[0, 0], torch.tensor([2.0, 0.0]))  # mean of tokens 0 and 3
    restored = unmerge(merged)
    assert torch.equal(restored[0, 3], torch.tensor([2.0, 0.0])) and torch.equal(restored[0, 1:3], x[0, 1:3])


@pytest.mark.parametrize("hw", [(8, 8), (7, 9), (16, 12)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_matching_equals_tomesd_on_random_tokens(hw, ratio):
    h, w = hw
    x = torch.randn(2, h * w, 16, generator=torch.Generator().manual_seed(h * w))
    r = int(h * w * ratio)
    ref_merge, ref_unmerge = tomesd_matching(x, w, h, 2, 2, r, no_rand=True)
    merge, unmerge = bipartite_soft_matching(x, make_partition(h, w, 2, 2), r)
    assert merge(x).shape == ref_merge(x).shape
    assert torch.allclose(unmerge(merge(x)), ref_unmerge(ref_merge(x)), atol=1e-6)


@pytest.mark.parametrize("hw,ratio", [((8, 8), 0.5), ((7, 9), 0.25), ((16, 12), 0.75)])
def test_the_gpu_and_cpu_matchings_place_every_token_alike(hw, ratio):
    """The GPU's path (every token scored, destinations masked) and the CPU's (sources gathered and
    scored alone) give the same slots, so the same merged tokens, on either device."""
    from tome_core.engine.merge import match_tokens

    h, w = hw
    x = torch.randn(2, h * w, 16, generator=torch.Generator().manual_seed(7))
    choice = torch.randint(4, (h // 2, w // 2), generator=torch.Generator().manual_seed(8))
    partition = make_partition(h, w, 2, 2, choice)
    everything = match_tokens(x, partition, int(h * w * ratio), gather_sources=False)
    sources = match_tokens(x, partition, int(h * w * ratio), gather_sources=True)
    assert torch.equal(everything.slot, sources.slot) and everything.shape == sources.shape
    assert torch.equal(everything.inverse_counts, sources.inverse_counts)
    assert torch.equal(everything.functions()[0](x), sources.functions()[0](x))


def test_r_zero_is_the_identity_function():
    x = torch.randn(1, 16, 4)
    merge, unmerge = bipartite_soft_matching(x, make_partition(4, 4, 2, 2), r=0)
    assert merge(x) is x and unmerge(x) is x


@pytest.mark.parametrize(
    "tokens,latent,expected",
    [
        (65 * 97, (65, 97), (1, 65, 97)),
        (33 * 49, (65, 97), (2, 33, 49)),   # 520x776 px: stride-2 convs round up
        (9 * 13, (65, 97), (8, 9, 13)),
        (63 * 38, (125, 75), (2, 63, 38)),  # 1000x600 px
        (32 * 32, (64, 64), (2, 32, 32)),
        (7, (64, 64), None),
    ],
)
def test_grid_for_tokens_finds_the_level(tokens, latent, expected):
    assert grid_for_tokens(tokens, *latent) == expected


def test_kv_window_is_the_one_closest_to_ratio():
    assert [kv_pool_window(r, 2, 2) for r in (0.0, 0.25, 0.3, 0.5, 0.7, 0.75)] == [
        (1, 1), (1, 1), (1, 2), (1, 2), (2, 2), (2, 2)]
    assert [kv_pool_window(r, 3, 3) for r in (0.6, 0.85, 0.88)] == [(1, 3), (2, 3), (3, 3)]


def test_pool_tokens_averages_partial_border_windows_over_what_they_cover():
    x = torch.arange(15, dtype=torch.float32).view(1, 15, 1)  # 5x3 grid, values = raster index
    pooled = pool_tokens(x, 5, 3, (2, 2))
    assert pooled.flatten().tolist() == [2.0, 3.5, 8.0, 9.5, 12.5, 14.0]


def test_kv_pick_index_takes_the_centre_of_each_window_border_windows_included():
    # 5x3 grid, 2x2 windows: rows {0,1},{2,3},{4}; columns {0,1},{2}; centre = offset size // 2
    assert kv_pick_index(5, 3, (2, 2)).tolist() == [4, 5, 10, 11, 13, 14]
    assert kv_pick_index(6, 6, (3, 3)).tolist() == [7, 10, 25, 28]


def test_kv_pick_index_with_random_choice_stays_inside_each_window():
    h, w, (py, px) = 7, 10, (3, 3)
    choice = torch.rand(2, 3, 4, generator=torch.Generator().manual_seed(0))
    index = kv_pick_index(h, w, (py, px), choice)
    rows, cols = index // w, index % w
    window_row = torch.arange(3).repeat_interleave(4)
    window_col = torch.arange(4).repeat(3)
    assert torch.equal(rows // py, window_row) and torch.equal(cols // px, window_col)
    assert (rows < h).all() and (cols < w).all()
    extreme = kv_pick_index(h, w, (py, px), torch.full((2, 3, 4), 0.999999))
    assert extreme.tolist()[-1] == 69  # the 1x1 bottom-right border window can only pick its token
    assert len(set(index.tolist())) == 12 and not torch.equal(index, kv_pick_index(h, w, (py, px)))


def test_partition_seed_depends_on_every_part_and_is_stable():
    base = partition_seed(0, 999.0, 64, 64)
    assert base == partition_seed(0, 999.0, 64, 64)
    assert len({base, partition_seed(1, 999.0, 64, 64), partition_seed(0, 979.0, 64, 64),
                partition_seed(0, 999.0, 32, 32)}) == 4


def test_chunked_best_destinations_equal_the_full_score_matrix(monkeypatch):
    import tome_core.engine.merge as merge_module

    gen = torch.Generator().manual_seed(0)
    src, dst = torch.randn(2, 300, 8, generator=gen), torch.randn(2, 100, 8, generator=gen)
    full_max, full_idx = (src @ dst.transpose(-1, -2)).max(dim=-1)
    monkeypatch.setattr(merge_module, "SCORE_CHUNK_ELEMENTS", 2 * 100 * 7)  # 7 rows per chunk
    chunk_max, chunk_idx = merge_module.best_destinations(src, dst)
    assert torch.equal(chunk_max, full_max) and torch.equal(chunk_idx, full_idx)


def test_kv_picks_are_shared_within_a_step_and_redrawn_across_steps():
    """cond/uncond (or ComfyUI's separate calls) at one step see the same keys; the next step others."""
    from tome_core import ToMeConfig, TokenMerger

    hidden = torch.randn(2, 32 * 32, 8)
    merger = TokenMerger(ToMeConfig(ratio=0.75, mode="kv", seed=3))
    first = merger.plan(hidden, (32, 32), step_key=999.0).reduce_kv(hidden)
    again = TokenMerger(ToMeConfig(ratio=0.75, mode="kv", seed=3)).plan(hidden, (32, 32), step_key=999.0)
    assert first.shape == (2, 256, 8) and torch.equal(again.reduce_kv(hidden), first)
    assert not torch.equal(merger.plan(hidden, (32, 32), step_key=979.0).reduce_kv(hidden), first)
    fixed = TokenMerger(ToMeConfig(ratio=0.75, mode="kv", use_rand=False))
    assert torch.equal(fixed.plan(hidden, (32, 32), step_key=999.0).reduce_kv(hidden),
                       fixed.plan(hidden, (32, 32), step_key=979.0).reduce_kv(hidden))


def test_step_choice_is_the_same_for_a_value_and_its_tensor_and_varies_with_step_and_seed():
    from tome_core.engine.plan import STEP_CANDIDATES, step_choice

    steps = [999.0 - 50 * i for i in range(20)] + [14.61, 0.029]
    for step in steps:
        as_tensor = step_choice(torch.tensor([step, step]), seed=3)
        assert as_tensor.dtype == torch.long and as_tensor.shape == (1,)
        assert int(as_tensor) == step_choice(step, seed=3) == step_choice(torch.tensor(step), seed=3)
    choices = [step_choice(step, seed=3) for step in steps]
    assert all(0 <= c < STEP_CANDIDATES for c in choices) and len(set(choices)) >= STEP_CANDIDATES // 2
    assert choices != [step_choice(step, seed=4) for step in steps]


def test_a_step_tensor_draws_its_partition_on_its_device_without_a_host_read():
    merger = TokenMerger(ToMeConfig(ratio=0.5, seed=2))
    from_float = merger.table((16, 16), 979.0, torch.device("cpu"))
    from_tensor = TokenMerger(ToMeConfig(ratio=0.5, seed=2)).table((16, 16), torch.tensor([979.0, 979.0]),
                                                                      torch.device("cpu"))
    assert torch.equal(from_float.dst_idx, from_tensor.dst_idx) and torch.equal(from_float.base_slot,
                                                                                from_tensor.base_slot)
    other = merger.table((16, 16), 999.0, torch.device("cpu"))
    assert not torch.equal(other.dst_idx, from_float.dst_idx)


def test_matching_compiles_whole_through_the_opaque_slot_op():
    """Under torch.compile the int64 slot arithmetic runs as torch.ops.tome.match_slots (inductor's CUDA code
    generation failed on it fused); the CPU's inductor compiles the matching in one graph, equal to eager."""
    partition = make_partition(8, 8, 2, 2)
    x = torch.randn(2, 64, 16, generator=torch.Generator().manual_seed(0))

    def merged(tokens):
        merge, unmerge = match_tokens(tokens, partition, 24).functions()
        return unmerge(merge(tokens) * 2)

    compiled = torch.compile(merged, fullgraph=True)
    assert torch.allclose(compiled(x), merged(x), atol=1e-6)
