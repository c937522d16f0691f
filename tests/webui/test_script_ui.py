"""Loading scripts/tome.py the WebUI's way, its gradio 3.41 UI, settings, infotext + paste-back and
the XYZ axes. WebUI modules are the doubles in webui_doubles.py (see its docstring)."""
from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
import types

import pytest

import webui_doubles as wd
from tome_webui import settings as tome_settings
from tome_webui.options import FIELDS, INFOTEXT_KEYS
from webui_helpers import REPO, SCRIPT_PATH, make_p, script_args


def test_the_script_registers_as_an_always_visible_script(script_module, host):
    [data] = host.scripts.scripts_data
    assert data.script_class is script_module.ToMeScript and data.path == SCRIPT_PATH
    assert data.module.__name__ == "tome.py"  # the WebUI names a script module by its file name
    s = script_module.ToMeScript()
    assert s.title() == "ToMe" and s.show(False) is host.scripts.AlwaysVisible
    assert len(host.callbacks.ui_settings) == 1 and len(host.callbacks.before_ui) == 1


def test_imports_need_the_extension_folder_only_while_the_script_is_imported(gr):
    """In a fresh interpreter without the repo on sys.path: load the script, restore sys.path, then
    run a generation's callbacks; a lazy import of tome_core/tome_webui would fail there."""
    code = textwrap.dedent(f"""
        import sys, types
        sys.path = [p for p in sys.path if p not in ("", {REPO!r})] + [{os.path.dirname(__file__)!r}]
        import pytest, gradio as gr, webui_doubles as wd
        mp = pytest.MonkeyPatch()
        host = wd.install(mp, gr)
        before = list(sys.path)
        module = wd.load_script_file({SCRIPT_PATH!r}, host.scripts.scripts_data)
        assert sys.path == before and {REPO!r} not in sys.path
        s = module.ToMeScript()
        with gr.Blocks():
            controls = s.ui(False)
        host.callbacks.ui_settings[0]()
        host.callbacks.before_ui[0]()
        p = types.SimpleNamespace(sd_model=None, extra_generation_params={{}}, enable_hr=False,
                                  get_token_merging_ratio=lambda for_hr=False: 0)
        s.process(p, *[c.value for c in controls])  # disabled by default: returns without patching
        s.process_before_every_sampling(p)
        s.postprocess(p, None)
        print("OK")
    """)
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.stdout.strip().endswith("OK"), result.stderr[-3000:]


def test_ui_controls_follow_the_documented_api_argument_order(script):
    labels = [c.label for c in script.controls]
    assert labels[:4] == ["ToMe (token merging)", "Ratio", "Hires ratio", "Max downsample"]
    assert len(script.controls) == len(FIELDS) == 19
    values = [c.value for c in script.controls]
    assert values == [False, -1.0, 0.5, "1", 2, 2, True, 0, "default", True, False, False, 0.0, 1.0, 0, "nearest",
                      "level", "auto", 1]
    doc = open(os.path.join(REPO, "docs", "WEBUI.md"), encoding="utf-8").read()
    documented = re.findall(r"^\| (\d+) \| `(\w+)` \|", doc, flags=re.M)
    assert [(int(i), name) for i, name in documented] == [(i, f.name) for i, f in enumerate(FIELDS)]


def test_the_accordion_header_checkbox_is_the_enable_control(script, host):
    enabled = script.controls[0]
    assert isinstance(enabled, host.ui_components.InputAccordion(False).__class__)
    assert enabled.accordion.label == "ToMe (token merging)"


def test_img2img_hides_the_hires_ratio_but_keeps_the_argument_order(script_module, gr):
    s = script_module.ToMeScript()
    s.is_img2img = True
    with gr.Blocks():
        controls = s.ui(True)
    assert len(controls) == len(FIELDS) and controls[2].visible is False
    assert controls[1].elem_id == "script_img2img_tome_ratio"


