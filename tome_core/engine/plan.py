"""Per-block token plans: what a transformer block merges, decided from its input and the step.

``TokenMerger`` is the one piece every host drives. It lives on the patched object (a diffusers
UNet's state, or a closure made per ComfyUI patch) and caches the partition of each level for the
current step, so all blocks of a level and both halves of a CFG batch share it, and cond/uncond
evaluated in separate calls at the same step draw the same partition.
"""
from __future__ import annotations

import hashlib
import logging
import math
import struct
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .config import ToMeConfig
from .levels import Level, grid_for_tokens
from .reuse import MatchingReuse
from .speed_check import Verdict, verdict
from .merge import (Partition, TokenFn, do_nothing, kv_pick_index, kv_pool_window, make_partition, match_tokens,
                    pool_tokens, to_device)

log = logging.getLogger("tome_core")


@dataclass(frozen=True)
class TokenPlan:
    """What one block does to its tokens; every function is the identity where ToMe is off.

    merge: [B, N, C] -> [B, N', C] before attention; unmerge: back to [B, N, C] after it.
    reduce_kv: [B, N, C] -> [B, N'', C], the downsampled source of self-attention keys and values.
    """

    active: bool = False
    merge: TokenFn = do_nothing
    unmerge: TokenFn = do_nothing
    reduce_kv: TokenFn = do_nothing


IDENTITY_PLAN = TokenPlan()
RunLevel = Callable[[Tuple[int, int], int, bool], None]  # (grid, downsample, reduced): one real model call


class LevelMatching:
    """One level's partition and, once its first block has run, that block's plan (matching "level").

    Made afresh for every model call by ``TokenMerger.step_tables``, so a matching is shared by the
    blocks of one call and never outlives it; a block whose tokens differ in batch or count from the
    first one's matches its own. ``blocks``: how many blocks of the call use it (0: unknown); the
    last one takes the plan away, so under torch.compile nothing made inside the graph is left on
    this object when the graph ends (a graph break otherwise).
    """

    __slots__ = ("partition", "plan", "shape", "blocks", "uses", "kept", "keep")

    def __init__(self, partition: Partition, blocks: int = 0) -> None:
        self.partition = partition
        self.plan: Optional[TokenPlan] = None
        self.shape: Optional[Tuple[int, ...]] = None
        self.blocks = blocks
        self.uses = 0
        self.kept: Optional[Tuple[TokenPlan, Tuple[int, ...]]] = None  # an earlier call's plan to reuse (match_every)
        self.keep: Optional[Callable[[Any], None]] = None  # where this call's fresh plan is kept for the next calls

    def take(self) -> TokenPlan:
        """The shared plan for one more block; the level's last block leaves nothing behind."""
        plan = self.plan
        self.uses += 1
        if self.blocks and self.uses >= self.blocks:
            self.plan, self.shape = None, None
        return plan


_MAX_CACHED_PARTITIONS = 32


def partition_seed(seed: int, step_key: float, h: int, w: int) -> int:
    """A 63-bit seed from the user's seed, the step and the grid: stable across processes."""
    payload = struct.pack("<qdqq", seed, float(step_key), h, w)
    return int.from_bytes(hashlib.blake2b(payload, digest_size=8).digest(), "little") >> 1


