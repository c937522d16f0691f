"""One wrong input is one red input: where ComfyUI's real server reports a bad ToMe value.

ComfyUI reports a failed node validation function on every input the function declares, and skips
its own range and dropdown checks for those inputs. So the advanced node declares only ``mode`` (the
one check ComfyUI 0.3.75 does not do for a V3 dropdown); ComfyUI checks every range on that input
alone; the rules across inputs are refused when the node runs, before any sampling, with a message
naming exactly their inputs. Same outcome on the 2024 ComfyUI (V1 registration) and 0.3.75 (V3).
"""
from __future__ import annotations

import json

import pytest

import comfy_env
from comfy_env import PromptInvalid, advanced, api_prompt


def saved_advanced_example(**changes) -> dict:
    """example_workflows/api/ToMe_SD15_advanced.api.json made CPU-sized, with ToMe's ``changes``."""
    prompt = json.loads((comfy_env.REPO / "example_workflows" / "api" / "ToMe_SD15_advanced.api.json").read_text())
    prompt["1"]["inputs"]["ckpt_name"] = comfy_env.CHECKPOINT_NAME
    prompt["4"]["inputs"].update(width=64, height=64)
    prompt["5"]["inputs"]["steps"] = 1
    prompt["10"]["inputs"].update(changes, min_tokens=0)
    return prompt


def rejected_inputs(comfy, prompt: dict) -> tuple:
    """The inputs POST /prompt's node_errors name (all on the ToMe node "10"), and the errors."""
    with pytest.raises(PromptInvalid) as caught:
        comfy.validate(prompt)
    node_errors = caught.value.node_errors
    assert list(node_errors) == ["10"], node_errors
    errors = node_errors["10"]["errors"]
    return {error["extra_info"]["input_name"] for error in errors}, errors


def test_an_invalid_mode_is_reported_on_mode_alone(comfy, checkpoint):
    names, errors = rejected_inputs(comfy, saved_advanced_example(mode="average"))
    assert names == {"mode"}, errors
    text = " ".join(f"{e['message']} {e['details']}" for e in errors)
    assert "average" in text and "merge" in text and "kv" in text, text


def test_an_invalid_mode_beside_values_that_break_other_rules_reports_only_what_is_checked_per_input(comfy, checkpoint):
    """The cross-input rules are not evaluated at validation, so an invalid mode beside a ratio too high
    for its cells and a reversed window gives mode's error alone, and nothing crashes."""
    names, errors = rejected_inputs(comfy, api_prompt(advanced(mode="average", ratio=0.9, sx=1, sy=1,
                                                               start_percent=0.9, end_percent=0.1)))
    assert names == {"mode"}, errors


@pytest.mark.parametrize("changes, expected", [
    (dict(ratio=0.99), {"ratio"}), (dict(sx=0), {"sx"}), (dict(sy=9), {"sy"}), (dict(start_percent=1.5), {"start_percent"}),
    (dict(end_percent=-0.1), {"end_percent"}), (dict(max_downsample=16), {"max_downsample"}),
    (dict(ratio=0.99, sx=9), {"ratio", "sx"}),
], ids=["ratio", "sx", "sy", "start", "end", "max_downsample", "two-ranges"])
def test_ranges_are_reported_by_comfyui_on_each_input_at_fault(comfy, checkpoint, changes, expected):
    names, errors = rejected_inputs(comfy, api_prompt(advanced(**changes)))
    assert names == expected, errors
    assert all(e["type"] in ("value_bigger_than_max", "value_smaller_than_min") for e in errors), errors


@pytest.mark.parametrize("changes, named", [
    (dict(ratio=0.9), ("ratio", "sx=2", "sy=2")),
    (dict(ratio=0.5, sx=1, sy=1), ("ratio", "sx=1", "sy=1")),
    (dict(start_percent=0.8, end_percent=0.2), ("start_percent", "end_percent")),
    (dict(mode="kv", merge_crossattn=True), ("mode", "merge_crossattn")),
    (dict(max_downsample=3), ("max_downsample",)),
], ids=["ratio-vs-cell", "cell-1x1", "window", "kv-cross", "downsample-3"])
def test_rules_across_inputs_are_refused_before_sampling_naming_their_inputs(comfy, checkpoint, changes, named):
    """Accepted by POST /prompt (no input is wrong on its own), then the ToMe node fails when it runs:
    the prompt's execution error is the node's (so the KSampler it feeds never ran) and names the
    rule's inputs."""
    result = comfy.run(saved_advanced_example(**changes))
    assert not result.success and not result.images
    error = result.error_message()
    assert error["node_id"] == "10" and error["node_type"] == "TomeCoreToMeAdvanced", error
    message = error["exception_message"]
    assert message.startswith("ToMe:") and all(name in message for name in named), message


def test_an_unknown_kv_downsample_is_refused_on_that_input(comfy, checkpoint):
    """ComfyUI checks no V3 dropdown (0.3.75) and no optional input (2024): the node refuses it when it
    runs, naming it. A ComfyUI that checks it at POST /prompt must report it on kv_downsample alone."""
    prompt = saved_advanced_example(mode="kv", kv_downsample="max")
    try:
        result = comfy.run(prompt)
    except PromptInvalid as refused:
        names = {e["extra_info"]["input_name"] for e in refused.node_errors["10"]["errors"]}
        assert names == {"kv_downsample"}, refused.node_errors
        return
    assert not result.success and not result.images
    error = result.error_message()
    assert error["node_id"] == "10" and "kv_downsample" in error["exception_message"], error


def test_the_saved_example_itself_is_valid_and_runs(comfy, checkpoint):
    result = comfy.run(saved_advanced_example())
    assert result.success and len(result.images) == 1, result.error_message()
