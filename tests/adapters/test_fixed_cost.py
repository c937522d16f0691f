"""Free when it does nothing, light where it acts: what one UNet forward pays for a ToMe patch on a GPU's terms.

On a fast GPU a step is bound by launching kernels from Python, so every ATen op, every Python call into
``tome_core`` and every host sync is paid in full. Counted on the second forward after ``apply_patch`` (the
first builds the step's tables), as the bench's ``--ops`` does: ops under a ``TorchDispatchMode``, Python calls
with ``sys.setprofile``. The tiny SD1.5 has SD1.5's block layout (16 transformer blocks on 4 levels), so the
counts of hooks and calls are those of the full model.
"""
from __future__ import annotations

import pytest
import torch

import tome_core
from tome_bench.models import build_unet, make_inputs
from tome_bench.op_count import count_ops, count_python_calls
from tome_core.catalogue.unets import level_blocks
from conftest import StandInClock as DriftingClock

HOST_DEFAULTS = dict(matching="level", speed_check="auto")  # ComfyUI's and the WebUI's
DOING_NOTHING = {
    "ratio 0": dict(ratio=0.0, **HOST_DEFAULTS),
    "every level whole (min_tokens)": dict(min_tokens=1 << 20, **HOST_DEFAULTS),
    "outside its step window": dict(start_percent=0.6, **HOST_DEFAULTS),  # the call is at t=500: progress 0.5
}


@pytest.fixture(scope="module")
def unet():
    return build_unet("sd15", "tiny", seed=0)


@pytest.fixture(scope="module")
def inputs(unet):
    sample, _, context, _ = make_inputs(unet, "sd15", 2, 128, 128, seed=1)
    return sample, torch.full((2,), 500.0), context


def forward(unet, inputs):
    sample, timestep, context = inputs
    with torch.no_grad():
        return unet(sample, timestep, encoder_hidden_states=context).sample


def second_forward(unet, inputs, **options):
    """(ops count, output) of the second forward after applying ``options``; the patch is removed after."""
    tome_core.apply_patch(unet, **options)
    try:
        forward(unet, inputs)
        return count_ops(lambda: forward(unet, inputs))
    finally:
        tome_core.remove_patch(unet)


def block_hooks(unet) -> int:
    return sum(len(m._forward_pre_hooks) + len(m._forward_hooks) for m in unet.modules() if m is not unet)


@pytest.mark.parametrize("name", list(DOING_NOTHING))
def test_a_patch_that_reduces_nothing_adds_no_sync_two_ops_at_most_and_five_calls(unet, inputs, name):
    vanilla, expected = count_ops(lambda: forward(unet, inputs))
    count, out = second_forward(unet, inputs, **DOING_NOTHING[name])
    assert torch.equal(out, expected)
    windowed = "start_percent" in DOING_NOTHING[name]  # a user-set window reads the step: one sync at most
    assert count.syncs - vanilla.syncs == (1 if windowed else 0)
    assert count.total - vanilla.total <= 2, count.added_over(vanilla)
    assert count.tome_calls <= 5


@pytest.mark.parametrize("options, most_calls", [
    (dict(HOST_DEFAULTS), 61),  # the hosts' default: 312 at cacab79, 61 at 811b2d0, 71 with compile marks, 61 again
    (dict(mode="kv"), 108),  # half of 216
    (dict(), 104),  # tomesd's defaults (merge, one matching per block)
    (dict(HOST_DEFAULTS, max_downsample=2), 200),
])
def test_reduced_paths_never_sync_and_call_little(unet, inputs, options, most_calls):
    vanilla, expected = count_ops(lambda: forward(unet, inputs))
    count, out = second_forward(unet, inputs, **options)
    assert not torch.equal(out, expected)  # it does reduce
    assert count.syncs == vanilla.syncs == 0
    assert 0 < count.tome_calls <= most_calls


