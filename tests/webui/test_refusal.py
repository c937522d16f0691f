"""A bad ToMe setting stops the generation with the engine's message; it never yields an image
without ToMe. Driven through the stand-ins of the WebUI's real control flow (webui_doubles: the
API's ``text2imgapi`` and exception handler, the UI's ``wrap_gradio_call``, a ``ScriptRunner``
that swallows what callbacks raise, ``process_images_inner`` calling ``p.sample`` outside them)
on a real ldm UNet (A1111) and a real ComfyUI ModelPatcher (Forge)."""
from __future__ import annotations

import html
import importlib.machinery
import sys
import types

import pytest
import torch

import tome_core
import webui_doubles as wd
from test_a1111_run import assert_clean
from test_forge_path import ForgeModel, build_comfy_sd15_patcher
from tome_webui.options import INFOTEXT_KEYS
from webui_helpers import make_p, script_args

BAD_VALUES = {  # field -> (value as the API sends it, what the message must say)
    "ratio=5": ({"ratio": 5}, "ratio must be in"),
    "ratio=-0.5": ({"ratio": -0.5}, "use -1 for the model's default ratio"),  # -1 itself is the default
    "max_downsample=3": ({"max_downsample": 3}, "max_downsample"),
    "ratio='abc'": ({"ratio": "abc"}, "ToMe: ratio must be a number, got 'abc'"),
    "sx='two'": ({"sx": "two"}, "ToMe: sx must be a whole number, got 'two'"),
}


def api_request(**values) -> dict:
    return {"steps": 2, "alwayson_scripts": {"ToMe": {"args": script_args(**values)}}}


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_api_answers_a_bad_value_with_an_error_carrying_the_engines_message(script, host, sd_model, name):
    values, message = BAD_VALUES[name]
    status, body = wd.api_txt2img(sd_model, host.opts, [script], api_request(**values))
    assert status == 500 and "images" not in body
    assert body["errors"].startswith("ToMe") and message in body["errors"]
    assert body["error"] in ("ValueError", "TypeError")
    assert_clean(sd_model)


@pytest.mark.parametrize("name", list(BAD_VALUES))
def test_the_ui_shows_the_error_and_no_image(script, host, sd_model, name):
    values, message = BAD_VALUES[name]
    p = make_p(sd_model, host, script, script_args(**values))
    images, _, _, error_box = wd.wrap_gradio_call(lambda: wd.txt2img_ui(p), extra_outputs=wd.TXT2IMG_EXTRA_OUTPUTS)()
    assert images is None and p.closed
    assert error_box.startswith("<div class='error'>ValueError: ToMe") and html.escape(message) in error_box
    assert not any(key in p.extra_generation_params for key in INFOTEXT_KEYS)
    assert_clean(sd_model)


def test_a_good_ui_run_gives_images_and_tome_in_the_info(script, host, sd_model):
    p = make_p(sd_model, host, script, script_args(ratio=0.5))
    images, _, info, _ = wd.wrap_gradio_call(lambda: wd.txt2img_ui(p), extra_outputs=wd.TXT2IMG_EXTRA_OUTPUTS)()
    assert len(images) == 1 and "ToMe ratio: 0.5" in info
    assert_clean(sd_model)


def test_xyz_cells_copied_from_one_p_do_not_inherit_a_refusal(script, host, sd_model):
    """xyz_grid's cells are ``copy(p)`` of the one p; a refused cell stops the job, and a later
    cell (or run) made from the same p generates normally with ToMe."""
    parent = make_p(sd_model, host, script, script_args(ratio=0.5))
    bad = wd.copy_p(parent)
    bad.tome_overrides = {"ratio": 5}  # as the XYZ "ToMe ratio" axis sets it
    with pytest.raises(ValueError, match="ratio must be in"):
        wd.process_images(bad)
    assert "sample" not in vars(parent)
    good = wd.copy_p(bad)  # even a copy of the refused cell itself
    good.tome_overrides = {"ratio": 0.4}
    out = wd.process_images(good)
    assert "ToMe ratio: 0.4" in out.info and len(out.images) == 1
    wd.txt2img(parent)
    assert_clean(sd_model)


def test_the_refusal_never_reaches_sampling_and_a_good_run_after_it_is_normal(script, host, sd_model, reference):
    calls = []
    counter = sd_model.model.diffusion_model.register_forward_pre_hook(lambda m, a: calls.append(1))
    p = make_p(sd_model, host, script, script_args(ratio=5))
    with pytest.raises(ValueError, match="ratio must be in"):
        wd.txt2img(p)
    assert calls == [] and not p.scripts.reported  # refused by p.sample, not swallowed by the runner

    p.script_args = script_args(ratio=0.5)  # the same p object again (as a reused or copied p would be)
    out = wd.txt2img(p)
    assert calls and "ToMe ratio: 0.5" in out.info
    counter.remove()
    assert_clean(sd_model)
    ref = wd.txt2img(make_p(reference, host, None, []))
    assert not torch.equal(out.images[0], ref.images[0])


