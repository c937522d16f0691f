"""Every UI example in example_workflows/ against the node definitions of the running ComfyUI.

The template browser loads these files into the frontend as they are, so a renamed node, a widget value
in the wrong slot, a combo option ComfyUI dropped or a link between mismatched types would reach users
as a broken template. The definitions are the tests' real server's ``GET /object_info``: ComfyUI's own
node_info over ``nodes.NODE_CLASS_MAPPINGS`` (core, extras and this pack as ComfyUI loaded it), V1 and
V3 nodes alike, in the form the frontend builds widgets from. A workflow that needs a node class this
ComfyUI lacks (the 2024 one has no Flux or Wan nodes, 0.3.75 no LTX-2 nodes) is skipped, naming it.

Widget rules are the frontend's (checked by loading each example into the 0.3.75 and 2026-08 frontends
in headless chromium and re-serialising it): ``widgets_values`` holds the widget inputs, required then
optional, in ``input_order``; a control value follows an INT input with ``control_after_generate``
(before that flag existed, ``seed`` and ``noise_seed``); a dynamic combo's chosen option adds its own
widgets right after it; trailing optional widgets may be absent (the frontend gives them their default,
e.g. 2026's CreateVideo.bit_depth and SaveVideo's hidden codec).
"""
from __future__ import annotations

import io
import json
import urllib.parse
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple

import pytest
from PIL import Image

from comfy_env import PACKAGE_NAME

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows"
NAMES = sorted(path.stem for path in EXAMPLES.glob("*.json"))
OUR_NODES = ("TomeCoreToMe", "TomeCoreToMeAdvanced")
WANVIDEO_NODE = "TomeCoreToMeWanVideo"  # its example needs ComfyUI-WanVideoWrapper's nodes too
WIDGET_TYPES = {"INT", "FLOAT", "STRING", "BOOLEAN", "COMBO", "COMFY_DYNAMICCOMBO_V3"}
CONTROL_VALUES = {"fixed", "increment", "decrement", "randomize"}
# Combos that list the user's model files: none exist in the tests, so any file name is accepted there.
MODEL_FILE_INPUTS = {"ckpt_name", "unet_name", "clip_name", "clip_name1", "clip_name2", "clip_name3", "vae_name",
                     "lora_name", "text_encoder", "model_name", "control_net_name",
                     "model", "lora_0", "lora_1", "lora_2", "lora_3", "lora_4"}  # the WanVideoWrapper's loaders
MODEL_FILE_SUFFIXES = (".safetensors", ".sft", ".ckpt", ".pt", ".pth", ".bin", ".gguf")
FRONTEND_NODES = {"Note", "MarkdownNote"}  # drawn by the frontend alone: no server definition to check against
SAMPLING_NODES = {"KSampler", "KSamplerAdvanced", "SamplerCustom", "CFGGuider", "BasicGuider", "DualCFGGuider",
                  "WanVideoSampler"}


def load(name: str) -> dict:
    return json.loads((EXAMPLES / f"{name}.json").read_text(encoding="utf-8"))


@pytest.fixture(scope="module")
def object_info(comfy) -> Dict[str, dict]:
    """Every node definition of the running ComfyUI, as its frontend receives them."""
    return comfy.get_json("/object_info")


def options_of(spec: list) -> dict:
    return spec[1] if len(spec) > 1 and isinstance(spec[1], dict) else {}


def is_widget(spec: list) -> bool:
    """An input the frontend draws as a widget (a value in widgets_values), not as a link socket only."""
    options = options_of(spec)
    if options.get("forceInput"):
        return False
    return isinstance(spec[0], list) or spec[0] in WIDGET_TYPES or "widgetType" in options


def ordered_inputs(inputs: dict, order: Optional[dict] = None) -> List[Tuple[str, list, bool]]:
    """(name, spec, optional) of each required, then optional, input in the server's input_order."""
    rows = []
    for group in ("required", "optional"):
        specs = inputs.get(group) or {}
        for name in (order or {}).get(group, list(specs)):
            rows.append((name, specs[name], group == "optional"))
    return rows


def input_spec(node_def: dict, name: str) -> Optional[list]:
    for group in ("required", "optional"):
        spec = (node_def["input"].get(group) or {}).get(name)
        if spec is not None:
            return spec
    return None


def value_problem(name: str, spec: list, value: Any) -> Optional[str]:
    """Why ``value`` does not fit the widget ``spec`` of input ``name``, or None."""
    kind, options = spec[0], options_of(spec)
    kind = options.get("widgetType", kind)
    if isinstance(kind, list) or kind == "COMBO":
        choices = kind if isinstance(kind, list) else options.get("options", [])
        if name in MODEL_FILE_INPUTS or not choices:  # a file name, or an option the list has ("none")
            ok = isinstance(value, str) and (value.endswith(MODEL_FILE_SUFFIXES) or value in choices)
            return None if ok else f"{name} = {value!r} is not a model file name"
        return None if value in choices else f"{name} = {value!r} is not among its options {choices}"
    if kind == "COMFY_DYNAMICCOMBO_V3":
        keys = [option["key"] for option in options.get("options", [])]
        return None if value in keys else f"{name} = {value!r} is not among its options {keys}"
    if kind == "BOOLEAN":
        return None if isinstance(value, bool) else f"{name} = {value!r} is not a boolean"
    if kind == "STRING":
        return None if isinstance(value, str) else f"{name} = {value!r} is not a string"
    if kind in ("INT", "FLOAT"):
        types = (int,) if kind == "INT" else (int, float)
        if isinstance(value, bool) or not isinstance(value, types):
            return f"{name} = {value!r} is not an {kind}"
        if "min" in options and value < options["min"]:
            return f"{name} = {value!r} is below its minimum {options['min']}"
        if "max" in options and value > options["max"]:
            return f"{name} = {value!r} is above its maximum {options['max']}"
    return None


