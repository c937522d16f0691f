"""The speed check on every ComfyUI DiT family, in each mode it takes: the model call timed whole against reduced.

Each family's own ComfyUI classes at reduced size (test_comfy_dit's and test_comfy_families' builders), sampled by
ComfyUI. Timings are forced (``speed_check.measure_speedup`` replaced by one that runs both sides it is handed,
whole then reduced, and returns a chosen speed-up), so nothing is decided by the clock; what it runs is the real
call repeated through ToMe's APPLY_MODEL wrapper. A reduced verdict gives the image of the check switched off, a
whole one the image without ToMe, and a call ToMe leaves whole runs no ToMe code in its blocks.
"""
from __future__ import annotations

import pytest
import torch

from test_comfy_dit import FAMILIES as BASE_FAMILIES
from test_comfy_dit import comfy, sample, tome_package  # noqa: F401
from test_comfy_families import FAMILIES as MORE_FAMILIES

from tome_core.adapters.model_patcher.dit import dit_family, patch_dit_model_patcher, resolve_dit
from tome_core.engine import speed_check
from tome_core.engine.config import ToMeConfig

FAMILIES = dict(BASE_FAMILIES, **MORE_FAMILIES)


@pytest.fixture(autouse=True)
def fresh_verdicts():
    speed_check.forget_verdicts()
    yield
    speed_check.forget_verdicts()


def force(monkeypatch, speedup: float) -> list:
    sides = []

    def timer(config, shape, device, dtype, run=None):
        run(False), run(True)
        sides.append(shape)
        return speedup

    monkeypatch.setattr(speed_check, "measure_speedup", timer)
    return sides


def _cases():
    """(family, mode) of every family, in each mode its ComfyUI class takes (decided from the class, no model built)."""
    return [(family, mode) for family in FAMILIES for mode in ("kv", "merge")]


@pytest.mark.parametrize("family, mode", _cases())
def test_the_check_runs_on_every_family_in_each_mode(comfy, monkeypatch, family, mode):
    built = FAMILIES[family](comfy)
    patcher, latent, cond = built[:3]
    known = resolve_dit(patcher)
    if mode == "merge" and not known.merges:
        pytest.skip(f"{family}: mode merge does not reach this class")
    off = sample(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode)), latent, cond, steps=1)
    sides = force(monkeypatch, 1.5)
    patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode, speed_check="on"))
    on = sample(comfy, patched, latent, cond, steps=1)
    assert sides == [None], f"{dit_family(patcher).name}: timed {len(sides)} times"
    assert torch.equal(on, off)


@pytest.mark.parametrize("family, mode", [("flux", "kv"), ("flux", "merge"), ("qwen_image", "merge"),
                                          ("wan", "merge"), ("z_image", "merge")])
def test_a_call_measured_slower_runs_as_unpatched(comfy, monkeypatch, family, mode):
    """Left whole: the image is ToMe's absent, and no ToMe block patch runs in the call (mode merge's replace
    patches sit the call out; NextDiT's object-patched layers pass it on)."""
    patcher, latent, cond = FAMILIES[family](comfy)[:3]
    vanilla = sample(comfy, patcher, latent, cond, steps=1)
    force(monkeypatch, 0.9)
    patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode, speed_check="on"))
    seen = []
    blocks = patched.model_options["transformer_options"].get("patches_replace", {}).get("dit", {})
    for key, patch in list(blocks.items()):
        def counting(args, extra, patch=patch):
            seen.append(1)
            return patch(args, extra)
        counting.tome_owner, counting.tome_previous = getattr(patch, "tome_owner", None), getattr(
            patch, "tome_previous", None)
        blocks[key] = counting
    assert torch.equal(sample(comfy, patched, latent, cond, steps=1), vanilla)  # decides: left whole
    state = patched.wrappers["apply_model"][next(iter(patched.wrappers["apply_model"]))][0].__self__
    assert "left whole" in " ".join(state.describe_verdicts())
    seen.clear()
    assert torch.equal(sample(comfy, patched, latent, cond, steps=1), vanilla)  # a sampling run of that shape
    assert seen == []  # no ToMe block patch ran in any of its calls
