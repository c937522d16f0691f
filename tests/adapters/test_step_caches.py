"""ToMe beside diffusers' step caches on the merging transformers: both act, or ToMe refuses naming the cache.

Each case runs a 6-step loop (``_loop``) on a tiny seeded transformer of the family with the cache alone, then with
ToMe applied before or after the cache. "Both act": the cache computes the same steps as alone (its probe block runs
whole beside merge, so it decides on the same output), ToMe reduces the computed calls, and the final output differs
from the cache alone's. Ratio 0 gives the cache alone's output bit for bit; so does the cache after ``remove_patch``.
A cache inside a merged block (on its attention) is refused in mode merge, naming it and what works; it composes with
kv. Speed figures: ``python -m tome_bench.experiments.step_caches`` (docs/BENCHMARK.md).
"""
from __future__ import annotations

import contextlib
import os

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tome_core import apply_patch, describe, remove_patch  # noqa: E402
from tome_core.adapters.hooks.dit import STATE_ATTR  # noqa: E402
from tome_core.engine import speed_check  # noqa: E402
from test_dit_diffusers import flux, wan  # noqa: E402
from test_dit_families import ltx2, qwen_image, run  # noqa: E402

STEPS = (0.9, 0.8, 0.7, 0.6, 0.5, 0.4)
FAMILIES = {"flux": flux, "wan": wan, "qwen_image": qwen_image}
_NOW = [0.0]
# each cache as a user configures it, set to skip some of the 6 steps of these tiny models alone
CACHES = {
    "first_block_cache": lambda: diffusers.FirstBlockCacheConfig(threshold=0.5),
    "mag_cache": lambda: diffusers.MagCacheConfig(threshold=0.5, num_inference_steps=len(STEPS),
                                                  mag_ratios=[1.0] * len(STEPS)),
    "taylorseer_lite": lambda: diffusers.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                                               use_lite_mode=True, taylor_factors_dtype=torch.float32),
    "sea_cache": lambda: diffusers.SeaCacheConfig(threshold=0.5),
    "taylorseer": lambda: diffusers.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                                          taylor_factors_dtype=torch.float32),
    "pyramid_attention_broadcast": lambda: diffusers.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: _NOW[0]),
}
BLOCK_CACHES = ("first_block_cache", "mag_cache", "sea_cache", "taylorseer_lite")  # on whole blocks (or outside them)
# SeaCache reads the raw vision latents; packed ones (Flux, Qwen-Image) it cannot read, and it "runs in fail-open mode"
# (computes every step) by itself: test_sea_cache_fails_open_on_packed_latents
SEA_OPEN = (("flux", "sea_cache"), ("qwen_image", "sea_cache"))
INNER_CACHES = ("taylorseer", "pyramid_attention_broadcast")  # on the attentions inside the blocks


def _loop(model, inputs):
    """The final output of a 6-step Euler-like loop and the steps whose last block computed."""
    blocks = [b for name in ("transformer_blocks", "single_transformer_blocks", "blocks")
              for b in getattr(model, name, ())]
    computed = []
    inner = next(m for m in blocks[-1].children() if any(True for _ in m.parameters()))
    handle = inner.register_forward_pre_hook(lambda m, a: computed.append(_NOW[0]))
    x = inputs["hidden_states"]
    try:
        for index, step in enumerate(STEPS):  # where the loop is, as diffusers' pipelines tell their caches
            _NOW[0] = step * 1000
            context = model.cache_context("cond", step_index=index, sigma=step, num_inference_steps=len(STEPS)) \
                if hasattr(model, "_diffusers_hook") else contextlib.nullcontext()
            with context:
                call = dict(inputs, hidden_states=x, timestep=torch.full_like(inputs["timestep"], step))
                out = run(model, call)
            x = x - 0.1 * out if out.shape == x.shape else x
    finally:
        handle.remove()
    return out, len(dict.fromkeys(computed))