def widget_problems(node_def: dict, values: list) -> List[str]:
    """Line widgets_values up with the node's widget inputs, as the frontend does when it loads the node."""
    problems: List[str] = []
    position = 0

    def walk(rows: List[Tuple[str, list, bool]], prefix: str) -> None:
        nonlocal position
        for index, (name, spec, optional) in enumerate(rows):
            if not is_widget(spec):
                continue
            if position >= len(values):
                rest = [n for n, s, o in rows[index:] if is_widget(s) and not o]
                if rest:
                    problems.append(f"no value for the widget(s) {[prefix + n for n in rest]}")
                return
            value = values[position]
            position += 1
            problem = value_problem(prefix + name, spec, value)
            if problem:
                problems.append(problem)
            options = options_of(spec)
            control = options.get("control_after_generate", name in ("seed", "noise_seed") and spec[0] == "INT")
            if control:
                if position < len(values) and values[position] in CONTROL_VALUES:
                    position += 1
                else:
                    problems.append(f"{prefix}{name}: no control_after_generate value after it")
            if spec[0] == "COMFY_DYNAMICCOMBO_V3":
                chosen = [o for o in options.get("options", []) if o["key"] == value]
                if chosen:
                    walk(ordered_inputs(chosen[0]["inputs"]), f"{prefix}{name}.")

    walk(ordered_inputs(node_def["input"], node_def.get("input_order")), "")
    if position < len(values):
        problems.append(f"{len(values) - position} value(s) more than the widgets: {values[position:]}")
    return problems


def types_match(origin: str, target: Any) -> bool:
    if isinstance(target, list):  # a combo input fed by a link
        target = "COMBO"
    return "*" in (origin, target) or origin in str(target).split(",")


def graph_problems(workflow: dict, object_info: Dict[str, dict]) -> List[str]:
    """Everything in ``workflow`` that does not agree with the live node definitions."""
    problems: List[str] = []
    nodes = {node["id"]: node for node in workflow["nodes"]}
    for node in workflow["nodes"]:
        if node["type"] in FRONTEND_NODES:
            continue
        where = f"node {node['id']} {node['type']}"
        node_def = object_info[node["type"]]
        problems += [f"{where}: {p}" for p in widget_problems(node_def, node.get("widgets_values") or [])]
        linked = {entry["name"] for entry in node.get("inputs", []) if entry.get("link") is not None}
        for entry in node.get("inputs", []):
            # a widget's socket (newer frontends save one per widget) is named after it, "format.codec" for a
            # dynamic combo's child: its input is the part before the dot
            base = entry["name"].split(".")[0] if entry.get("widget") else entry["name"]
            if input_spec(node_def, base) is None:
                problems.append(f"{where}: input {entry['name']!r} does not exist")
        for name, spec, optional in ordered_inputs(node_def["input"], node_def.get("input_order")):
            if not optional and not is_widget(spec) and name not in linked:
                problems.append(f"{where}: required input {name!r} is not connected")
    for link_id, origin, origin_slot, target, target_slot, link_type in workflow["links"]:
        where = f"link {link_id} ({origin}:{origin_slot} -> {target}:{target_slot})"
        if origin not in nodes or target not in nodes:
            problems.append(f"{where}: a node is missing")
            continue
        outputs = object_info[nodes[origin]["type"]]["output"]
        if origin_slot >= len(outputs):
            problems.append(f"{where}: {nodes[origin]['type']} has no output {origin_slot}")
            continue
        origin_type = outputs[origin_slot]
        saved_outputs = nodes[origin].get("outputs") or []
        if origin_slot >= len(saved_outputs) or link_id not in (saved_outputs[origin_slot].get("links") or []):
            problems.append(f"{where}: not listed on its origin's output")
        inputs = nodes[target].get("inputs", [])
        if target_slot >= len(inputs) or inputs[target_slot].get("link") != link_id:
            problems.append(f"{where}: not the link of its target's input {target_slot}")
            continue
        spec = input_spec(object_info[nodes[target]["type"]], inputs[target_slot]["name"])
        if spec is None:
            continue  # reported above
        if not types_match(origin_type, spec[0]):
            problems.append(f"{where}: {origin_type} into {inputs[target_slot]['name']} ({spec[0]})")
        if link_type not in (origin_type, "*"):
            problems.append(f"{where}: recorded as {link_type}, the output is {origin_type}")
    return problems