class TokenMerger:
    """Turns a block's input into a ``TokenPlan`` according to one ``ToMeConfig``.

    base_downsample: the latent downsampling of the model's first attention level (see levels.py).
    levels: the model's attention levels by downsampling (``levels.attention_levels``), which the
        speed check times; without them no level is timed. timer: replaces the timing (tests).
    """

    def __init__(self, config: ToMeConfig, base_downsample: int = 1, levels: Optional[Dict[int, Level]] = None,
                 timer: Optional[Callable] = None) -> None:
        self.config = config
        self.base_downsample = base_downsample
        self.levels = levels or {}
        self.timer = timer
        # (latent (h, w), level downsample) -> the speed check's verdict, for describe()
        self.verdicts: Dict[Tuple[Tuple[int, int], int], Tuple[Tuple[int, int], Verdict]] = {}
        # called with describe()'s lines whenever a verdict is new (a host shows them where users look)
        self.listeners: List[Callable[[List[str]], None]] = []
        self._partitions: Dict[Tuple, Partition] = {}
        self._kv_indices: Dict[Tuple, torch.Tensor] = {}
        self._reduced: Dict[Tuple, Tuple] = {}  # (latent, batch, dtype, device) -> reduced_levels
        self._step: List[Any] = [None, 0]  # the last step tensor and its step_choice (draw_table)
        self._warned_grid = False
        self.reuse = MatchingReuse(config.match_every)  # level matchings kept across calls (match_every > 1)
        # The config is frozen, so mode "kv"'s pooling window is the same for every block and step.
        self._kv_window = kv_pool_window(config.ratio, config.sx, config.sy)

    def plan(self, hidden: torch.Tensor, latent_hw: Tuple[int, int], step_key: Any = 0.0,
             progress: Optional[float] = None) -> TokenPlan:
        """hidden: [B, N, C] block input; latent_hw: the UNet input's (H, W); step_key: timestep or sigma."""
        if not self.config.in_schedule(progress):
            return IDENTITY_PLAN
        grid = self.grid(hidden, latent_hw)
        return IDENTITY_PLAN if grid is None else self.plan_at(hidden, grid, step_key)

    def grid(self, hidden: torch.Tensor, latent_hw: Tuple[int, int]) -> Optional[Tuple[int, int]]:
        """(h, w) of the token grid ToMe acts on in this block, or None where it leaves the block alone.

        Decided from shapes and the config only, so a host can skip blocks ToMe does not touch
        before it looks at the step (which may cost a device-to-host sync).
        """
        config = self.config
        if not config.enabled:
            return None
        n_tokens = hidden.shape[1]
        if n_tokens < config.min_tokens:
            return None
        grid = grid_for_tokens(n_tokens, int(latent_hw[0]), int(latent_hw[1]))
        if grid is None:
            if not self._warned_grid:
                log.warning("ToMe: %d tokens match no level of a %sx%s latent; leaving such blocks unmerged "
                            "(another patch reshaped the tokens?).", n_tokens, *latent_hw)
                self._warned_grid = True
            return None
        downsample, h, w = grid
        if downsample > config.max_downsample * self.base_downsample:
            return None
        if config.mode == "kv" and self._kv_window == (1, 1):
            return None
        return h, w

    def needs_step(self) -> bool:
        """Whether plans depend on the step: only random partitions (use_rand) do."""
        return self.config.use_rand and not (self.config.mode == "kv" and self.config.kv_downsample == "avg")

    def plan_at(self, hidden: torch.Tensor, grid: Tuple[int, int], step_key: Any = 0.0,
                latent_hw: Optional[Tuple[int, int]] = None) -> TokenPlan:
        """The plan of a block whose level ``grid`` (from ``grid``) ToMe acts on, at ``step_key``.

        For hosts that call no per-call hook (``step_tables``): the speed check runs here, eagerly.
        """
        if latent_hw is not None and not self.pays(latent_hw, grid, hidden.shape[0], hidden.dtype, hidden.device):
            return IDENTITY_PLAN
        return self.plan_with(hidden, grid, self.table(grid, step_key, hidden.device))

    def pays(self, latent_hw: Tuple[int, int], grid: Tuple[int, int], batch: int, dtype: torch.dtype,
             device: torch.device, run_level: Optional[RunLevel] = None) -> bool:
        """Whether reducing the level of ``grid`` pays (speed_check; True when it is off or the level unknown).

        run_level(grid, downsample, reduced): one real model call with that level reduced or with nothing
        reduced, from a host that can repeat the call in progress; the speed check then times those calls
        (what the user gets), else the level's self-attention alone.
        """
        if self.config.speed_check == "off":
            return True
        downsample = next((ds for ds in sorted(self.levels) if tuple(grid) in
                           {(r(latent_hw[0] / ds), r(latent_hw[1] / ds)) for r in (math.ceil, math.floor)}), None)
        if downsample is None:
            return True
        run = None if run_level is None else (lambda reduced: run_level(grid, downsample, reduced))
        model = (tuple(latent_hw), tuple(self.levels.values())) if run is not None else None
        found = verdict(self.config, self.levels[downsample], grid, batch, dtype, device, self.timer, run, model)
        key, entry = (tuple(latent_hw), downsample), (tuple(grid), found)
        if self.verdicts.get(key) != entry:
            self.verdicts[key] = entry
            lines = self.describe()
            for listener in self.listeners:
                listener(lines)
        return found.reduce

    def describe(self) -> list:
        """What this plan does, one line each: the settings, then each level the speed check decided."""
        config = self.config
        levels = ", ".join(str(d) for d in (1, 2, 4, 8) if d <= config.max_downsample)
        head = f"ToMe {config.mode} r={config.ratio:g} on UNet levels {levels} (1 = the first attention level)"
        if config.mode == "merge":
            head += f", matching per {config.matching}"
            if config.match_every > 1:
                head += f", each matching reused for {config.match_every} model calls"
        if config.speed_check == "off":
            return [head + "; speed check off: every selected level is reduced"]
        lines = [head + f"; speed check {config.speed_check}" + (
            ": on a GPU each level is timed once per shape, and left whole where reducing it measured slower"
            if config.speed_check == "auto" else ": each level is timed once per device and shape")]
        return lines + (self.describe_levels() or ["no level decided yet (decided at the first model call)"])

    def describe_levels(self) -> list:
        """One line per level the speed check decided, latest latent size first seen first."""
        lines = []
        for ((height, width), downsample), ((h, w), found) in self.verdicts.items():
            level = self.levels[downsample]
            lines.append(f"level {downsample // self.base_downsample} ({h}x{w} tokens, {level.blocks} blocks) at "
                         f"{8 * width}x{8 * height} px: {found.text(self.config.mode)}")
        return lines

    def verdict_records(self) -> list:
        """``describe_levels`` as plain values: per decided level its number (1 = the first attention level, as
        ``max_downsample`` counts), token grid, blocks, image size in pixels and the verdict's ``record``."""
        return [dict(found.record(), level=downsample // self.base_downsample, tokens=[h, w],
                     blocks=self.levels[downsample].blocks, pixels=[8 * width, 8 * height])
                for ((height, width), downsample), ((h, w), found) in self.verdicts.items()]

    def table(self, grid: Tuple[int, int], step_key: Any, device: torch.device) -> Any:
        """The per-step choice of one level: its partition (merge), kept indices (kv nearest) or None (kv avg)."""
        h, w = grid
        if self.config.mode != "kv":
            return self._partition(h, w, step_key, device)
        return None if self.config.kv_downsample == "avg" else self._kv_index(h, w, step_key, device)

    def call_table(self, grid: Tuple[int, int], step_key: Any, device: torch.device, downsample: int = 0) -> Any:
        """``table`` for one model call: with matching "level", wrapped so the call's blocks share one matching."""
        table = self.table(grid, step_key, device)
        shared = self.config.mode == "merge" and self.config.matching == "level"
        level = self.levels.get(downsample)
        return LevelMatching(table, level.blocks if level is not None else 0) if shared else table

    def reduced_levels(self, latent_hw: Tuple[int, int], device: torch.device, batch: int = 0,
                       dtype: Optional[torch.dtype] = None,
                       run_level: Optional[RunLevel] = None) -> Tuple[Tuple[Tuple[int, int], int], ...]:
        """(grid, downsample) of each level a model call of this latent reduces, in depth order: the levels ToMe may
        act on that the speed check lets through (``call_layout``), decided once per latent size, batch, dtype and
        device (one look-up after that). Empty: the call reduces nothing, and the host runs it as if unpatched."""
        key = (latent_hw, batch, dtype, device)
        found = self._reduced.get(key)
        if found is None:
            layout = self.call_layout(latent_hw, device, batch, dtype, run_level)
            found = tuple((grid, downsample) for grid, downsample, pays in layout if pays)
            if len(self._reduced) >= _MAX_CACHED_PARTITIONS:
                self._reduced.clear()
            self._reduced[key] = found
        return found

    def step_tables(self, latent_hw: Tuple[int, int], step_key: Any, device: torch.device,
                    batch: int = 0, dtype: Optional[torch.dtype] = None,
                    run_level: Optional[RunLevel] = None,
                    levels: Optional[Tuple[Tuple[Tuple[int, int], int], ...]] = None,
                    reuse: bool = True) -> Dict[Tuple[int, int], Any]:
        """``table`` of every level grid this model call reduces (``reduced_levels``, or ``levels`` where the host
        found them already or forces them: a speed-check repeat, which also keeps no matching for later calls:
        ``reuse`` False), built once per model call.

        A host calls this where it reads the step (outside any compiled region) and the blocks
        then only look their grid up: the step's float and the seeded generator never reach
        traced code, so torch.compile neither breaks the graph there nor recompiles per step.
        step_key may be the step's device tensor (``step_choice``: nothing is read on the host).
        batch, dtype: of the model call, for the speed check; run_level: see ``pays``.
        """
        if levels is None:
            levels = self.reduced_levels(latent_hw, device, batch, dtype, run_level)
        tables: Dict[Tuple[int, int], Any] = {}
        for grid, downsample in levels:
            table = tables[grid] = self.call_table(grid, step_key, device, downsample)
            if self.reuse.on and reuse and isinstance(table, LevelMatching):
                key = (grid, batch, str(device))
                table.kept = self.reuse.take(key)
                table.keep = lambda plan_and_shape, key=key: self.reuse.keep(key, plan_and_shape)
        return tables

    def call_layout(self, latent_hw: Tuple[int, int], device: torch.device, batch: int = 0,
                    dtype: Optional[torch.dtype] = None,
                    run_level: Optional[RunLevel] = None) -> List[Tuple[Tuple[int, int], int, bool]]:
        """(grid, downsample, whether reducing it pays) of every level grid ToMe may act on for this latent, in
        depth order (the speed check's verdicts are cached per shape; ``reduced_levels`` keeps the result)."""
        config, (height, width) = self.config, latent_hw
        layout, seen = [], set()
        downsample = 1 if config.enabled and not (config.mode == "kv" and self._kv_window == (1, 1)) else 1 << 30
        while downsample <= config.max_downsample * self.base_downsample:
            for rounding in (math.ceil, math.floor):
                grid = (rounding(height / downsample), rounding(width / downsample))
                if min(grid) >= 1 and grid not in seen and grid[0] * grid[1] >= config.min_tokens:
                    seen.add(grid)
                    layout.append((grid, downsample, dtype is None or
                                   self.pays(latent_hw, grid, batch, dtype, device, run_level)))
            downsample *= 2
        return layout

    def plan_with(self, hidden: torch.Tensor, grid: Tuple[int, int], table: Any) -> TokenPlan:
        """The plan of a block on level ``grid`` from that level's ``table`` (see ``table``)."""
        config = self.config
        h, w = grid
        if config.mode == "kv":
            if table is None:
                window = self._kv_window
                return TokenPlan(active=True, reduce_kv=lambda x: pool_tokens(x, h, w, window))
            return TokenPlan(active=True, reduce_kv=lambda x: x.index_select(1, table))
        if isinstance(table, LevelMatching):
            shape = tuple(hidden.shape[:2])
            if table.plan is None or table.shape != shape:
                kept = None if torch.compiler.is_compiling() else table.kept  # compiled: nothing outlives a graph
                if kept is not None and kept[1] == shape:
                    table.plan, table.shape = kept  # match_every: an earlier call's matching
                else:
                    table.plan, table.shape = self.plan_with(hidden, grid, table.partition), shape
                    if table.keep is not None:
                        table.keep((table.plan, shape))
            return table.take()
        matching = match_tokens(hidden, table, int(hidden.shape[1] * config.ratio))
        if matching is None:
            return IDENTITY_PLAN
        merge, unmerge = matching.functions()
        return TokenPlan(active=True, merge=merge, unmerge=unmerge)

    def _kv_index(self, h: int, w: int, step_key: Any, device: torch.device) -> torch.Tensor:
        def build(generator: Optional[torch.Generator]) -> torch.Tensor:
            py, px = self._kv_window
            choice = None if generator is None else torch.rand((2, -(-h // py), -(-w // px)), generator=generator)
            return kv_pick_index(h, w, self._kv_window, choice)

        return self._per_step(self._kv_indices, h, w, step_key, device, build)

    def _partition(self, h: int, w: int, step_key: Any, device: torch.device) -> Partition:
        config = self.config

        def build(generator: Optional[torch.Generator]) -> Partition:
            cell_choice = None if generator is None else torch.randint(
                config.sx * config.sy, (h // config.sy, w // config.sx), generator=generator)
            return make_partition(h, w, config.sx, config.sy, cell_choice)

        return self._per_step(self._partitions, h, w, step_key, device, build)

    def _per_step(self, cache: Dict[Tuple, Any], h: int, w: int, step_key: Any, device: torch.device,
                  build: Callable[[Optional[torch.Generator]], Any]) -> Any:
        """The table of grid (h, w) at this step (``draw_table``; candidates seeded by (seed, candidate, grid))."""
        seed = self.config.seed
        return draw_table(cache, (h, w, str(device)), step_key, device, self.config, build,
                          lambda k: torch.Generator().manual_seed(partition_seed(seed, float(k), h, w)), self._step)


def draw_table(cache: Dict[Tuple, Any], key: Tuple, step_key: Any, device: torch.device, config: ToMeConfig,
               build: Callable[[Optional[torch.Generator]], Any],
               generator_for: Callable[[int], torch.Generator], memo: List[Any]) -> Any:
    """A per-step table (a kv index or a ``Partition``): ``build(None)`` without use_rand; with it, one of
    ``STEP_CANDIDATES`` tables built once per ``key`` (grid, device) from ``generator_for(k)``, the one
    ``step_choice`` hashes the step to. step_key may be a device tensor: it is hashed on its device and the
    candidate picked there, so no step value is ever read on the host. memo: [step tensor, its choice], shared by
    the blocks of a call (the step is hashed once per tensor).
    """
    stacked = cache.get(key)
    if stacked is None:
        if len(cache) >= _MAX_CACHED_PARTITIONS:
            cache.clear()
        tables = [build(None)] if not config.use_rand else [build(generator_for(k)) for k in range(STEP_CANDIDATES)]
        stacked = cache[key] = Candidates.of(tables, device)
    if not config.use_rand:
        return stacked.pick(0)
    if isinstance(step_key, torch.Tensor):
        if step_key.device != stacked.device:
            step_key = float(step_key.detach().reshape(-1).max())  # a step held on the host: no device read
        elif step_key is not memo[0]:
            memo[:] = [step_key, step_choice(step_key, config.seed)]
    return stacked.pick(memo[1] if step_key is memo[0] else step_choice(step_key, config.seed))


STEP_CANDIDATES = 16  # seeded tables per grid; each step uses the one its step value hashes to
_PRIME = 2147483647  # 2**31 - 1


def _mix(x: Any, seed_mix: int, count: int) -> Any:
    """Hash x in [0, 2**24) (an int or a long tensor alike) into [0, count): one multiply-add modulo a prime
    (products stay below 2**56, so int64 never overflows), then modulo ``count``."""
    return ((x * 1583458089 + seed_mix) % _PRIME) % count


def step_choice(step: Any, seed: int, count: int = STEP_CANDIDATES) -> Any:
    """Which of ``count`` seeded candidates a step draws, from the step's value (a timestep or a sigma, the
    largest of a batch's) rounded to 1/1024 in float32 and hashed with the seed.

    step: a tensor -> a [1] long tensor on its device, computed there (never read: no host sync);
    a number -> an int. Both give the same choice for the same value, so the same seed and step draw the
    same table on any device and in every call of the step (both CFG halves, cond and uncond apart).
    """
    seed_mix = partition_seed(seed, 0.0, 0, 0) % _PRIME
    if isinstance(step, torch.Tensor):
        value = step.detach().reshape(-1).amax(0, keepdim=True).float()
        return _mix((value * 1024.0).round().long() & 0xFFFFFF, seed_mix, count)
    value = struct.unpack("<f", struct.pack("<f", float(step)))[0]  # float32, as the tensor path rounds it
    return _mix(int(round(value * 1024.0)) & 0xFFFFFF, seed_mix, count)


class Candidates:
    """A grid's seeded tables (a kv index [M] or a ``Partition``), stacked on the device so that a step picks
    one with a single ``index_select`` per tensor kind, by an index that may itself live on the device."""

    __slots__ = ("device", "longs", "floats", "sizes", "last")

    def __init__(self, device: torch.device, longs: torch.Tensor, floats: Optional[torch.Tensor],
                 sizes: Optional[Tuple[int, ...]]) -> None:
        self.device, self.longs, self.floats, self.sizes = device, longs, floats, sizes
        self.last: Tuple[Any, Any] = (None, None)  # the last choice and its table: blocks of a call share it

    @classmethod
    def of(cls, tables: List[Any], device: torch.device) -> "Candidates":
        device = torch.device(device)
        if isinstance(tables[0], torch.Tensor):
            return cls(device, to_device(torch.stack(tables), device), None, None)
        parts = [(t.dst_idx, t.src_idx, t.base_slot, t.is_src) for t in tables]
        sizes = tuple(p.numel() for p in parts[0])
        longs = torch.stack([torch.cat(p) for p in parts])
        floats = torch.stack([t.dst_mask for t in tables])
        return cls(device, to_device(longs, device), to_device(floats, device), sizes)

    def pick(self, choice: Any) -> Any:
        """The table at ``choice`` (an int, or a [1] long tensor on this device)."""
        last = self.last[0]
        if choice is last or (isinstance(choice, int) and isinstance(last, int) and choice == last):
            return self.last[1]
        table = self._pick(choice)
        self.last = (choice, table)
        return table

    def _pick(self, choice: Any) -> Any:
        if isinstance(choice, int):
            longs, floats = self.longs[choice], (None if self.floats is None else self.floats[choice])
        else:
            longs = self.longs.index_select(0, choice).view(-1)
            floats = None if self.floats is None else self.floats.index_select(0, choice).view(-1)
        if self.sizes is None:
            return longs
        dst_idx, src_idx, base_slot, is_src = longs.split(self.sizes)
        return Partition(dst_idx=dst_idx, src_idx=src_idx, dst_mask=floats, base_slot=base_slot, is_src=is_src)
