"""Steady-state timing (``tome_core.engine.timing``) and the speed check's use of it, with a stand-in clock.

The stand-in counts virtual seconds that each call adds, so what is timed is known exactly: a slow first call
(the patch's one-time work) must never become the result, a span must hold enough back-to-back calls, and the
speed check must read the steady ratio of whole to reduced calls. No real time is measured here."""
from __future__ import annotations

import pytest
import torch

from tome_core import ToMeConfig
from tome_core.engine import speed_check, timing
from conftest import StandInClock as VirtualClock


def costly(clock: VirtualClock, first: float, then: float):
    """A call costing ``first`` seconds the first time and ``then`` after; returns the call's index."""
    calls = []

    def fn():
        clock.now += first if not calls else then
        calls.append(1)
        return len(calls)

    return fn, calls


def test_a_slow_first_call_is_timed_apart_and_never_the_result():
    clock = VirtualClock()
    fn, calls = costly(clock, first=2.0, then=0.01)
    t = timing.steady(fn, clock, min_span_s=0.25, max_calls=64)
    assert t.first_s == pytest.approx(2.0)
    assert t.seconds == pytest.approx(0.01)
    assert t.calls == 25 and len(calls) == 1 + 1 + 25  # first, the sizing call, the span
    assert t.out == len(calls)


def test_a_span_holds_at_least_two_calls_even_when_one_call_is_long():
    clock = VirtualClock()
    fn, calls = costly(clock, first=5.0, then=0.4)  # one call longer than the span
    t = timing.steady(fn, clock, min_span_s=0.25, max_calls=64)
    assert t.calls == 2 and t.seconds == pytest.approx(0.4) and t.first_s == pytest.approx(5.0)


def test_spans_are_capped():
    clock = VirtualClock()
    fn, _ = costly(clock, first=0.001, then=0.0001)
    assert timing.steady(fn, clock, min_span_s=10.0, max_calls=64).calls == 64


def test_the_cpu_times_one_call_and_reports_no_first_call():
    fn_calls = []
    t = timing.steady(lambda: fn_calls.append(1) or 7, timing.clock_for("cpu"), 0.25, 64)
    assert fn_calls == [1] and t.out == 7 and t.first_s is None and t.calls == 1
    assert timing.clock_for("cpu").back_to_back is False


def test_calls_for_fills_the_span():
    assert timing.calls_for(0.01, 0.25, 2, 64) == 25
    assert timing.calls_for(1.0, 0.25, 2, 64) == 2
    assert timing.calls_for(1.0, 0.25, 1, 64) == 1
    assert timing.calls_for(0.0, 0.25, 2, 64) == 64


def _runner(clock: VirtualClock, whole: float, reduced: float, first_reduced: float):
    order = []

    def run(is_reduced: bool):
        seen_reduced = any(order_reduced for order_reduced in order)
        if is_reduced:
            clock.now += reduced if seen_reduced else first_reduced
        else:
            clock.now += whole
        order.append(is_reduced)

    return run, order


def test_the_speed_check_reads_the_steady_ratio_not_the_first_call():
    """Whole 10 ms, reduced 5 ms, the first reduced call 300 ms (its tables): the verdict is 2.0x."""
    clock = VirtualClock()
    run, order = _runner(clock, whole=0.010, reduced=0.005, first_reduced=0.300)
    speedup = speed_check.measure_speedup(ToMeConfig(ratio=0.5), None, torch.device("cpu"), torch.float32,
                                          run=run, clock=clock)
    assert speedup == pytest.approx(2.0)
    calls = timing.calls_for(0.010, timing.STEADY_SPAN_S, 2, timing.STEADY_MAX_CALLS)
    assert calls == 25  # the benchmark's steady span: 0.25 s
    # warm-up (whole, reduced), the sizing call, then spans of `calls` calls: whole, reduced, whole, ..., whole
    expected = [False, True, False] + [False] * calls + ([True] * calls + [False] * calls) * speed_check.CALL_ROUNDS
    assert order == expected


def test_a_long_call_is_checked_in_spans_of_two_calls():
    """A call longer than the span: spans of 2 calls, as the benchmark's steady rows (2 + 1 + 2 * (2 * CALL_ROUNDS
    + 1) calls)."""
    clock = VirtualClock()
    run, order = _runner(clock, whole=2.0, reduced=1.0, first_reduced=3.0)
    speedup = speed_check.measure_speedup(ToMeConfig(ratio=0.5), None, torch.device("cpu"), torch.float32,
                                          run=run, clock=clock)
    assert speedup == pytest.approx(2.0) and len(order) == 3 + 2 * (2 * speed_check.CALL_ROUNDS + 1)


def test_each_reduced_span_is_paired_with_the_whole_spans_beside_it():
    """A clock drifting during the check (every call 1 % slower than the one before) cannot decide the verdict: each
    reduced span is compared with the mean of the whole spans before and after it, as the benchmark pairs a row
    with the vanilla timings around it."""
    clock = VirtualClock()
    cost = {"drift": 1.0}

    def run(reduced: bool):
        cost["drift"] *= 1.01
        clock.now += (0.5 if reduced else 1.0) * cost["drift"]

    speedup = speed_check.measure_speedup(ToMeConfig(ratio=0.5), None, torch.device("cpu"), torch.float32,
                                          run=run, clock=clock)
    assert speedup == pytest.approx(2.0, rel=0.001)


def test_the_attention_stand_in_is_timed_in_spans_too(monkeypatch):
    """Hosts without a per-call hook time a level's self-attention. With each attention costing (queries x keys)
    virtual microseconds, kv r=0.75 on an 8x8 level (2x2 windows: 16 keys of 64) reads 4x."""
    clock = VirtualClock()
    real = speed_check._Attention.__call__

    def costed(self, x, keys=None):
        clock.now += x.shape[1] * (x if keys is None else keys).shape[1] * 1e-6
        return real(self, x, keys)

    monkeypatch.setattr(speed_check._Attention, "__call__", costed)
    config = ToMeConfig(ratio=0.75, mode="kv", speed_check="on")
    shape = speed_check.LevelShape("cpu", "float32", 2, (8, 8), 32, 4, 5)
    speedup = speed_check.measure_speedup(config, shape, torch.device("cpu"), torch.float32, clock=clock)
    assert speedup == pytest.approx(4.0)
    calls = timing.calls_for(64 * 64 * 1e-6, timing.STEADY_SPAN_S, 2, timing.STEADY_MAX_CALLS)
    assert calls == 62
    assert len(clock.spans) == 1 + 2 * speed_check.ROUNDS  # the sizing span, then whole and reduced (kv: no matching)
