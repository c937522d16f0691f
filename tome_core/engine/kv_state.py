"""What every DiT adapter keeps per patch: the config, the kept indices (kv) or destinations (merge) per step and
one-time warnings."""
from __future__ import annotations

import logging
from typing import Dict, Tuple

import torch

from .config import ToMeConfig
from .plan import partition_seed
from .grid import TokenLayout
from .kv import dit_window, keep_index, pick_index_nd

_LOG = logging.getLogger("tome.dit")
_MAX_CACHED = 16


class KVPatchState:
    """Base of the diffusers and ComfyUI adapters' state (it lives on the patched object, never in a global)."""

    def __init__(self, config: ToMeConfig) -> None:
        self.config = config
        self._cache: Dict[Tuple, torch.Tensor] = {}
        self._warned: set = set()
        self.reduced_calls = 0

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _LOG.warning(message)

    def _generator(self, grid: Tuple[int, ...], step_key: float) -> "torch.Generator | None":
        """The step's seeded generator (UNets' partition seed), None for centre picks (use_rand off)."""
        if not self.config.use_rand:
            return None
        rows = grid[-2] * (grid[0] if len(grid) == 3 else 1)
        return torch.Generator().manual_seed(partition_seed(self.config.seed, step_key, rows, grid[-1]))

    def keep_for(self, layout: TokenLayout, step_key: float, device: torch.device) -> torch.Tensor:
        """Kept sequence indices, built once per (layout, step, device) with a generator seeded like UNets'
        partitions (seed, step, grid), so both CFG halves and separate cond/uncond calls pick alike."""
        config = self.config
        key = (layout, step_key if config.use_rand else None, str(device))
        keep = self._cache.get(key)
        if keep is None:
            grid = layout.grid
            window = dit_window(config.ratio, grid, config.sx, config.sy)
            generator = self._generator(grid, step_key)
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            keep = self._cache[key] = keep_index(layout, pick_index_nd(grid, window, generator)).to(device)
        return keep

    def destinations_for(self, grid: Tuple[int, ...], window: Tuple[int, ...], step_key: float,
                         device: torch.device) -> torch.Tensor:
        """Mode merge's destinations: one grid token per window, seeded like ``keep_for`` (cached alike)."""
        config = self.config
        key = ("merge", grid, window, step_key if config.use_rand else None, str(device))
        picks = self._cache.get(key)
        if picks is None:
            generator = self._generator(grid, step_key)
            if len(self._cache) >= _MAX_CACHED:
                self._cache.clear()
            picks = self._cache[key] = pick_index_nd(grid, window, generator).to(device)
        return picks