def test_hooks_sit_only_on_the_blocks_reduced_in_the_call(unet, inputs):
    levels = level_blocks(unet)
    assert block_hooks(unet) == 0
    tome_core.apply_patch(unet, ratio=0.5, start_percent=0.0, end_percent=0.5, **HOST_DEFAULTS)
    try:
        assert block_hooks(unet) == 0  # nothing until a call says what it reduces
        sample, _, context = inputs
        with torch.no_grad():
            unet(sample, torch.full((2,), 900.0), encoder_hidden_states=context)  # progress 0.1: in the window
        hooked = {id(m) for m in unet.modules() if m is not unet and (m._forward_pre_hooks or m._forward_hooks)}
        level_one = {id(m) for block in levels[1] for m in block.modules()}
        assert hooked and hooked <= level_one  # only level 1 (max_downsample 1) is reduced
        with torch.no_grad():
            unet(sample, torch.full((2,), 100.0), encoder_hidden_states=context)  # progress 0.9: outside
        assert block_hooks(unet) == 0
    finally:
        tome_core.remove_patch(unet)
    assert block_hooks(unet) == 0 and len(unet._forward_pre_hooks) == 0


@pytest.mark.parametrize("family, mode", [("flux", "kv"), ("flux", "merge"), ("wan", "merge")])
def test_transformers_draw_their_step_on_the_device_without_a_host_sync(family, mode):
    """diffusers DiTs: the seeded picks or destinations of a step are drawn from the timestep tensor where it
    lives; the same step gives the same output as its value read on the host would."""
    from tome_bench.dit_models import build_dit, forward as dit_forward, make_dit_inputs

    model = build_dit(family, blocks=2, scale="tiny")
    inputs = make_dit_inputs(model, family, 2, 64, 64, frames=5 if family == "wan" else 1, seed=1)
    vanilla, _ = count_ops(lambda: dit_forward(model, inputs))
    tome_core.apply_patch(model, ratio=0.5, mode=mode)
    try:
        dit_forward(model, inputs)
        count, out = count_ops(lambda: dit_forward(model, inputs))
    finally:
        tome_core.remove_patch(model)
    assert count.syncs == vanilla.syncs == 0, count.added_over(vanilla)
    tome_core.apply_patch(model, ratio=0.5, mode=mode, start_percent=0.0, end_percent=1.0 - 1e-9)  # reads the step
    try:
        read = dit_forward(model, inputs)
    finally:
        tome_core.remove_patch(model)
    assert torch.equal(out, read)


def test_the_experiment_alternates_vanilla_and_each_patch_and_pairs_them_against_drift():
    """python -m tome_bench.experiments.fixed_cost --device cuda, its timing path on a stand-in clock: each patched
    span sits between two vanilla spans and is compared with their mean, so a linear drift cancels; the first call
    after applying is reported apart."""
    from tome_bench.measure import alternate

    clock = DriftingClock()
    order = []

    def forward():
        clock.now += order[-1][1] if order else 0.0

    costs = {"vanilla": 0.020}

    def vanilla_forward():
        costs["vanilla"] += 0.0001  # drifts up 0.1 ms per call
        order.append(("vanilla", costs["vanilla"]))
        forward()

    state = {"patched": False, "first": False}

    def apply():
        state.update(patched=True, first=True)

    def remove():
        state["patched"] = False

    def call():
        if not state["patched"]:
            return vanilla_forward()
        cost = 1.0 if state["first"] else costs["vanilla"] / 2  # half the current vanilla cost, once warmed
        state["first"] = False
        order.append(("patched", cost))
        forward()

    result = alternate(call, apply, remove, 5, clock)
    assert len(result["vanilla_ms"]) == 6 and len(result["patched_ms"]) == 5
    assert result["first_call_ms"] == pytest.approx([1000.0] * 5)
    kinds = [kind for kind, _ in order]
    runs = [kinds[0]] + [b for a, b in zip(kinds, kinds[1:]) if a != b]
    assert runs == ["vanilla", "patched"] * 5 + ["vanilla"]  # V, P, V, ..., V
    assert result["ratio"] == pytest.approx(2.0, rel=0.02) and result["ratio_max"] - result["ratio_min"] < 0.05


def test_the_experiment_counts_and_times_a_tiny_unet_on_a_stand_in_clock():
    from tome_bench.experiments import fixed_cost

    clock = DriftingClock()
    unet = build_unet("sd15", "tiny", seed=0)
    # 1 s a call (a long call: spans of 2 calls), 3 s for the first call of a patch
    seen = {"state": None}

    def cost(module, args, kwargs):
        state = module.__dict__.get("_tome_core")
        first = state is not None and state is not seen["state"]
        seen["state"] = state
        clock.now += 3.0 if first else 1.0

    unet.register_forward_pre_hook(cost, with_kwargs=True)
    lines = []
    case = fixed_cost.run_case("sd15", 64, torch.device("cpu"), torch.float32, alternations=2, clock=clock,
                               log=lines.append, unet=unet)
    assert [row["case"] for row in case["rows"]] == [label for label, _ in fixed_cost.CASES]
    for row in case["rows"]:
        assert row["timing"]["ratios"] == pytest.approx([1.0] * 2)
        assert row["timing"]["first_call_ms"] == pytest.approx([3000.0] * 2)
    assert case["rows"][0]["host_syncs"] == 0 and "1.000x vanilla" in lines[0]


