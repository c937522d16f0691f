"""A headless client against the tests' real ComfyUI server (its main.py, on 127.0.0.1).

POST /prompt with a bad ToMe value answers HTTP 400 with ``node_errors`` before anything runs; a
good example workflow is queued, run by ComfyUI's own prompt worker, and its image is fetched back
through /history and /view. The frontend files and node definitions the browser would load are
served too.
"""
from __future__ import annotations

import io
import json
import urllib.parse
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows" / "api"


def small(prompt: dict, checkpoint: str) -> dict:
    prompt = json.loads(json.dumps(prompt))
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = checkpoint
        if node["class_type"] == "EmptyLatentImage":
            inputs.update(width=64, height=64)
        if node["class_type"] == "KSampler":
            inputs["steps"] = 1
        if node["class_type"] == "TomeCoreToMeAdvanced":
            inputs["min_tokens"] = 0
    return prompt


@pytest.fixture(scope="module")
def http(comfy, checkpoint):
    """What a headless client sees: node definitions, extensions, a refused and an accepted prompt."""
    results = {"object_info": comfy.object_info("TomeCoreToMeAdvanced"), "extensions": comfy.get_json("/extensions")}
    status, raw = comfy.request("GET", "/workflow_templates")  # ComfyUI 0.3.x: the template browser's list
    results["templates"] = json.loads(raw) if status == 200 else None
    results["script_status"], script = comfy.request("GET", "/extensions/tome-diffusion/tome.js")
    results["script"] = script.decode()

    bad = small(json.loads((EXAMPLES / "ToMe_SD15_basic.api.json").read_text()), checkpoint)
    bad["10"]["inputs"]["ratio"] = 0.95
    results["bad_status"], raw = comfy.request("POST", "/prompt", {"prompt": bad})
    results["bad_body"] = json.loads(raw)
    results["queued_after_bad"] = comfy.get_json("/prompt")["exec_info"]["queue_remaining"]

    good = small(json.loads((EXAMPLES / "ToMe_SD15_advanced.api.json").read_text()), checkpoint)
    results["good_status"], raw = comfy.request("POST", "/prompt", {"prompt": good, "client_id": "headless"})
    prompt_id = json.loads(raw)["prompt_id"]
    results["executed"] = comfy.wait(prompt_id).success
    history = comfy.get_json(f"/history/{prompt_id}")
    image = history[prompt_id]["outputs"]["7"]["images"][0]
    query = urllib.parse.urlencode({"filename": image["filename"], "subfolder": image["subfolder"],
                                    "type": image["type"]})
    results["view_status"], results["png"] = comfy.request("GET", f"/view?{query}")
    results["tome_ui"] = history[prompt_id]["outputs"]["10"]["tome"][0]
    return results


def test_bad_value_is_an_http_400_with_node_errors_before_anything_runs(http):
    assert http["bad_status"] == 400
    errors = http["bad_body"]["node_errors"]["10"]
    assert errors["class_type"] == "TomeCoreToMe"
    assert any("ratio" in f"{e['message']} {e['details']}" for e in errors["errors"])
    assert http["queued_after_bad"] == 0


def test_example_workflow_runs_headless_through_post_prompt(http):
    assert http["good_status"] == 200 and http["executed"] is True
    assert http["view_status"] == 200
    image = np.asarray(Image.open(io.BytesIO(http["png"])).convert("RGB"))
    assert image.shape == (64, 64, 3) and image.std() > 1.0
    assert http["tome_ui"]["ratio"] == 0.6 and http["tome_ui"]["base_downsample"] == 1


def test_the_browser_gets_tooltips_and_the_extension(http):
    node = http["object_info"]
    assert node["display_name"] == "ToMe (advanced)" and node["category"] == "model_patches/unet"
    assert all(spec[1].get("tooltip") for spec in node["input"]["required"].values())
    assert "/extensions/tome-diffusion/tome.js" in http["extensions"]
    assert http["script_status"] == 200 and "registerExtension" in http["script"]


def test_the_template_browser_lists_the_ui_examples(http):
    if http["templates"] is None:
        pytest.skip("this ComfyUI has no /workflow_templates route (added in 2025)")
    assert sorted(http["templates"]["tome-diffusion"]) == [
        "ToMe_Flux1_dev", "ToMe_LTX2_t2v", "ToMe_Qwen_Image", "ToMe_SD15_advanced", "ToMe_SD15_basic",
        "ToMe_SD15_compare", "ToMe_Wan22_5B_t2v", "ToMe_WanVideoWrapper_T2V", "ToMe_Z_Image_Turbo"]
