"""Whether reducing a level pays on this device: a short timing, once per device and shape.

On a fast GPU a step is bound by launching kernels, so what a merge saves in attention can be worth less
than its own kernels and hooks cost (SD1.5 on an H100: merging slowed the step at 512 px and at 1024 px,
where attention alone measured 2.51x). With ``speed_check`` "auto" (GPUs) or "on" (any device) each level is
therefore timed once per device and shape before it is reduced, and left whole where reducing it would slow
the step. Where the host can repeat the model call in progress (diffusers and WebUI hooks, ComfyUI's model
wrapper), the real call is timed, whole against that level reduced, interleaved, median of a few rounds:
what the user gets. Elsewhere (hosts without a per-call hook) the level's self-attention stands in, at its
real shape with this config's own merge or key/value reduction, and the verdict says so. Each side is timed as
the benchmark times a step (``timing``): on a GPU, CUDA events around back-to-back calls after a warm-up, so
the verdict is the steady step's speed-up, not one synchronised call's (which adds the host's launch time to
every call). Verdicts are cached for the process, keyed by everything they depend on, so a second sampling run
on the same shape does not time again.

Pure engine code: it knows no host. Hosts see verdicts through ``TokenMerger.verdicts``.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch
import torch.nn.functional as F

from .config import SPEED_CHECKS, ToMeConfig
from .levels import Level
from .timing import Clock, calls_for, clock_for, span

__all__ = ["SPEED_CHECKS", "Verdict", "call_verdict", "verdict", "cached_verdicts", "forget_verdicts",
           "measure_speedup"]
TIMED_BY_AUTO = ("cuda", "xpu", "mps")  # "auto" times on these; the CPU is where merging always paid
PAYS_ABOVE = 1.02  # reduce iff the measured speed-up exceeds this: within 2 % of doing nothing, error for no gain
ROUNDS = 5
CALL_ROUNDS = 3  # interleaved rounds of real model calls (each a span of whole calls and one of reduced calls)
# On a GPU each timed span is back-to-back calls lasting at least this long (one call where a call is longer):
# short calls are launch-bound and need several to show the steady state; a long call is its own steady state,
# and the check's cost stays that of 2 + 2 * CALL_ROUNDS calls.
SPAN_S = 0.05
MAX_SPAN_CALLS = 16


@dataclass(frozen=True)
class LevelShape:
    """Everything a level's timing depends on (with the config's reduction settings)."""

    device: str  # e.g. "cuda:0 (NVIDIA H200)"
    dtype: str
    batch: int
    grid: Tuple[int, int]
    channels: int
    heads: int
    blocks: int


@dataclass(frozen=True)
class Verdict:
    """Whether a level is reduced, and why: the measured speed-up, or that it was not timed."""

    reduce: bool
    speedup: Optional[float]  # t_whole / t_reduced; None: not timed
    device: str
    timed: str = "the model call"  # what was timed: the real model call, or the level's self-attention alone

    def text(self, mode: str) -> str:
        verb = "merging" if mode == "merge" else "kv"
        if self.speedup is None:
            return f"reduced (not timed on {self.device})"
        state = "reduced" if self.reduce else "left whole"
        what = "the model call" if self.timed == "the model call" else "its self-attention alone"
        return f"{state}: {what} with {verb} measured {self.speedup:.2f}x on {self.device}"


def device_label(device: torch.device) -> str:
    """A device's name for verdicts and caches: its type, index and, for a GPU, its model."""
    device = torch.device(device)
    if device.type == "cuda" and torch.cuda.is_available():
        index = device.index if device.index is not None else torch.cuda.current_device()
        return f"cuda:{index} ({torch.cuda.get_device_name(index)})"
    return str(device)


def should_time(config: ToMeConfig, device: torch.device) -> bool:
    """Whether ``config`` times levels on ``device``: "on" everywhere, "auto" on GPUs only."""
    return config.speed_check == "on" or (config.speed_check == "auto" and
                                          torch.device(device).type in TIMED_BY_AUTO)


