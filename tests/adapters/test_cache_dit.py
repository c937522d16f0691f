"""cache-dit (PyPI ``cache-dit`` 1.5.3, diffusers' "speed stack") beside ToMe on diffusers DiTs, in both orders.

cache-dit's DBCache wraps a transformer's block lists: each call runs the first ``Fn`` blocks, compares their
residual with the last computed step's, and where it moved less than ``residual_diff_threshold`` it skips the other
blocks and adds their stored residual instead (``cache_dit.caching.cache_blocks.pattern_base``). It calls every block
module as ``block(...)``, so ToMe's per-block (merge) and per-attention (kv) forwards run inside it; the residuals it
stores are whole-stream ones (ToMe's merge gives each block's update back on every token), so a skipped step adds
a residual of the right size. Checked on tiny real diffusers classes with seeded weights (the builders of
test_dit_diffusers and test_dit_families), through an 8-step Euler loop, DBCache F1B0 alone and with the TaylorSeer
calibrator: both act (the cache still skips steps, in mode merge the ones it skips alone; ToMe reduces every block
call the cache computes and no other, but for the blocks the cache decides from, which mode merge leaves whole; the
result differs from each alone and is the same in either order), ratio 0 and ``remove_patch`` give the cache alone's
result bit for bit, ``disable_cache`` ToMe alone's, and every buffer cache-dit stores has the shape it has without
ToMe. The speed check's repeats of a call step over cache-dit's forward.

cache-dit marks the transformer it caches: ``_is_cached`` (True), ``_context_manager`` (its CachedContextManager) and
``_context_names`` (one cache context per block list) in the instance ``__dict__``; the skipped steps of the run in
progress are ``_context_manager.get_context(name).get_cached_steps()`` for each name.
"""
from __future__ import annotations

import importlib.metadata
import os
from dataclasses import dataclass
from typing import Callable, Dict, List, Tuple

import pytest
import torch

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # read when cache_dit is first imported: its info lines
if os.environ.get("CI") == "true":  # CI's set-up installs cache-dit (tests/run.sh): there a missing one fails
    import cache_dit
else:
    cache_dit = pytest.importorskip("cache_dit", reason="cache-dit 1.5.3 is installed --no-deps by tests/run.sh")
diffusers = pytest.importorskip("diffusers")

from cache_dit import DBCacheConfig, TaylorSeerCalibratorConfig  # noqa: E402

from tome_core import apply_patch, describe, is_patched, remove_patch  # noqa: E402
from tome_core.adapters.hooks.dit import STATE_ATTR  # noqa: E402
from tome_core.engine import speed_check  # noqa: E402
from conftest import hook_count  # noqa: E402
from test_dit_diffusers import flux, hunyuan_video, wan  # noqa: E402
from test_dit_families import ltx2, qwen_image, run, z_image  # noqa: E402

CACHE_DIT_VERSION = "1.5.3"
STEPS = 8
ORDERS = ("cache_first", "tome_first")


@dataclass(frozen=True)
class Family:
    build: Callable
    modes: Tuple[str, ...]
    sigmas: Tuple[float, float]  # the loop's first and last noise level: a span where DBCache skips some steps
    threshold: Dict[str, float]  # DBCache's residual_diff_threshold per cache configuration
    time: str = "x1000"  # the timestep the model takes for noise level s: "sigma" s, "rising" 1 - s, "x1000" 1000 s


