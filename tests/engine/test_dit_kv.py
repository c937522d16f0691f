"""The pure DiT kv engine (tome_core.engine.kv): windows, picks, kept indices on 2-D and 3-D grids."""
from __future__ import annotations

import math

import pytest
import torch

from tome_core.engine.grid import TokenLayout
from tome_core.engine.kv import dit_window, keep_index, pick_index_nd, reduce_kv
from tome_core.engine.merge import kv_pick_index, kv_pool_window


def test_2d_window_is_the_unet_choice():
    for ratio in (0.0, 0.3, 0.5, 0.7, 0.75):
        assert dit_window(ratio, (64, 64)) == kv_pool_window(ratio, 2, 2)
    assert dit_window(0.75, (1, 9)) == (1, 2)  # a side of one token is never windowed


def test_3d_window_adds_frames_only_past_the_spatial_window():
    assert dit_window(0.5, (9, 8, 8)) == (1, 1, 2)
    assert dit_window(0.75, (9, 8, 8)) == (1, 2, 2)
    assert dit_window(0.875, (9, 8, 8)) == (2, 2, 2)
    assert dit_window(0.875, (1, 8, 8)) == (1, 2, 2)  # one frame: no temporal window


@pytest.mark.parametrize("h,w", [(4, 4), (5, 7), (1, 3), (9, 2)])
def test_2d_picks_match_kv_pick_index(h, w):
    assert torch.equal(pick_index_nd((h, w), (2, 2)), kv_pick_index(h, w, (2, 2)))
    g = torch.Generator().manual_seed(3)
    picks = pick_index_nd((h, w), (2, 2), g)
    g = torch.Generator().manual_seed(3)
    counts = (math.ceil(h / 2), math.ceil(w / 2))
    choice = torch.stack([torch.rand(counts, generator=g), torch.rand(counts, generator=g)])
    assert torch.equal(picks, kv_pick_index(h, w, (2, 2), choice))


@pytest.mark.parametrize("grid,window", [((5, 3, 5), (2, 2, 2)), ((3, 4, 4), (2, 2, 2)), ((1, 5, 5), (1, 2, 2))])
def test_3d_picks_one_real_token_per_window(grid, window):
    g = torch.Generator().manual_seed(0)
    picks = pick_index_nd(grid, window, g)
    expected = math.prod(math.ceil(n / s) for n, s in zip(grid, window))
    assert picks.numel() == expected == picks.unique().numel()
    t, h, w = grid
    coords = torch.stack([picks // (h * w), picks // w % h, picks % w], 1)
    cells = coords // torch.tensor(window)
    assert cells.unique(dim=0).shape[0] == expected  # every window, partial ones at the borders too
    assert (coords < torch.tensor(grid)).all()


def test_keep_index_keeps_text_on_either_side():
    layout = TokenLayout((3, 3), prefix=4, suffix=2)
    grid_index = pick_index_nd((3, 3), (2, 2))
    keep = keep_index(layout, grid_index)
    assert keep[:4].tolist() == [0, 1, 2, 3] and keep[-2:].tolist() == [13, 14]
    assert keep[4:-2].tolist() == (grid_index + 4).tolist()
    k = torch.randn(2, 3, layout.length, 5)
    v = torch.randn(2, 3, layout.length, 5)
    rk, rv = reduce_kv(k, v, keep)
    assert rk.shape == (2, 3, 4 + 4 + 2, 5) and torch.equal(rk[:, :, :4], k[:, :, :4])
    assert torch.equal(rv[:, :, -2:], v[:, :, -2:])


def test_layout_rejects_bad_grids():
    with pytest.raises(ValueError, match="grid"):
        TokenLayout((4,))
    with pytest.raises(ValueError, match="grid"):
        TokenLayout((0, 4))
