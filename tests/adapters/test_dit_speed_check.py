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


def _family_cases():
    """(family, mode) of every diffusers DiT family the catalogue's tests build, in each mode it takes."""
    from test_dit_families import FAMILIES
    from tome_core.catalogue.diffusers_lookup import family_of

    cases = []
    for name, build in FAMILIES.items():
        model = build()[0]
        cases += [(name, "kv")] + ([(name, "merge")] if family_of(model).merge is not None else [])
    return cases


@pytest.mark.parametrize("family, mode", _family_cases())
def test_the_check_runs_on_every_family_in_both_modes(monkeypatch, family, mode):
    """Each family's batch is read from its own input (Z-Image's is a list of latents named ``x``; it raised
    KeyError: 'hidden_states' on an H100); the repeated call is the real one; a faster call is reduced as with the
    check off, a slower one left whole."""
    from test_dit_families import FAMILIES, run

    model, inputs, _ = FAMILIES[family]()
    vanilla = run(model, inputs)
    tome_core.apply_patch(model, ratio=0.5, mode=mode)
    try:
        reduced = run(model, inputs)
    finally:
        tome_core.remove_patch(model)
    batch = len(inputs.get("x", inputs.get("hidden_states")))
    for speedup, expected in ((1.5, reduced), (0.9, vanilla)):
        runs = []
        force(monkeypatch, speedup, runs)
        speed_check.forget_verdicts()
        tome_core.apply_patch(model, ratio=0.5, mode=mode, speed_check="on")
        try:
            out = run(model, inputs)
            text = tome_core.describe(model)
        finally:
            tome_core.remove_patch(model)
        assert runs == [None], text  # timed once, with the real call
        assert torch.equal(out, expected), (family, mode, speedup)
        assert f"batch {batch}: " in text and f"measured {speedup:.2f}x" in text, text


def test_the_reduced_side_of_the_check_is_the_call_as_the_user_gets_it(monkeypatch):
    """The check's repeats go through the patch's per-call hook: the reduced side plans its call (the per-call
    set-up a real step pays: the reading, the step's seeded picks, the plan), the whole side runs with the blocks'
    hooks unregistered, as a call ToMe leaves whole."""
    from tome_core.adapters.hooks.dit_call import STATE_ATTR

    model = build_dit("flux", blocks=2, scale="tiny")
    inputs = make_dit_inputs(model, "flux", 2, 64, 64, seed=1)
    seen = []

    def timer(config, shape, device, dtype, run=None):
        state = model.__dict__[STATE_ATTR]
        build = state.build

        def counting(*args, **kwargs):
            seen.append("planned")
            return build(*args, **kwargs)

        state.build = counting
        for reduced in (False, True, False):
            run(reduced)
            seen.append((reduced, state.hooks.attached))
        state.build = build
        return 1.5

    monkeypatch.setattr(speed_check, "measure_speedup", timer)
    tome_core.apply_patch(model, ratio=0.5, mode="kv", speed_check="on")
    try:
        forward(model, inputs)
    finally:
        tome_core.remove_patch(model)
    assert seen == [(False, False), "planned", (True, True), (False, False)]
