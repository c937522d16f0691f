"""The DiT merge-error experiment (tome_bench/experiments/dit_merge_error.py) on tiny-width models: ratio 0 is
the identity for every variant, the variants keep the tokens removed equal, the matching features are what the
block's attention sees, the windows and block ranges reach the engine, sigma 0.5 is the bench's photo content,
and the JSON leads with its device and commit. The tiny models check the plumbing, not the errors."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("skimage")

import tome_core  # noqa: E402
from tome_core.adapters.hooks import dit_merge  # noqa: E402
from tome_core.engine import call_plan  # noqa: E402
from tome_bench import dit_models  # noqa: E402
from tome_bench.experiments import dit_merge_error as exp  # noqa: E402


@pytest.fixture(scope="module")
def wan():
    model = exp.build("wan", 2, tiny=True)
    return model, exp.inputs_for(model, "wan", exp.TINY_SIZES["wan"], "photo")


@pytest.mark.parametrize("family, attention", [("flux", "attn"), ("qwen_image", "attn"), ("wan", "attn1")])
def test_modulated_features_are_the_attention_input(family, attention):
    """``modulated`` is exactly the image tokens the first reduced block hands its attention (Flux single blocks:
    the image part of [text, image]); ``normed`` is the same before the AdaLN shift and scale."""
    model = exp.build(family, 2, tiny=True)
    inputs = exp.inputs_for(model, family, exp.TINY_SIZES[family], "noise")
    tome_core.apply_patch(model, ratio=0.5, mode="merge")
    block = model.__dict__[dit_merge.STATE_ATTR].blocks[0][1]
    tome_core.remove_patch(model)
    seen = {}

    def on_block(module, args, kwargs):
        named = dit_merge.block_keywords(module, args, kwargs)
        seen["modulated"] = exp._block_features(module, named, "modulated")
        seen["normed"] = exp._block_features(module, named, "normed")

    def on_attention(module, args, kwargs):
        seen["attention"] = kwargs.get("hidden_states", args[0] if args else None)

    handles = [block.register_forward_pre_hook(on_block, with_kwargs=True),
               getattr(block, attention).register_forward_pre_hook(on_attention, with_kwargs=True)]
    try:
        dit_models.forward(model, inputs)
    finally:
        for handle in handles:
            handle.remove()
    n = seen["modulated"].shape[1]
    torch.testing.assert_close(seen["modulated"].float(), seen["attention"][:, -n:].float(), rtol=0.02, atol=0.02)
    assert not torch.allclose(seen["normed"].float(), seen["modulated"].float())


def test_ratio_zero_is_the_identity_and_variants_remove_the_same_tokens(wan):
    model, inputs = wan
    with dit_models.peaked_attention(model, exp.PEAKED):
        reference = dit_models.forward(model, inputs)
        for feature in exp.FEATURES:
            out, removed, blocks = exp.merged(model, inputs, 0.0, features=feature)
            assert exp.cfg_err("wan", out, reference) == 0.0 and removed == 0
        removed = {}
        for name, window in exp.WINDOWS.items():
            for feature in exp.FEATURES:
                out, removed[name, feature], blocks = exp.merged(model, inputs, 0.5, features=feature, window=window)
                assert 0 < exp.cfg_err("wan", out, reference) < 1 and blocks == 2
    grid = exp._tokens("wan", exp.TINY_SIZES["wan"])
    assert set(removed.values()) == {grid // 2}
    assert call_plan.match_grid.__name__ == "match_grid" and call_plan.merge_window.__name__ == "merge_window"


def test_windows_reach_the_engine():
    """Inside ``video_window`` a 3-D grid gets the window (cut to the grid), an image grid today's."""
    with exp.video_window((2, 2, 2)):
        assert call_plan.merge_window((1, 4, 4), 2, 2) == (1, 2, 2)
        assert call_plan.merge_window((4, 6, 8), 2, 2) == (2, 2, 2)
        assert call_plan.merge_window((6, 8), 2, 2) == (2, 2)
    assert call_plan.merge_window((4, 6, 8), 2, 2) == (1, 2, 2)


def test_block_ranges_cover_what_they_name():
    ranges = exp.block_ranges(6)
    model = exp.build("wan", 6, tiny=True)
    inputs = exp.inputs_for(model, "wan", exp.TINY_SIZES["wan"], "noise")
    reduced = {name: exp.merged(model, inputs, ratio, block_start=start, block_end=end)[2]
               for name, start, end, ratio in ranges}
    assert list(reduced.values()) == [6, 2, 2, 2, 4, 6, 6]
    assert [round(r, 3) for *_, r in ranges[-2:]] == [0.167, 0.333]  # a third's and the inner blocks' tokens x blocks


def test_sigma_half_is_the_bench_photo(wan):
    model, inputs = wan
    at = exp.inputs_at(model, "wan", exp.TINY_SIZES["wan"], 0.5)
    assert torch.equal(at["hidden_states"], inputs["hidden_states"])
    assert at["timestep"].tolist() == inputs["timestep"].tolist() == [500.0, 500.0]


def test_main_writes_rows_led_by_device_and_commit(tmp_path, capsys):
    out = tmp_path / "errors.json"
    assert exp.main(["--tiny", "--experiments", "windows", "--families", "wan", "--ratios", "0,0.75",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert list(result)[:2] == ["device", "commit"]
    rows = result["windows"]
    assert len(rows) == 2 * 2 * len(exp.WINDOWS)  # contents x ratios x windows
    assert {r["err"] for r in rows if r["ratio"] == 0} == {0.0}
    assert {r["removed"] for r in rows if r["ratio"] == 0.75} == {24}
