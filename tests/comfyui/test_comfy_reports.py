"""The layout a 2026 ComfyUI model reports inside its forward, read by mode "kv" instead of the one derived from the
model call: ``transformer_options["grid_sizes"]`` (Wan: the post-patch (t, h, w) of the latent it patched) and
``["img_slice"]`` (Flux's single blocks: [text tokens, joint sequence length]).

The derived layout comes from the latent and text the APPLY_MODEL wrapper sees. Here a DIFFUSION_MODEL wrapper (what
a node between ToMe and the model's patch embedding can do, through ComfyUI's own wrapper API) runs the model on a
cropped latent or a longer text, so the derived layout is wrong and only the model's report is right: the reduced
attention calls follow the report. Reduced-size real ComfyUI models (test_comfy_dit's builders), sampled by ComfyUI.
ComfyUIs that set no report (0.3.75 sets neither) skip, naming why: there the derived layout is all there is.
"""
from __future__ import annotations

import pytest
import torch

from test_comfy_dit import OVERRIDE, comfy, flux, sample, spy_on, wan  # noqa: F401

from tome_core.engine.config import ToMeConfig
from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
from tome_core.adapters.model_patcher.layout import token_layout
from tome_core.engine.kv import dit_window, pick_index_nd


def _reports(comfy, patcher, latent, cond, key: str) -> list:
    """The values of transformer_options[key] that the model call's attentions receive (1 step, no ToMe)."""
    seen = []

    def spy(func, *args, **kwargs):
        seen.append((kwargs.get("transformer_options") or {}).get(key))
        return func(*args, **kwargs)

    probe = patcher.clone()
    probe.model_options.setdefault("transformer_options", {})[OVERRIDE] = spy
    sample(comfy, probe, latent, cond, steps=1)
    if all(value is None for value in seen):
        name = type(patcher.model.diffusion_model)
        pytest.skip(f"this ComfyUI's {name.__module__}.{name.__qualname__} sets no transformer_options['{key}']: "
                    "the layout comes from the model call alone")
    return seen


def _wrapped(comfy, patcher, wrapper):
    """A clone of the patcher with a DIFFUSION_MODEL wrapper: it runs inside ToMe's APPLY_MODEL wrapper."""
    clone = patcher.clone()
    clone.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "test_reports", wrapper)
    return clone


def _drop_last_patch_column(executor, x, *args, **kwargs):
    """The model runs on the latent less its last patch column (2 latent columns); the output is padded back."""
    return torch.nn.functional.pad(executor(x[..., :-2], *args, **kwargs), (0, 2))


def _picks(grid) -> int:
    return len(pick_index_nd(grid, dit_window(0.5, grid)))


def test_wan_reduces_the_grid_it_reports_not_the_derived_one(comfy):
    """Wan's call carries a 3 x 3 x 5 grid (45 tokens), but the model patches 3 x 3 x 4 (36) and reports it: both
    self-attentions (36 keys, the derived layout's 45 matches none of them) are reduced to the reported grid's
    picks, every query kept, each kept key a real key of another position."""
    patcher, latent, cond, _ = wan(comfy)
    cropped = _wrapped(comfy, patcher, _drop_last_patch_column)
    reported = [value for value in _reports(comfy, cropped, latent, cond, "grid_sizes") if value is not None]
    assert {tuple(value) for value in reported} == {(3, 3, 4)}
    assert token_layout(patcher.model.diffusion_model, latent, cond[0][0], {}).length == 45
    vanilla = spy_on(cropped)
    sample(comfy, cropped, latent, cond, steps=1)
    base = _wrapped(comfy, patcher, _drop_last_patch_column)
    calls = spy_on(base)
    sample(comfy, patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv", seed=3)), latent, cond, steps=1)
    assert len(calls) == len(vanilla) > 0
    shortened = [(a, b) for a, b in zip(vanilla, calls) if b[1].shape[1] < a[1].shape[1]]
    assert len(shortened) == 2 and all(a[1].shape[1] == 36 and b[1].shape[1] == _picks((3, 3, 4))
                                       for a, b in shortened)
    (q0, k0, _, _), (q1, k1, _, _) = shortened[0]
    assert torch.equal(q0, q1)
    match = (k1[0][:, None] == k0[0][None]).all(-1)
    assert (match.sum(1) >= 1).all() and match.float().argmax(1).unique().numel() == k1.shape[1]


def _three_more_text_tokens(executor, x, timestep, context, *args, **kwargs):
    """The model runs with its text's first 3 tokens appended once more (8 text tokens instead of 5)."""
    return executor(x, timestep, torch.cat([context, context[:, :3]], 1), *args, **kwargs)


def test_flux_single_blocks_keep_the_text_length_they_report(comfy):
    """Flux's call carries 5 text tokens, but the model runs 8 and its single blocks report img_slice [8, 43]: the
    reduced single-block self-attentions keep all 8 text keys (the derived layout would keep 5 and take the other 3
    for the grid's first tokens) and the reported grid's picks."""
    patcher, latent, cond, where = flux(comfy)
    longer = _wrapped(comfy, patcher, _three_more_text_tokens)
    assert [8, 43] in _reports(comfy, longer, latent, cond, "img_slice")
    vanilla = spy_on(longer)
    sample(comfy, longer, latent, cond, steps=1)
    base = _wrapped(comfy, patcher, _three_more_text_tokens)
    calls = spy_on(base)
    sample(comfy, patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv", seed=3)), latent, cond, steps=1)
    shortened = [(a, b) for a, b in zip(vanilla, calls) if b[1].shape[2] < a[1].shape[2]]
    picks = _picks((5, 7))
    assert len(shortened) == 2 and all(b[1].shape[2] == 8 + picks for _, b in shortened)  # the 2 single blocks
    a, b = shortened[0]  # the first: the same inputs with and without ToMe
    assert torch.equal(a[0], b[0])
    for full, kept in ((a[1], b[1]), (a[2], b[2])):
        assert torch.equal(kept[:, :, :8], full[:, :, :8])
        grid = full[0, :, 8:].transpose(0, 1).flatten(1)
        match = (kept[0, :, 8:].transpose(0, 1).flatten(1)[:, None] == grid[None]).all(-1)
        assert (match.sum(1) >= 1).all() and match.float().argmax(1).unique().numel() == picks


def test_flux_report_that_cannot_hold_the_grid_is_left_whole_with_one_warning(comfy, caplog):
    """The model runs on a cropped latent (5 x 6 tokens) while the call's latent gives 5 x 7: its report [5, 35]
    cannot hold the derived grid after the text, and the report holds no frames to rebuild it from, so the single
    blocks are left whole (the image is the unpatched one under the same crop, bit for bit) and one warning says so."""
    patcher, latent, cond, _ = flux(comfy)
    cropped = _wrapped(comfy, patcher, _drop_last_patch_column)
    assert [5, 35] in _reports(comfy, cropped, latent, cond, "img_slice")
    expected = sample(comfy, cropped, latent, cond)
    with caplog.at_level("WARNING", logger="tome.dit"):
        patched = patch_dit_model_patcher(_wrapped(comfy, patcher, _drop_last_patch_column),
                                          ToMeConfig(ratio=0.5, mode="kv"))
        assert torch.equal(sample(comfy, patched, latent, cond), expected)
    warned = [r.getMessage() for r in caplog.records if "img_slice" in r.getMessage()]
    assert warned == ["ToMe: flux: the model reports img_slice=[5, 35], which does not hold this call's tokens that "
                      "keep every key; such calls are left unreduced."]
