"""Where a DiT's tokens sit in one attention sequence: text before, an image/video grid, text after."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class TokenLayout:
    """One attention sequence: ``prefix`` tokens, then a raster grid (h, w) or (t, h, w), then ``suffix``.

    Flux puts its text first (prefix = text length), diffusers' SD3 last (suffix = text length;
    ComfyUI's MMDiT puts it first); an image-only self-attention (Wan's attn1, SD3.5's attn2) has
    neither. The layout comes from the model's inputs, never from a guess: a sequence whose length
    does not match is left alone.
    """

    grid: Tuple[int, ...]
    prefix: int = 0
    suffix: int = 0

    def __post_init__(self) -> None:
        if len(self.grid) not in (2, 3) or any(int(n) < 1 for n in self.grid):
            raise ValueError(f"ToMe: a DiT token grid is (h, w) or (t, h, w) of positive sizes, got {self.grid!r}.")
        if self.prefix < 0 or self.suffix < 0:
            raise ValueError(f"ToMe: prefix/suffix token counts must be >= 0, got {self.prefix}, {self.suffix}.")

    @property
    def grid_tokens(self) -> int:
        return math.prod(self.grid)

    @property
    def length(self) -> int:
        """Length of the whole sequence this layout describes."""
        return self.prefix + self.grid_tokens + self.suffix

    def image_only(self) -> "TokenLayout":
        """The same grid without text: the layout of an image-only self-attention."""
        return TokenLayout(self.grid)
