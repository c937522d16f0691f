"""The speed check (a level is reduced only where it measured faster) and matching "level".

Timings are forced: ``speed_check.measure_speedup`` is replaced by a function returning chosen
speed-ups, so these tests decide nothing by the clock; one test runs the real timing once on a tiny
shape and checks only that it measures something.
"""
from __future__ import annotations

import pytest
import torch

import tome_core
from tome_core.engine import plan as plan_module
from tome_core.engine import speed_check
from tome_bench.models import build_unet, make_inputs
from tome_core.catalogue.unets import attention_levels
from tome_core.engine.levels import Level


@pytest.fixture(scope="module")
def unet():
    return build_unet("sd15", "tiny", seed=0)


@pytest.fixture(scope="module")
def inputs(unet):
    sample, timestep, context, _ = make_inputs(unet, "sd15", 2, 128, 128, seed=1)
    return sample, timestep, context


@pytest.fixture(autouse=True)
def fresh_verdicts():
    speed_check.forget_verdicts()
    yield
    speed_check.forget_verdicts()


def forward(unet, inputs):
    sample, timestep, context = inputs
    with torch.no_grad():
        return unet(sample, timestep, encoder_hidden_states=context).sample


def patched_run(unet, inputs, **options):
    """(output, describe text) of one forward with ToMe applied with ``options``; removed after."""
    tome_core.apply_patch(unet, **options)
    try:
        return forward(unet, inputs), tome_core.describe(unet)
    finally:
        tome_core.remove_patch(unet)


def forced(speedups: dict, calls: list):
    """A timer giving ``speedups[grid]`` (default 2.0) and recording what it was asked to time."""
    def timer(config, shape, device, dtype, run=None):
        calls.append(shape)
        return speedups.get(shape.grid, 2.0)
    return timer


def test_attention_levels_of_the_real_architectures():
    sd15, sdxl = attention_levels(build_unet("sd15", "tiny")), attention_levels(build_unet("sdxl", "tiny"))
    assert sd15[1] == Level(downsample=1, blocks=5, channels=32, heads=4)
    assert [level.blocks for level in sd15.values()] == [5, 5, 5, 1]  # down 2 + up 3 per level; the middle at 8x
    # SDXL (tiny: 2 layers per attention below the top): level 2x = down 2x2 + up 3x2, 4x = down 2x2 + mid 2 + up 3x2
    assert sorted(sdxl) == [2, 4] and (sdxl[2].blocks, sdxl[4].blocks) == (10, 12)


def test_a_level_measured_slower_is_left_whole_and_the_output_is_vanilla(unet, inputs, monkeypatch):
    calls = []
    monkeypatch.setattr(speed_check, "measure_speedup", forced({(16, 16): 0.86}, calls))
    vanilla = forward(unet, inputs)
    out, text = patched_run(unet, inputs, ratio=0.5, speed_check="on")
    assert torch.equal(out, vanilla)
    assert [shape.grid for shape in calls] == [(16, 16)] and calls[0].blocks == 5 and calls[0].batch == 2
    assert "level 1 (16x16 tokens, 5 blocks) at 128x128 px: left whole: the model call with merging measured 0.86x on cpu" in text


def test_a_level_measured_faster_is_reduced_as_without_the_check(unet, inputs, monkeypatch):
    monkeypatch.setattr(speed_check, "measure_speedup", forced({(16, 16): 1.31}, []))
    plain, _ = patched_run(unet, inputs, ratio=0.5)
    checked, text = patched_run(unet, inputs, ratio=0.5, speed_check="on")
    assert torch.equal(checked, plain) and not torch.equal(checked, forward(unet, inputs))
    assert "level 1 (16x16 tokens, 5 blocks) at 128x128 px: reduced: the model call with merging measured 1.31x on cpu" in text


def test_levels_are_decided_apart_and_each_shape_is_timed_once(unet, inputs, monkeypatch):
    calls = []
    monkeypatch.setattr(speed_check, "measure_speedup", forced({(16, 16): 0.9, (8, 8): 1.2}, calls))
    tome_core.apply_patch(unet, ratio=0.5, max_downsample=2, speed_check="on")
    only_level_2 = forward(unet, inputs)
    forward(unet, inputs)
    tome_core.apply_patch(unet, ratio=0.5, max_downsample=2, speed_check="on")  # a new patch, same shapes
    forward(unet, inputs)
    lines = tome_core.describe(unet).splitlines()
    tome_core.remove_patch(unet)
    assert sorted(shape.grid for shape in calls) == [(8, 8), (16, 16)]  # cached for the process
    assert lines[1].startswith("level 1 (16x16 tokens") and "left whole" in lines[1]
    assert lines[2].startswith("level 2 (8x8 tokens") and "reduced: the model call with merging measured 1.20x" in lines[2]
    tome_core.apply_patch(unet, ratio=0.5, max_downsample=2)
    both = forward(unet, inputs)
    tome_core.remove_patch(unet)
    vanilla = forward(unet, inputs)
    assert not torch.equal(only_level_2, both) and not torch.equal(only_level_2, vanilla)


