"""example_workflows/ToMe_SD15_compare: one seed rendered plain and with ToMe side by side, from core nodes.

The example promises that its two images differ by ToMe alone: two KSamplers with the same seed, settings,
prompts and latent, one fed the checkpoint's model, the other the ToMe node's. Checked in the graph, and on
the tests' real ComfyUI server with its API graph made CPU-sized (64 px, 2 steps, the tiny checkpoint): at
ratio 0.5 the two images differ, at ratio 0 they are equal, and the plain one is the same in both runs.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from comfy_env import pixels

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows"
NAME = "ToMe_SD15_compare"


def test_the_two_samplers_differ_by_their_model_only():
    workflow = json.loads((EXAMPLES / f"{NAME}.json").read_text(encoding="utf-8"))
    nodes = {node["id"]: node for node in workflow["nodes"]}
    origin = {link[0]: nodes[link[1]]["type"] for link in workflow["links"]}
    source = {link[0]: (link[1], link[2]) for link in workflow["links"]}
    samplers = [node for node in workflow["nodes"] if node["type"] == "KSampler"]
    assert len(samplers) == 2 and samplers[0]["widgets_values"] == samplers[1]["widgets_values"]
    inputs = [{i["name"]: i["link"] for i in sampler["inputs"]} for sampler in samplers]
    for name in ("positive", "negative", "latent_image"):
        assert source[inputs[0][name]] == source[inputs[1][name]], name
    assert sorted(origin[i["model"]] for i in inputs) == ["CheckpointLoaderSimple", "TomeCoreToMe"]
    saved = [node for node in workflow["nodes"] if node["type"] == "SaveImage"]
    assert len(saved) == 2 and saved[0]["widgets_values"] != saved[1]["widgets_values"]


def _small(checkpoint: str, ratio: float) -> dict:
    prompt = json.loads((EXAMPLES / "api" / f"{NAME}.api.json").read_text(encoding="utf-8"))
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = checkpoint
        if node["class_type"] == "EmptyLatentImage":
            inputs.update(width=64, height=64)
        if node["class_type"] == "KSampler":
            inputs["steps"] = 2
        if node["class_type"] == "TomeCoreToMe":
            inputs["ratio"] = ratio
    return prompt


def _images(comfy, prompt: dict) -> dict:
    """{SaveImage title: pixels} of one fresh run."""
    result = comfy.run_fresh(prompt)
    assert result.success, result.error_message()
    found = {}
    for node_id, output in result.outputs.items():
        if prompt[node_id]["class_type"] != "SaveImage":
            continue  # the ToMe node's own UI output (its token counts)
        (image,) = output["images"]
        found[prompt[node_id]["_meta"]["title"]] = pixels(
            comfy.workdir / "output" / image.get("subfolder", "") / image["filename"])
    return found


def test_the_example_renders_plain_and_tome_from_one_seed(comfy, checkpoint):
    on = _images(comfy, _small(checkpoint, 0.5))
    off = _images(comfy, _small(checkpoint, 0.0))
    assert set(on) == set(off) == {"Plain", "ToMe r=0.5"}
    assert on["Plain"].shape == on["ToMe r=0.5"].shape == (64, 64, 3) and on["Plain"].std() > 1.0
    assert not np.array_equal(on["Plain"], on["ToMe r=0.5"])
    assert np.array_equal(off["Plain"], off["ToMe r=0.5"])  # ratio 0: nothing but ToMe told them apart
    assert np.array_equal(on["Plain"], off["Plain"])
