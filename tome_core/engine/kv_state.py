"""What every DiT adapter keeps per patch: the config, the kept indices (kv) or destinations (merge) per step and
one-time warnings."""
from __future__ import annotations

import logging
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .config import ToMeConfig
from .plan import draw_table, partition_seed
from .reuse import MatchingReuse
from .speed_check import Verdict, call_verdict
from .grid import TokenLayout
from .kv import dit_window, keep_index, pick_index_nd

_LOG = logging.getLogger("tome.dit")


def call_label(grid: Tuple[int, ...], batch: int) -> str:
    """A call shape in words for the speed check's verdicts: "64x64 image tokens, batch 2", "9x30x52 video ..."."""
    kind = "video" if len(grid) == 3 else "image"
    return f"{'x'.join(str(n) for n in grid)} {kind} tokens, batch {batch}"


class KVPatchState:
    """Base of the diffusers and ComfyUI adapters' state (it lives on the patched object, never in a global)."""

    def __init__(self, config: ToMeConfig) -> None:
        self.config = config
        self._cache: Dict[Tuple, Any] = {}  # (what, grid or layout, device) -> seeded candidates (draw_table)
        self._step: List[Any] = [None, 0]  # the last step tensor and its choice
        self._warned: set = set()
        self.reduced_calls = 0
        self.verdicts: Dict[str, Verdict] = {}  # the speed check's, by call shape (call_pays)
        self.reuse = MatchingReuse(config.match_every)  # mode merge: GridMatches kept across calls (match_every)

    def call_pays(self, what: Tuple, label: str, dtype: torch.dtype, device: torch.device,
                  run: Optional[Callable[[bool], object]]) -> bool:
        """The speed check of one model call of ``what`` (class, layout, batch): ``speed_check.call_verdict``; the
        verdict is kept under ``label`` (e.g. "1024x1024 px, batch 2") for ``describe_verdicts``."""
        if self.config.speed_check == "off":
            return True
        found = call_verdict(self.config, what, dtype, device, run)
        if self.verdicts.get(label) != found:
            self.verdicts[label] = found
            self.warn_once(f"verdict:{label}:{found}", f"ToMe speed check: {label}: {found.text(self.config.mode)}")
        return found.reduce

    def describe_verdicts(self) -> list:
        """One line per call shape the speed check decided."""
        return [f"{label}: {found.text(self.config.mode)}" for label, found in self.verdicts.items()]

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _LOG.warning(message)

    def _generator(self, grid: Tuple[int, ...], step_key: float) -> "torch.Generator | None":
        """A generator seeded like UNets' partitions (seed, step_key, grid); None for centre picks (no use_rand)."""
        if not self.config.use_rand:
            return None
        rows = grid[-2] * (grid[0] if len(grid) == 3 else 1)
        return torch.Generator().manual_seed(partition_seed(self.config.seed, step_key, rows, grid[-1]))

    def _draw(self, key: Tuple, grid: Tuple[int, ...], step_key: Any, device: torch.device,
              build: Callable[[Optional[torch.Generator]], torch.Tensor]) -> torch.Tensor:
        return draw_table(self._cache, key + (str(device),), step_key, device, self.config, build,
                          lambda k: self._generator(grid, float(k)), self._step)

    def keep_for(self, layout: TokenLayout, step_key: Any, device: torch.device) -> torch.Tensor:
        """Kept sequence indices of a call: one of the seeded candidates of (layout, device), the one the step
        draws (``draw_table``: a step tensor is hashed on its device, never read), so both CFG halves and separate
        cond/uncond calls pick alike."""
        window = dit_window(self.config.ratio, layout.grid, self.config.sx, self.config.sy)
        return self._draw(("keep", layout), layout.grid, step_key, device,
                          lambda generator: keep_index(layout, pick_index_nd(layout.grid, window, generator)))

    def destinations_for(self, grid: Tuple[int, ...], window: Tuple[int, ...], step_key: Any,
                         device: torch.device) -> torch.Tensor:
        """Mode merge's destinations: one grid token per window, drawn like ``keep_for``."""
        return self._draw(("merge", grid, window), grid, step_key, device,
                          lambda generator: pick_index_nd(grid, window, generator))
