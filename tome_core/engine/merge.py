"""Token merging as pure tensor functions (no hooks, no host, no global state).

Bipartite soft matching on a strided 2-D partition ("Token Merging for Fast Stable Diffusion",
arXiv 2303.17604): one destination token per sx*sy cell, every other token is a source; the r
sources most similar (cosine) to their best destination are averaged into it. ``merge`` shrinks
[B, N, C] to [B, N - r, C]; ``unmerge`` copies each merged token back to every position it absorbed.

The maths equals tomesd 0.1.3's; the bookkeeping is cheaper: the partition is computed once per
grid and step (``make_partition``) and shared by every block and batch row, the r best edges are
picked with ``topk`` instead of a full sort, merging is one ``scatter_add_`` and unmerging one
``index_select``.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial
from typing import Callable, Optional, Tuple

import torch

TokenFn = Callable[[torch.Tensor], torch.Tensor]


def do_nothing(x: torch.Tensor) -> torch.Tensor:
    """The identity, so an inactive plan runs the same call sites with nothing to do."""
    return x


@dataclass(frozen=True)
class Partition:
    """Destination/source split of an h*w token grid (raster order), shared across a batch and step.

    dst_idx: [Nd] token indices of the destinations (one per full sx*sy cell).
    src_idx: [Ns] the remaining token indices, including the ragged right/bottom border.
    dst_mask: [N] float, -inf at destinations and 0 at sources: keeps destinations out of the top-r.
    base_slot: [N] long, a destination's place among the destinations, Nd - 1 at sources (whose
        place in the merged sequence is Nd - 1 + their rank among the unmerged sources).
    is_src: [N] long, 1 at sources.
    The last three let ``match_tokens`` work on the whole sequence without gathering the sources.
    """

    dst_idx: torch.Tensor
    src_idx: torch.Tensor
    dst_mask: torch.Tensor
    base_slot: torch.Tensor
    is_src: torch.Tensor

    @property
    def num_dst(self) -> int:
        return self.dst_idx.numel()


def make_partition(h: int, w: int, sx: int, sy: int, cell_choice: Optional[torch.Tensor] = None,
                   device: torch.device | str = "cpu") -> Partition:
    """Pick one destination per full sx*sy cell of an h*w grid.

    cell_choice: [h // sy, w // sx] integers in [0, sx*sy) choosing the cell's destination in
        row-major order inside the cell; None picks the top-left token (tomesd's use_rand=False).
    Tokens of a partial cell at the right or bottom border are all sources, as in tomesd.
    Built on the CPU once per grid and step, then moved to ``device`` without a host sync.
    """
    hsy, wsx = h // sy, w // sx
    if cell_choice is None:
        cell_choice = torch.zeros(hsy, wsx, dtype=torch.long)
    cell_choice = cell_choice.to("cpu", torch.long)
    rows = torch.arange(hsy).view(-1, 1) * sy + cell_choice // sx
    cols = torch.arange(wsx).view(1, -1) * sx + cell_choice % sx
    is_dst = torch.zeros(h * w, dtype=torch.int8).index_fill_(0, (rows * w + cols).flatten(), 1)
    # A stable sort puts the sources, then the destinations, each in raster order: the same split as
    # nonzero() without its data-dependent shape (the number of destinations is hsy * wsx).
    order = torch.sort(is_dst, stable=True).indices
    num_src, num_dst = h * w - hsy * wsx, hsy * wsx
    dst_idx = order[num_src:]
    base_slot = torch.full((h * w,), num_dst - 1, dtype=torch.long)
    base_slot[dst_idx] = torch.arange(num_dst)
    dst_mask = torch.zeros(h * w).masked_fill_(is_dst.bool(), float("-inf"))
    return Partition(dst_idx=to_device(dst_idx, device), src_idx=to_device(order[:num_src], device),
                     dst_mask=to_device(dst_mask, device), base_slot=to_device(base_slot, device),
                     is_src=to_device(1 - is_dst.long(), device))


def to_device(x: torch.Tensor, device: torch.device | str) -> torch.Tensor:
    """Move a table built on the CPU to ``device`` without a host sync.

    A plain CPU-to-CUDA copy waits for the stream to drain; from pinned memory with non_blocking it is
    queued like a kernel (the caching host allocator keeps the pinned buffer alive until it is done).
    """
    device = torch.device(device)
    if device.type == "cuda":
        return x.pin_memory().to(device, non_blocking=True)
    return x.to(device)


SCORE_CHUNK_ELEMENTS = 1 << 23  # ~32 MB of fp32 scores at a time on the CPU (cache-sized)
SCORE_CHUNK_ELEMENTS_GPU = 1 << 26  # 128 MB of bf16 on a GPU: one or two launches up to 1024 px


def best_destinations(src: torch.Tensor, dst: torch.Tensor) -> Tuple[torch.Tensor, torch.Tensor]:
    """Max and argmax over destinations of src @ dst^T, in row chunks.

    src: [B, Ns, C], dst: [B, Nd, C] -> ([B, Ns], [B, Ns]). The full score matrix would be the
    largest tensor of the step at high resolution (CPU and GPU attention kernels never build one),
    so it is never materialised whole; the result is the same.
    """
    batch, num_src, _ = src.shape
    budget = SCORE_CHUNK_ELEMENTS if src.device.type == "cpu" else SCORE_CHUNK_ELEMENTS_GPU
    rows = max(1, budget // max(1, batch * dst.shape[1]))
    dst_t = dst.transpose(-1, -2)
    if rows >= num_src:
        return torch.bmm(src, dst_t).max(dim=-1)
    best = [torch.bmm(src[:, i:i + rows], dst_t).max(dim=-1) for i in range(0, num_src, rows)]
    return torch.cat([b.values for b in best], dim=1), torch.cat([b.indices for b in best], dim=1)


@dataclass(frozen=True)
class Matching:
    """Where every token of a [B, N, C] sequence goes when r of them are merged away.

    slot: [B, N] each token's place in the merged sequence [destinations | unmerged sources];
    the rest is ``slot`` laid out for the two ops that use it, built once per matching so that
    merging is one scatter-add and a scale, and unmerging one row gather.
    """

    shape: Tuple[int, int, int]  # (batch, tokens, merged tokens)
    slot: torch.Tensor
    scatter_index: torch.Tensor  # [B * N, C] the flat slot of each token, broadcast over channels
    inverse_counts: torch.Tensor  # [B * N', 1] 1 / tokens averaged into each merged token
    flat_slot: torch.Tensor  # [B * N] slot + batch offset

    def functions(self) -> Tuple[TokenFn, TokenFn]:
        """(merge, unmerge) as partials of module-level functions: torch.compile carries them from the
        block's pre-hook to its attention hooks without breaking the graph (closures would)."""
        return partial(_merge, matching=self), partial(_unmerge, matching=self)


GATHER_SOURCES_ON = ("cpu",)  # device types where match_tokens gathers the sources and scores them alone


def match_tokens(metric: torch.Tensor, partition: Partition, r: int,
                 gather_sources: Optional[bool] = None) -> Optional[Matching]:
    """Bipartite soft matching of ``metric``'s tokens on ``partition``; None when nothing is merged.

    metric: [B, N, C] tokens whose cosine similarity decides the matching (the block input).
    r: number of tokens to remove, clipped to the number of sources. The r sources most similar to
    their best destination are averaged into it (tomesd 0.1.3's maths), with a few large ops, no
    sort and no host sync. On a GPU scores are taken for every token against the destinations, the
    destinations' own rows masked out, so no source is gathered (each op is a kernel launch, and
    the extra quarter of score rows is cheap there); on the CPU, where those rows would cost more
    than the gather, the sources are gathered and scored alone. The result is the same.
    gather_sources: None chooses by device (``GATHER_SOURCES_ON``).
    """
    batch, n_tokens, channels = metric.shape
    num_dst = partition.num_dst
    r = min(r, n_tokens - num_dst)
    if r <= 0:
        return None
    num_out = n_tokens - r
    with torch.no_grad():
        metric = metric / metric.norm(dim=-1, keepdim=True)
        dst = metric.index_select(1, partition.dst_idx)
        if metric.device.type in GATHER_SOURCES_ON if gather_sources is None else gather_sources:
            src_max, src_idx = best_destinations(metric.index_select(1, partition.src_idx), dst)
            merged = partition.src_idx[src_max.topk(r, dim=-1, sorted=False).indices]  # [B, r] positions
            node_idx = src_idx.new_empty(batch, n_tokens).index_copy_(1, partition.src_idx, src_idx)
        else:
            node_max, node_idx = best_destinations(metric, dst)
            merged = (node_max + partition.dst_mask).topk(r, dim=-1, sorted=False).indices  # [B, r] positions
        slots = torch.ops.tome.match_slots if torch.compiler.is_compiling() else match_slots
        slot, flat_slot, inverse_counts = slots(merged, node_idx, partition.base_slot, partition.is_src, num_out)
    return Matching(shape=(batch, n_tokens, num_out), slot=slot,
                    scatter_index=flat_slot.view(-1, 1).expand(-1, channels),
                    inverse_counts=inverse_counts.to(metric.dtype), flat_slot=flat_slot)


def match_slots(merged: torch.Tensor, node_idx: torch.Tensor, base_slot: torch.Tensor, is_src: torch.Tensor,
                num_out: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Each token's place in the merged sequence, from the merged sources and their destinations.

    merged: [B, r] positions merged away; node_idx: [B, N] each token's best destination; base_slot, is_src:
    the partition's. Returns (slot [B, N], flat_slot [B * N] = slot + batch offset, inverse_counts [B * N', 1]
    float32). Under torch.compile this runs as one opaque op (``torch.ops.tome.match_slots``): inductor's CUDA
    code generation failed on this int64 arithmetic fused into one kernel ("list indices must be integers or
    slices, not NoneType", torch 2.11), while eager kernels and the CPU's inductor handled it.
    """
    batch, n_tokens = node_idx.shape
    is_merged = torch.zeros(batch, n_tokens, dtype=torch.bool, device=node_idx.device).scatter_(1, merged, True)
    unmerged = is_src.masked_fill(is_merged, 0)  # [B, N] 1 at sources that stay
    slot = torch.where(is_merged, node_idx, base_slot + unmerged.cumsum(dim=1) * unmerged)
    flat_slot = (slot + torch.arange(0, batch * num_out, num_out, device=slot.device).view(-1, 1)).view(-1)
    counts = torch.zeros(batch * num_out, 1, dtype=torch.float32, device=slot.device)
    counts.index_add_(0, flat_slot, torch.ones(batch * n_tokens, 1, device=slot.device))
    return slot, flat_slot, counts.reciprocal_()


def _register_match_slots() -> None:
    """``match_slots`` as the custom op torch.ops.tome.match_slots (once per process: a second copy of this
    package, as a host may import it under two names, reuses the first's)."""
    if hasattr(torch.ops.tome, "match_slots"):
        return

    @torch.library.custom_op("tome::match_slots", mutates_args=())
    def _op(merged: torch.Tensor, node_idx: torch.Tensor, base_slot: torch.Tensor, is_src: torch.Tensor,
            num_out: int) -> Tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return match_slots(merged, node_idx, base_slot, is_src, num_out)

    @_op.register_fake
    def _(merged, node_idx, base_slot, is_src, num_out):
        batch, n_tokens = node_idx.shape
        return (node_idx.new_empty(batch, n_tokens), node_idx.new_empty(batch * n_tokens),
                node_idx.new_empty(batch * num_out, 1, dtype=torch.float32))


_register_match_slots()


def bipartite_soft_matching(metric: torch.Tensor, partition: Partition, r: int) -> Tuple[TokenFn, TokenFn]:
    """``match_tokens`` as (merge, unmerge); r <= 0 (or no source to merge) gives the identity.

    merge: [B, N, C'] -> [B, N - r, C'] (destinations first, then unmerged sources);
    unmerge: [B, N - r, C'] -> [B, N, C'].
    """
    matching = match_tokens(metric, partition, r)
    return (do_nothing, do_nothing) if matching is None else matching.functions()


def _merge(x: torch.Tensor, matching: Matching) -> torch.Tensor:
    batch, n_tokens, num_out = matching.shape
    channels = x.shape[-1]
    index = matching.scatter_index
    if index.shape[1] != channels:
        index = matching.flat_slot.view(-1, 1).expand(-1, channels)
    scale = matching.inverse_counts
    if scale.dtype != x.dtype:
        scale = scale.to(x.dtype)
    # scatter_add_ rather than index_add_ or scatter_reduce: the fastest of the three on CPU.
    out = torch.zeros(batch * num_out, channels, dtype=x.dtype, device=x.device)
    return out.scatter_add_(0, index, x.reshape(batch * n_tokens, channels)).mul_(scale).view(batch, num_out, channels)


def _unmerge(x: torch.Tensor, matching: Matching) -> torch.Tensor:
    batch, n_tokens, num_out = matching.shape
    channels = x.shape[-1]
    return x.reshape(batch * num_out, channels).index_select(0, matching.flat_slot).view(batch, n_tokens, channels)


def kv_pool_window(ratio: float, sx: int, sy: int) -> Tuple[int, int]:
    """The (py, px) window, within sy x sx, that pools keys/values closest to ``ratio``.

    Chooses the window area py*px closest in log scale to 1 / (1 - ratio) (ties: the smaller area,
    then the squarer window): with 2x2 cells ratio 0.5 -> (1, 2), 0.7-0.75 -> (2, 2), below ~0.29
    -> (1, 1) (off); with 3x3 cells ratio 0.85 -> (2, 3), 0.88 -> (3, 3).
    """
    target = math.log(1.0 / (1.0 - ratio))
    windows = [(py, px) for py in range(1, sy + 1) for px in range(1, sx + 1)]
    return min(windows, key=lambda pw: (round(abs(math.log(pw[0] * pw[1]) - target), 9), pw[0] * pw[1],
                                        abs(pw[0] - pw[1]), -pw[1]))


def pool_tokens(x: torch.Tensor, h: int, w: int, window: Tuple[int, int]) -> torch.Tensor:
    """Average x: [B, h*w, C] over (py, px) windows of its token grid -> [B, ceil(h/py)*ceil(w/px), C].

    Partial windows at the border average only the tokens they cover (ceil_mode, no padding).
    """
    if window == (1, 1):
        return x
    batch, _, channels = x.shape
    grid = x.transpose(1, 2).reshape(batch, channels, h, w)
    pooled = torch.nn.functional.avg_pool2d(grid, kernel_size=window, stride=window, ceil_mode=True)
    return pooled.flatten(2).transpose(1, 2)


def kv_pick_index(h: int, w: int, window: Tuple[int, int], choice: Optional[torch.Tensor] = None,
                  device: torch.device | str = "cpu") -> torch.Tensor:
    """Raster indices of one token per (py, px) window of an h x w grid: [ceil(h/py) * ceil(w/px)].

    This is ToDo's nearest-neighbour downsampling of keys/values: a real token stands for its
    window, so keys keep their magnitude (averaging shrinks them and flattens peaked attention).
    choice: [2, ceil(h/py), ceil(w/px)] uniform draws in [0, 1) that place the pick (row, column)
    inside each window, as tomesd's use_rand places destinations; None picks each window's centre.
    Partial windows at the border pick among the tokens they cover.
    """
    py, px = window
    rows_start = torch.arange(0, h, py)
    cols_start = torch.arange(0, w, px)
    rows_size = (h - rows_start).clamp(max=py)
    cols_size = (w - cols_start).clamp(max=px)
    if choice is None:
        row_offset = (rows_size // 2).view(-1, 1).expand(len(rows_start), len(cols_start))
        col_offset = (cols_size // 2).view(1, -1).expand(len(rows_start), len(cols_start))
    else:
        row_offset = (choice[0] * rows_size.view(-1, 1)).long()
        col_offset = (choice[1] * cols_size.view(1, -1)).long()
    rows = rows_start.view(-1, 1) + row_offset
    cols = cols_start.view(1, -1) + col_offset
    return to_device((rows * w + cols).flatten(), device)
