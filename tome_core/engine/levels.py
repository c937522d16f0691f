"""A UNet level's token grid: which power-of-two downsampling of the latent a sequence of tokens is.

Pure arithmetic on sizes; where the levels sit in a model's module tree is the catalogue's
(``catalogue/unets.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Tuple


def grid_for_tokens(n_tokens: int, latent_h: int, latent_w: int) -> Optional[Tuple[int, int, int]]:
    """(downsample, h, w) of a level with n_tokens tokens for a latent of latent_h x latent_w.

    UNets halve each side per level, rounding up (stride-2 conv with padding 1) or down (pooling),
    so sizes not divisible by 8 are found exactly; None when no power-of-two level matches.
    """
    downsample = 1
    while downsample <= 2 * max(latent_h, latent_w):
        for rounding in (math.ceil, math.floor):
            h, w = rounding(latent_h / downsample), rounding(latent_w / downsample)
            if h * w == n_tokens:
                return downsample, h, w
        downsample *= 2
    return None


@dataclass(frozen=True)
class Level:
    """The transformer blocks that share one token grid: what a timing of that level needs."""

    downsample: int  # latent downsampling of the level's tokens (1 = the latent grid itself)
    blocks: int  # transformer blocks on it, down path, middle and up path together
    channels: int  # width of their self-attention input
    heads: int
