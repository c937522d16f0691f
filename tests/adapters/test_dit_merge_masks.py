"""Balanced attention in diffusers where the attention backend drops the mask: plain, said so, never silently lost.

ToMe's bias joins the mask of the merged blocks' torch scaled_dot_product_attention (a TorchFunctionMode per
attention). diffusers' attention dispatcher can send an attention elsewhere: ``set_attention_backend("sage")`` or the
``attention_backend("sage")`` context run diffusers' own ``_sage_attention`` (attention_dispatch.py, 0.42.1), which
calls ``sageattn`` and never SDPA, so no mask reaches it. Here the real dispatcher and backend function run, with only
the CUDA kernel replaced by tests/sage_standin.py's CPU ``sageattn`` (mirroring thu-ml/SageAttention core.py: the mask
is taken into ``**kwargs`` and ignored). The control: the "_native_math" backend, which ends in SDPA and keeps the
bias. On a tiny seeded diffusers Qwen-Image (balanced is its default).
"""
from __future__ import annotations

import logging

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

import sage_standin  # noqa: E402
from tome_core import apply_patch, describe, remove_patch  # noqa: E402
from tome_core.adapters.hooks import dit_merge  # noqa: E402
from tome_core.adapters.hooks.dit import STATE_ATTR  # noqa: E402
from test_dit_families import qwen_image, run  # noqa: E402

NOTE = ("balanced attention needs a mask; QwenDoubleStreamAttnProcessor2_0 on diffusers' 'sage' attention backend "
        "ignores masks: plain")


@pytest.fixture
def dispatch(monkeypatch):
    """diffusers' attention dispatcher with sage usable on this CPU (the stand-in kernel); the active backend is put
    back afterwards."""
    from diffusers.models import attention_dispatch

    registry = attention_dispatch._AttentionBackendRegistry
    monkeypatch.setattr(registry, "_active_backend", registry._active_backend)
    monkeypatch.setattr(attention_dispatch, "_CAN_USE_SAGE_ATTN", True)
    monkeypatch.setattr(attention_dispatch, "sageattn", sage_standin.sageattn)
    sage_standin.calls.clear()
    return attention_dispatch


@pytest.fixture
def probes(monkeypatch):
    """Every attention's first-call learning (``_learn``) and kernel probe (``sdpa_drops_mask``), counted."""
    seen = {"learn": 0, "sdpa": 0}
    learn, sdpa = dit_merge._learn, dit_merge.sdpa_drops_mask

    def counted_learn(*args):
        seen["learn"] += 1
        return learn(*args)

    def counted_sdpa(*args):
        seen["sdpa"] += 1
        return sdpa(*args)

    monkeypatch.setattr(dit_merge, "_learn", counted_learn)
    monkeypatch.setattr(dit_merge, "sdpa_drops_mask", counted_sdpa)
    return seen


def qwen():
    """The tiny Qwen-Image without a text mask: diffusers' sage backend refuses any mask, the text's included."""
    model, inputs, _ = qwen_image(batch=2)
    inputs.pop("encoder_hidden_states_mask")
    return model, inputs


def patched(model, how: str = "balanced"):
    apply_patch(model, ratio=0.5, mode="merge", merge_attention=how)
    return model.__dict__[STATE_ATTR]


def test_a_backend_that_drops_the_mask_gets_plain_attention_said_once(dispatch, probes, caplog):
    """set_attention_backend("sage"): the merged attentions run plain (the output is merge_attention "plain"'s, bit
    for bit, from the first call), no mask reaches the backend, describe() and the log say so once; each attention
    learns it at its first call only."""
    model, inputs = qwen()
    model.set_attention_backend("sage")
    patched(model, "plain")
    plain = run(model, inputs)
    sage_standin.calls.clear()
    state = patched(model)
    with caplog.at_level(logging.WARNING, logger="tome.dit"):
        first, second = run(model, inputs), run(model, inputs)
    assert torch.equal(first, plain) and torch.equal(second, plain)
    assert sage_standin.calls and not any(masked for _, _, masked in sage_standin.calls)
    assert NOTE in describe(model).splitlines() and state.notes == [NOTE]
    assert [m for m in caplog.messages if "needs a mask" in m] == [
        f"ToMe: QwenImageTransformer2DModel: {NOTE} (it does not run torch's scaled_dot_product_attention, where "
        "ToMe adds the mask)."]
    assert probes == {"learn": 2, "sdpa": 0}  # the 2 merged blocks' attentions, once each
    assert state.takes_mask and not any(state.takes_mask.values())
    remove_patch(model)


