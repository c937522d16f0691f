"""One model call's sequence split across processes (context parallelism), as the reduction must see it.

Under context parallelism each process holds one contiguous chunk of the call's sequence: the text's and the grid's
tokens split apart into ``world`` equal chunks (diffusers' ``EquipartitionSharder``: process r holds text tokens
``[r*T/W, (r+1)*T/W)`` and grid tokens ``[r*G/W, (r+1)*G/W)``), its joint sequence ``[text_r, grid_r]``. Ulysses
attention gathers the chunks before attending: its queries and keys run over the whole sequence in process order,
``[text_0, grid_0, text_1, grid_1, ...]``. Mode kv keeps the keys the one-process call keeps, found at their place in
that gathered order (``gathered``), so a context-parallel call attends to the same keys as the one-process call: the
same image within float tolerance, the same token counts on every process. Host-free: a host reads ``world`` and
``rank`` from its own parallel config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

from .grid import TokenLayout


@dataclass(frozen=True)
class SequenceSlices:
    """How a call's sequence is split: ``world`` processes, this one ``rank``; ``ring``: Ring attention (each
    attention step sees one process's chunk of keys); ``uneven``: chunks of unequal length allowed (diffusers'
    ``ulysses_anything`` / ``ring_anything``)."""

    world: int
    rank: int
    ring: bool = False
    uneven: bool = False
    setting: str = ""  # the host's words for the parallel setting, for messages

    def refusal(self, mode: str, layout: Optional[TokenLayout] = None) -> Optional[str]:
        """Why ToMe cannot reduce calls under this split in ``mode`` (and one of ``layout`` where given), else
        None."""
        if mode != "kv":
            return (f"mode {mode} merges each block's tokens, which are split across processes here (a per-process "
                    "merge is not built yet): use mode 'kv'")
        if self.ring:
            return ("Ring attention hands each attention step one process's chunk of keys, so ToMe cannot pick the "
                    "kept keys where it reads them: use Ulysses attention (ulysses_degree) alone")
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