FAMILIES = {  # thresholds a few hundredths from every residual diff the cache alone compares (margin ~0.01 on Z-Image)
    "flux": Family(flux, ("merge", "kv"), (0.9, 0.5), {"dbcache": 0.4, "taylorseer": 0.5}, "sigma"),
    "qwen_image": Family(qwen_image, ("merge", "kv"), (0.9, 0.5), {"dbcache": 0.6, "taylorseer": 0.65}, "sigma"),
    "z_image": Family(z_image, ("merge", "kv"), (0.5, 0.499), {"dbcache": 0.06, "taylorseer": 0.06}, "rising"),
    "wan": Family(wan, ("merge", "kv"), (0.9, 0.5), {"dbcache": 0.43, "taylorseer": 0.5}),
    "ltx2": Family(ltx2, ("merge", "kv"), (0.9, 0.5), {"dbcache": 0.3, "taylorseer": 0.2}),
    "hunyuan_video": Family(hunyuan_video, ("kv",), (0.9, 0.5), {"dbcache": 0.55, "taylorseer": 0.55}),  # kv only
}
# the blocks DBCache F1 computes at every step to decide whether the rest is (the first of each block list it
# caches; Flux's: its double then single blocks as one list): mode merge leaves them whole, so the cache decides on
# their exact outputs
PROBES = {"flux": ("transformer_blocks.0",), "qwen_image": ("transformer_blocks.0",), "z_image": ("layers.0",),
          "wan": ("blocks.0",), "ltx2": ("transformer_blocks.0",),
          "hunyuan_video": ("transformer_blocks.0", "single_transformer_blocks.0")}
CACHES = ("dbcache", "taylorseer")
WARMUP = {"dbcache": 2, "taylorseer": 4}  # TaylorSeer extrapolates once it holds two computed steps after warmup


def cache_options(family: str, cache: str, calibrator: bool = True) -> dict:
    """DBCache F1B0 over this loop's steps (one call per step: no separate CFG calls), with TaylorSeer (order 1) for
    "taylorseer" unless ``calibrator`` is False."""
    config = DBCacheConfig(Fn_compute_blocks=1, Bn_compute_blocks=0,
                           residual_diff_threshold=FAMILIES[family].threshold[cache], max_warmup_steps=WARMUP[cache],
                           num_inference_steps=STEPS, enable_separate_cfg=False)
    calibrator = TaylorSeerCalibratorConfig(taylorseer_order=1) if cache == "taylorseer" and calibrator else None
    return dict(cache_config=config, calibrator_config=calibrator)


def cache_is_on(model) -> bool:
    """What cache-dit leaves on the transformer it caches (duck typed)."""
    own = model.__dict__
    return own.get("_is_cached") is True and "_context_manager" in own and bool(own.get("_context_names"))


def cached_steps(model) -> List[List[int]]:
    """The steps the cache skipped in the last run, per block list (cache context)."""
    manager = model._context_manager
    return [manager.get_context(name).get_cached_steps() for name in model._context_names]


class BufferShapes:
    """The shape of every tensor cache-dit stores (Fn residual, Bn residual or hidden states, text stream) and of
    what its skipped steps hand on: set over the context manager's own methods (an instance attribute each)."""

    def __init__(self, model) -> None:
        self.seen = set()
        manager = model._context_manager
        for name in ("set_Fn_buffer", "set_Bn_buffer", "set_Bn_encoder_buffer"):
            own = getattr(manager, name)

            def record(buffer, prefix="Fn", _own=own, _name=name):
                if isinstance(buffer, torch.Tensor):
                    self.seen.add((_name, prefix, tuple(buffer.shape)))
                return _own(buffer, prefix)

            setattr(manager, name, record)
        apply = manager.apply_cache

        def apply_cache(hidden_states, encoder_hidden_states=None, **kwargs):
            out = apply(hidden_states, encoder_hidden_states, **kwargs)
            self.seen.add(("apply_cache", kwargs.get("prefix"), tuple(hidden_states.shape),
                           tuple(out[0].shape), None if out[1] is None else tuple(out[1].shape)))
            return out

        manager.apply_cache = apply_cache


def sample(name: str, model, inputs) -> torch.Tensor:
    """An 8-step Euler loop from the family's first noise level to its last; the final latent. A cached model starts
    from a fresh cache state (``refresh_context``): cache-dit 1.5.3 renews a transformer-only context one call late,
    so without it a second run's first call would be the first run's step 8, served from its residuals."""
    family = FAMILIES[name]
    if cache_is_on(model):
        cache_dit.refresh_context(model)
    latent_key, time_key = ("x", "t") if name == "z_image" else ("hidden_states", "timestep")
    call = dict(inputs)
    latent = call[latent_key]
    sigmas = torch.linspace(family.sigmas[0], family.sigmas[1], STEPS + 1).tolist()
    for now, after in zip(sigmas[:-1], sigmas[1:]):
        t = {"sigma": now, "rising": 1.0 - now, "x1000": 1000.0 * now}[family.time]
        call[time_key], call[latent_key] = torch.full((1,), t), latent
        out = run(model, call)
        step = after - now
        latent = [x + step * v for x, v in zip(latent, out)] if name == "z_image" else latent + step * out
    return torch.stack(latent) if isinstance(latent, list) else latent