def _with(model, inputs, cache, order, **tome):
    """The loop with ``cache`` and ToMe (``tome``: apply_patch's settings) applied in ``order``; both taken off after."""
    try:
        if order == "tome_first":
            apply_patch(model, **tome)
        model.enable_cache(CACHES[cache]())
        if order == "cache_first":
            apply_patch(model, **tome)
        found = _loop(model, inputs)
        state = model.__dict__[STATE_ATTR]
        return found, state.reduced_calls, describe(model)
    finally:
        remove_patch(model)
        if model.is_cache_enabled:
            model.disable_cache()


def _alone(model, inputs, cache):
    model.enable_cache(CACHES[cache]())
    try:
        return _loop(model, inputs)
    finally:
        model.disable_cache()


@pytest.mark.parametrize("family,cache", [(f, c) for f in FAMILIES for c in BLOCK_CACHES if (f, c) not in SEA_OPEN] +
                         [("ltx2", "taylorseer_lite")])
@pytest.mark.parametrize("mode", ["merge", "kv"])
@pytest.mark.parametrize("order", ["cache_first", "tome_first"])
def test_a_cache_on_whole_blocks_and_tome_both_act(family, cache, mode, order):
    model, inputs, _ = (ltx2 if family == "ltx2" else FAMILIES[family])()
    vanilla, _ = _loop(model, inputs)
    (alone, skipped_alone) = _alone(model, inputs, cache)
    assert skipped_alone < len(STEPS) and not torch.equal(alone, vanilla)  # the cache acts alone
    tome = dict(ratio=0.5, mode=mode, block_start=0.0, speed_check="off")
    (both, computed), reduced, said = _with(model, inputs, cache, order, **tome)
    assert computed == skipped_alone  # the cache computes the steps it computes alone
    assert reduced > 0 and torch.isfinite(both).all() and not torch.equal(both, alone)  # ToMe acts on those
    if mode == "merge" and cache != "taylorseer_lite":  # the probe block runs whole, said in describe()
        assert "runs whole" in said and "decides from its output" in said
    (zero, _), _, _ = _with(model, inputs, cache, order, **dict(tome, ratio=0.0))
    assert torch.equal(zero, alone)  # ratio 0: the cache alone, bit for bit
    assert torch.equal(_alone(model, inputs, cache)[0], alone)  # after removal: the cache alone, bit for bit


@pytest.mark.parametrize("cache", BLOCK_CACHES)
def test_both_orders_give_the_same_output(cache):
    model, inputs, _ = wan()
    tome = dict(ratio=0.5, mode="merge", speed_check="off")
    first = _with(model, inputs, cache, "cache_first", **tome)[0][0]
    second = _with(model, inputs, cache, "tome_first", **tome)[0][0]
    assert torch.equal(first, second)


@pytest.mark.parametrize("family,cache", [(f, c) for f in FAMILIES for c in INNER_CACHES
                                          if (f, c) != ("wan", "taylorseer")])
@pytest.mark.parametrize("order", ["cache_first", "tome_first"])
def test_a_cache_inside_merged_blocks_is_refused_naming_it_and_composes_with_kv(family, cache, order):
    """On an attention inside a merged block a cached output would hold another step's merged tokens: refused at
    apply_patch (cache first) or at the first model call (ToMe first), naming the cache and mode kv; kv composes."""
    model, inputs, _ = FAMILIES[family]()
    alone, _ = _alone(model, inputs, cache)
    with pytest.raises(RuntimeError, match=r"diffusers' \w+ caches .*use mode='kv' on this transformer.*FirstBlockCache"):
        _with(model, inputs, cache, order, ratio=0.5, mode="merge", block_start=0.0, speed_check="off")
    assert not hasattr(model, STATE_ATTR) or STATE_ATTR not in model.__dict__
    (both, _), reduced, _ = _with(model, inputs, cache, order, ratio=0.5, mode="kv", block_start=0.0,
                                  speed_check="off")
    assert reduced > 0 and not torch.equal(both, alone) and torch.isfinite(both).all()
    (zero, _), _, _ = _with(model, inputs, cache, order, ratio=0.0, mode="kv", speed_check="off")
    assert torch.equal(zero, alone)


