"""Steady-state timing of a call on its device: the benchmark and the speed check time the same way.

A sampler queues model calls back to back: on a GPU the host runs ahead and launches overlap the device's
work, so what a step costs is the device time per call over many calls, not one call timed alone with a
synchronisation on each side (that adds the host's whole launch time to every call: the speed check once read
1.05x on Qwen-Image where the step gained 1.50x). And the first call after a patch is applied pays its one-time
work (the seeded tables, the speed check itself), so it is timed apart and never stands for the step.

A ``Clock`` times a span of calls. ``EventClock`` (CUDA) records events on the current stream and synchronises
once, at the end; ``SyncedClock`` synchronises the device at both ends of the span (other GPUs); on the CPU,
where calls do not queue, a span is one call. Tests give a stand-in clock that counts virtual time.
"""
from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol

import torch


# A steady timing on a GPU: back-to-back calls spanning at least this long (at least 2, at most STEADY_MAX_CALLS).
# The benchmark's rows and the speed check's verdicts use the same span, so a verdict says what the bench measures
# (with 0.05 s spans the check read 0.92x at SD1.5 512 px on an H100 where the bench read 0.82x).
STEADY_SPAN_S = 0.25
STEADY_MAX_CALLS = 64


class Clock(Protocol):
    """Times a span of calls: ``start()``, the calls, then ``stop()`` -> seconds (waiting for the device)."""

    back_to_back: bool  # calls queue on the device: a span of several calls measures the steady state

    def start(self) -> None: ...

    def stop(self) -> float: ...


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type in ("xpu", "mps"):
        getattr(torch, device.type).synchronize()


class EventClock:
    """CUDA events on the current stream around the span; one synchronisation, on the end event."""

    back_to_back = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.begin = torch.cuda.Event(enable_timing=True)
        self.end = torch.cuda.Event(enable_timing=True)

    def start(self) -> None:
        self.begin.record()

    def stop(self) -> float:
        self.end.record()
        self.end.synchronize()
        return self.begin.elapsed_time(self.end) / 1000


class SyncedClock:
    """Wall clock with the device synchronised at both ends of the span (any device; the CPU needs no sync)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.back_to_back = device.type != "cpu"
        self.t0 = 0.0

    def start(self) -> None:
        _sync(self.device)
        self.t0 = time.perf_counter()

    def stop(self) -> float:
        _sync(self.device)
        return time.perf_counter() - self.t0


def clock_for(device: torch.device | str) -> Clock:
    """The clock a device is timed with: CUDA events on CUDA, a synchronised wall clock elsewhere."""
    device = torch.device(device)
    if device.type == "cuda":
        return EventClock(device)
    return SyncedClock(device)


def span(fn: Callable[[], Any], clock: Clock, calls: int) -> tuple[float, Any]:
    """Seconds per call of ``calls`` back-to-back calls of ``fn``, and the last call's result."""
    out = None
    clock.start()
    for _ in range(calls):
        out = fn()
    return clock.stop() / calls, out


def calls_for(estimate_s: float, min_span_s: float, min_calls: int, max_calls: int) -> int:
    """Back-to-back calls so that a span lasts at least ``min_span_s`` (within ``min_calls``..``max_calls``)."""
    wanted = math.ceil(min_span_s / max(estimate_s, 1e-9) - 1e-6)  # 0.25 / 0.01 is 25.000000000000004
    return max(min_calls, min(max_calls, wanted))


@dataclass(frozen=True)
class Timing:
    """One timing of a call: its steady seconds per call, the first call's seconds (None where not timed apart),
    the calls in the timed span, and the last result."""

    seconds: float
    out: Any
    first_s: Optional[float] = None
    calls: int = 1


def steady(fn: Callable[[], Any], clock: Clock, min_span_s: float, max_calls: int, min_calls: int = 2) -> Timing:
    """``fn``'s steady time per call, the first call timed apart.

    Where calls queue (``clock.back_to_back``): the first call alone (``first_s``: what a user pays once after
    patching), a second alone to size the span, then ``calls_for`` calls back to back (at least ``min_calls``,
    spanning ``min_span_s``); a lone first call never becomes the result. Elsewhere (the CPU): one call, which is
    its own steady state up to the one-time work it includes (``first_s`` None).
    """
    if not clock.back_to_back:
        seconds, out = span(fn, clock, 1)
        return Timing(seconds, out)
    first_s, _ = span(fn, clock, 1)
    estimate, _ = span(fn, clock, 1)
    calls = calls_for(estimate, min_span_s, min_calls, max_calls)
    seconds, out = span(fn, clock, calls)
    return Timing(seconds, out, first_s, calls)