@dataclass
class Outcome:
    out: torch.Tensor
    steps: List[List[int]]
    shapes: set


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    """These models are a few thousand weights: one intra-op thread is as fast, and does not slow down tenfold when
    the cores are shared (two threads spinning for a busy core)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


_MEMO: dict = {}


def vanilla(name: str) -> torch.Tensor:
    if (name, "vanilla") not in _MEMO:
        model, inputs, _ = FAMILIES[name].build()
        _MEMO[name, "vanilla"] = sample(name, model, inputs)
    return _MEMO[name, "vanilla"]


def cache_alone(name: str, cache: str) -> Outcome:
    if (name, cache) not in _MEMO:
        model, inputs, _ = FAMILIES[name].build()
        cache_dit.enable_cache(model, **cache_options(name, cache))
        shapes = BufferShapes(model)
        _MEMO[name, cache] = Outcome(sample(name, model, inputs), cached_steps(model), shapes.seen)
    return _MEMO[name, cache]


def tome_alone(name: str, mode: str) -> torch.Tensor:
    if (name, mode) not in _MEMO:
        model, inputs, _ = FAMILIES[name].build()
        apply_patch(model, ratio=0.5, mode=mode)
        _MEMO[name, mode] = sample(name, model, inputs)
    return _MEMO[name, mode]


def both(name: str, cache: str, mode: str, order: str, ratio: float = 0.5, **settings):
    """A fresh model with the cache and ToMe, put on in ``order``; (model, inputs, buffer shapes)."""
    model, inputs, _ = FAMILIES[name].build()
    if order == "cache_first":
        cache_dit.enable_cache(model, **cache_options(name, cache))
        apply_patch(model, ratio=ratio, mode=mode, **settings)
    else:
        apply_patch(model, ratio=ratio, mode=mode, **settings)
        cache_dit.enable_cache(model, **cache_options(name, cache))
    assert cache_is_on(model) and is_patched(model)
    return model, inputs, BufferShapes(model)


def calls_of(modules) -> Tuple[List[int], list]:
    """Count the calls of ``modules`` (a forward pre-hook each; cache-dit calls its blocks as modules)."""
    count = [0]

    def hook(*_):
        count[0] += 1
    return count, [module.register_forward_pre_hook(hook) for module in modules]


CASES = [(name, cache, mode, order) for name, family in FAMILIES.items() for cache in CACHES for mode in family.modes
         for order in ORDERS]


def test_the_pinned_cache_dit_version():
    assert importlib.metadata.version("cache-dit") == cache_dit.__version__ == CACHE_DIT_VERSION


def test_cache_dit_marks_the_transformer_and_calls_each_block_as_a_module():
    """The marks ``cache_is_on`` reads come with enable_cache and go with disable_cache; a forward pre-hook on a
    block runs at every call cache-dit computes it: the first block at every step, the others at the steps it
    does not skip."""
    model, inputs, _ = wan()
    assert not cache_is_on(model)
    cache_dit.enable_cache(model, **cache_options("wan", "dbcache"))
    assert cache_is_on(model) and len(model._context_names) == 1
    first, first_handles = calls_of(model.blocks[:1])
    rest, rest_handles = calls_of(model.blocks[1:])
    sample("wan", model, inputs)
    skipped = cached_steps(model)[0]
    assert skipped and first[0] == STEPS and rest[0] == (STEPS - len(skipped)) * (len(model.blocks) - 1)
    assert model._cached_steps == skipped  # the stats cache-dit sets after the last of num_inference_steps
    for handle in first_handles + rest_handles:
        handle.remove()
    cache_dit.disable_cache(model)
    assert not cache_is_on(model) and not any(key in model.__dict__ for key in ("_is_cached", "_context_manager"))


@pytest.mark.parametrize("name", FAMILIES)
def test_the_taylorseer_calibrator_acts(name):
    """Its skipped steps extrapolate the stored residuals: another result than DBCache's plain reuse, same steps."""
    model, inputs, _ = FAMILIES[name].build()
    cache_dit.enable_cache(model, **cache_options(name, "taylorseer", calibrator=False))
    plain = sample(name, model, inputs)
    assert cached_steps(model) == cache_alone(name, "taylorseer").steps
    assert not torch.equal(plain, cache_alone(name, "taylorseer").out)