@pytest.mark.parametrize("cache", ["first_block_cache", "mag_cache"])
@pytest.mark.parametrize("speedup, verdict", [(1.5, "reduced"), (0.9, "left whole")])
def test_the_speed_check_times_computed_steps_and_leaves_the_cache_as_it_was(cache, speedup, verdict, monkeypatch):
    """speed_check "on" times the first call by repeating it whole and reduced with the cache stepped over (the
    timer is forced, the repeats are real): the cache then computes the same steps as with the check off, and the
    output is the check-off one (reduced) or the cache alone's (left whole), bit for bit."""
    model, inputs, _ = wan()
    alone, computed_alone = _alone(model, inputs, cache)
    tome = dict(ratio=0.5, mode="merge", block_start=0.0)
    (off, computed_off), _, _ = _with(model, inputs, cache, "cache_first", speed_check="off", **tome)
    repeats = []

    def timer(config, shape, device, dtype, run=None):
        before = [n for n, m in model.named_modules() if getattr(m.__dict__.get("_diffusers_hook"), "hooks", None)]
        run(False), run(True)
        repeats.append(before)
        return speedup
    speed_check.forget_verdicts()
    monkeypatch.setattr(speed_check, "measure_speedup", timer)
    try:
        (on, computed_on), _, said = _with(model, inputs, cache, "cache_first", speed_check="on", **tome)
    finally:
        speed_check.forget_verdicts()
    assert len(repeats) == 1 and repeats[0]  # timed once, by repeating the call, with the cache on the model
    assert f"{verdict}: the model call with merging measured {speedup:.2f}x on cpu" in said, said
    if verdict == "reduced":
        assert computed_on == computed_off and torch.equal(on, off)
    else:
        assert computed_on == computed_alone and torch.equal(on, alone)

def test_taylorseer_default_hooks_nothing_on_wan_so_merge_runs_alone():
    """diffusers 0.42.1's TaylorSeer identifiers ("^blocks.*attn", matched whole) miss Wan's ``blocks.N.attn1``: the
    cache hooks no module there, and ToMe's merge runs as alone (nothing to refuse, nothing cached)."""
    model, inputs, _ = wan()
    tome = dict(ratio=0.5, mode="merge", speed_check="off")
    apply_patch(model, **tome)
    alone = _loop(model, inputs)[0]
    remove_patch(model)
    model.enable_cache(CACHES["taylorseer"]())
    assert not [n for n, m in model.named_modules() if getattr(m.__dict__.get("_diffusers_hook"), "hooks", None)]
    model.disable_cache()
    (both, computed), _, _ = _with(model, inputs, "taylorseer", "cache_first", **tome)
    assert torch.equal(both, alone) and computed == len(STEPS)


