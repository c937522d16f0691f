"""tome's two registrations in a real ComfyUI server: V3 (``comfy_entrypoint``) where the host has
``comfy_api.latest`` (ComfyUI 0.3.x), V1 (``NODE_CLASS_MAPPINGS``) where it has not (the 2024 one).

Also: the saved example workflows load and run on either, the V3 node draws the same image as the
V1 node of the same code on the same ComfyUI, and /prompt's node_errors name the inputs at fault.
"""
from __future__ import annotations

import json
import textwrap

import numpy as np
import pytest

import comfy_env
from comfy_env import PromptInvalid, advanced, api_prompt, pixels, run_image

EXAMPLES = comfy_env.REPO / "example_workflows" / "api"


def host_has_v3() -> bool:
    return (comfy_env.find_comfyui() / "comfy_api" / "latest" / "__init__.py").is_file()



def small(prompt: dict, prefix: str) -> dict:
    """A saved workflow made CPU-sized: the tiny checkpoint, 64x64, 2 steps; ToMe's widgets untouched."""
    prompt = json.loads(json.dumps(prompt))
    for node in prompt.values():
        node.pop("_meta", None)
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = comfy_env.CHECKPOINT_NAME
        elif node["class_type"] == "EmptyLatentImage":
            inputs.update(width=64, height=64)
        elif node["class_type"] == "KSampler":
            inputs["steps"] = 2
        elif node["class_type"] == "SaveImage":
            inputs["filename_prefix"] = prefix
    return prompt


def saved_workflows():
    return sorted(EXAMPLES.glob("*.api.json"))


# -- which registration the host serves -----------------------------------------------------------

def test_object_info_serves_the_registration_of_this_host(comfy):
    basic, adv = comfy.object_info("TomeCoreToMe"), comfy.object_info("TomeCoreToMeAdvanced")
    mode, kv = adv["input"]["required"]["mode"], adv["input"]["optional"]["kv_downsample"]
    if host_has_v3():  # io.Combo.Input serializes as "COMBO" + options; a V1 list combo as the list itself
        assert mode[0] == "COMBO" and mode[1]["options"] == ["merge", "kv"]
        assert kv[0] == "COMBO" and kv[1]["options"] == ["nearest", "avg"]
    else:
        assert mode[0] == ["merge", "kv"] and kv[0] == ["nearest", "avg"]
    assert mode[1]["default"] == "merge" and kv[1]["default"] == "nearest"
    for info, name in ((basic, "ToMe"), (adv, "ToMe (advanced)")):
        assert info["display_name"] == name and info["category"] == "model_patches/unet"
        assert info["output"] == ["MODEL"]
        if host_has_v3():  # the 2024 /object_info has neither field
            assert info["output_tooltips"] == ["A copy of the model with ToMe applied."]
            assert info["description"].startswith("Token Merging")
        for kind, group in info["input"].items():
            for spec in group.values() if kind != "hidden" else ():  # hidden: the node's id, no widget
                assert spec[1].get("tooltip")
    assert list(basic["input"]["required"]) == ["model", "ratio", "max_downsample"]
    assert list(adv["input"]["required"]) == ["model", "ratio", "max_downsample", "sx", "sy", "use_rand",
                                              "tome_seed", "mode", "merge_crossattn", "start_percent",
                                              "end_percent", "min_tokens"]
    # optional: workflows saved before they existed still load
    assert list(adv["input"]["optional"]) == ["kv_downsample", "block_start", "block_end", "matching", "speed_check",
                                                   "match_every"]
    ratio = adv["input"]["required"]["ratio"][1]
    assert (ratio["default"], ratio["min"], ratio["max"], ratio["step"]) == (-1.0, -1.0, 0.98, 0.01)  # -1: the model's
    assert basic["input"]["required"]["ratio"][1]["max"] == 0.75
    seed = adv["input"]["required"]["tome_seed"][1]
    assert (seed["default"], seed["min"], seed["max"], seed["control_after_generate"]) == (0, 0, 0xFFFFFFFF, False)
    assert adv["input"]["required"]["start_percent"][1]["step"] == 0.001


def test_the_package_exports_exactly_one_registration_for_this_host(comfy):
    """The package as ComfyUI imports it, in this ComfyUI's own Python: ComfyUI 0.3.75's
    nodes.load_custom_node takes NODE_CLASS_MAPPINGS when present and then never calls
    comfy_entrypoint, so V3 is live only if NODE_CLASS_MAPPINGS is absent."""
    import subprocess
    import sys

    script = textwrap.dedent(f"""
        import importlib.util, json, sys
        sys.path.insert(0, {str(comfy_env.find_comfyui())!r})
        spec = importlib.util.spec_from_file_location("tome_pkg", {str(comfy_env.REPO / '__init__.py')!r},
                                                      submodule_search_locations=[{str(comfy_env.REPO)!r}])
        module = importlib.util.module_from_spec(spec); sys.modules["tome_pkg"] = module
        spec.loader.exec_module(module)
        print(json.dumps({{"v1": hasattr(module, "NODE_CLASS_MAPPINGS"), "v3": hasattr(module, "comfy_entrypoint")}}))
    """)
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    exports = json.loads(out.stdout.strip().splitlines()[-1])
    assert exports == ({"v1": False, "v3": True} if host_has_v3() else {"v1": True, "v3": False})