def test_auto_times_gpus_only_and_says_so_on_the_cpu(unet, inputs, monkeypatch):
    calls = []
    monkeypatch.setattr(speed_check, "measure_speedup", forced({}, calls))
    _, text = patched_run(unet, inputs, ratio=0.5, speed_check="auto")
    assert calls == []
    assert "level 1 (16x16 tokens, 5 blocks) at 128x128 px: reduced (not timed on cpu)" in text
    assert speed_check.should_time(tome_core.ToMeConfig(speed_check="auto"), torch.device("cuda", 0))


def test_off_is_tomesd_behaviour_and_kv_is_checked_too(unet, inputs, monkeypatch):
    calls = []
    monkeypatch.setattr(speed_check, "measure_speedup", forced({(16, 16): 0.5}, calls))
    _, text = patched_run(unet, inputs, ratio=0.5)
    assert calls == [] and "speed check off" in text
    out, text = patched_run(unet, inputs, ratio=0.5, mode="kv", speed_check="on")
    vanilla = forward(unet, inputs)
    assert torch.equal(out, vanilla) and "left whole: the model call with kv measured 0.50x" in text


def test_bad_speed_check_and_matching_are_refused_before_patching(unet):
    with pytest.raises(ValueError, match="speed_check must be one of"):
        tome_core.apply_patch(unet, speed_check="sometimes")
    with pytest.raises(ValueError, match="matching must be one of"):
        tome_core.apply_patch(unet, matching="step")
    assert not tome_core.is_patched(unet)


def test_the_real_timing_measures_on_this_device():
    config = tome_core.ToMeConfig(ratio=0.5, speed_check="on", matching="level")
    shape = speed_check.LevelShape("cpu", "float32", 2, (8, 8), 32, 4, 5)
    speedup = speed_check.measure_speedup(config, shape, torch.device("cpu"), torch.float32)
    assert 0.05 < speedup < 20.0


def test_level_matching_matches_once_per_level_and_call(unet, inputs, monkeypatch):
    counted = []
    real = plan_module.match_tokens

    def counting(metric, partition, r):
        counted.append(tuple(metric.shape))
        return real(metric, partition, r)

    monkeypatch.setattr(plan_module, "match_tokens", counting)
    for matching, expected in (("block", 5), ("level", 1)):
        counted.clear()
        tome_core.apply_patch(unet, ratio=0.5, matching=matching)
        try:
            forward(unet, inputs)
            forward(unet, inputs)
        finally:
            tome_core.remove_patch(unet)
        assert counted == [(2, 256, 32)] * (2 * expected), matching


def test_level_matching_is_the_identity_at_ratio_zero_and_after_removal(unet, inputs):
    vanilla = forward(unet, inputs)
    tome_core.apply_patch(unet, ratio=0.0, matching="level", speed_check="on")
    assert torch.equal(forward(unet, inputs), vanilla)
    tome_core.apply_patch(unet, ratio=0.5, matching="level")
    merged = forward(unet, inputs)
    tome_core.remove_patch(unet)
    assert not torch.equal(merged, vanilla) and torch.equal(forward(unet, inputs), vanilla)


def test_the_speed_check_times_the_real_model_call_where_the_host_can_repeat_it(unet, inputs):
    """diffusers/WebUI hooks repeat the call in progress: a warm-up of each side, then CALL_ROUNDS reduced spans each
    between two whole spans, and the verdict says it timed the model call; the call's own output is ToMe's as
    without it."""
    calls = []
    handle = unet.conv_in.register_forward_pre_hook(lambda module, args: calls.append(1))
    try:
        out, text = patched_run(unet, inputs, ratio=0.5, speed_check="on")
        again, _ = patched_run(unet, inputs, ratio=0.5, speed_check="on")  # the verdict is cached
    finally:
        handle.remove()
    assert len(calls) == 1 + 2 + (2 * speed_check.CALL_ROUNDS + 1) + 1
    assert "level 1 (16x16 tokens, 5 blocks) at 128x128 px: " in text and "the model call with merging measured" in text
    reduced = "reduced: the model call" in text
    plain, _ = patched_run(unet, inputs, ratio=0.5)
    assert torch.equal(out, plain if reduced else forward(unet, inputs)) and torch.equal(again, out)
