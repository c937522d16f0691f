"""Balanced attention under another node's attention override: kept where the override honours a mask, plain (and
said so) where it ignores one, never silently lost.

Qwen-Image's default merge weighs the merged image keys with a mask (balanced attention). KJNodes' "Patch Sage
Attention KJ" (kjnodes_standin.py, mirroring kijai/ComfyUI-KJNodes 3f20054) sets ``optimized_attention_override``,
which ComfyUI calls under ToMe's per-block override; it hands the mask to ``sageattn``, which ignores it
(tests/sage_standin.py, mirroring thu-ml/SageAttention core.py ``sageattn``). ToMe probes the override once (a tiny
call with and without a mask) and runs plain attention under one that ignores masks. On a reduced-size Qwen-Image
from ComfyUI's own classes, sampled by ComfyUI, both node orders.
"""
from __future__ import annotations

import logging
import sys

import pytest
import torch

import sage_standin
from test_comfy_dit import comfy, sample  # noqa: F401
from test_comfy_families import qwen_image

from tome_core.adapters.model_patcher import dit_merge
from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
from tome_core.engine.config import ToMeConfig

ORDERS = ("sage_first", "tome_first")
NOTE = ("balanced attention needs a mask; ComfyUI-KJNodes' PathchSageAttentionKJ.patch.attention_override_sage "
        "ignores masks: plain")


@pytest.fixture
def kj(comfy, monkeypatch):
    """The pack's module, with the sageattention stand-in in sys.modules (where the pack imports it from)."""
    import kjnodes_standin

    sage_standin.calls.clear()
    monkeypatch.setitem(sys.modules, "sageattention", sage_standin.module())
    return kjnodes_standin.load()


@pytest.fixture
def probes(monkeypatch):
    """Every probe ToMe runs (``mask_probe.mask_dropped`` as dit_merge calls it): (override, device)."""
    seen = []
    real = dit_merge.mask_dropped

    def counted(override, options, device, dtype, width):
        seen.append((override, device))
        return real(override, options, device, dtype, width)

    monkeypatch.setattr(dit_merge, "mask_dropped", counted)
    return seen


def stacked(kj, patcher, order: str, **settings):
    """Sage and ToMe (mode merge, Qwen-Image's default balanced attention unless told) in ``order``."""
    def sage(model):
        return kj.PathchSageAttentionKJ().patch(model, "auto")[0]

    def tome(model):
        return patch_dit_model_patcher(model, ToMeConfig(ratio=0.5, mode="merge", **settings))

    return tome(sage(patcher)) if order == "sage_first" else sage(tome(patcher))


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("order", ORDERS)
def test_an_override_that_ignores_masks_gets_plain_attention_said_once(comfy, kj, probes, order, caplog):
    """Under KJ's Sage the merged blocks run plain attention: the image is ToMe's with merge_attention "plain" under
    the same override, bit for bit; no mask reaches sage after the probe's; the note names the pack's function, in
    the patch's notes and once in the log; two runs probe once."""
    patcher, latent, cond, _ = qwen_image(comfy)[:4]
    plain = sample(comfy, stacked(kj, patcher, order, merge_attention="plain"), latent, cond)
    sage_standin.calls.clear()
    on = stacked(kj, patcher, order)
    with caplog.at_level(logging.WARNING, logger="tome.dit"):
        image = sample(comfy, on, latent, cond)
        assert torch.equal(sample(comfy, on, latent, cond), image)
    assert torch.equal(image, plain)
    state = dit_merge.merge_patch_of(on)
    assert state.notes == [NOTE] and state.reduced_calls > 0
    assert [message for message in caplog.messages if "needs a mask" in message] == [f"ToMe: qwen_image: {NOTE}."]
    assert len(probes) == 1 and probes[0][0].__qualname__.endswith("attention_override_sage")
    masked = [call for call in sage_standin.calls if call[2]]
    assert len(masked) == 1 and masked[0][:2] == (16, 16)  # the probe's only, 16 tokens