def missing_classes(workflow: dict, object_info: Dict[str, dict]) -> List[str]:
    return sorted({node["type"] for node in workflow["nodes"]} - set(object_info) - FRONTEND_NODES)


@pytest.mark.parametrize("name", NAMES)
def test_example_matches_the_live_node_definitions(object_info, name):
    """Node classes, widget values and link types of the example as the running ComfyUI defines them."""
    workflow = load(name)
    assert set(OUR_NODES) <= set(object_info), "the server did not load this pack"
    missing = missing_classes(workflow, object_info)
    if missing:
        pytest.skip(f"{name}: this ComfyUI has no {', '.join(missing)}")
    assert graph_problems(workflow, object_info) == []


@pytest.mark.parametrize("name", NAMES)
def test_tome_patches_the_model_the_sampler_uses(name):
    """One ToMe node, fed a model and feeding the sampler; the DiT examples use the basic node at the model's default
    (ratio -1: the node picks the family's mode, ratio and block range itself), the WanVideoWrapper's its own node in
    mode merge at Wan's default, every other input at its default (tests/test_templates.py: the SD1.5 ones)."""
    workflow = load(name)
    nodes = {node["id"]: node for node in workflow["nodes"]}
    (tome,) = [node for node in workflow["nodes"] if node["type"] in OUR_NODES + (WANVIDEO_NODE,)]
    assert tome["mode"] == 0 and tome["inputs"][0]["name"] == "model" and tome["inputs"][0]["link"] is not None
    fed = [row[3] for row in workflow["links"] if row[1] == tome["id"]]
    assert fed and all(nodes[target]["type"] in SAMPLING_NODES for target in fed), fed
    if name.startswith("ToMe_WanVideoWrapper"):
        assert tome["type"] == WANVIDEO_NODE
        assert tome["widgets_values"] == [-1.0, "merge", 2, 2, True, 0, 0.0, 1.0, -1.0, 1.0, "auto"]
        assert not [node for node in workflow["nodes"] if node["type"] == "WanVideoEnhanceAVideo"]  # merge refuses FETA
    elif not name.startswith("ToMe_SD15"):
        assert tome["type"] == "TomeCoreToMe" and tome["widgets_values"] == [-1.0, 1]


@pytest.mark.parametrize("name", NAMES)
def test_each_example_has_a_thumbnail(name):
    """The template browser shows <name>.jpg (the frontend asks custom-node packs for .jpg only)."""
    path = EXAMPLES / f"{name}.jpg"
    assert path.is_file(), f"{path.name} is missing"
    with Image.open(path) as image:
        assert image.format == "JPEG" and min(image.size) >= 64, (image.format, image.size)


@pytest.mark.parametrize("name", NAMES)
def test_the_server_serves_the_thumbnail_the_template_browser_asks_for(comfy, name):
    """The URL of the frontend's getTemplateThumbnailUrl for a custom-node template."""
    status, _ = comfy.request("GET", "/workflow_templates")
    if status != 200:
        pytest.skip("this ComfyUI has no /workflow_templates route (added in 2025)")
    path = f"/api/workflow_templates/{urllib.parse.quote(PACKAGE_NAME)}/{name}.jpg"
    status, raw = comfy.request("GET", path)
    assert status == 200, path
    assert Image.open(io.BytesIO(raw)).format == "JPEG"


def test_the_checker_finds_each_kind_of_fault(object_info):
    """The checks above are not vacuous: each broken copy of the basic SD1.5 example is reported."""
    good = load("ToMe_SD15_basic")
    assert graph_problems(good, object_info) == []

    def broken(change) -> List[str]:
        workflow = json.loads(json.dumps(good))
        change({node["type"]: node for node in workflow["nodes"]}, workflow)
        return graph_problems(workflow, object_info)

    def set_widgets(node_type, values):
        return lambda nodes, _: nodes[node_type].update(widgets_values=values)

    cases = {
        "no control_after_generate": set_widgets("KSampler", [1234, 20, 7.0, "euler", "normal", 1.0]),
        "not among its options": set_widgets("KSampler", [1234, "fixed", 20, 7.0, "no_such_sampler", "normal", 1.0]),
        "above its maximum": set_widgets("TomeCoreToMe", [0.9, 1]),
        "is not an INT": set_widgets("EmptyLatentImage", [512.5, 512, 1]),
        "more than the widgets": set_widgets("SaveImage", ["ToMe", "extra"]),
        "no value for the widget": set_widgets("EmptyLatentImage", [512]),
        "not a model file name": set_widgets("CheckpointLoaderSimple", [3]),
        "recorded as": lambda _, w: w["links"][0].__setitem__(5, "CLIP"),
        "CLIP into model": lambda _, w: w["links"][0].__setitem__(2, 1),
        "required input 'vae' is not connected": lambda nodes, _: nodes["VAEDecode"]["inputs"][1].update(link=None),
        "input 'latent' does not exist": lambda nodes, _: nodes["VAEDecode"]["inputs"][0].update(name="latent"),
    }
    for expected, change in cases.items():
        problems = broken(change)
        assert any(expected in problem for problem in problems), (expected, problems)
