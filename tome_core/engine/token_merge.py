"""Pure tensor engine of mode "merge" on DiTs: carry fewer image tokens through a whole block.

Why this shape (GPU first): on a DiT with fused attention most of a block's time is projections,
feed-forward and modulation, which only fewer *tokens* make cheaper (mode "kv" shortens keys only).
One ``TokenMerge`` is planned per model call from the first reduced block's input and reused by the
call's other reduced blocks; applying it is a scatter-add, a divide and a row gather per block,
with no host synchronisation and no sort on the hot path.

The matching is local: the grid is cut into windows of ``window`` tokens, one token per window is
its destination (picked like kv's keys, seeded per step), and the ``r`` other tokens most similar
to their own window's destination (cosine, summed over the batch) are merged into it. Local keeps
RoPE honest: a merged token sits at its destination's position, at most one window away from any
of its members. One matching serves the whole batch, so positional tables without a batch axis
(a rotary table shared by the batch) are cut with one index; CFG halves share their latent, so their
matchings would agree anyway.

Unmerge restores the sequence by the block's *update*, not its output: every token keeps its own
input and adds the update its group computed (``unmerge_update``), as tomesd's unmerge adds to the
residual stream. Tokens outside the grid (text, references, registers) are never merged.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .grid import TokenLayout


@dataclass(frozen=True)
class TokenMerge:
    """One call's merge of a token stream of ``length`` tokens into ``kept.numel()`` slots.

    group: [length] the slot each stream token is carried in; kept: [slots] the stream index of each
    slot's representative (itself or its destination), ascending; counts: [slots, 1] tokens per slot.
    """

    group: torch.Tensor
    kept: torch.Tensor
    counts: torch.Tensor
    length: int

    @property
    def slots(self) -> int:
        return self.kept.numel()

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        """[B, length, C] -> [B, slots, C]: each slot the mean of its tokens."""
        out = x.new_zeros(x.shape[0], self.slots, x.shape[-1]).index_add_(1, self.group, x)
        return out / self.counts.to(x.dtype)

    def unmerge_update(self, x: torch.Tensor, merged_in: torch.Tensor, merged_out: torch.Tensor) -> torch.Tensor:
        """The block's output on the full stream: each token's input ``x`` plus its slot's update."""
        return x + (merged_out - merged_in).index_select(1, self.group)

    def log_sizes(self) -> torch.Tensor:
        """[slots] float32: log of the tokens each slot stands for (0 for a token carried alone)."""
        return self.counts[:, 0].float().log()

    def take(self, table: torch.Tensor, dim: int, offset: int = 0, before: int = 0) -> torch.Tensor:
        """Rows of a per-token table (RoPE, masks, per-token modulation) for the merged stream, along ``dim``:
        ``before`` leading rows kept whole, then the stream's kept rows found ``offset`` rows in."""
        index = self.kept + offset
        if before:
            index = torch.cat([torch.arange(before, device=index.device), index])
        return table.index_select(dim, index)


def merge_window(grid: Sequence[int], sx: int, sy: int) -> tuple:
    """The destination window on a grid: sy x sx spatial (one frame at a time on video), never past a side."""
    window = (min(sy, grid[-2]), min(sx, grid[-1]))
    return window if len(grid) == 2 else (1,) + window


@dataclass(frozen=True)
class GridMatch:
    """Which grid tokens merge away and into which: ``merged_away`` [n] bool, ``target`` [n] the grid index each
    token is carried by (its destination, or itself). Independent of what surrounds the grid, so one matching
    serves every stream of a call (Flux's image stream and its [text, image] stream): ``on`` builds each."""

    merged_away: torch.Tensor
    target: torch.Tensor
    removed: int

    def on(self, layout: TokenLayout) -> TokenMerge:
        """The merge of a stream laid out as ``layout`` (this grid after ``layout.prefix`` tokens)."""
        device, length, n = self.target.device, layout.length, self.target.numel()
        start = layout.prefix
        merged_away = torch.zeros(length, dtype=torch.bool, device=device)
        merged_away[start:start + n] = self.merged_away
        slot = torch.cumsum(~merged_away, 0) - 1  # slot of each kept token
        target = torch.arange(length, device=device)
        target[start:start + n] = start + self.target
        group = torch.where(merged_away, slot[target], slot)
        slots = length - self.removed
        kept = torch.sort((~merged_away).to(torch.uint8), descending=True, stable=True).indices[:slots]
        counts = torch.zeros(slots, 1, device=device).index_add_(0, group, torch.ones(length, 1, device=device))
        return TokenMerge(group, kept, counts, length)


