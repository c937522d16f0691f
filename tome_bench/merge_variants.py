"""Two ways of choosing and using merged tokens that ``merged_token_use`` measured and the engine does not take:
soft merge/unmerge within a window (ToMA, arXiv 2509.10918) and destinations chosen by facility location (each
window's medoid). Pure torch on the engine's types (``token_merge.GridMatch``/``TokenMerge``), applied to the DiT
merge hooks by ``applied`` (the experiment's only way in); tests/bench/test_merge_variants.py checks them (a lab module beside the experiment that runs them).

- ``soften``: each merged-away token is shared among the kept tokens of its own window by a softmax of its cosine
  similarity to them over a temperature; merge averages each slot's share-weighted tokens (``SoftMerge.merge``),
  unmerge gives each token the share-weighted mix of its slots' updates. The same slots are carried: equal tokens.
- ``medoid_destinations``: each window's destination is the token with the largest summed similarity to the
  window's tokens (facility location with one facility per window) instead of a seeded random one.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Iterator, Optional, Sequence

import torch

from tome_core.engine import call_plan
from tome_core.engine.grid import TokenLayout
from tome_core.engine.token_merge import GridMatch, TokenMerge, _window_of_each_token


@dataclass(frozen=True)
class SoftMerge(TokenMerge):
    """A ``TokenMerge`` whose tokens are shared among ``k`` candidate slots: ``group`` [length, k] the slots,
    ``weight`` [length, k] each token's share of each (rows sum to 1); counts: [slots, 1] the mass each slot holds
    (summing to ``length``). A one-hot weight is the hard merge."""

    weight: Optional[torch.Tensor] = None

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        spread = x.unsqueeze(2) * self.weight.to(x.dtype).unsqueeze(-1)  # [B, length, k, C]
        out = x.new_zeros(x.shape[0], self.slots, x.shape[-1]).index_add_(1, self.group.flatten(), spread.flatten(1, 2))
        return out / self.counts.to(x.dtype)

    def unmerge_update(self, x: torch.Tensor, merged_in: torch.Tensor, merged_out: torch.Tensor) -> torch.Tensor:
        update = (merged_out - merged_in).index_select(1, self.group.flatten()).unflatten(1, tuple(self.group.shape))
        return x + (update * self.weight.to(x.dtype).unsqueeze(-1)).sum(2)


@dataclass(frozen=True)
class SoftMatch(GridMatch):
    """A ``GridMatch`` whose ``target`` is [n, k] candidates with ``weight`` [n, k]; ``on`` builds a ``SoftMerge``."""

    weight: Optional[torch.Tensor] = None

    def on(self, layout: TokenLayout) -> SoftMerge:
        device, length, n = self.target.device, layout.length, self.target.shape[0]
        start, k = layout.prefix, self.target.shape[1]
        merged_away = torch.zeros(length, dtype=torch.bool, device=device)
        merged_away[start:start + n] = self.merged_away
        slot = torch.cumsum(~merged_away, 0) - 1
        slots = length - self.removed
        kept = torch.sort((~merged_away).to(torch.uint8), descending=True, stable=True).indices[:slots]
        group = slot.unsqueeze(1).repeat(1, k)  # tokens outside the grid: their own slot alone
        group[start:start + n] = slot[start + self.target]
        weight = torch.zeros(length, k, device=device)
        weight[:, 0] = 1.0
        weight[start:start + n] = self.weight
        counts = torch.zeros(slots, 1, device=device).index_add_(0, group.flatten(), weight.reshape(-1, 1))
        return SoftMerge(group, kept, counts, length, weight)


def window_members(grid: Sequence[int], window: Sequence[int], device: torch.device) -> torch.Tensor:
    """[windows, prod(window)] the raster grid indices of each window's tokens (windows in ``pick_index_nd``'s
    order), -1 where a partial window at a border has none."""
    counts = [-(-n // s) for n, s in zip(grid, window)]
    corners = torch.stack(torch.meshgrid(*[torch.arange(c, device=device) * s for c, s in zip(counts, window)],
                                         indexing="ij"), -1).reshape(-1, len(grid))
    offsets = torch.stack(torch.meshgrid(*[torch.arange(s, device=device) for s in window], indexing="ij"),
                          -1).reshape(-1, len(grid))
    coords = corners[:, None] + offsets[None]  # [windows, w, dims]
    inside = (coords < torch.tensor(list(grid), device=device)).all(-1)
    flat = torch.zeros(coords.shape[:2], dtype=torch.long, device=device)
    for dim, n in enumerate(grid):
        flat = flat * n + coords[..., dim]
    return flat.masked_fill(~inside, -1)


def medoid_destinations(tokens: torch.Tensor, grid: Sequence[int], window: Sequence[int]) -> torch.Tensor:
    """[windows] each window's token with the largest sum of cosine similarities to the window's tokens (over the
    batch). tokens: [B, n, C], raster order."""
    members = window_members(grid, window, tokens.device)
    inside = members >= 0
    unit = torch.nn.functional.normalize(tokens.float(), dim=-1)[:, members.clamp(min=0)]  # [B, windows, w, C]
    unit = unit * inside.unsqueeze(-1)
    score = torch.einsum("bwic,bwjc->wi", unit, unit).masked_fill(~inside, -float("inf"))
    return members.gather(1, score.argmax(1, keepdim=True)).squeeze(1)


def soften(match: GridMatch, tokens: torch.Tensor, grid: Sequence[int], window: Sequence[int],
           temperature: float) -> SoftMatch:
    """``match`` with each merged-away token shared among its window's kept tokens by softmax(similarity / T) (mean
    cosine over the batch); kept tokens stay one-hot to themselves. As T -> 0 each merged-away token goes to its
    window's most similar kept token."""
    device = tokens.device
    members = window_members(grid, window, device)
    candidates = members[_window_of_each_token(grid, window, device)]  # [n, w]
    valid = (candidates >= 0) & ~match.merged_away[candidates.clamp(min=0)]
    candidates = torch.where(valid, candidates, match.target.unsqueeze(1))
    unit = torch.nn.functional.normalize(tokens.float(), dim=-1)
    similarity = torch.stack([(unit * unit[:, candidates[:, j]]).sum(-1).mean(0)
                              for j in range(candidates.shape[1])], 1)  # [n, w]
    weight = torch.softmax((similarity / temperature).masked_fill(~valid, -float("inf")), 1)
    own = (candidates == match.target.unsqueeze(1)) & valid
    first_own = own & (torch.cumsum(own.int(), 1) == 1)
    weight = torch.where(match.merged_away.unsqueeze(1), weight, first_own.float())
    return SoftMatch(match.merged_away, candidates, match.removed, weight)


@contextlib.contextmanager
def applied(temperature: Optional[float] = None, medoid: bool = False) -> Iterator[None]:
    """While open, the diffusers DiT merge hooks match with medoid destinations and/or soften the matching at
    ``temperature`` (None: hard), by wrapping the engine call plan's ``match_grid`` (every host's merge matches
    there)."""
    if temperature is None and not medoid:
        yield
        return
    original = call_plan.match_grid

    def match(tokens, grid, ratio, destinations, window):
        if medoid:
            destinations = medoid_destinations(tokens, grid, window)
        found = original(tokens, grid, ratio, destinations, window)
        return found if temperature is None else soften(found, tokens, grid, window, temperature)

    call_plan.match_grid = match
    try:
        yield
    finally:
        call_plan.match_grid = original
