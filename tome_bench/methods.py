"""The methods the benchmark compares: vanilla, this project's modes, and tomesd.

Each variant is applied right before its forward and removed right after, so every variant
runs on the same UNet object and the comparison is interleaved.
"""
from __future__ import annotations

import contextlib
import importlib
from dataclasses import dataclass
from typing import Iterator

import torch

METHODS = ("vanilla", "merge", "merge-level", "merge-auto", "merge-reuse", "merge-plain", "merge-bal", "merge-prop", "kv",
           "kv-avg", "tomesd")
DEFAULT_METHODS = ("vanilla", "merge", "kv", "tomesd")
# tome_core.apply_patch options of this project's methods
OUR_METHODS = {"merge": {"mode": "merge"}, "merge-level": {"mode": "merge", "matching": "level"},
               # what the ComfyUI nodes and the WebUI do by default (speed check on GPUs)
               "merge-auto": {"mode": "merge", "matching": "level", "speed_check": "auto"},
               # level matching kept for 3 model calls (match_every): what reusing the matching saves per call
               "merge-reuse": {"mode": "merge", "matching": "level", "match_every": 3},
               # DiT merge with each way of weighing the merged keys (token_merge.key_bias); "merge" is the family's
               "merge-plain": {"mode": "merge", "merge_attention": "plain"},
               "merge-bal": {"mode": "merge", "merge_attention": "balanced"},
               "merge-prop": {"mode": "merge", "merge_attention": "proportional"},
               "kv": {"mode": "kv"}, "kv-avg": {"mode": "kv", "kv_downsample": "avg"}}
# what each method name means, for the report
DESCRIPTIONS = {
    "vanilla": "unpatched UNet",
    "merge": "tome_core.apply_patch(mode='merge') (DiTs: the family's merge attention)",
    "merge-level": "tome_core.apply_patch(mode='merge', matching='level'): one matching per level and call",
    "merge-auto": "tome_core.apply_patch(mode='merge', matching='level', speed_check='auto'): the ComfyUI/WebUI "
                  "default; on a GPU a level measured slower is left whole",
    "merge-reuse": "tome_core.apply_patch(mode='merge', matching='level', match_every=3): two calls in three reuse "
                   "the matching (its error column is a matching call's; the error of reuse across steps: "
                   "python -m tome_bench.experiments.matching_reuse)",
    "merge-plain": "tome_core.apply_patch(mode='merge', merge_attention='plain'): DiTs, each merged key as one token",
    "merge-bal": "tome_core.apply_patch(mode='merge', merge_attention='balanced'): DiTs, the merged image keys weigh "
                 "as the image's tokens against the text",
    "merge-prop": "tome_core.apply_patch(mode='merge', merge_attention='proportional'): DiTs, each merged key weighs as "
                  "the tokens it holds",
    "kv": "tome_core.apply_patch(mode='kv')",
    "kv-avg": "tome_core.apply_patch(mode='kv', kv_downsample='avg')",
    "tomesd": "tomesd.apply_patch (reference package)",
}


@dataclass(frozen=True)
class Variant:
    """One row of the comparison: a method at a ratio (vanilla has ratio 0)."""

    method: str
    ratio: float = 0.0
    cell: tuple[int, int] | None = None  # (sx, sy) of this variant; None = the run's default (2, 2)
    blocks: tuple[float, float] | None = None  # DiTs: (block_start, block_end); None = every block

    @property
    def label(self) -> str:
        if self.method == "vanilla":
            return "vanilla"
        cell = f" {self.cell[0]}x{self.cell[1]}" if self.cell else ""
        blocks = f" b{self.blocks[0]:g}-{self.blocks[1]:g}" if self.blocks else ""
        return f"{self.method} r={self.ratio:g}{cell}{blocks}"

    @classmethod
    def parse(cls, entry: str, ratios: tuple[float, ...]) -> list["Variant"]:
        """'kv' -> kv at every ratio; 'kv@0.75' -> at 0.75 only; 'kv@0.88:3x3' -> with sx=3, sy=3;
        'kv@0.75+b0.34' -> DiT blocks 0.34..1 only ('+b0.34-0.8': block_start 0.34, block_end 0.8)."""
        entry, _, block_text = entry.partition("+b")
        spec, _, cell_text = entry.partition(":")
        method, _, ratio_text = spec.partition("@")
        cell = tuple(int(v) for v in cell_text.lower().split("x")) if cell_text else None
        if cell is not None and len(cell) != 2:
            raise ValueError(f"bad cell {cell_text!r} in {entry!r}: use SXxSY, e.g. kv@0.88:3x3")
        blocks = None
        if block_text:
            start, _, end = block_text.partition("-")
            try:
                blocks = (float(start), float(end) if end else 1.0)
            except ValueError:
                raise ValueError(f"bad block range {block_text!r}: use +bSTART or +bSTART-END, e.g. kv@0.75+b0.34") from None
        return [cls(method, r, cell, blocks) for r in ((float(ratio_text),) if ratio_text else ratios)]


def availability(method: str) -> str | None:
    """None when ``method`` can run here, else the reason it cannot."""
    if method not in METHODS:
        return f"unknown method {method!r}; choose from {', '.join(METHODS)}"
    if method == "vanilla":
        return None
    if method == "tomesd":
        try:
            importlib.import_module("tomesd")
        except ImportError:
            return "tomesd is not installed (pip install tomesd)"
        return None
    tome_core = importlib.import_module("tome_core")
    if not callable(getattr(tome_core, "apply_patch", None)):
        return "tome_core.apply_patch is not available in this checkout"
    return None


@contextlib.contextmanager
def patched(unet: torch.nn.Module, variant: Variant, **options) -> Iterator[torch.nn.Module]:
    """Apply ``variant`` to ``unet`` for the duration of the block; always removes it again.

    options: extra keyword arguments shared by both packages' ``apply_patch`` (e.g.
    ``max_downsample``, ``use_rand``); ``seed`` is passed to tome_core only.
    """
    if variant.method == "vanilla":
        yield unet
        return
    if variant.cell is not None:
        options = dict(options, sx=variant.cell[0], sy=variant.cell[1])
    if variant.blocks is not None:
        options = dict(options, block_start=variant.blocks[0], block_end=variant.blocks[1])
    if variant.method == "tomesd":
        pkg = importlib.import_module("tomesd")
        options = {k: v for k, v in options.items() if k != "seed"}
        pkg.apply_patch(unet, ratio=variant.ratio, **options)
    else:
        pkg = importlib.import_module("tome_core")
        pkg.apply_patch(unet, ratio=variant.ratio, **OUR_METHODS[variant.method], **options)
    try:
        yield unet
    finally:
        pkg.remove_patch(unet)
