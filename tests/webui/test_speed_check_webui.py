"""The speed check in the WebUI: its verdicts in the infotext ("ToMe levels"), written after each batch
(Script.postprocess_batch) so every image's infotext has them, on the A1111 path (ldm UNet, hooks) and the
Forge path (a real ComfyUI ModelPatcher). Timings are forced (``speed_check.measure_speedup`` replaced),
so no test decides anything by the clock."""
from __future__ import annotations

import pytest
import torch

import webui_doubles as wd
from test_forge_path import build_comfy_sd15_patcher, forge_run
from tome_core.engine import speed_check
from tome_webui.options import LEVELS_KEY
from webui_helpers import make_p, script_args


@pytest.fixture(autouse=True)
def forced_timings(monkeypatch):
    """Level 1 of the 128 px images (16x16 tokens) measures 0.86x, anything else 1.4x."""
    calls = []

    def timer(config, shape, device, dtype, run=None):
        calls.append(shape)
        return 0.86 if shape.grid == (16, 16) else 1.4

    speed_check.forget_verdicts()
    monkeypatch.setattr(speed_check, "measure_speedup", timer)
    yield calls
    speed_check.forget_verdicts()


def levels_of(info: str) -> str:
    return wd.parse_generation_parameters(info).get(LEVELS_KEY, "")


def test_a1111_leaves_a_slower_level_whole_and_says_so_in_the_infotext(script, host, sd_model, reference,
                                                                        forced_timings):
    plain = wd.txt2img(make_p(reference, host, None, []))
    out = wd.txt2img(make_p(sd_model, host, script, script_args(speed_check="on")))
    assert torch.equal(out.images[0], plain.images[0])  # level 1 left whole: the image is the plain one
    text = levels_of(out.info)
    assert "level 1 (16x16 tokens, 5 blocks) at 128x128 px: left whole: the model call with merging measured 0.86x on cpu" in text
    assert [shape.grid for shape in forced_timings] == [(16, 16)]
    assert out.infotexts and all(LEVELS_KEY in wd.parse_generation_parameters(t) for t in out.infotexts)


def test_a1111_hires_pass_verdicts_join_the_first_pass(script, host, sd_model):
    out = wd.txt2img(make_p(sd_model, host, script, script_args(speed_check="on", hr_ratio=0.5), enable_hr=True,
                            steps=2))
    text = levels_of(out.info)
    assert "at 128x128 px: left whole" in text and "at 256x256 px: reduced: the model call with merging measured 1.40x" in text


def test_auto_on_the_cpu_is_not_timed_and_the_infotext_says_so(script, host, sd_model, reference, forced_timings):
    plain = wd.txt2img(make_p(reference, host, None, []))
    out = wd.txt2img(make_p(sd_model, host, script, script_args()))  # the WebUI's default: speed_check auto
    assert forced_timings == [] and not torch.equal(out.images[0], plain.images[0])
    assert "ToMe speed check: auto" in out.info
    assert "level 1 (16x16 tokens, 5 blocks) at 128x128 px: reduced (not timed on cpu)" in levels_of(out.info)


def test_off_writes_no_levels(script, host, sd_model):
    out = wd.txt2img(make_p(sd_model, host, script, script_args(speed_check="off")))
    assert LEVELS_KEY not in wd.parse_generation_parameters(out.info)


def test_forge_leaves_a_slower_level_whole_and_says_so_in_the_infotext(script, host, forced_timings):
    patcher = build_comfy_sd15_patcher()
    plain, _ = forge_run(host, None, patcher, [])
    out, model = forge_run(host, script, patcher, script_args(speed_check="on"))
    assert model.patches_seen and set(model.patches_seen) == {1}
    assert torch.equal(out.images[0], plain.images[0])
    assert "level 1 (16x16 tokens, 5 blocks) at 128x128 px: left whole: " in levels_of(out.info)
    # timed: the model call, repeated through ToMe's model_function_wrapper (Forge has no model wrappers)
    assert "left whole: the model call with merging measured 0.86x on cpu" in levels_of(out.info)