def test_without_input_accordion_a_plain_enable_checkbox_is_used(script_module, gr, monkeypatch):
    monkeypatch.setitem(sys.modules, "modules.ui_components", types.ModuleType("modules.ui_components"))
    s = script_module.ToMeScript()
    with gr.Blocks():
        controls = s.ui(False)
    assert type(controls[0]) is gr.Checkbox and controls[0].label == "Enable ToMe"


def test_settings_section_holds_the_defaults_the_controls_start_with(script_module, host, gr):
    host.callbacks.ui_settings[0]()
    infos = host.opts.data_labels
    assert set(infos) == {key for key, _, _ in tome_settings.OPTIONS}
    assert {info.section for info in infos.values()} == {("tome", "ToMe")}
    host.opts.tome_default_enabled = True
    host.opts.tome_default_ratio = 0.3
    host.opts.tome_default_hr_ratio = 0.2
    host.opts.tome_default_max_downsample = "2"
    s = script_module.ToMeScript()
    with gr.Blocks():
        controls = s.ui(False)
    assert [c.value for c in controls[:4]] == [True, 0.3, 0.2, "2"]


def test_infotext_holds_every_option_and_pasting_it_restores_the_controls(script, host, sd_model):
    args = script_args(ratio=0.4, hr_ratio=0.3, max_downsample="2", sx=3, sy=1, use_rand=False, seed=7,
                       merge_crossattn=True, start_percent=0.1, end_percent=0.9, min_tokens=64,
                       kv_downsample="avg", match_every=2)
    processed = wd.txt2img(make_p(sd_model, host, script, args, enable_hr=True, steps=1))
    assert "ToMe ratio: 0.4, ToMe hr ratio: 0.3, ToMe max downsample: 2, ToMe sx: 3, ToMe sy: 1" in processed.info
    params = wd.parse_generation_parameters(processed.info)
    assert set(INFOTEXT_KEYS) <= set(params)

    pasted = wd.paste(script.infotext_fields, params)
    by_control = {id(control): value for (control, _), value in zip(script.infotext_fields, pasted)}
    restored = [by_control[id(c)] for c in script.controls]
    assert restored == [True, 0.4, 0.3, "2", 3.0, 1.0, False, 7.0, "merge", True, True, False, 0.1, 0.9, 64.0,
                        "avg", "level", "auto", 2.0]
    assert script.paste_field_names == list(INFOTEXT_KEYS)


def test_pasting_an_infotext_without_tome_turns_the_accordion_off(script):
    params = wd.parse_generation_parameters("a cat\nSteps: 20, Sampler: Euler a, Seed: 1, Size: 512x512")
    pasted = wd.paste(script.infotext_fields, params)
    assert pasted[0] is False and pasted[1:] == [None] * (len(pasted) - 1)


def make_xyz_module():
    """Stands in for the built-in scripts/xyz_grid.py (loaded by the WebUI as module "xyz_grid.py")."""
    xyz = types.ModuleType("xyz_grid.py")

    class AxisOption:
        def __init__(self, label, type, apply, format_value=None, confirm=None, cost=0.0, choices=None,
                     prepare=None):
            self.label, self.type, self.apply, self.confirm, self.choices = label, type, apply, confirm, choices

    class AxisOptionImg2Img(AxisOption):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            self.is_img2img = True

    class Script(wd.Script):
        def ui(self, is_img2img):
            """xyz_grid.py ``Script.ui``: the axes of this tab, fixed now, and the X/Y/Z type dropdowns'
            choices, which ``ScriptRunner.create_script_ui_inner`` copies into ``api_info``."""
            self.current_axis_options = [x for x in xyz.axis_options
                                         if type(x) == AxisOption or x.is_img2img == is_img2img]
            labels = [x.label for x in self.current_axis_options]
            self.api_info = types.SimpleNamespace(
                args=[types.SimpleNamespace(label=f"{axis} type", choices=list(labels)) for axis in "XYZ"])
            return []

    Script.__module__ = "xyz_grid.py"
    xyz.AxisOption, xyz.AxisOptionImg2Img, xyz.Script = AxisOption, AxisOptionImg2Img, Script
    xyz.axis_options = [AxisOption("Nothing", str, lambda p, x, xs: None),
                        AxisOptionImg2Img("Image CFG Scale", float, lambda p, x, xs: None)]
    return xyz


