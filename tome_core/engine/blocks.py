"""Which of a transformer's blocks the block range holds: one rule for every host.

A DiT's blocks are counted in depth order over its block lists (Flux: its double blocks, then its
single blocks); block i of n is in the range iff block_start <= (i + 0.5) / n <= block_end. Where
block_start is not given, a model's default range starts at its first block list marked as reduced
by default (Flux: the single blocks). Adapters only count their host's lists; the rule and the
refusal's words live here.
"""
from __future__ import annotations

from typing import Optional, Sequence, Tuple

from .config import ToMeConfig


def default_start(counts: Sequence[int], defaults: Sequence[bool]) -> float:
    """block_start when none is given: the share of the depth before the first default-reduced block list.

    counts: blocks per list in run order; defaults: whether each list is reduced by default.
    """
    total, before = sum(counts), 0
    for count, default in zip(counts, defaults):
        if default and count:
            return before / total if 0 < before < total else 0.0
        before += count
    return 0.0


def chosen_blocks(config: ToMeConfig, count: int, default: float, model_name: str) -> Optional[Tuple[bool, ...]]:
    """Per block of ``count`` (depth order), whether config's range holds it; None when it holds every block.

    default: the model's ``default_start``. Raises ValueError naming ``model_name`` when the range holds none.
    """
    if config.block_range(default) == (0.0, 1.0):
        return None
    chosen = tuple(config.block_on(index, count, default) for index in range(count))
    if not any(chosen):
        start, end = config.block_range(default)
        raise ValueError(
            f"ToMe: block_start={start:g}..block_end={end:g} holds none of {model_name}'s {count} blocks "
            f"(block i is in it iff its centre (i + 0.5) / {count} is); widen the range.")
    return chosen
