"""A bad ToMe setting stops the generation with the engine's message; it never yields an image
without ToMe. Driven through the stand-ins of the WebUI's real control flow (webui_doubles: the
API's ``text2imgapi`` and exception handler, the UI's ``wrap_gradio_call``, a ``ScriptRunner``
that swallows what callbacks raise, ``process_images_inner`` calling ``p.sample`` outside them)
on a real ldm UNet (A1111) and a real ComfyUI ModelPatcher (Forge)."""
from __future__ import annotations

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
    "ratio=-1": ({"ratio": -1}, "ratio must be in"),
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


def test_the_ui_shows_the_error_and_no_image(script, host, sd_model):
    p = make_p(sd_model, host, script, script_args(ratio=5))
    images, html = wd.wrap_gradio_call(lambda: wd.txt2img(p))()
    assert images is None
    assert html.startswith("<div class='error'>ValueError: ToMe: ratio must be in") and p.closed
    assert not any(key in p.extra_generation_params for key in INFOTEXT_KEYS)


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
    assert status == 422 and body["errors"] == "always on script NoSuch not found"


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
    assert status == 500 and "merge_mlp is not available" in body["errors"]
    assert model.patches_seen == [] and model.forge_objects.unet is comfy_patcher


def test_forge_refuses_a_schedule_window_without_percent_to_sigma(script, host, comfy_patcher):
    clone = comfy_patcher.clone()
    clone.add_object_patch("model_sampling", types.SimpleNamespace())  # a build without percent_to_sigma
    model = ForgeModel(clone)
    status, body = wd.api_txt2img(model, host.opts, [script], api_request(start_percent=0.2), forge=True)
    assert status == 500 and "percent_to_sigma" in body["errors"] and model.patches_seen == []


def test_forge_refuses_an_unsupported_model_naming_it(script, host, comfy_patcher):
    clone = comfy_patcher.clone()
    clone.add_object_patch("diffusion_model", NotAUNet())
    model = ForgeModel(clone)
    status, body = wd.api_txt2img(model, host.opts, [script], api_request(), forge=True)
    assert status == 500 and "cannot patch a BaseModel model (NotAUNet)" in body["errors"]
    assert model.patches_seen == []


def test_forge_bad_values_behave_as_in_a1111(script, host, comfy_patcher):
    for values, message in BAD_VALUES.values():
        model = ForgeModel(comfy_patcher)
        status, body = wd.api_txt2img(model, host.opts, [script], api_request(**values), forge=True)
        assert status == 500 and message in body["errors"] and model.patches_seen == []


@pytest.fixture
def forge_installed(monkeypatch):
    """Forge, reForge and Forge Classic ship the package ``modules_forge`` (A1111 does not)."""
    module = types.ModuleType("modules_forge")
    module.__spec__ = importlib.machinery.ModuleSpec("modules_forge", None, is_package=True)
    monkeypatch.setitem(sys.modules, "modules_forge", module)


def test_merge_mlp_is_not_offered_on_forge(script_module, host, gr, forge_installed):
    s = script_module.ToMeScript()
    with gr.Blocks():
        controls = s.ui(False)
    merge_mlp = controls[[f.name for f in wd_fields()].index("merge_mlp")]
    assert merge_mlp.visible is False and merge_mlp.interactive is False and merge_mlp.value is False


def test_merge_mlp_is_offered_on_a1111(script):
    merge_mlp = script.controls[[f.name for f in wd_fields()].index("merge_mlp")]
    assert merge_mlp.visible is not False and merge_mlp.interactive is not False


def wd_fields():
    from tome_webui.options import FIELDS

    return FIELDS
