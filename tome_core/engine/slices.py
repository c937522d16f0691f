"""One model call's sequence split across processes (context parallelism), as the reduction must see it.

Under context parallelism each process holds one contiguous chunk of the call's sequence: the text's and the grid's
tokens split apart into ``world`` equal chunks (diffusers' ``EquipartitionSharder``: process r holds text tokens
``[r*T/W, (r+1)*T/W)`` and grid tokens ``[r*G/W, (r+1)*G/W)``), its joint sequence ``[text_r, grid_r]``. Ulysses
attention gathers the chunks before attending: its queries and keys run over the whole sequence in process order,
``[text_0, grid_0, text_1, grid_1, ...]``. Mode kv keeps the keys the one-process call keeps, found at their place in
that gathered order (``gathered``), so a context-parallel call attends to the same keys as the one-process call: the
same image within float tolerance, the same token counts on every process.

Mode merge reduces each process's own chunk (``band``): a chunk of whole grid rows (frames) is a band of the
image, merged within itself (windows inside it, ``local_grid``) by every process alike, so every process ends each
block with the same token count, and the result equals one process merging the same bands (``MergeCall.bands``).
Host-free: a host reads ``world`` and ``rank`` from its own parallel config.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Tuple

import torch

from .grid import TokenLayout


@dataclass(frozen=True)
class SequenceSlices:
    """How a call's sequence is split: ``world`` processes, this one ``rank``; ``ring``: Ring attention (each
    attention step sees one process's chunk of keys); ``uneven``: chunks of unequal length allowed (diffusers'
    ``ulysses_anything`` / ``ring_anything``); ``agree``: the host's collective over the split's processes."""

    world: int
    rank: int
    ring: bool = False
    uneven: bool = False
    setting: str = ""  # the host's words for the parallel setting, for messages
    ulysses: int = 1  # the processes Ulysses attention gathers over (its all-to-all splits the heads among them)
    # (value, "max" or "min") -> that over every process of the split: the host's collective, which the speed check
    # takes one verdict with (None: a host without one; the speed check then does not time)
    agree: Optional[Callable[[float, str], float]] = field(default=None, compare=False, repr=False)

    def refusal(self, mode: str, layout: Optional[TokenLayout] = None, text: int = 0,
                window: Sequence[int] = (2, 2), attention: str = "plain") -> Optional[str]:
        """Why ToMe cannot reduce calls under this split in ``mode``, else None. ``layout``, where read: mode kv's
        key sequence; mode merge's image stream, ``text`` the text tokens split beside it (0 where the host does
        not split the text), ``window`` (sy, sx) its merge window, ``attention`` how merged keys are weighed."""
        if mode == "merge":
            return self._merge_refusal(layout, text, window, attention)
        if self.ring:
            return ("Ring attention hands each attention step one process's chunk of keys, so ToMe cannot pick the "
                    "kept keys where it reads them: use Ulysses attention (ulysses_degree) alone, or mode 'merge'")
        if self.uneven:
            return ("uneven chunks (ulysses_anything / ring_anything) would keep a different number of keys on each "
                    "process: leave them off")
        if layout is None:
            return None
        if layout.suffix:
            return f"{layout.suffix} tokens follow the grid (reference images), whose place per process is not known"
        if layout.prefix % self.world or layout.grid_tokens % self.world:
            return (f"{layout.prefix} text and {layout.grid_tokens} image tokens do not split into {self.world} equal "
                    "chunks")
        return None

    def _merge_refusal(self, stream: Optional[TokenLayout], text: int, window: Sequence[int],
                       attention: str) -> Optional[str]:
        if self.uneven:
            return ("uneven chunks (ulysses_anything / ring_anything) would merge a different number of tokens on "
                    "each process: leave them off")
        if attention == "proportional":
            return ("proportional attention weighs each key by the tokens its slot holds, which differ per process: "
                    "use merge_attention 'balanced' or 'plain'")
        if stream is None:
            return None
        if stream.prefix or stream.suffix:
            return (f"{stream.prefix + stream.suffix} tokens beside the grid (reference images), whose place per "
                    "process is not known")
        if text % self.world:
            return f"{text} text tokens do not split into {self.world} equal chunks"
        if self.local_grid(stream.grid, window) is None:
            size = "x".join(map(str, stream.grid))
            if len(stream.grid) == 2:
                return (f"the {size} token grid's {stream.grid[0]} rows do not split into {self.world} bands of whole "
                        f"rows: pick a height whose token rows divide by {self.world} (on Flux and Qwen-Image a token "
                        "row is 16 px), or mode 'kv'")
            frames, rows = stream.grid[0], stream.grid[0] * stream.grid[1]
            return (f"the {size} video grid's {frames} latent frames do not split into {self.world} equal chunks, nor "
                    f"its {rows} rows into {self.world} bands whose {window[0]}-row merge windows stay in one frame: "
                    f"pick a frame count whose latent frames divide by {self.world}, or mode 'kv'")
        return None

    def local_grid(self, grid: Sequence[int], window: Sequence[int] = (2, 2)) -> Optional[Tuple[int, ...]]:
        """The grid of one process's chunk of ``grid`` (raster order): (h / world, w) of an image; of a video
        (t / world, h, w) where its frames split evenly, else its rows as one (t * h / world, w) band whose
        ``window[0]``-row merge windows never straddle a frame; None where a chunk is not whole rows so aligned."""
        if len(grid) == 3:
            frames, height, width = grid
            if frames % self.world == 0:
                return (frames // self.world, height, width)
            rows, sy = frames * height, min(window[0], height)
            if rows % self.world == 0 and height % sy == 0 and (rows // self.world) % sy == 0:
                return (rows // self.world, width)
            return None
        height, width = grid
        return (height // self.world, width) if height % self.world == 0 else None

    def heads_refusal(self, heads: Optional[int]) -> Optional[str]:
        """Why the split cannot run a model of ``heads`` attention heads at all (with or without ToMe), else None."""
        if heads and self.ulysses > 1 and heads % self.ulysses:
            return (f"ulysses_degree={self.ulysses} does not divide its {heads} attention heads, which Ulysses "
                    "attention splits across the processes (it would fail inside the attention, ToMe or not): pick a "
                    "ulysses_degree that divides them")
        return None

    def own(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """This process's chunk of ``x`` along ``dim`` (as the host's even split hands it)."""
        size = x.shape[dim] // self.world
        return x.narrow(dim, self.rank * size, size)

    def carrier(self, x: torch.Tensor, dim: int) -> torch.Tensor:
        """A tensor ``world`` times ``x``'s length along ``dim`` whose chunk at this process's place is ``x``: what a
        host that splits a module's input inside the module's own call (diffusers' ``_cp_plan`` on a first block)
        splits back to ``x``."""
        shape = list(x.shape)
        shape[dim] *= self.world
        out = x.new_zeros(shape)
        out.narrow(dim, self.rank * x.shape[dim], x.shape[dim]).copy_(x)
        return out

    def gathered(self, layout: TokenLayout, keep: torch.Tensor) -> torch.Tensor:
        """``keep`` (indices into the one-process sequence ``[text, grid]``) at their places in the gathered sequence
        ``[text_0, grid_0, text_1, grid_1, ...]``, ascending."""
        text, grid = layout.prefix // self.world, layout.grid_tokens // self.world
        chunk = text + grid
        image = keep - layout.prefix
        where = torch.div(image, grid, rounding_mode="floor") * chunk + text + image.remainder(grid)
        if text:
            is_text = keep < layout.prefix
            where = torch.where(is_text, torch.div(keep, text, rounding_mode="floor") * chunk + keep.remainder(text),
                                where)
        return where.sort().values