@pytest.mark.parametrize("name, cache, mode, order", CASES)
def test_both_act_the_cache_still_skips_and_tome_reduces_every_computed_call(name, cache, mode, order):
    """The cache skips steps with ToMe on too (mode merge: the ones it skips alone), ToMe reduces exactly the calls of
    its modules the cache computes (but those of the cache's probe blocks, left whole), every buffer the cache
    stores keeps its whole-stream shape, and the result is finite and neither one's alone."""
    alone = cache_alone(name, cache)
    skipped_alone = sum(len(steps) for steps in alone.steps)
    assert 0 < skipped_alone < len(alone.steps) * (STEPS - WARMUP[cache])  # the cache skips some steps, not all
    model, inputs, shapes = both(name, cache, mode, order)
    state = model.__dict__[STATE_ATTR]
    hooked = {block: module for block, module, *_ in state.modules}  # kv: attentions; merge: blocks
    block_of = (lambda key: key) if mode == "merge" else (lambda key: key.rsplit(".", 1)[0])  # kv: an attention
    whole = [key for key in hooked if block_of(key) in PROBES[name]]
    count, handles = calls_of(module for block, module in hooked.items() if block not in whole)
    probe_count, probe_handles = calls_of(hooked[block] for block in whole)
    out = sample(name, model, inputs)
    steps = cached_steps(model)
    # the cache skips the steps it skips alone: its probe blocks run whole in either mode, so the residual it compares
    # moves only with the latent (here by at most 0.011, five times less than the threshold's least margin; with the
    # probe's attention reduced in kv it moved by up to 0.08, and Z-Image with TaylorSeer skipped steps 4, 6, 7 where
    # alone it skips 4, 5, 7)
    assert any(steps) and all(WARMUP[cache] <= step < STEPS for per_list in steps for step in per_list)
    assert steps == alone.steps
    # ToMe reduced every call of its modules the cache computed (none dropped), and the skipped steps ran none
    assert state.reduced_calls == count[0] > 0
    assert count[0] + probe_count[0] < STEPS * len(hooked) or not any(steps)
    assert probe_count[0] == STEPS * len(whole)  # a probe block runs at every step, whole
    assert all(f"{block_of(key)} runs whole" in describe(model) for key in whole)
    for handle in handles + probe_handles:
        handle.remove()
    assert shapes.seen == alone.shapes  # every stored residual / hidden state at its whole-stream size
    assert torch.isfinite(out).all()
    assert not torch.equal(out, alone.out) and not torch.equal(out, tome_alone(name, mode))


@pytest.mark.parametrize("name, cache, mode", sorted({case[:3] for case in CASES}))
def test_the_order_does_not_change_the_result(name, cache, mode):
    """Cache first or ToMe first: the same run, bit for bit (each acts inside the other's calls alike)."""
    first, second = (sample(name, *both(name, cache, mode, order)[:2]) for order in ORDERS)
    assert torch.equal(first, second)