def test_xyz_axes_set_ratio_and_max_downsample_per_cell(script, host, sd_model):
    xyz = make_xyz_module()
    host.scripts.scripts_data.append(wd.ScriptClassData(xyz.Script, "xyz_grid.py", "", xyz))
    host.callbacks.before_ui[0]()
    host.callbacks.before_ui[0]()  # a UI reload must not add the axes twice
    axes = {o.label: o for o in xyz.axis_options}
    assert [o.label for o in xyz.axis_options][2:] == ["[ToMe] Ratio", "[ToMe] Hires ratio",
                                                       "[ToMe] Max downsample"]
    assert axes["[ToMe] Max downsample"].choices() == ["1", "2", "4", "8"]
    with pytest.raises(ValueError, match="ratio must be in"):
        axes["[ToMe] Ratio"].confirm(None, [0.2, 1.5])

    p = make_p(sd_model, host, script, script_args(enabled=False, ratio=0.5), steps=1)
    cell = wd.copy_p(p)
    axes["[ToMe] Ratio"].apply(cell, 0.25, [0.25])
    axes["[ToMe] Max downsample"].apply(cell, int("2"), [2])
    info = wd.txt2img(cell).info
    assert "ToMe ratio: 0.25" in info and "ToMe max downsample: 2" in info
    assert not hasattr(p, "tome_overrides")
    assert "ToMe ratio" not in wd.txt2img(p).info


def test_xyz_axes_reach_an_xyz_script_whose_ui_was_built_before_on_before_ui(script, host, sd_model):
    """Started API-only (``--nowebui``), the WebUI builds the UI in ``Api.__init__`` (``ui.create_ui()``)
    before ``webui.api_only`` runs ``on_before_ui`` (A1111 1.8 c8a5322d; Forge dfdcbab's
    ``api_only_worker``): xyz_grid's ``Script.ui`` had already fixed the axes ``run`` resolves an index
    in, and ``/sdapi/v1/script-info`` did not list "[ToMe] Ratio" (seen in the real A1111 1.8.0-RC)."""
    xyz = make_xyz_module()
    host.scripts.scripts_data.append(wd.ScriptClassData(xyz.Script, "xyz_grid.py", "", xyz))
    built = {}
    for is_img2img in (False, True):  # scripts_txt2img / scripts_img2img, UI built
        built[is_img2img] = xyz.Script()
        built[is_img2img].is_img2img = is_img2img
        built[is_img2img].ui(is_img2img)
    host.scripts.scripts_txt2img = types.SimpleNamespace(scripts=[script, built[False]])
    host.scripts.scripts_img2img = types.SimpleNamespace(scripts=[built[True]])
    host.callbacks.before_ui[0]()

    tome_axes = ["[ToMe] Ratio", "[ToMe] Hires ratio", "[ToMe] Max downsample"]
    assert [o.label for o in built[False].current_axis_options] == ["Nothing", *tome_axes]
    assert [o.label for o in built[True].current_axis_options] == ["Nothing", "Image CFG Scale", *tome_axes]
    for s in built.values():
        labels = [o.label for o in s.current_axis_options]
        assert all(arg.choices == labels for arg in s.api_info.args)
    # An API client picks the axis by its index in the listed choices; run() resolves it the same way.
    index = built[False].api_info.args[0].choices.index("[ToMe] Ratio")
    p = make_p(sd_model, host, script, script_args(enabled=False), steps=1)
    cell = wd.copy_p(p)
    built[False].current_axis_options[index].apply(cell, 0.25, [0.25])
    assert "ToMe ratio: 0.25" in wd.txt2img(cell).info


def test_the_real_webui_tool_sends_the_args_in_the_scripts_order():
    """tests/webui/real_webui.py runs with the WebUI's Python and keeps its own copy of the order: the same."""
    real_webui = pytest.importorskip("real_webui")
    assert list(real_webui.ARG_ORDER) == [f.name for f in FIELDS]
    assert set(real_webui.ARG_DEFAULTS) == set(real_webui.ARG_ORDER)