@pytest.mark.parametrize("cache", ["first_block_cache", "mag_cache"])
def test_block_caches_fail_on_ltx2_by_themselves_and_leave_tome_as_it_was(cache):
    """diffusers 0.42.1 has no block metadata for LTX-2's blocks: FirstBlockCache and MagCache raise at enable_cache
    without ToMe too; a ToMe patch applied before stays as it was."""
    model, inputs, _ = ltx2()
    apply_patch(model, ratio=0.5, mode="merge", speed_check="off")
    alone = _loop(model, inputs)[0]
    with pytest.raises(ValueError, match="not registered"):
        model.enable_cache(CACHES[cache]())
    if model.is_cache_enabled:
        model.disable_cache()
    assert torch.equal(_loop(model, inputs)[0], alone)
    remove_patch(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_faster_cache_fails_by_itself_and_leaves_tome_as_it_was(family):
    """diffusers 0.42.1's FasterCache fails on these transformers without ToMe ("'NoneType' object is not
    subscriptable" in its attention hook); beside ToMe it fails the same way, and nothing of ToMe's is left after."""
    model, inputs, _ = FAMILIES[family]()
    vanilla = _loop(model, inputs)[0]
    config = lambda: diffusers.FasterCacheConfig(  # noqa: E731
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: _NOW[0], is_guidance_distilled=True)
    model.enable_cache(config())
    with pytest.raises(TypeError, match="not subscriptable"):
        _loop(model, inputs)
    model.disable_cache()
    apply_patch(model, ratio=0.5, mode="kv", speed_check="off")
    model.enable_cache(config())
    with pytest.raises(TypeError, match="not subscriptable"):
        _loop(model, inputs)
    model.disable_cache()
    remove_patch(model)
    assert torch.equal(_loop(model, inputs)[0], vanilla)


@pytest.mark.parametrize("family", ["flux", "qwen_image"])
def test_sea_cache_fails_open_on_packed_latents(family):
    """SeaCache computes every step of Flux and Qwen-Image by itself (it cannot read their packed latents); with ToMe
    it still computes every step, and ToMe reduces them."""
    model, inputs, _ = FAMILIES[family]()
    _, computed = _alone(model, inputs, "sea_cache")
    assert computed == len(STEPS)
    (_, computed), reduced, _ = _with(model, inputs, "sea_cache", "cache_first", ratio=0.5, mode="merge",
                                      speed_check="off")
    assert computed == len(STEPS) and reduced > 0


def _cache_dit_loop(model, inputs, tome=None, timer=None):
    """The loop under cache-dit's DBCache F1B0 (ToMe applied after it with ``tome``), taken off after."""
    import cache_dit
    cache_dit.enable_cache(model, cache_config=cache_dit.DBCacheConfig(
        Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=0.5, max_warmup_steps=1,
        num_inference_steps=len(STEPS)))
    try:
        if tome is not None:
            apply_patch(model, **tome)
        found = _loop(model, inputs)
        return found, describe(model) if tome is not None else ""
    finally:
        remove_patch(model)
        cache_dit.disable_cache(model)


@pytest.mark.parametrize("speedup, verdict", [(None, None), (1.5, "reduced"), (0.9, "left whole")])
def test_cache_dit_probe_block_runs_whole_and_the_speed_check_steps_over_it(speedup, verdict, monkeypatch):
    """cache-dit's DBCache decides from its first Fn blocks: beside merge those run whole (said in describe()), so it
    computes the steps it computes alone; the speed check's repeats run the model's own forward, outside cache-dit's
    state, so the check changes neither the steps computed nor the output."""
    if os.environ.get("CI") != "true":  # CI installs cache-dit (tests/run.sh): there a missing one fails
        pytest.importorskip("cache_dit")
    model, inputs, _ = wan()
    (alone, computed_alone), _ = _cache_dit_loop(model, inputs)
    tome = dict(ratio=0.5, mode="merge", block_start=0.0, speed_check="off")
    (off, computed_off), said = _cache_dit_loop(model, inputs, tome)
    assert computed_off == computed_alone < len(STEPS) and not torch.equal(off, alone)
    assert "blocks.0 runs whole: cache-dit DBCache decides from its output" in said, said
    if speedup is None:
        return
    repeats = []

    def timer(config, shape, device, dtype, run=None):
        run(False), run(True)
        repeats.append(shape)
        return speedup
    speed_check.forget_verdicts()
    monkeypatch.setattr(speed_check, "measure_speedup", timer)
    try:
        (on, computed_on), said = _cache_dit_loop(model, inputs, dict(tome, speed_check="on"))
    finally:
        speed_check.forget_verdicts()
    assert len(repeats) == 1 and f"{verdict}: the model call with merging measured {speedup:.2f}x" in said
    expected = (off, computed_off) if verdict == "reduced" else (alone, computed_alone)
    assert computed_on == expected[1] and torch.equal(on, expected[0])


@pytest.mark.parametrize("cache", ["first_block_cache", "pyramid_attention_broadcast"])
def test_a_kv_family_hunyuan_video_with_a_block_and_an_attention_cache(cache):
    """HunyuanVideo takes mode kv only: beside a cache on its blocks or on its attentions, both act, ratio 0 is the
    cache alone bit for bit."""
    from test_dit_diffusers import hunyuan_video
    model, inputs, _ = hunyuan_video()
    alone, computed_alone = _alone(model, inputs, cache)
    (both, computed), reduced, _ = _with(model, inputs, cache, "tome_first", ratio=0.5, mode="kv", speed_check="off")
    assert reduced > 0 and not torch.equal(both, alone) and torch.isfinite(both).all()
    assert computed == computed_alone
    (zero, _), _, _ = _with(model, inputs, cache, "cache_first", ratio=0.0, mode="kv", speed_check="off")
    assert torch.equal(zero, alone)