def test_a_good_api_request_gives_an_image_with_tome_in_the_infotext(script, host, sd_model):
    status, body = wd.api_txt2img(sd_model, host.opts, [script], api_request(ratio=0.4))
    assert status == 200 and body["images"] and "ToMe ratio: 0.4" in body["info"]
    status, body = wd.api_txt2img(sd_model, host.opts, [script], {"alwayson_scripts": {"NoSuch": {"args": []}}})
    assert status == 422 and body["detail"] == "Script 'NoSuch' not found" and body["error"] == "HTTPException"


def test_ratio_minus_one_is_tomesds_half_on_a_unet(script, host, sd_model):
    """The slider's -1 (its default) on an A1111 UNet: tomesd's 0.5, written as such, the same image."""
    status, body = wd.api_txt2img(sd_model, host.opts, [script], api_request(ratio=-1))
    status_half, body_half = wd.api_txt2img(sd_model, host.opts, [script], api_request(ratio=0.5))
    assert status == status_half == 200 and "ToMe ratio: 0.5" in body["info"]
    assert all(torch.equal(a, b) for a, b in zip(body["images"], body_half["images"])) and body["images"]


def make_img2img_p(model, host, script, args):
    p = wd.Img2ImgProcessing(model, host.opts, steps=2)
    p.scripts = wd.ScriptRunner([script])
    p.script_args = args
    return p


def test_img2img_refuses_through_its_own_sample_and_runs_normally_after(script, host, sd_model):
    p = make_img2img_p(sd_model, host, script, script_args(max_downsample=3))
    with pytest.raises(ValueError, match="max_downsample"):
        wd.img2img(p)
    assert not any(key in p.extra_generation_params for key in INFOTEXT_KEYS) and not p.scripts.reported
    assert_clean(sd_model)
    out = wd.img2img(make_img2img_p(sd_model, host, script, script_args(ratio=0.5)))
    assert "ToMe ratio: 0.5" in out.info and "ToMe hr ratio" not in out.info
    assert_clean(sd_model)


class NotAUNet(torch.nn.Module):
    """A transformer-only diffusion model (no BasicTransformerBlock in input/middle blocks), e.g. SD3."""

    def __init__(self):
        super().__init__()
        self.joint_blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])


def test_a1111_refuses_a_model_without_a_unet_before_writing_the_infotext(script, host):
    model = types.SimpleNamespace(model=types.SimpleNamespace(diffusion_model=NotAUNet()))
    status, body = wd.api_txt2img(model, host.opts, [script], api_request())
    assert status == 500 and "no UNet with transformer blocks" in body["errors"]


# ---------------------------------------------------------------- Forge / reForge


@pytest.fixture(scope="module")
def comfy_patcher():
    return build_comfy_sd15_patcher()


def test_forge_refuses_merge_mlp_before_anything_is_written_or_patched(script, host, comfy_patcher):
    model = ForgeModel(comfy_patcher)
    status, body = wd.api_txt2img(model, host.opts, [script], api_request(merge_mlp=True), forge=True)
    assert status == 500 and "merge_mlp is not available" in body["message"] and "errors" not in body
    assert model.patches_seen == [] and model.forge_objects.unet is comfy_patcher


def test_forge_refuses_match_every_naming_the_fix(script, host, comfy_patcher):
    """Forge marks no sampling run (no model wrappers, no sample_sigmas): a run could start on the last run's
    matching, so match_every above 1 stops the job with the fix."""
    model = ForgeModel(comfy_patcher)
    status, body = wd.api_txt2img(model, host.opts, [script], api_request(match_every=2), forge=True)
    assert status == 500 and "match_every=2" in body["message"] and "set match_every=1" in body["message"]
    assert model.patches_seen == [] and model.forge_objects.unet is comfy_patcher


def test_forge_refuses_a_schedule_window_without_percent_to_sigma(script, host, comfy_patcher):
    clone = comfy_patcher.clone()
    clone.add_object_patch("model_sampling", types.SimpleNamespace())  # a build without percent_to_sigma
    model = ForgeModel(clone)
    status, body = wd.api_txt2img(model, host.opts, [script], api_request(start_percent=0.2), forge=True)
    assert status == 500 and "percent_to_sigma" in body["message"] and model.patches_seen == []


def test_forge_refuses_an_unsupported_model_naming_it(script, host, comfy_patcher):
    clone = comfy_patcher.clone()
    clone.add_object_patch("diffusion_model", NotAUNet())
    model = ForgeModel(clone)
    status, body = wd.api_txt2img(model, host.opts, [script], api_request(), forge=True)
    assert status == 500 and "cannot patch a BaseModel model (NotAUNet, test_refusal.NotAUNet)" in body["message"]
    assert model.patches_seen == []