@pytest.mark.parametrize("order", ORDERS)
def test_an_override_that_honours_masks_keeps_balanced(comfy, kj, probes, monkeypatch, order):
    """The control (sage taking the mask): balanced stays, the image is ToMe-balanced's alone (sage's float16 aside)
    and not plain's; every merged attention hands sage the mask; no note."""
    monkeypatch.setitem(sys.modules, "sageattention", sage_standin.module(honouring=True))
    patcher, latent, cond, _ = qwen_image(comfy)[:4]
    alone = sample(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="merge")), latent, cond)
    plain = sample(comfy, stacked(kj, patcher, order, merge_attention="plain"), latent, cond)
    sage_standin.calls.clear()
    probes.clear()
    on = stacked(kj, patcher, order)
    image = sample(comfy, on, latent, cond)
    assert dit_merge.merge_patch_of(on).notes == [] and len(probes) == 1
    assert rel(image, alone) < 1e-3 < rel(plain, alone) and rel(image, alone) < rel(plain, alone) / 10
    # 2 steps x 2 merged blocks, each with the mask (batched cond and uncond), and the probe's one
    assert sum(masked for _, _, masked in sage_standin.calls) == 2 * 2 + 1


def test_the_probe_runs_once_and_the_steady_forward_is_plains(comfy, kj, probes):
    """The probe is set-up work: once per override (not per call or step). A steady model call under an override
    that ignores masks dispatches the same ATen ops, host syncs and Python calls into tome_core as ToMe with plain
    attention under it (no mask built, no override of ToMe's called); a new override object is probed once more."""
    from tome_bench.op_count import count_ops

    patcher, latent, cond, _ = qwen_image(comfy)[:4]
    counts = {}
    for how in ("balanced", "plain"):
        on = stacked(kj, patcher, "sage_first", merge_attention=how)
        sample(comfy, on, latent, cond, steps=1)  # the first call: the probe (balanced)
        counts[how], _ = count_ops(lambda: sample(comfy, on, latent, cond, steps=1))
    assert len(probes) == 1
    balanced, plain = counts["balanced"], counts["plain"]
    assert (balanced.total, balanced.syncs, balanced.tome_calls) == (plain.total, plain.syncs, plain.tome_calls)
    assert balanced.ops == plain.ops
    again = stacked(kj, patcher, "tome_first")  # another Sage node run: a new override object
    sample(comfy, again, latent, cond, steps=1)
    sample(comfy, again, latent, cond, steps=1)
    assert len(probes) == 2


def test_comfyuis_own_attention_is_probed_without_an_override(comfy, probes, monkeypatch):
    """Without another node's override the merged blocks run ComfyUI's attention function (PyTorch's on this CPU),
    which takes the mask: balanced, probed once; a function that drops it (ComfyUI 0.3.x's ``attention_sage`` hands
    the mask to the real sageattn) gets plain, named: the image is plain's under that function."""
    import comfy.ldm.qwen_image.model as qwen_model
    from comfy.ldm.modules import attention

    patcher, latent, cond, _ = qwen_image(comfy)[:4]
    on = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="merge"))
    sample(comfy, on, latent, cond, steps=1)
    assert dit_merge.merge_patch_of(on).notes == [] and len(probes) == 1 and probes[0][0] is None

    def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                       **kwargs):  # ComfyUI 0.3.75's, as far as the mask goes: handed to sageattn with the tensors
        layout = "HND" if skip_reshape else "NHD"  # [B, H, N, D] as handed, else [B, N, H, D] from [B, N, H * D]
        if not skip_reshape:
            q, k, v = (t.unflatten(-1, (heads, -1)) for t in (q, k, v))
        out = sage_standin.sageattn(q, k, v, attn_mask=mask, is_causal=False, tensor_layout=layout)
        if skip_output_reshape:  # [B, H, N, D]
            return out if skip_reshape else out.transpose(1, 2)
        return (out.transpose(1, 2) if skip_reshape else out).flatten(2)

    attention_sage.__module__, attention_sage.__qualname__ = "comfy.ldm.modules.attention", "attention_sage"
    chosen = attention.wrap_attn(attention_sage)  # as --use-sage-attention makes it the models' function
    # a 2026 ComfyUI hands sageattn the mask only where it says it takes one (else it leaves sage for PyTorch's
    # attention: the next test); 0.3.75 always does
    monkeypatch.setattr(attention, "SAGE_ATTENTION_SUPPORTS_MASK", True, raising=False)
    monkeypatch.setattr(attention, "optimized_attention_masked", chosen)
    monkeypatch.setattr(qwen_model, "optimized_attention_masked", chosen)  # bound at import by the model's module
    images = {how: sample(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="merge",
                                                                              merge_attention=how)), latent, cond)
              for how in ("plain", "balanced")}
    assert torch.equal(images["balanced"], images["plain"])
    again = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="merge"))
    sample(comfy, again, latent, cond, steps=1)
    assert dit_merge.merge_patch_of(again).notes == [
        "balanced attention needs a mask; ComfyUI's attention_sage ignores masks: plain"]


