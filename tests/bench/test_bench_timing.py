"""The benchmark times a variant's steady step, never the first call after it was applied.

A stand-in clock of a device where calls queue (as CUDA's) replaces the real one, and the tiny UNet's calls
cost virtual seconds: a patched call right after ``apply_patch`` costs 1 s (its one-time work), later patched
calls 10 ms, vanilla calls 20 ms. Rows must say 10 ms and 20 ms (2x), and report the 1 s apart."""
from __future__ import annotations

import pytest
import torch

from tome_bench import measure, runner
from tome_bench.methods import Variant
from tome_bench.models import build_unet
from conftest import StandInClock as VirtualClock

STATE_ATTR = "_tome_core"


@pytest.fixture
def costed_unet(monkeypatch):
    clock = VirtualClock()
    monkeypatch.setattr(measure.timing, "clock_for", lambda device: clock)
    unet = build_unet("sd15", "tiny", seed=0)
    seen = {"state": None}

    def cost(module, args, kwargs):
        state = module.__dict__.get(STATE_ATTR)
        if state is None:
            clock.now += 0.020
        elif state is not seen["state"]:
            seen["state"] = state  # the first call of this patch
            clock.now += 1.0
        else:
            clock.now += 0.010

    unet.register_forward_pre_hook(cost, with_kwargs=True)
    return unet


def test_rows_time_the_steady_step_and_report_the_first_call_apart(costed_unet):
    cfg = runner.BenchConfig(families=("sd15",), resolutions=((64, 64),), methods=("vanilla", "merge"),
                             repeats=2, scale="tiny", peaked=1.0, dtype="fp32")
    variants = [Variant("vanilla"), Variant("merge", 0.5)]
    rows = runner.run_case(costed_unet, "sd15", (64, 64), variants, cfg, lambda _: None)
    vanilla, merge = rows
    assert vanilla["times_s"] == pytest.approx([0.020, 0.020])
    assert merge["times_s"] == pytest.approx([0.010, 0.010])
    assert merge["speedup"] == pytest.approx(2.0)
    assert merge["first_call_s"] == pytest.approx(1.0) and merge["first_calls_s"] == pytest.approx([1.0, 1.0])
    assert vanilla["first_call_s"] == pytest.approx(0.020)


def test_a_variant_applied_anew_each_round_is_timed_after_its_first_call(costed_unet):
    """The spans hold enough calls for GPU_ROUND_S and never fewer than 2."""
    calls = []
    costed_unet.register_forward_pre_hook(lambda *_: calls.append(1))
    with runner.patched(costed_unet, Variant("merge", 0.5), seed=0):
        inputs = runner.case_inputs(costed_unet, "sd15", (64, 64), runner.BenchConfig(
            resolutions=((64, 64),), scale="tiny", dtype="fp32"))
        t = measure.timed_wait(lambda: measure.forward(costed_unet, inputs), torch.device("cpu"))
    assert t.seconds == pytest.approx(0.010) and t.first_s == pytest.approx(1.0)
    assert t.wait is None or 0 <= t.wait <= 1
    assert len(calls) == 2 + round(measure.GPU_ROUND_S / 0.010)


def test_compiled_rows_per_mode_are_written_as_each_variant_compiles(costed_unet, monkeypatch):
    """A long compilation never holds back what is measured: the eager rows, then each compiled row, are handed to
    ``emit`` as they are done; each mode's rows compare with that mode's compiled vanilla."""
    compiled_ms = {("vanilla", "default"): 30.0, ("merge", "default"): 20.0,
                   ("vanilla", "reduce-overhead"): 24.0, ("merge", "reduce-overhead"): 12.0}
    calls = []

    def fake_compile(model, inputs, v, cfg, forward, mode="default", case=None):
        calls.append((v.method, mode))
        t = compiled_ms[(v.method, mode)] / 1000
        return {"times": [t, t], "first_s": 40.0, "out": forward(model, inputs), "recompiles": 0, "graphs": 2,
                **({"cudagraph_skips": 0, "cudagraph_skip_reasons": []} if mode == "reduce-overhead" else {})}

    monkeypatch.setattr(runner, "_compile_variant", fake_compile)
    cfg = runner.BenchConfig(families=("sd15",), resolutions=((64, 64),), methods=("vanilla", "merge"), repeats=1,
                             scale="tiny", peaked=1.0, dtype="fp32", compile=True,
                             compile_modes=("default", "reduce-overhead"))
    emitted = []
    rows = runner.run_case(costed_unet, "sd15", (64, 64), [Variant("vanilla"), Variant("merge", 0.5)], cfg,
                           lambda _: None, emit=lambda so_far: emitted.append(len(so_far)))
    assert emitted == [2, 3, 4, 5, 6]
    assert calls == [("vanilla", "default"), ("merge", "default"), ("vanilla", "reduce-overhead"),
                     ("merge", "reduce-overhead")]
    default, graphs = rows[3], rows[5]
    assert default["compile_mode"] == "default" and default["speedup"] == pytest.approx(1.5)
    assert graphs["compile_mode"] == "reduce-overhead" and graphs["speedup"] == pytest.approx(2.0)
    assert graphs["attention"] == "inductor + CUDA graphs" and graphs["cudagraph_skips"] == 0
    assert default["speedup_vs_eager"] == pytest.approx(20.0 / 20.0)  # eager vanilla 20 ms (virtual)
    assert default["recompiles"] == 0 and default["compile_s"] == 40.0


def test_compile_modes_are_checked():
    with pytest.raises(ValueError, match="compile modes must be from default, reduce-overhead"):
        runner.BenchConfig(compile=True, compile_modes=("max-autotune",))
