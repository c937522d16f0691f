"""The templates (example_workflows/*.json) show today's defaults, their thumbnails say what they run, and every model
file they load comes with a link to fetch it.

A template's ToMe ratio is "model default" (-1: the catalogue's per-family default, resolved by the node) unless the
template shows a trade on purpose, and then a note in the template says so. Thumbnails are drawn by
tools/template_thumbnails.py from the template and the catalogue and carry their words in the JPEG comment.
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tools"))
import template_thumbnails  # noqa: E402

EXAMPLES = REPO / "example_workflows"
NAMES = sorted(path.stem for path in EXAMPLES.glob("*.json"))
NOTES = {"Note", "MarkdownNote"}
# Loader widgets that name a model file, by loader (the WanVideoWrapper's loaders included).
MODEL_FILE_WIDGETS = {"CheckpointLoaderSimple": [0], "UNETLoader": [0], "CLIPLoader": [0], "DualCLIPLoader": [0, 1],
                      "VAELoader": [0], "LTXAVTextEncoderLoader": [0, 1], "LTXVAudioVAELoader": [0],
                      "WanVideoModelLoader": [0], "WanVideoVAELoader": [0], "LoadWanVideoT5TextEncoder": [0]}


def load(name: str) -> dict:
    return json.loads((EXAMPLES / f"{name}.json").read_text(encoding="utf-8"))


def test_every_template_has_its_thumbnail_spec():
    assert sorted(template_thumbnails.TEMPLATES) == NAMES


@pytest.mark.parametrize("name", NAMES)
def test_the_ratio_is_the_models_default_or_a_note_says_why_not(name):
    workflow = load(name)
    node = template_thumbnails.tome_node(workflow)
    ratio = node["widgets_values"][0]
    if ratio == template_thumbnails.MODEL_DEFAULT:
        return
    notes = " ".join(str(n["widgets_values"][0]) for n in workflow["nodes"] if n["type"] in NOTES)
    assert re.search(rf"ratio\s+{re.escape(f'{ratio:g}')}\b", notes) and "trade" in notes, (
        f"{name}: ratio {ratio} is not the model's default and no note in the template says why")
    assert "model default" in notes  # and how to get the default back


def test_a_ratio_other_than_the_default_without_a_note_is_caught(tmp_path, monkeypatch):
    workflow = load("ToMe_SD15_advanced")
    workflow["nodes"] = [n for n in workflow["nodes"] if n["type"] not in NOTES]
    (tmp_path / "ToMe_SD15_advanced.json").write_text(json.dumps(workflow))
    monkeypatch.setattr(sys.modules[__name__], "EXAMPLES", tmp_path)
    with pytest.raises(AssertionError, match="no note in the template says why"):
        test_the_ratio_is_the_models_default_or_a_note_says_why_not("ToMe_SD15_advanced")


def test_each_thumbnail_says_the_mode_and_ratio_its_template_runs():
    """The words in each .jpg are those the tool draws from the template and the catalogue today."""
    assert template_thumbnails.stale() == []
    words = {name: template_thumbnails.comment_of(EXAMPLES / f"{name}.jpg") for name in NAMES}
    assert words["ToMe_SD15_basic"].endswith("| merge 0.5 (model default)")  # SD1.5: tomesd's 0.5, mode merge
    assert words["ToMe_SD15_advanced"].endswith("| merge 0.6, 2 levels")
    from tome_core.catalogue.families import BY_NAME

    for name, family in (("ToMe_Flux1_dev", "flux"), ("ToMe_Qwen_Image", "qwen_image"),
                         ("ToMe_Z_Image_Turbo", "z_image"), ("ToMe_Wan22_5B_t2v", "wan"), ("ToMe_LTX2_t2v", "ltx2")):
        entry = BY_NAME[family]
        assert words[name].endswith(f"| {entry.default_mode} {entry.default_ratio:g} (model default)"), words[name]


def test_a_thumbnail_left_behind_by_a_changed_default_is_caught(monkeypatch):
    from tome_core.catalogue.families import BY_NAME

    flux = BY_NAME["flux"]
    monkeypatch.setattr(type(flux), "ratio_for", lambda self, mode: 0.3 if self is flux else 0.5)
    assert "ToMe_Flux1_dev" in template_thumbnails.stale()


@pytest.mark.parametrize("name", NAMES)
def test_every_model_file_a_template_loads_has_a_link(name):
    """The frontend's missing-models dialog offers a download for each file named in a loader's properties.models."""
    for node in load(name)["nodes"]:
        for index in MODEL_FILE_WIDGETS.get(node["type"], []):
            file_name = node["widgets_values"][index]
            links = {m["name"]: m for m in node.get("properties", {}).get("models", [])}
            assert file_name in links, f"{name}: {node['type']} loads {file_name} with no link"
            assert links[file_name]["url"].startswith("https://huggingface.co/"), links[file_name]
            assert links[file_name]["url"].split("?")[0].endswith("/" + file_name)
            assert links[file_name]["directory"]
