"""The speed check on diffusers transformers: the model call timed whole against reduced, once per call shape.

Timings are forced (``speed_check.measure_speedup`` replaced by one that runs both calls it is handed and returns
a chosen speed-up), so nothing is decided by the clock; the run it is given is the real repeated call.
"""
from __future__ import annotations

import pytest
import torch

import tome_core
from tome_bench.dit_models import build_dit, forward, make_dit_inputs
from tome_core.engine import speed_check


@pytest.fixture(autouse=True)
def fresh_verdicts():
    speed_check.forget_verdicts()
    yield
    speed_check.forget_verdicts()


def force(monkeypatch, speedup: float, runs: list):
    def timer(config, shape, device, dtype, run=None):
        run(False), run(True)
        runs.append(shape)
        return speedup
    monkeypatch.setattr(speed_check, "measure_speedup", timer)


@pytest.mark.parametrize("family, mode", [("flux", "kv"), ("flux", "merge"), ("wan", "merge")])
def test_a_call_measured_slower_is_left_whole_and_a_faster_one_reduced(monkeypatch, family, mode):
    model = build_dit(family, blocks=2, scale="tiny")
    inputs = make_dit_inputs(model, family, 2, 64, 64, frames=5 if family == "wan" else 1, seed=1)
    vanilla = forward(model, inputs)
    tome_core.apply_patch(model, ratio=0.5, mode=mode)
    always = forward(model, inputs)
    tome_core.remove_patch(model)
    for speedup, expected, verdict in ((0.9, vanilla, "left whole"), (1.5, always, "reduced")):
        runs = []
        force(monkeypatch, speedup, runs)
        speed_check.forget_verdicts()
        tome_core.apply_patch(model, ratio=0.5, mode=mode, speed_check="on")
        try:
            first, second = forward(model, inputs), forward(model, inputs)
            text = tome_core.describe(model)
        finally:
            tome_core.remove_patch(model)
        assert runs == [None]  # timed once: the second call reuses the verdict
        assert torch.equal(first, expected) and torch.equal(second, expected)
        verb = "kv" if mode == "kv" else "merging"
        assert f"batch 2: {verdict}: the model call with {verb} measured {speedup:.2f}x on cpu" in text, text
    assert torch.equal(forward(model, inputs), vanilla)


def test_auto_does_not_time_the_cpu_and_says_so():
    model = build_dit("flux", blocks=2, scale="tiny")
    inputs = make_dit_inputs(model, "flux", 2, 64, 64, seed=1)
    tome_core.apply_patch(model, ratio=0.5, mode="merge", speed_check="auto")
    try:
        forward(model, inputs)
        text = tome_core.describe(model)
    finally:
        tome_core.remove_patch(model)
    assert "4x4 image tokens, batch 2: reduced (not timed on cpu)" in text