@pytest.mark.parametrize("name, cache, mode, order", CASES)
def test_ratio_zero_and_removal_give_the_cache_alone_bit_for_bit(name, cache, mode, order):
    alone = cache_alone(name, cache)
    model, inputs, _ = both(name, cache, mode, order, ratio=0.0)
    assert torch.equal(sample(name, model, inputs), alone.out) and cached_steps(model) == alone.steps
    model, inputs, _ = both(name, cache, mode, order)
    sample(name, model, inputs)
    remove_patch(model)
    assert not is_patched(model) and cache_is_on(model) and hook_count(model) == 0
    assert not [sub for sub in model.modules() if sub is not model and "forward" in sub.__dict__]  # no marks left
    assert torch.equal(sample(name, model, inputs), alone.out) and cached_steps(model) == alone.steps


@pytest.mark.parametrize("name, mode", [(name, mode) for name, family in FAMILIES.items() for mode in family.modes])
@pytest.mark.parametrize("order", ORDERS)
def test_disable_cache_leaves_tome_alone(name, mode, order):
    """The other way round: the cache taken off, ToMe alone's result."""
    model, inputs, _ = both(name, "dbcache", mode, order)
    sample(name, model, inputs)
    cache_dit.disable_cache(model)
    assert not cache_is_on(model) and is_patched(model)
    assert torch.equal(sample(name, model, inputs), tome_alone(name, mode))


@pytest.mark.parametrize("name, mode", [(name, mode) for name, family in FAMILIES.items() for mode in family.modes])
def test_the_cache_put_on_after_tome_ran_wraps_its_marked_blocks(name, mode):
    """ToMe's marked forwards already on the blocks (a reduced call ran) when cache-dit reads their signatures and
    wraps the block lists: as if the cache had been put on before that call."""
    model, inputs, _ = FAMILIES[name].build()
    apply_patch(model, ratio=0.5, mode=mode)
    sample(name, model, inputs)
    assert any("forward" in sub.__dict__ for sub in model.modules())
    cache_dit.enable_cache(model, **cache_options(name, "dbcache"))
    fresh, fresh_inputs, _ = both(name, "dbcache", mode, "tome_first")
    assert torch.equal(sample(name, model, inputs), sample(name, fresh, fresh_inputs))
    assert cached_steps(model) == cached_steps(fresh)


@pytest.mark.parametrize("order", ORDERS)
def test_the_speed_check_does_not_repeat_calls_through_the_cache(monkeypatch, order):
    """speed_check="on" beside cache-dit: the check's repeats of the call step over cache-dit's forward (they would
    count as sampling steps: its warmup, cached steps and refresh point shifted), so each model call the user makes is
    one cache step and the result is the check's-off one where the check decides to reduce."""
    def timer(config, shape, device, dtype, run=None):
        run(False), run(True)  # what measure_speedup does first: the call once whole, once reduced
        return 1.5
    monkeypatch.setattr(speed_check, "measure_speedup", timer)
    results = {}
    try:
        for check in ("off", "on"):
            speed_check.forget_verdicts()
            model, inputs, _ = both("wan", "dbcache", "merge", order, speed_check=check)
            out = sample("wan", model, inputs)
            counted = model._context_manager.get_context(model._context_names[0]).executed_steps
            results[check] = out, counted, cached_steps(model)
    finally:
        speed_check.forget_verdicts()
    assert results["on"][1] == results["off"][1] == STEPS  # the cache counted the user's calls, no repeat
    assert results["on"][2] == results["off"][2] and torch.equal(results["on"][0], results["off"][0])


def test_flux_probes_past_its_double_blocks_run_whole():
    """DBCache F2 on a Flux of one double block: its probes are the double block and the first single block (cache-dit
    caches Flux's double and single blocks as one list named after transformer_blocks), and both run whole."""
    model, inputs, _ = flux()
    config = DBCacheConfig(Fn_compute_blocks=2, Bn_compute_blocks=0, residual_diff_threshold=0.4, max_warmup_steps=2,
                           num_inference_steps=STEPS, enable_separate_cfg=False)
    cache_dit.enable_cache(model, cache_config=config)
    apply_patch(model, ratio=0.5, mode="merge")
    count, handles = calls_of(model.single_transformer_blocks[1:])
    sample("flux", model, inputs)
    assert model.__dict__[STATE_ATTR].reduced_calls == count[0] > 0  # the one single block past the probes
    assert "single_transformer_blocks.0 runs whole" in describe(model)
