"""tome's nodes inside a real ComfyUI server: prompt validation, execution, a real (tiny) SD1.5 checkpoint.

Every prompt goes through ComfyUI's own ``POST /prompt`` (validation: HTTP 400 with
``node_errors``) and its prompt worker; results come back through ``/history``. CPU, 64x64, 2 steps.
"""
from __future__ import annotations

import numpy as np
import pytest

import comfy_env
from comfy_env import ADVANCED_DEFAULTS, PromptInvalid, advanced, api_prompt, pixels, run_image

BASIC = {"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.5, "max_downsample": 1}}



@pytest.fixture(scope="module")
def baseline(comfy, checkpoint):
    return run_image(comfy, api_prompt(None, prefix="plain"))


@pytest.fixture(scope="module")
def tome_run(comfy, checkpoint):
    result = comfy.run(api_prompt(BASIC, prefix="tome"))
    assert result.success, result.error_message()
    return result


def test_nodes_are_registered_beside_core_tome(comfy):
    basic, advanced_node = comfy.object_info("TomeCoreToMe"), comfy.object_info("TomeCoreToMeAdvanced")
    assert basic["display_name"] == "ToMe"
    assert advanced_node["display_name"] == "ToMe (advanced)"
    core = comfy.object_info("TomePatchModel")  # core's own node is still there, unchanged
    assert core["display_name"] != basic["display_name"] and "ratio" in core["input"]["required"]
    if "python_module" in basic:  # 2025+ reports where a node comes from
        assert core["python_module"] in ("comfy_extras.nodes_tomesd", "nodes")
        assert "tome-diffusion" in basic["python_module"]
    assert "/extensions/tome-diffusion/tome.js" in comfy.get_json("/extensions")


def test_tome_writes_a_finite_image_that_differs_from_the_plain_run(baseline, tome_run):
    image = pixels(tome_run.images[0])
    assert image.shape == baseline.shape == (64, 64, 3)
    assert image.std() > 1.0  # not blank
    assert np.abs(image - baseline).mean() > 0.1
    info = tome_run.outputs["10"]["tome"][0]
    assert info["ratio"] == 0.5 and info["base_downsample"] == 1 and info["model_type"] == "BaseModel"


def test_same_workflow_and_seed_give_the_same_image(comfy, tome_run):
    """Run again with the server's cache emptied: the partition's generator is seeded, never global."""
    again = comfy.run_fresh(api_prompt(BASIC, prefix="tome"))
    assert again.success and again.cached_nodes() == []
    assert np.array_equal(pixels(again.images[-1]), pixels(tome_run.images[0]))


def test_the_input_model_is_not_changed(comfy, baseline):
    """One graph: the loader's MODEL feeds ToMe and, once the ToMe branch has sampled and decoded
    (tome_test_nodes' TomeTestAfter passes the same MODEL object on only then), a plain sampler; the
    plain branch's image is the plain run's, and the loader's MODEL carries no patch."""
    prompt = api_prompt(dict(advanced(merge_crossattn=True)), prefix="patched")
    prompt["40"] = {"class_type": "TomeTestAfter", "inputs": {"model": ["1", 0], "after": ["6", 0]}}
    prompt["20"] = dict(prompt["5"], inputs=dict(prompt["5"]["inputs"], model=["40", 0]))
    prompt["21"] = {"class_type": "VAEDecode", "inputs": {"samples": ["20", 0], "vae": ["1", 2]}}
    prompt["22"] = {"class_type": "SaveImage", "inputs": {"images": ["21", 0], "filename_prefix": "unpatched"}}
    prompt["30"] = {"class_type": "TomeTestModelReport", "inputs": {"model": ["10", 0], "label": "tome"}}
    prompt["31"] = {"class_type": "TomeTestModelReport", "inputs": {"model": ["40", 0], "label": "loader"}}
    result = comfy.run(prompt)
    assert result.success, result.error_message()
    [plain] = [pixels(path) for path in result.images if path.name.startswith("unpatched")]
    assert np.array_equal(plain, baseline)
    assert result.outputs["31"]["patches"][0]["patches"] == {}
    patched = result.outputs["30"]["patches"][0]["patches"]
    assert patched["attn1_patch"] == ["tome_attn1_patch"] and patched["attn2_patch"] == ["tome_attn2_patch"]
    assert patched["attn1_output_patch"] == ["tome_attn1_output_patch"]


@pytest.mark.parametrize("tome", [
    advanced(ratio=0.0),
    advanced(start_percent=1.0, end_percent=1.0),  # the window holds no step of the schedule
    advanced(min_tokens=100_000),
], ids=["ratio0", "empty-window", "min-tokens"])
def test_inactive_settings_give_exactly_the_plain_image(comfy, baseline, tome):
    assert np.array_equal(run_image(comfy, api_prompt(tome, prefix="inactive")), baseline)


@pytest.mark.parametrize("tome", [
    advanced(mode="kv", ratio=0.75),
    advanced(mode="kv", ratio=0.75, kv_downsample="avg"),
    advanced(merge_crossattn=True),
    advanced(use_rand=False, sx=4, sy=2, ratio=0.8),
    advanced(end_percent=0.5),
    advanced(max_downsample=2, tome_seed=7),
], ids=["kv", "kv-avg", "crossattn", "norand-4x2", "first-half", "two-levels"])
def test_advanced_settings_run_and_change_the_image(comfy, baseline, tome):
    image = run_image(comfy, api_prompt(tome, prefix="adv"))
    assert np.abs(image - baseline).mean() > 0.1


def test_two_tome_nodes_in_one_graph_do_not_interfere(comfy, tome_run):
    kv = advanced(mode="kv", ratio=0.75)
    alone_kv = run_image(comfy, api_prompt(kv, prefix="alone_kv"))
    alone_basic = pixels(tome_run.images[0])

    prompt = api_prompt(BASIC, prefix="branch_a")
    branch = api_prompt(kv, prefix="branch_b")
    renamed = {"10": "110", "5": "105", "6": "106", "7": "107"}
    for old_id, new_id in renamed.items():
        prompt[new_id] = branch[old_id]
        for name, value in prompt[new_id]["inputs"].items():
            if isinstance(value, list) and value[0] in renamed:
                prompt[new_id]["inputs"][name] = [renamed[value[0]], value[1]]
    result = comfy.run(prompt)
    assert result.success, result.error_message()
    by_prefix = {path.name.split("_")[1]: pixels(path) for path in result.images}
    assert np.array_equal(by_prefix["a"], alone_basic)
    assert np.array_equal(by_prefix["b"], alone_kv)


def test_composes_with_self_attention_guidance(comfy, baseline):
    """SAG replaces the middle block's attn1; ToMe (level 1 only) merges around it."""
    sag = {"class_type": "SelfAttentionGuidance", "inputs": {"scale": 0.5, "blur_sigma": 2.0}}
    with_sag = run_image(comfy, api_prompt(None, prefix="sag", pre_nodes=[sag]))
    both = run_image(comfy, api_prompt(BASIC, prefix="sag_tome", pre_nodes=[sag]))
    assert np.abs(both - with_sag).mean() > 0.1 and both.std() > 1.0


# Rules across inputs are refused when the node runs, naming their inputs: test_comfy_validation.py.
@pytest.mark.parametrize("tome, field", [
    ({"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.9, "max_downsample": 1}}, "ratio"),
    ({"class_type": "TomeCoreToMe", "inputs": {"ratio": -1.5, "max_downsample": 1}}, "ratio"),
    ({"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.5, "max_downsample": 3}}, "max_downsample"),
    (advanced(mode="average"), "mode"),
    (advanced(sx=9), "sx"),
    (advanced(tome_seed=-1), "tome_seed"),
], ids=["ratio-high", "ratio-negative", "downsample-3", "mode", "sx", "seed"])
def test_bad_widget_values_fail_validation_naming_the_input(comfy, checkpoint, tome, field):
    with pytest.raises(PromptInvalid) as caught:
        comfy.validate(api_prompt(tome))
    node_errors = caught.value.node_errors
    assert list(node_errors) == ["10"] and node_errors["10"]["class_type"] == tome["class_type"]
    text = " ".join(f"{e['message']} {e['details']}" for e in node_errors["10"]["errors"])
    assert field in text, text


def test_ratio_minus_one_is_tomesds_half_on_a_unet_and_another_negative_stops_the_run(comfy, checkpoint):
    """The ratio widget's -1 (its default, "the model's"): tomesd's 0.5 on a UNet, the same image through /prompt; a
    negative ratio other than -1 passes the widget's range and is refused when the node runs, naming ratio and -1."""
    minus_one = {"class_type": "TomeCoreToMe", "inputs": {"ratio": -1.0, "max_downsample": 1}}
    assert np.array_equal(run_image(comfy, api_prompt(minus_one, prefix="minus_one")),
                          run_image(comfy, api_prompt(BASIC, prefix="half")))
    result = comfy.run(api_prompt({"class_type": "TomeCoreToMe", "inputs": {"ratio": -0.1, "max_downsample": 1}},
                                  prefix="negative"))
    assert not result.success and not result.images
    error = result.error_message()
    assert error["node_id"] == "10" and "ratio = -0.1: use -1 for the model's default" in error["exception_message"]


def test_unsupported_model_is_an_execution_error_naming_the_model(comfy, checkpoint):
    """A transformer-only model stand-in (tome_test_nodes' loader: a real ModelPatcher around a
    module named like ComfyUI's Flux class, without BasicTransformerBlock)."""
    prompt = api_prompt(BASIC, prefix="dit")
    prompt["10"]["inputs"]["model"] = ["9", 0]
    prompt["9"] = {"class_type": "TomeTestDiTLoader", "inputs": {}}
    result = comfy.run(prompt)
    assert not result.success and not result.images
    error = result.error_message()
    assert error["node_id"] == "10" and error["node_type"] == "TomeCoreToMe"
    assert "Flux" in error["exception_message"] and "Supported" in error["exception_message"]


@pytest.fixture(scope="module")
def loader_model(comfy, checkpoint):
    """The checkpoint's MODEL, loaded in this process with ComfyUI's own loader (no server, no executor)."""
    import importlib

    comfy_env.import_comfy(comfy.comfy_dir)
    comfy_sd = importlib.import_module("comfy.sd")
    path = comfy.checkpoint_dir / checkpoint
    return comfy_sd.load_checkpoint_guess_config(str(path), output_vae=False, output_clip=False)[0]


def _hypertile_node():
    """HyperTile is a classic node in 2024 ComfyUI and a schema (V3) node in 0.3.x."""
    from comfy_extras.nodes_hypertile import HyperTile

    return HyperTile


def _hypertile_block_output(comfy, patcher, x):
    """Run x through a real ComfyUI BasicTransformerBlock with patcher's transformer options."""
    import random

    import torch
    from comfy.ldm.modules.attention import BasicTransformerBlock

    from comfy_env import _seeded_init

    block = BasicTransformerBlock(32, 4, 8, context_dim=32, checkpoint=False)
    _seeded_init(block, 5)
    options = dict(patcher.model_options["transformer_options"], original_shape=[2, 4, 64, 64],
                   sigmas=torch.full((2,), 3.0), block=("input", 1))
    random.seed(0)  # HyperTile picks its tiling with the global RNG
    with torch.no_grad():
        return block(x.clone(), context=torch.randn(2, 7, 32, generator=torch.Generator().manual_seed(1)),
                     transformer_options=options)


def _apply_hypertile(model, **inputs):
    node = _hypertile_node()
    if hasattr(node, "FUNCTION"):
        return getattr(node(), node.FUNCTION)(model, **inputs)[0]
    return node.execute(model, **inputs).result[0]


def test_hypertile_then_tome_merge_is_refused_kv_acts_and_the_reverse_fails_loudly(comfy, tome_package, loader_model):
    """ComfyUI runs attn1 output patches in registration order (not nested): after HyperTile, mode merge
    is refused when the node runs and mode kv reduces the keys/values HyperTile's tiles attend to; a
    HyperTile that tiles tokens ToMe merged fails loudly. Real ComfyUI objects in this process: the
    loaded model, HyperTile's own node, a real BasicTransformerBlock (the server-level table is
    test_comfy_compose.py)."""
    import torch

    tome = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMeAdvanced"]()
    x = torch.randn(2, 64 * 64, 32, generator=torch.Generator().manual_seed(0))

    tiled = _apply_hypertile(loader_model, tile_size=256, swap_size=1, max_depth=1, scale_depth=False)
    with pytest.raises(ValueError, match="HyperTile is applied before ToMe"):
        tome.patch(tiled, **ADVANCED_DEFAULTS)
    (tiled_then_kv,) = tome.patch(tiled, **dict(ADVANCED_DEFAULTS, mode="kv"))["result"]
    alone = _hypertile_block_output(comfy, tiled, x)
    both = _hypertile_block_output(comfy, tiled_then_kv, x)
    assert both.shape == alone.shape and not torch.equal(both, alone)

    (merged,) = tome.patch(loader_model, **dict(ADVANCED_DEFAULTS, ratio=0.75))["result"]
    merged_then_tiled = _apply_hypertile(merged, tile_size=32, swap_size=1, max_depth=1, scale_depth=False)
    with pytest.raises(RuntimeError, match="HyperTile"):
        _hypertile_block_output(comfy, merged_then_tiled, x)


def test_a_second_tome_node_in_a_row_changes_nothing(comfy, tome_run):
    """Only the first ToMe patch acts on a block; the image is the first node's alone."""
    chained = run_image(comfy, api_prompt(advanced(mode="kv", ratio=0.75), prefix="chained", pre_nodes=[BASIC]))
    assert np.array_equal(chained, pixels(tome_run.images[0]))
