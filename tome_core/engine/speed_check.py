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
from .merge import do_nothing, kv_pick_index, kv_pool_window, make_partition, match_tokens, pool_tokens
from .timing import STEADY_MAX_CALLS, STEADY_SPAN_S, Clock, calls_for, clock_for, span

__all__ = ["SPEED_CHECKS", "Verdict", "call_verdict", "decided_call", "verdict", "cached_verdicts",
           "forget_verdicts", "measure_speedup", "time_calls"]
TIMED_BY_AUTO = ("cuda", "xpu", "mps")  # "auto" times on these; the CPU is where merging always paid
PAYS_ABOVE = 1.02  # reduce iff the measured speed-up exceeds this: within 2 % of doing nothing, error for no gain
ROUNDS = 5  # rounds of the self-attention stand-in (hosts that cannot repeat the model call)
# Reduced spans of a real model call, each between two whole spans (W R W R W R W). On a GPU each span is the
# benchmark's steady span (timing.STEADY_SPAN_S, at least 2 calls): about 2 s once per call shape and process, so
# a short launch-bound call is timed as the bench times it (0.05 s spans read 0.92x where the bench read 0.82x).
CALL_ROUNDS = 3


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
    untimed: Optional[str] = None  # why a device that is timed did not time this call; None: timed, or not a timed device

    def record(self) -> dict:
        """The verdict as plain values, for a UI that words it itself (the ComfyUI node's lines)."""
        return {"reduce": self.reduce, "speedup": self.speedup, "device": self.device, "untimed": self.untimed,
                "timed": self.timed}

    def text(self, mode: str) -> str:
        verb = "merging" if mode == "merge" else "kv"
        if self.speedup is None:
            return f"reduced (not timed on {self.device}{f': {self.untimed}' if self.untimed else ''})"
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


Agree = Callable[[float, str], float]  # (value, "max" or "min") -> that over every process of a split call


def measure_speedup(config: ToMeConfig, shape: Optional[LevelShape], device: torch.device, dtype: torch.dtype,
                    run: Optional[Callable[[bool], object]] = None, clock: Optional[Clock] = None,
                    agree: Optional[Agree] = None) -> float:
    """t_whole / t_reduced on ``device``: of the real model call where the host can repeat it (``run``: the call as
    the user gets it, whole or reduced, per-call set-up, hooks, launches and the rest of the model included:
    ``time_calls``; ``agree``: split across processes, timed together), else of the level's self-attention over its
    blocks (per block the merge or key/value reduction, the attention on the fewer tokens and the unmerge, plus the
    matching: once per level with matching "level", else once per block). Each side is a steady span as the
    benchmark times its rows (``timing``); ``clock`` replaces the device's clock (tests).
    """
    clock = clock or clock_for(device)
    if run is not None:
        return time_calls(run, clock, agree)
    return _time_attention(config, shape, device, dtype, clock)


def _stand_in_reduction(config: ToMeConfig, x: torch.Tensor, grid: Tuple[int, int]) -> Tuple[Callable, Callable]:
    """(match, reduce) of one level's stand-in: the same tables and ops as a real step's plan (engine ``plan``),
    built from the merge functions themselves (centre picks: the same cost as seeded ones)."""
    h, w = grid
    window = kv_pool_window(config.ratio, config.sx, config.sy)
    if config.mode == "kv" and config.kv_downsample == "avg":
        return (lambda: None), (lambda attend: attend(x, pool_tokens(x, h, w, window)))
    if config.mode == "kv":
        index = kv_pick_index(h, w, window, None, x.device)
        return (lambda: None), (lambda attend: attend(x, x.index_select(1, index)))
    partition = make_partition(h, w, config.sx, config.sy, None, x.device)
    r = int(x.shape[1] * config.ratio)

    def match():
        matching = match_tokens(x, partition, r)
        return (do_nothing, do_nothing) if matching is None else matching.functions()

    merge, unmerge = match()
    return match, (lambda attend: unmerge(attend(merge(x))))


def _time_attention(config: ToMeConfig, shape: LevelShape, device: torch.device, dtype: torch.dtype,
                    clock: Clock) -> float:
    """The stand-in's speed-up: the level's blocks' self-attention whole against reduced, plus the matchings."""
    generator = torch.Generator().manual_seed(1)
    x = torch.randn(shape.batch, shape.grid[0] * shape.grid[1], shape.channels, generator=generator).to(device, dtype)
    attention = _Attention(shape.channels, shape.heads, dtype, device)
    match, reduce = _stand_in_reduction(config, x, shape.grid)
    matches = 1 if config.matching == "level" else shape.blocks
    merge = config.mode == "merge"

    def reduced():
        return reduce(attention)

    def whole():
        return attention(x)

    whole_s, reduced_s, match_s = [], [], []
    with torch.no_grad():
        for fn in (whole, reduced, match):  # warm-up: kernels chosen, caches filled
            fn()
        calls = span_calls(whole, clock)
        for _ in range(ROUNDS):
            whole_s.append(span(whole, clock, calls)[0])
            reduced_s.append(span(reduced, clock, calls)[0])
            match_s.append(span(match, clock, calls)[0] if merge else 0.0)
    whole_total = shape.blocks * statistics.median(whole_s)
    cost = shape.blocks * statistics.median(reduced_s) + matches * statistics.median(match_s)
    return whole_total / cost


