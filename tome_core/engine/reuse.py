"""Reusing a matching across model calls (``ToMeConfig.match_every``), as ToMA and CA-ToMe do across steps.

Why it is a count and not a step: which step a call is at lives on the device (a timestep or sigma tensor), and
reading it stops the host from running ahead of the GPU; a count of model calls of one shape costs nothing.
A host that knows where a sampling run starts (ComfyUI: a new ``sample_sigmas``) calls ``restart`` there, so
a run never starts on the last run's matching. Kept matchings are per key (grid, batch, device): a call of
another shape gets its own. Under torch.compile nothing is kept (the matching made inside a compiled graph
must not outlive it), so every call matches afresh there.
"""
from __future__ import annotations

from typing import Any, Dict, Hashable, Optional

import torch

_MAX_KEYS = 32


class _Kept:
    """One kept matching and how many calls it has served."""

    __slots__ = ("uses", "matching")

    def __init__(self, matching: Any) -> None:
        self.uses, self.matching = 1, matching


class MatchingReuse:
    """Matchings kept for ``every`` model calls each: the call that made one and the ``every - 1`` after it."""

    __slots__ = ("every", "on", "kept", "marker")

    def __init__(self, every: int) -> None:
        self.every = every
        self.on = every > 1  # an attribute, not a property: read once per level in every model call
        self.kept: Dict[Hashable, _Kept] = {}
        self.marker: Any = None  # what the host last said a sampling run is (``restart_on``)

    def take(self, key: Hashable) -> Optional[Any]:
        """The matching to reuse in this call (counted as one more use), or None: match afresh and ``keep`` it."""
        entry = self.kept.get(key)
        if entry is None or entry.uses >= self.every:
            return None
        entry.uses += 1
        return entry.matching

    def keep(self, key: Hashable, matching: Any) -> None:
        """A matching made in this call: reused by the next ``every - 1`` calls of ``key``."""
        if not self.on or torch.compiler.is_compiling():
            return
        if key not in self.kept and len(self.kept) >= _MAX_KEYS:
            self.kept.clear()
        self.kept[key] = _Kept(matching)

    def restart(self) -> None:
        """Forget every kept matching: the next call of each key matches afresh."""
        self.kept.clear()

    def restart_on(self, marker: Any) -> None:
        """``restart`` when the host's sampling-run marker (an object, compared by identity) changed."""
        if marker is not self.marker:
            self.marker = marker
            self.restart()