def match_grid(tokens: torch.Tensor, grid: Sequence[int], ratio: float, destinations: torch.Tensor,
               window: Sequence[int]) -> GridMatch:
    """Match the grid's tokens [B, n, C] (raster order): merge away the ``ratio * n`` non-destinations most similar
    to their own window's destination (at most all of them).

    destinations: [windows] raster grid indices, one per window of ``window`` (``kv.pick_index_nd``).
    """
    device, n = tokens.device, tokens.shape[1]
    destinations = destinations.to(device)
    dst_of_token = destinations[_window_of_each_token(grid, window, device)]  # [n]
    unit = torch.nn.functional.normalize(tokens.float(), dim=-1)
    similarity = (unit * unit[:, dst_of_token]).sum(-1).sum(0)  # [n], summed over the batch
    # index_fill_ writes its value from a kernel argument; ``t[index] = True`` would copy it from the host first (on
    # CUDA a pageable upload and a stream sync per call: two in every merge forward, 1.6 ms each on Flux, H100)
    is_dst = torch.zeros(n, dtype=torch.bool, device=device).index_fill_(0, destinations, True)
    similarity = similarity.masked_fill(is_dst, -float("inf"))
    r = min(int(ratio * n), n - destinations.numel())
    merged_away = torch.zeros(n, dtype=torch.bool, device=device)
    if r > 0:
        merged_away.index_fill_(0, similarity.topk(r).indices, True)
    target = torch.where(merged_away, dst_of_token, torch.arange(n, device=device))
    return GridMatch(merged_away, target, max(r, 0))


def match_bands(tokens: torch.Tensor, band_grid: Sequence[int], bands: int, ratio: float,
                destinations: torch.Tensor, window: Sequence[int]) -> GridMatch:
    """``match_grid`` as ``bands`` processes of context parallelism each match their own band of the grid's tokens
    [B, n, C] (``bands`` equal raster chunks, each laid out as ``band_grid``): one process reducing what a split
    call reduces (``slices.SequenceSlices.local_grid``)."""
    n = tokens.shape[1] // bands
    parts = [match_grid(tokens[:, band * n:(band + 1) * n], band_grid, ratio, destinations, window)
             for band in range(bands)]
    return GridMatch(torch.cat([part.merged_away for part in parts]),
                     torch.cat([part.target + band * n for band, part in enumerate(parts)]),
                     sum(part.removed for part in parts))


def _window_of_each_token(grid: Sequence[int], window: Sequence[int], device: torch.device) -> torch.Tensor:
    """[prod(grid)] the raster id of the window (in ``pick_index_nd``'s order) each grid token falls in."""
    ids = torch.zeros((), dtype=torch.long, device=device)
    for dim, (n, s) in enumerate(zip(grid, window)):
        per_side = -(-n // s)
        coord = torch.arange(n, device=device) // s
        ids = ids.unsqueeze(-1) * per_side + coord
    return ids.flatten()


# what each merge attention does, in the words describe() and the ComfyUI node use
ATTENTION_WORDS = {"plain": "plain attention (each merged key as one token)",
                   "balanced": "balanced attention (the merged image keys weigh as the image's tokens against the text)",
                   "proportional": "proportional attention (each merged key weighs as the tokens it holds)"}


def key_bias(merge: TokenMerge, stream: TokenLayout, keys: int, text: int = 0, text_first: bool = True,
             how: str = "balanced") -> Optional[torch.Tensor]:
    """The additive logit bias [keys] (float32) of an attention over the merged stream, so merged keys weigh as the
    tokens they hold; None where it changes nothing (no bias, or one value on every key) or the keys are not the
    stream.

    The keys are the merged stream laid out as ``stream`` (``keys == merge.slots``), or it with the ``text`` tokens a
    joint attention concatenates inside the block before it (``text_first``) or after it. ``how``:

    - "proportional": ``log`` of the tokens each key's slot stands for (ToMe for ViTs' ``prop_attn``), so attention
      over a merged key is attention over its tokens where they are alike.
    - "balanced": one value for every merged grid key, ``log(grid tokens / grid slots)``, 0 for the keys carried
      whole (text, references, padding): the grid keeps its share of the attention against them, and within the grid
      nothing changes. Where every key is a grid key (an image-only self-attention) that is one value on every key,
      which changes nothing: no bias there.
    - "plain": none.
    """
    if how == "plain" or keys not in (merge.slots, merge.slots + text):
        return None
    if how == "proportional":
        bias = merge.log_sizes()
    else:
        if keys == merge.slots and stream.prefix + stream.suffix == 0:
            return None
        in_grid = (merge.kept >= stream.prefix) & (merge.kept < stream.prefix + stream.grid_tokens)
        slots = merge.slots - stream.prefix - stream.suffix
        bias = in_grid.float() * math.log(stream.grid_tokens / slots)
    if keys == merge.slots:
        return bias
    zeros = bias.new_zeros(text)
    return torch.cat([zeros, bias] if text_first else [bias, zeros])


def biased_mask(mask: Optional[torch.Tensor], bias: torch.Tensor, dtype: torch.dtype, ndim: int) -> torch.Tensor:
    """An attention mask with ``bias`` [keys] added to every logit: the bias alone shaped [1, ..., keys] (``ndim``
    axes), a float mask plus it, a boolean mask's kept keys at it and its masked keys at -inf."""
    bias = bias.to(dtype).view((1,) * (ndim - 1) + (-1,))
    if mask is None:
        return bias
    if mask.dtype == torch.bool:
        return torch.where(mask, bias, -float("inf"))  # a scalar operand: no tensor made on the host
    return mask + bias