@pytest.mark.parametrize("name, supports_mask, leaves", [("attention_sage", False, True),
                                                         ("attention_sage", True, False),
                                                         ("attention_flash", None, True),
                                                         ("attention3_sage", None, True),
                                                         ("attention_pytorch", None, False)])
def test_comfyuis_functions_that_leave_their_kernel_for_a_mask(comfy, monkeypatch, name, supports_mask, leaves):
    """From ComfyUI's own code (comfy/ldm/modules/attention.py): the 2026 ``attention_sage`` runs attention_pytorch
    for a masked call unless ``sageattn`` takes ``attn_mask`` (``SAGE_ATTENTION_SUPPORTS_MASK``), ``attention3_sage``
    always does, ``attention_flash`` raises, warns and runs SDPA: ToMe hands them no mask (their kernel stays)."""
    from comfy.ldm.modules import attention

    from tome_core.adapters.model_patcher.mask_probe import leaves_its_kernel

    def func(q, k, v, heads, mask=None, **kwargs):
        raise AssertionError("not called")

    func.__name__, func.__module__ = name, "comfy.ldm.modules.attention"
    if supports_mask is not None:
        monkeypatch.setattr(attention, "SAGE_ATTENTION_SUPPORTS_MASK", supports_mask, raising=False)
    assert leaves_its_kernel(func) is leaves


@pytest.mark.parametrize("order", ORDERS)
def test_the_node_is_told_what_the_run_found(comfy, kj, tome_package, monkeypatch, order):
    """The basic node on Qwen-Image says "balanced" when it runs (the probe needs the run); the first model call's
    finding is sent to it (ComfyUI's ``PromptServer.send_sync``, the "tome.levels" event web/tome.js draws), once."""
    import importlib

    tome_nodes = importlib.import_module(f"{tome_package.__name__}.nodes.tome_nodes")
    ui_messages = importlib.import_module(f"{tome_package.__name__}.nodes.ui_messages")
    sent = []

    class PromptServer:  # the one method the node uses (server.py PromptServer.send_sync(event, data, sid))
        client_id = "client"

        def send_sync(self, event, data, sid=None):
            sent.append((event, data, sid))

    monkeypatch.setattr(ui_messages, "_prompt_server", PromptServer)
    patcher, latent, cond, _ = qwen_image(comfy)[:4]

    def node(model):
        out = tome_nodes.ToMe().patch(model, ratio=0.5, max_downsample=1, unique_id="7")
        assert out["ui"]["tome"][0]["merge_attention"] == "balanced"
        return out["result"][0]

    def sage(model):
        return kj.PathchSageAttentionKJ().patch(model, "auto")[0]

    on = node(sage(patcher)) if order == "sage_first" else sage(node(patcher))
    sample(comfy, on, latent, cond)
    # every message is this node's; the note is added once and kept in each message after it, beside the speed
    # check's verdicts (on the CPU: not timed)
    assert sent and all(event == "tome.levels" and data["node"] == "7" and sid == "client"
                        for event, data, sid in sent)
    with_note = [data for _, data, _ in sent if data["notes"]]
    assert with_note and all(data["notes"] == [NOTE] and data["lines"][0] == NOTE for data in with_note)
    assert with_note[-1] == sent[-1][1] and len(sent) - sent.index(next(m for m in sent if m[1]["notes"])) == \
        len(with_note)  # once found, never lost
    assert all(v["reduce"] and v["device"] == "cpu" for v in sent[-1][1]["verdicts"])