def span_calls(fn: Callable[[], object], clock: Clock) -> int:
    """Calls per timed span, as the benchmark's steady rows: one where calls do not queue (the CPU), else at least
    2 and enough to last ``timing.STEADY_SPAN_S`` (sized from one more call of ``fn``)."""
    if not clock.back_to_back:
        return 1
    return calls_for(span(fn, clock, 1)[0], STEADY_SPAN_S, 2, STEADY_MAX_CALLS)


def time_calls(run: Callable[[bool], object], clock: Clock, agree: Optional[Agree] = None) -> float:
    """The model call's speed-up as the benchmark measures a row: after one warm-up call of each side, steady spans
    alternated whole, reduced, whole, ... whole (``CALL_ROUNDS`` reduced spans); each reduced span against the mean
    of the whole spans beside it, so a clock or host drifting during the check cannot decide the sign; the median.
    ``run(reduced)`` must be the call as the user gets it: the patch's per-call set-up included. ``agree``: the call
    is split across processes (context parallelism), each running its collectives: every process runs as many calls
    per span (the most any asks for)."""
    ratios = []
    with torch.no_grad():
        run(False), run(True)  # warm-up: kernels chosen, caches filled, the patch's one-time work done
        calls = span_calls(lambda: run(False), clock)
        if agree is not None:
            calls = int(agree(calls, "max"))
        whole = [span(lambda: run(False), clock, calls)[0]]
        for _ in range(CALL_ROUNDS):
            reduced = span(lambda: run(True), clock, calls)[0]
            whole.append(span(lambda: run(False), clock, calls)[0])
            ratios.append((whole[-2] + whole[-1]) / 2 / reduced)
    return statistics.median(ratios)


Timer = Callable[..., float]  # (config, shape, device, dtype, run=None) -> speed-up, as measure_speedup
_VERDICTS: Dict[Tuple, Verdict] = {}  # process-wide: what was measured on a device holds for every model
GENERATION = [0]  # bumped by forget_verdicts: a host's own memo of decisions is valid within one generation


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


def _call_key(config: ToMeConfig, what: Tuple, label: str, dtype: torch.dtype, timer: Optional[Timer]) -> Tuple:
    return ("call", what, label, str(dtype), config.mode, config.ratio, config.sx, config.sy, config.block_start,
            config.block_end, config.merge_attention, timer)


def decided_call(config: ToMeConfig, what: Tuple, dtype: torch.dtype, device: torch.device,
                 timer: Optional[Timer] = None) -> Optional[Verdict]:
    """The verdict ``call_verdict`` would give without timing anything: an untimed one where the check does not time
    on this device, the cached one, or None where the call shape is still to be timed. A host asks this before it
    plans a call, so a call shape left whole costs no planning at all."""
    device = torch.device(device)
    label = device_label(device)
    if not should_time(config, device):
        return Verdict(reduce=True, speedup=None, device=label)
    return _VERDICTS.get(_call_key(config, what, label, dtype, timer))


def call_verdict(config: ToMeConfig, what: Tuple, dtype: torch.dtype, device: torch.device,
                 run: Optional[Callable[[bool], object]], timer: Optional[Timer] = None,
                 untimed: str = "cannot repeat the call beside another hook on the model",
                 agree: Optional[Agree] = None) -> Verdict:
    """Whether reducing a transformer's model call pays: the call timed whole against reduced (``run``), once per
    ``what`` (the model class, its token layout and batch), dtype, device and setting, then cached. run None: the
    call is not timed (reduced, and the verdict says why: ``untimed``). ``agree``: the call is split across
    processes, which time it together (each repeat runs every process's collectives) and take one verdict: every
    process times where any has no verdict yet, as many calls on each, and keeps the lowest speed-up measured."""
    device = torch.device(device)
    label = device_label(device)
    if not should_time(config, device) or run is None:
        return Verdict(reduce=True, speedup=None, device=label, untimed=None if run is not None else untimed)
    key = _call_key(config, what, label, dtype, timer)
    found = _VERDICTS.get(key)
    if agree is not None and agree(float(found is None), "max"):
        found = None
    if found is None:
        together = {} if agree is None else {"agree": agree}
        speedup = (timer or measure_speedup)(config, None, device, dtype, run=run, **together)
        if agree is not None:
            speedup = agree(speedup, "min")
            label += " (every process of the split, the slowest)"
        found = _VERDICTS[key] = Verdict(reduce=speedup > PAYS_ABOVE, speedup=round(float(speedup), 3),
                                         device=label)
    return found


def cached_verdicts() -> Tuple[Verdict, ...]:
    """Every verdict measured in this process so far, oldest first (what a host or a lab script can show)."""
    return tuple(_VERDICTS.values())


def forget_verdicts() -> None:
    """Drop every cached verdict (after a driver or hardware change, or in tests)."""
    _VERDICTS.clear()
    GENERATION[0] += 1