# -- saved workflows --------------------------------------------------------------------------------

@pytest.mark.parametrize("path", saved_workflows(), ids=lambda path: path.name)
def test_saved_workflow_loads_and_runs(comfy, checkpoint, path):
    prompt = small(json.loads(path.read_text()), f"saved_{path.stem}")
    result = comfy.run(prompt)
    assert result.success, result.error_message()
    assert result.images  # one image, or one per side of a comparison (ToMe_SD15_compare)
    for image in map(pixels, result.images):
        assert np.isfinite(image).all() and image.std() > 0


def test_saved_workflow_without_kv_downsample_still_runs(comfy, checkpoint):
    """Workflows saved before kv_downsample existed have no such input: it is optional."""
    prompt = api_prompt(advanced(mode="kv", ratio=0.5), prefix="no_kv_downsample")
    assert "kv_downsample" not in prompt["10"]["inputs"]
    with_default = api_prompt(advanced(mode="kv", ratio=0.5, kv_downsample="nearest"), prefix="kv_nearest")
    assert np.array_equal(run_image(comfy, prompt), run_image(comfy, with_default))


# -- V3 and V1 give the same image on one ComfyUI -------------------------------------------------

TWIN_IDS = {"TomeCoreToMe": "TomeTwinV1ToMe", "TomeCoreToMeAdvanced": "TomeTwinV1ToMeAdvanced"}


@pytest.fixture(scope="module")
def twin_server(comfy):
    """The tests' server, whose test-only node package (tome_test_nodes/v1_twin.py) also registers the
    repository's V1 classes (nodes/tome_nodes.py ToMe, ToMeAdvanced) under other ids, beside the V3
    nodes the repository itself serves there."""
    if not host_has_v3():
        pytest.skip("this ComfyUI has no comfy_api: only the V1 registration exists (tested above)")
    return comfy


@pytest.fixture(scope="module")
def plain_image(twin_server):
    return run_image(twin_server, api_prompt(None, prefix="plain"))


@pytest.mark.parametrize("tome", [
    {"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.5, "max_downsample": 1}},
    advanced(ratio=0.6, use_rand=False, start_percent=0.0, end_percent=0.8),
    advanced(mode="kv", ratio=0.75, kv_downsample="avg"),
], ids=["basic", "advanced-merge", "advanced-kv"])
def test_v3_node_draws_the_same_image_as_the_v1_node(twin_server, plain_image, tome):
    assert "COMBO" == twin_server.object_info("TomeCoreToMeAdvanced")["input"]["required"]["mode"][0]  # V3
    assert twin_server.object_info(TWIN_IDS["TomeCoreToMeAdvanced"])["input"]["required"]["mode"][0] == \
        ["merge", "kv"]  # V1
    v3 = run_image(twin_server, api_prompt(tome, prefix="v3"))
    v1 = run_image(twin_server, api_prompt(dict(tome, class_type=TWIN_IDS[tome["class_type"]]), prefix="v1"))
    assert np.array_equal(v3, v1) and not np.array_equal(v3, plain_image)


# -- errors on the input at fault -----------------------------------------------------------------

BASIC_CASES = [
    ({"ratio": 0.9, "max_downsample": 1}, {"ratio"}),
    ({"ratio": -1.5, "max_downsample": 1}, {"ratio"}),  # below -1 (the model's default); -0.1 is refused when it runs
    ({"ratio": 0.5, "max_downsample": 3}, {"max_downsample"}),
    ({"ratio": 0.5, "max_downsample": 9}, {"max_downsample"}),
]
# Every range is checked by ComfyUI on that input alone, mode by the node's validation (which declares
# mode only); the rules across inputs are refused when the node runs (test_comfy_validation.py).
ADVANCED_CASES = [
    (dict(tome_seed=-1), {"tome_seed"}),
    (dict(min_tokens=-64), {"min_tokens"}),
    (dict(sx=9), {"sx"}),
    (dict(ratio=0.99), {"ratio"}),
    (dict(mode="average"), {"mode"}),
]


def error_inputs(comfy, tome) -> tuple:
    with pytest.raises(PromptInvalid) as caught:
        comfy.validate(api_prompt(tome))
    node_errors = caught.value.node_errors
    assert list(node_errors) == ["10"], node_errors
    errors = node_errors["10"]["errors"]
    return {e["extra_info"]["input_name"] for e in errors}, errors


@pytest.mark.parametrize("inputs, expected", BASIC_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in case.items()) for case, _ in BASIC_CASES])
def test_basic_node_errors_name_only_the_input_at_fault(comfy, checkpoint, inputs, expected):
    names, errors = error_inputs(comfy, {"class_type": "TomeCoreToMe", "inputs": inputs})
    assert names == expected, errors


@pytest.mark.parametrize("changes, expected", ADVANCED_CASES,
                         ids=[",".join(f"{k}={v}" for k, v in case.items()) for case, _ in ADVANCED_CASES])
def test_advanced_node_errors_name_only_the_input_at_fault(comfy, checkpoint, changes, expected):
    names, errors = error_inputs(comfy, advanced(**changes))
    assert names == expected, errors