def test_the_backend_context_is_followed_both_ways(dispatch, probes):
    """diffusers' ``attention_backend`` context: inside it plain (said so); outside it, on the native backend,
    balanced again, equal to ToMe alone; each switch is learnt once."""
    model, inputs = qwen()
    state = patched(model)
    alone = run(model, inputs)
    patched(model, "plain")
    plain = run(model, inputs)
    with dispatch.attention_backend("sage"):
        plain_sage = run(model, inputs)
    state = patched(model)
    probes.update(learn=0, sdpa=0)
    with dispatch.attention_backend("sage"):
        assert torch.equal(run(model, inputs), plain_sage)
    assert torch.equal(run(model, inputs), alone) and not torch.equal(alone, plain)
    assert state.notes == [NOTE] and probes["learn"] == 4  # 2 attentions under sage, 2 on the native backend
    run(model, inputs)
    assert probes["learn"] == 4
    remove_patch(model)


def test_a_backend_that_ends_in_sdpa_keeps_balanced(dispatch, probes):
    """The control: diffusers' "_native_math" backend runs SDPA (math kernel): the bias reaches it, the output is
    ToMe-balanced's on the native backend (float rounding aside) and not plain's; no note; each attention learns it
    at its first call, the SDPA kernel choice is probed once for both."""
    model, inputs = qwen()
    patched(model)
    alone = run(model, inputs)
    patched(model, "plain")
    plain = run(model, inputs)
    model.set_attention_backend("_native_math")
    state = patched(model)
    probes.update(learn=0, sdpa=0)
    weighed = run(model, inputs)
    run(model, inputs)
    rel = ((weighed - alone).norm() / alone.norm()).item()
    assert rel < 1e-5 and ((plain - alone).norm() / alone.norm()).item() > 1e-3
    assert state.notes == [] and all(state.takes_mask.values()) and probes == {"learn": 2, "sdpa": 1}
    remove_patch(model)


def test_a_kernel_choice_that_cannot_run_a_mask_is_found():
    """``sdpa_drops_mask`` in a kernel choice where a masked SDPA cannot run (on CUDA diffusers' "_native_flash"
    backend: ``sdpa_kernel(FLASH_ATTENTION)``; on this CPU the efficient kernel alone, which has no CPU build): found,
    so the attention gets no mask instead of failing; the math kernel takes it."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    query = torch.randn(1, 2, 8, 16)
    with sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION):
        assert dit_merge.sdpa_drops_mask(query)
    with sdpa_kernel(SDPBackend.MATH):
        assert not dit_merge.sdpa_drops_mask(query)
    assert not dit_merge.sdpa_drops_mask(query.bfloat16())


def test_the_learning_adds_nothing_to_a_steady_forward(dispatch, probes):
    """After each attention's first call nothing is learnt or probed again, and a steady forward dispatches the same
    ATen ops and makes the same Python calls into tome_core as before this check existed (``_WeighedKeys`` in place
    of ``_FirstWeighing``: nothing learnt, the bias mode at every call); under sage, no more ops than plain
    attention's."""
    from tome_bench.op_count import count_ops

    model, inputs = qwen()
    counts = {}
    for name, backend, how in (("balanced", "native", "balanced"), ("sage", "sage", "balanced"),
                               ("sage plain", "sage", "plain")):
        model.set_attention_backend(backend)
        patched(model, how)
        run(model, inputs)  # the first call learns
        counts[name], _ = count_ops(lambda: run(model, inputs))
    assert probes["learn"] == 4  # native 2, sage 2; none in the counted forwards
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(dit_merge, "_FirstWeighing", lambda kernels, *how: dit_merge._WeighedKeys(*how))  # as before
        model.set_attention_backend("native")
        patched(model)
        run(model, inputs)
        before, _ = count_ops(lambda: run(model, inputs))
    assert (counts["balanced"].ops, counts["balanced"].tome_calls) == (before.ops, before.tome_calls)
    assert counts["balanced"].syncs == before.syncs == 0
    assert counts["sage"].ops == counts["sage plain"].ops and counts["sage"].syncs == 0
    # the two attention hooks, returning, and the two attentions' marked forwards (hooks/switched.py: torch.compile)
    assert counts["sage"].tome_calls == counts["sage plain"].tome_calls + 2 * 2 + 2
    remove_patch(model)
