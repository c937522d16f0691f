"""A UNet level's token grid: which power-of-two downsampling of the latent a sequence of tokens is.

Pure arithmetic on sizes; where the levels sit in a model's module tree is the catalogue's
(``catalogue/unets.py``).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Dict, Optional, Tuple


@functools.lru_cache(maxsize=64)
def level_grids(latent_h: int, latent_w: int) -> Dict[int, Tuple[int, int, int]]:
    """Token count -> (downsample, h, w) of every power-of-two level of a latent_h x latent_w latent.

    UNets halve each side per level, rounding up (stride-2 conv with padding 1) or down (pooling),
    so sizes not divisible by 8 are found exactly; a count two levels share goes to the shallower,
    rounded up first. Cached per latent size (a host looks it up in every model call): do not mutate.
    """
    grids: Dict[int, Tuple[int, int, int]] = {}
    downsample = 1
    while downsample <= 2 * max(latent_h, latent_w):
        for rounding in (math.ceil, math.floor):
            h, w = rounding(latent_h / downsample), rounding(latent_w / downsample)
            grids.setdefault(h * w, (downsample, h, w))
        downsample *= 2
    return grids


def grid_for_tokens(n_tokens: int, latent_h: int, latent_w: int) -> Optional[Tuple[int, int, int]]:
    """(downsample, h, w) of a level with n_tokens tokens for a latent of latent_h x latent_w (``level_grids``);
    None when no power-of-two level matches."""
    return level_grids(int(latent_h), int(latent_w)).get(n_tokens)


@dataclass(frozen=True)
class Level:
    """The transformer blocks that share one token grid: what a timing of that level needs."""

    downsample: int  # latent downsampling of the level's tokens (1 = the latent grid itself)
    blocks: int  # transformer blocks on it, down path, middle and up path together
    channels: int  # width of their self-attention input
    heads: int