class _Attention:
    """A self-attention at the level's width and heads: the part of a block a reduction changes."""

    def __init__(self, channels: int, heads: int, dtype: torch.dtype, device: torch.device) -> None:
        generator = torch.Generator().manual_seed(0)
        self.heads = heads
        self.weights = [(torch.randn(channels, channels, generator=generator) / math.sqrt(channels)).to(device, dtype)
                        for _ in range(4)]

    def __call__(self, x: torch.Tensor, keys: Optional[torch.Tensor] = None) -> torch.Tensor:
        wq, wk, wv, wo = self.weights
        source = x if keys is None else keys
        q, k, v = F.linear(x, wq), F.linear(source, wk), F.linear(source, wv)
        batch, _, channels = q.shape
        q, k, v = (t.view(batch, -1, self.heads, channels // self.heads).transpose(1, 2) for t in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v)
        return F.linear(out.transpose(1, 2).reshape(batch, -1, channels), wo)


def measure_speedup(config: ToMeConfig, shape: LevelShape, device: torch.device, dtype: torch.dtype,
                    run: Optional[Callable[[bool], object]] = None, clock: Optional[Clock] = None) -> float:
    """t_whole / t_reduced on ``device``: of the real model call where the host can repeat it (``run``: whole and
    with the level reduced, interleaved, after one warm-up each, median of ``CALL_ROUNDS``: what the user gets,
    hooks, launches and the rest of the model included), else of the level's self-attention over its blocks
    (per block the merge or key/value reduction, the attention on the fewer tokens and the unmerge, plus the
    matching: once per level with matching "level", else once per block). Each side is a span of back-to-back
    calls on a GPU (``timing``); ``clock`` replaces the device's clock (tests).
    """
    clock = clock or clock_for(device)
    if run is not None:
        return _time_calls(run, clock)
    from .plan import TokenMerger  # the plan builds the same tables and functions a real step uses

    h, w = shape.grid
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape.batch, h * w, shape.channels, generator=generator).to(device, dtype)
    attention = _Attention(shape.channels, shape.heads, dtype, device)
    merger = TokenMerger(config)
    table = merger.table((h, w), 0.0, device)
    merge = config.mode == "merge"
    matches = 1 if config.matching == "level" else shape.blocks

    def plan():
        return merger.plan_with(x, (h, w), table)

    ready = plan()

    def reduced():
        if merge:
            return ready.unmerge(attention(ready.merge(x)))
        return attention(x, ready.reduce_kv(x))

    def whole():
        return attention(x)

    whole_s, reduced_s, match_s = [], [], []
    with torch.no_grad():
        for fn in (whole, reduced, plan):  # warm-up: kernels chosen, caches filled
            fn()
        calls = _span_calls(whole, clock)
        for _ in range(ROUNDS):
            whole_s.append(span(whole, clock, calls)[0])
            reduced_s.append(span(reduced, clock, calls)[0])
            match_s.append(span(plan, clock, calls)[0] if merge else 0.0)
    whole_total = shape.blocks * statistics.median(whole_s)
    cost = shape.blocks * statistics.median(reduced_s) + matches * statistics.median(match_s)
    return whole_total / cost


def _span_calls(fn: Callable[[], object], clock: Clock) -> int:
    """Calls per timed span: one where calls do not queue (the CPU), else enough to last ``SPAN_S``."""
    if not clock.back_to_back:
        return 1
    return calls_for(span(fn, clock, 1)[0], SPAN_S, 1, MAX_SPAN_CALLS)


def _time_calls(run: Callable[[bool], object], clock: Clock) -> float:
    """Median whole span over median reduced span, the spans interleaved, after one warm-up call of each."""
    whole_s, reduced_s = [], []
    with torch.no_grad():
        run(False), run(True)  # warm-up: kernels chosen, caches filled, the patch's one-time work done
        calls = _span_calls(lambda: run(False), clock)
        for _ in range(CALL_ROUNDS):
            whole_s.append(span(lambda: run(False), clock, calls)[0])
            reduced_s.append(span(lambda: run(True), clock, calls)[0])
    return statistics.median(whole_s) / statistics.median(reduced_s)


Timer = Callable[..., float]  # (config, shape, device, dtype, run=None) -> speed-up, as measure_speedup
_VERDICTS: Dict[Tuple, Verdict] = {}  # process-wide: what was measured on a device holds for every model


def verdict(config: ToMeConfig, level: Level, grid: Tuple[int, int], batch: int, dtype: torch.dtype,
            device: torch.device, timer: Optional[Timer] = None, run: Optional[Callable[[bool], object]] = None,
            model: Optional[Tuple] = None) -> Verdict:
    """Whether ``config`` reduces ``level`` at ``grid`` for this batch, dtype and device.

    Not timed (reduced) unless ``should_time``; timed once per key, then cached. run(reduced): one real model
    call with the level reduced or whole (``model`` says which model and latent, for the cache key); without it
    the level's self-attention stands in. ``timer`` replaces ``measure_speedup`` (tests force a timing with it).
    """
    device = torch.device(device)
    label = device_label(device)
    if not should_time(config, device):
        return Verdict(reduce=True, speedup=None, device=label)
    shape = LevelShape(label, str(dtype).replace("torch.", ""), int(batch), tuple(grid), level.channels,
                       level.heads, level.blocks)
    key = (shape, config.mode, config.ratio, config.sx, config.sy, config.matching, config.kv_downsample,
           timer, model)
    found = _VERDICTS.get(key)
    if found is None:
        speedup = (timer or measure_speedup)(config, shape, device, dtype, run=run)
        found = _VERDICTS[key] = Verdict(reduce=speedup > PAYS_ABOVE, speedup=round(float(speedup), 3),
                                         device=label, timed="the model call" if run is not None else "attention")
    return found


def call_verdict(config: ToMeConfig, what: Tuple, dtype: torch.dtype, device: torch.device,
                 run: Optional[Callable[[bool], object]], timer: Optional[Timer] = None) -> Verdict:
    """Whether reducing a transformer's model call pays: the call timed whole against reduced (``run``), once per
    ``what`` (the model class, its token layout and batch), dtype, device and setting, then cached. run None: the
    host cannot repeat the call, so it is not timed (reduced, and the verdict says so)."""
    device = torch.device(device)
    label = device_label(device)
    if not should_time(config, device) or run is None:
        return Verdict(reduce=True, speedup=None, device=label if run is not None else f"{label}: cannot repeat "
                       "the call beside another hook on the model")
    key = ("call", what, label, str(dtype), config.mode, config.ratio, config.sx, config.sy, config.block_start,
           config.block_end, timer)
    found = _VERDICTS.get(key)
    if found is None:
        speedup = (timer or measure_speedup)(config, None, device, dtype, run=run)
        found = _VERDICTS[key] = Verdict(reduce=speedup > PAYS_ABOVE, speedup=round(float(speedup), 3),
                                         device=label)
    return found


def cached_verdicts() -> Tuple[Verdict, ...]:
    """Every verdict measured in this process so far, oldest first (what a host or a lab script can show)."""
    return tuple(_VERDICTS.values())


def forget_verdicts() -> None:
    """Drop every cached verdict (after a driver or hardware change, or in tests)."""
    _VERDICTS.clear()
