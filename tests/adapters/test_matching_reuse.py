"""``match_every``: a merge's matching kept for N model calls of one shape (ToMA, CA-ToMe), on real diffusers models.

What a user relies on: the calls between two matchings really reuse the earlier call's matching (their output is
the output of that matching on their own input, and they do less work), the call after them matches afresh (bit
for bit what per-call matching gives), a call of another shape never takes a matching that is not its own, and a
setting that could not act is refused before anything is patched.
"""
from __future__ import annotations

import pytest
import torch

import tome_core
from tome_bench.models import build_unet, make_inputs
from tome_bench.op_count import count_ops
from tome_core.engine.reuse import MatchingReuse

diffusers = pytest.importorskip("diffusers")

from test_dit_diffusers import flux, run as run_dit, wan  # noqa: E402

LEVEL = dict(matching="level")


def test_reuse_counts_uses_per_key_and_restarts_on_a_new_marker():
    reuse = MatchingReuse(3)
    assert reuse.take("a") is None
    reuse.keep("a", "m1")
    assert [reuse.take("a"), reuse.take("a"), reuse.take("a")] == ["m1", "m1", None]  # made + 2 reuses
    reuse.keep("a", "m2")
    assert reuse.take("b") is None and reuse.take("a") == "m2"
    marker = object()
    reuse.restart_on(marker)
    assert reuse.take("a") is None
    reuse.keep("a", "m3")
    reuse.restart_on(marker)  # the same sampling run: kept
    assert reuse.take("a") == "m3"
    assert not MatchingReuse(1).on
    once = MatchingReuse(1)
    once.keep("a", "m")
    assert once.take("a") is None  # every call matches


@pytest.fixture(scope="module")
def unet():
    return build_unet("sd15", "tiny", seed=0)


def unet_inputs(unet, seed: int, px: int = 128):
    sample, _, context, _ = make_inputs(unet, "sd15", 2, px, px, seed=seed)
    return sample, torch.full((2,), 500.0), context


def forward(unet, inputs):
    sample, timestep, context = inputs
    with torch.no_grad():
        return unet(sample, timestep, encoder_hidden_states=context).sample


def outputs(model, calls, fn, **options):
    tome_core.apply_patch(model, **options)
    try:
        return [fn(model, c) for c in calls]
    finally:
        tome_core.remove_patch(model)


def test_unet_calls_between_matchings_reuse_the_first_and_the_next_matches_afresh(unet):
    a, b = unet_inputs(unet, 1), unet_inputs(unet, 2)
    every_call = outputs(unet, [a, b], forward, **LEVEL)
    reused = outputs(unet, [a, b, b, b, a], forward, match_every=3, **LEVEL)
    assert torch.equal(reused[0], every_call[0])  # the first call matches
    assert not torch.allclose(reused[1], every_call[1], atol=1e-4)  # b on a's matching: another result
    assert torch.equal(reused[1], reused[2])  # both on a's matching
    assert torch.equal(reused[3], every_call[1])  # the 4th call matches b afresh
    assert not torch.equal(reused[4], every_call[0])  # the 5th reuses b's matching on a
    # a's matching on a again gives a's own output: what is reused is the matching, nothing else
    same = outputs(unet, [a, a], forward, match_every=2, **LEVEL)
    assert torch.equal(same[1], every_call[0])


def test_unet_a_reused_call_skips_the_matching(unet):
    a = unet_inputs(unet, 1)
    counts = {}
    for every in (1, 1 << 20):
        tome_core.apply_patch(unet, match_every=every, **LEVEL)
        try:
            forward(unet, a)
            counts[every], _ = count_ops(lambda: forward(unet, a))
        finally:
            tome_core.remove_patch(unet)
    matched, reused = counts[1], counts[1 << 20]
    assert reused.syncs == 0
    assert matched.total - reused.total >= 20  # normalise, score, top-r and the slot arithmetic of one level
    assert any("topk" in op for op in matched.ops) and not any("topk" in op for op in reused.ops)


def test_unet_another_shape_or_batch_matches_its_own(unet):
    a, big = unet_inputs(unet, 1), unet_inputs(unet, 2, px=192)
    single = tuple(t[:1] for t in unet_inputs(unet, 3))
    fresh = [outputs(unet, [x], forward, **LEVEL)[0] for x in (big, single)]
    reused = outputs(unet, [a, big, single], forward, match_every=4, **LEVEL)
    assert torch.equal(reused[1], fresh[0]) and torch.equal(reused[2], fresh[1])


