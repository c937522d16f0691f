"""Pure tensor engine of mode "kv" on DiTs: pick one real key/value per window of the token grid.

Keys arrive rotary-encoded (RoPE) in every supported family. Picking a real token keeps a real
rotated key at its own position, so it is exactly what attention would have seen for that token;
averaging rotated keys mixes different rotations (the mean of vectors rotated by different
angles shrinks and points nowhere), so ``avg`` is refused for DiTs.
"""
from __future__ import annotations

import functools
import math
from typing import Optional, Sequence, Tuple

import torch

from .merge import kv_pool_window
from .grid import TokenLayout


@functools.lru_cache(maxsize=256)  # asked in every model call: a cached answer costs no Python call
def dit_window(ratio: float, grid: Tuple[int, ...], sx: int = 2, sy: int = 2, st: int = 2) -> Tuple[int, ...]:
    """The window (py, px) or (pt, py, px) whose area is closest to 1 / (1 - ratio).

    Images use ``kv_pool_window`` unchanged (the UNet choice). Video adds a temporal side of at
    most ``st`` frames, used only where the spatial sx*sy window cannot reach the ratio: spatial
    neighbours are more alike than frames apart in motion. Sides never exceed the grid.
    """
    if len(grid) == 2:
        py, px = kv_pool_window(ratio, min(sx, grid[1]), min(sy, grid[0]))
        return (py, px)
    t, h, w = grid
    target = math.log(1.0 / (1.0 - ratio))
    windows = [(pt, py, px) for pt in range(1, min(st, t) + 1)
               for py in range(1, min(sy, h) + 1) for px in range(1, min(sx, w) + 1)]
    return min(windows, key=lambda win: (round(abs(math.log(win[0] * win[1] * win[2]) - target), 9),
                                         win[0] * win[1] * win[2], win[0], abs(win[1] - win[2]), -win[2]))


def window_for_dims(ratio: float, dims: int, sx: int = 2, sy: int = 2) -> Tuple[int, ...]:
    """``dit_window`` on a 2-D (image) or 3-D (video) grid larger than any window: what a family's calls
    get at any practical size, before a call says how large its grid is (for display)."""
    return dit_window(ratio, (1 << 20,) * dims, sx, sy)


def pick_index_nd(grid: Sequence[int], window: Sequence[int], generator: Optional[torch.Generator] = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Raster indices of one token per window of an N-d grid: [prod(ceil(n_i / w_i))], sorted.

    generator: draws the pick inside each window uniformly (seeded per step by the caller); None
    picks each window's centre. Partial windows at the borders (sides not multiples of the window,
    frame counts not divisible by the temporal side) pick among the tokens they cover.
    Same picks as ``tome_core.engine.merge.kv_pick_index`` for 2-D grids given the same draws.
    """
    coords = []
    counts = [math.ceil(n / s) for n, s in zip(grid, window)]
    for dim, (n, s) in enumerate(zip(grid, window)):
        start = torch.arange(0, n, s)
        size = (n - start).clamp(max=s)
        shape = [1] * len(grid)
        shape[dim] = -1
        if generator is None:
            offset = (size // 2).view(shape).expand(counts)
        else:
            draw = torch.rand(counts, generator=generator)
            offset = (draw * size.view(shape)).long()
        coords.append(start.view(shape) + offset)
    flat = torch.zeros(counts, dtype=torch.long)
    for dim, c in enumerate(coords):
        flat = flat * grid[dim] + c
    return flat.flatten().to(device)


def keep_index(layout: TokenLayout, grid_index: torch.Tensor) -> torch.Tensor:
    """Sequence indices kept for keys/values: every prefix/suffix (text) token plus the grid picks."""
    device = grid_index.device
    parts = [torch.arange(layout.prefix, device=device), grid_index + layout.prefix,
             torch.arange(layout.prefix + layout.grid_tokens, layout.length, device=device)]
    return torch.cat(parts)


def reduce_kv(key: torch.Tensor, value: torch.Tensor, keep: torch.Tensor,
              seq_dim: int = -2) -> Tuple[torch.Tensor, torch.Tensor]:
    """Keys/values [B, heads, L, D] (seq_dim -2) or [B, L, C] (seq_dim 1) -> only the kept tokens.

    ``keep`` comes from ``keep_index`` and already lives on the keys' device: no host sync here.
    """
    return key.index_select(seq_dim, keep), value.index_select(seq_dim, keep)