def test_forge_bad_values_behave_as_in_a1111(script, host, comfy_patcher):
    for values, message in BAD_VALUES.values():
        model = ForgeModel(comfy_patcher)
        status, body = wd.api_txt2img(model, host.opts, [script], api_request(**values), forge=True)
        assert status == 500 and message in body["message"] and model.patches_seen == []
        # reForge / Forge Classic: the Forge patch path behind A1111's handler, which answers in "errors"
        model = ForgeModel(comfy_patcher)
        status, body = wd.api_txt2img(model, host.opts, [script], api_request(**values), forge=True,
                                      handler="a1111")
        assert status == 500 and message in body["errors"] and model.patches_seen == []


def forge_ui(host, script, patcher, main_thread, **values):
    """The Generate button on a Forge-family host: wrap_gradio_gpu_call -> txt2img -> main_thread."""
    model = ForgeModel(patcher)
    p = make_p(model, host, script, script_args(**values))
    run = wd.wrap_gradio_call(lambda: main_thread.run_and_wait_result(wd.txt2img_ui, p, forge=True),
                              extra_outputs=wd.TXT2IMG_EXTRA_OUTPUTS, main_thread=main_thread)
    return run(), model, p


def test_forge_ui_shows_tomes_message(script, host, comfy_patcher):
    """Forge head keeps main_thread.last_exception, and its wrap_gradio_call shows that one."""
    main_thread = wd.MainThread(keeps_last_exception=True)
    (images, _, _, error_box), model, p = forge_ui(host, script, comfy_patcher, main_thread, merge_mlp=True)
    assert images is None and model.patches_seen == []
    assert error_box.startswith("<div class='error'>ValueError: ToMe: merge_mlp is not available")
    assert not any(key in p.extra_generation_params for key in INFOTEXT_KEYS)
    (images, _, info, _), model, _ = forge_ui(host, script, comfy_patcher, main_thread, ratio=0.5)
    assert len(images) == 1 and "ToMe ratio: 0.5" in info and model.patches_seen[0] > 0


def test_reforge_and_forge_classic_ui_stop_the_job_with_the_message_only_in_the_console(script, host, comfy_patcher):
    """reForge and Forge Classic's main_thread prints the exception and returns None: the job stops
    without an image, the UI's box shows list(None)'s TypeError, ToMe's message is in the console."""
    main_thread = wd.MainThread(keeps_last_exception=False)
    (images, _, _, error_box), model, p = forge_ui(host, script, comfy_patcher, main_thread, ratio=5)
    assert images is None and model.patches_seen == []
    assert error_box.startswith("<div class='error'>TypeError: ")
    assert "ToMe: ratio must be in" in str(main_thread.printed[-1])
    assert not any(key in p.extra_generation_params for key in INFOTEXT_KEYS)


def test_forge_img2img_refuses_before_its_sample_patches(script, host, comfy_patcher):
    model = ForgeModel(comfy_patcher)
    with pytest.raises(ValueError, match="merge_mlp is not available"):
        wd.img2img(make_img2img_p(model, host, script, script_args(merge_mlp=True)), forge=True)
    assert model.patches_seen == [] and model.forge_objects.unet is comfy_patcher
    model = ForgeModel(comfy_patcher)
    out = wd.img2img(make_img2img_p(model, host, script, script_args(ratio=0.5)), forge=True)
    assert "ToMe ratio: 0.5" in out.info and model.patches_seen and model.patches_seen[0] > 0


@pytest.fixture
def forge_installed(monkeypatch):
    """Forge, reForge and Forge Classic ship the package ``modules_forge`` (A1111 does not)."""
    module = types.ModuleType("modules_forge")
    module.__spec__ = importlib.machinery.ModuleSpec("modules_forge", None, is_package=True)
    monkeypatch.setitem(sys.modules, "modules_forge", module)


def test_merge_mlp_is_not_offered_on_forge(script_module, host, gr, forge_installed):
    s = script_module.ToMeScript()
    with gr.Blocks() as demo:
        controls = s.ui(False)
    merge_mlp = controls[[f.name for f in wd_fields()].index("merge_mlp")]
    assert merge_mlp.visible is False and merge_mlp.interactive is False and merge_mlp.value is False
    notes = [b.value for b in demo.blocks.values() if isinstance(b, gr.Markdown)]
    assert any("Merge MLP is not offered here" in note for note in notes)


def test_merge_mlp_is_offered_on_a1111(script_module, host, gr):
    s = script_module.ToMeScript()
    with gr.Blocks() as demo:
        controls = s.ui(False)
    merge_mlp = controls[[f.name for f in wd_fields()].index("merge_mlp")]
    assert merge_mlp.visible is not False and merge_mlp.interactive is not False
    assert not any("Merge MLP" in str(b.value) for b in demo.blocks.values() if isinstance(b, gr.Markdown))


def wd_fields():
    from tome_webui.options import FIELDS

    return FIELDS