def test_unet_settings_that_could_not_act_are_refused_before_patching(unet):
    with pytest.raises(ValueError, match="matching='level'"):
        tome_core.apply_patch(unet, match_every=2)  # tomesd's block matching has no call-wide matching
    with pytest.raises(ValueError, match="mode='merge'"):
        tome_core.apply_patch(unet, mode="kv", match_every=2)
    with pytest.raises(ValueError, match="match_every must be an int >= 1"):
        tome_core.apply_patch(unet, match_every=0, **LEVEL)
    assert not tome_core.is_patched(unet)
    tome_core.apply_patch(unet, match_every=3, **LEVEL)
    try:
        assert "each matching reused for 3 model calls" in tome_core.describe(unet)
    finally:
        tome_core.remove_patch(unet)


def test_unet_ratio_zero_with_reuse_is_bit_identical(unet):
    a = unet_inputs(unet, 1)
    plain = forward(unet, a)
    assert all(torch.equal(y, plain) for y in outputs(unet, [a, a], forward, ratio=0.0, match_every=3, **LEVEL))


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_dit_merge_calls_between_matchings_reuse_the_first(family):
    model, a, _ = {"flux": flux, "wan": wan}[family](batch=2)
    key = "hidden_states"
    g = torch.Generator().manual_seed(5)
    b = dict(a, **{key: a[key] + torch.randn(a[key].shape, generator=g)})
    every_call = outputs(model, [a, b], run_dit, mode="merge", ratio=0.5)
    reused = outputs(model, [a, b, b], run_dit, mode="merge", ratio=0.5, match_every=2)
    assert torch.equal(reused[0], every_call[0])
    assert not torch.allclose(reused[1], every_call[1], atol=1e-5)
    assert torch.equal(reused[2], every_call[1])
    same = outputs(model, [a, a], run_dit, mode="merge", ratio=0.5, match_every=2)
    assert torch.equal(same[1], every_call[0])


def test_dit_kv_refuses_reuse():
    model, _, _ = flux(batch=1)
    with pytest.raises(ValueError, match="mode='merge'"):
        tome_core.apply_patch(model, mode="kv", match_every=2)
    assert not tome_core.is_patched(model)


def test_under_torch_compile_every_call_matches_and_nothing_recompiles():
    """Nothing made inside a compiled graph is kept (it must not outlive it): compiled, match_every gives per-call
    matching (eager's outputs within 1e-4) at every step, with no recompilation between steps."""
    from torch._dynamo.utils import counters

    model, inputs, _ = flux(h=8, w=8)
    steps = (0.6, 0.5, 0.4)
    eager = []
    tome_core.apply_patch(model, ratio=0.5, mode="merge")
    try:
        for step in steps:
            eager.append(run_dit(model, dict(inputs, timestep=torch.full((1,), step))))
    finally:
        tome_core.remove_patch(model)
    torch._dynamo.reset()
    counters.clear()
    tome_core.apply_patch(model, ratio=0.5, mode="merge", match_every=3)
    try:
        compiled = torch.compile(model)
        graphs = []
        for step, expected in zip(steps, eager):
            result = run_dit(compiled, dict(inputs, timestep=torch.full((1,), step)))
            assert ((result - expected).norm() / expected.norm()).item() < 1e-4
            graphs.append(counters["stats"]["unique_graphs"])
        assert graphs[0] > 0 and graphs == [graphs[0]] * len(steps), graphs
        assert not model._tome_dit.reuse.kept
    finally:
        tome_core.remove_patch(model)
        torch._dynamo.reset()


def test_restart_matching_makes_the_next_call_match_afresh(unet):
    a, b = unet_inputs(unet, 1), unet_inputs(unet, 2)
    fresh_b = outputs(unet, [b], forward, **LEVEL)[0]
    tome_core.apply_patch(unet, match_every=4, **LEVEL)
    try:
        forward(unet, a)
        tome_core.restart_matching(unet)  # a new generation in a diffusers script
        assert torch.equal(forward(unet, b), fresh_b)
    finally:
        tome_core.remove_patch(unet)
    model, inputs, _ = flux(batch=1)
    tome_core.apply_patch(model, mode="merge", ratio=0.5, match_every=4)
    try:
        run_dit(model, inputs)
        assert model._tome_dit.reuse.kept
        tome_core.restart_matching(model)
        assert not model._tome_dit.reuse.kept
        assert "each matching reused for 4 model calls" in tome_core.describe(model)
    finally:
        tome_core.remove_patch(model)