def _forced_verdicts(monkeypatch, speedup: float) -> None:
    from tome_core.engine import speed_check

    def timer(config, shape, device, dtype, run=None):
        if run is not None:
            run(False), run(True)
        return speedup

    speed_check.forget_verdicts()
    monkeypatch.setattr(speed_check, "measure_speedup", timer)


def test_a_unet_level_the_speed_check_left_whole_costs_what_vanilla_costs(unet, inputs, monkeypatch):
    """SD1.5 1024 px on an H100: the hosts' default left its level whole, ran vanilla's kernels, and still measured
    0.974x: diffusers' ``unet.dtype`` walked all of the UNet's modules in every call. A call that reduces nothing now
    adds a handful of Python calls in all (ToMe's pre-hook, the verdict's look-up, torch's compile guard)."""
    _forced_verdicts(monkeypatch, 0.9)
    vanilla_calls = count_python_calls(lambda: forward(unet, inputs))
    vanilla, expected = count_ops(lambda: forward(unet, inputs))
    tome_core.apply_patch(unet, ratio=0.5, **dict(HOST_DEFAULTS, speed_check="on"))
    try:
        forward(unet, inputs)  # the first call decides (left whole)
        count, out = count_ops(lambda: forward(unet, inputs))
        calls = count_python_calls(lambda: forward(unet, inputs))
        assert "left whole" in tome_core.describe(unet)
        assert block_hooks(unet) == 0
    finally:
        tome_core.remove_patch(unet)
    assert torch.equal(out, expected)
    assert count.syncs == vanilla.syncs and count.total - vanilla.total <= 2 and count.tome_calls <= 3
    assert calls - vanilla_calls <= 12, calls - vanilla_calls


@pytest.mark.parametrize("mode, how", [("kv", "left whole"), ("merge", "left whole"), ("kv", "outside its window"),
                                       ("merge", "outside its window")])
def test_a_transformer_call_that_reduces_nothing_runs_no_tome_code_in_its_blocks(monkeypatch, mode, how):
    """diffusers DiTs: a call the speed check left whole, or outside the step window, has no ToMe hook on any block
    (a hook that only returns is still launch time in every block) and adds a handful of Python calls in all."""
    from tome_bench.dit_models import build_dit, forward as dit_forward, make_dit_inputs

    model = build_dit("flux", blocks=2, scale="tiny")
    inputs = make_dit_inputs(model, "flux", 2, 64, 64, seed=1)
    vanilla_calls = count_python_calls(lambda: dit_forward(model, inputs))
    vanilla, expected = count_ops(lambda: dit_forward(model, inputs))
    options = dict(ratio=0.5, mode=mode)
    if how == "left whole":
        _forced_verdicts(monkeypatch, 0.9)
        options["speed_check"] = "on"
    else:
        options.update(start_percent=0.0, end_percent=0.1)  # the call is at t=0.5: outside
    tome_core.apply_patch(model, **options)
    try:
        dit_forward(model, inputs)
        count, out = count_ops(lambda: dit_forward(model, inputs))
        calls = count_python_calls(lambda: dit_forward(model, inputs))
        hooked = [(name, m._forward_pre_hooks, m._forward_hooks) for name, m in model.named_modules()
                  if m is not model and (m._forward_pre_hooks or m._forward_hooks)]
    finally:
        tome_core.remove_patch(model)
    assert torch.equal(out, expected)
    assert hooked == []
    windowed = how == "outside its window"  # a user-set window reads the step: one sync
    assert count.syncs - vanilla.syncs == int(windowed) and count.total - vanilla.total <= 2 * int(windowed) + 2
    assert calls - vanilla_calls <= 32, calls - vanilla_calls  # 29: the hook, the memo of its inputs, one look-up
