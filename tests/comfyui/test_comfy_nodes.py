"""The node classes and tome_core.adapters.model_patcher.unet without ComfyUI (runs in any venv with torch).

The ModelPatcher here is a stand-in with the same duck-typed surface (clone, set_model_*_patch,
model.diffusion_model, model_sampling): the real one is exercised in test_comfy_workflow.py.
"""
from __future__ import annotations

import copy
import inspect
import json
import shutil
import subprocess
from pathlib import Path

import pytest
import torch

import tome_core
from tome_core import ToMeConfig, TokenMerger
from tome_core.adapters.model_patcher.unet import (
    SigmaWindow, UnsupportedModelError, make_patches, patch_model_patcher,
)

REPO = Path(__file__).resolve().parents[2]


class BasicTransformerBlock(torch.nn.Module):  # named like the block of every SD UNet implementation
    def __init__(self):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)


class Downsample(torch.nn.Module):
    pass


class StandInUNet(torch.nn.Module):
    """input_blocks/middle_block like ComfyUI's openaimodel; sdxl=True puts no attention at 1x."""

    def __init__(self, sdxl: bool = False):
        super().__init__()
        first = torch.nn.Sequential(torch.nn.Identity()) if sdxl else torch.nn.Sequential(BasicTransformerBlock())
        self.input_blocks = torch.nn.ModuleList([first, torch.nn.Sequential(Downsample()),
                                                 torch.nn.Sequential(BasicTransformerBlock())])
        self.middle_block = torch.nn.Sequential(BasicTransformerBlock())


class Sampling:
    def percent_to_sigma(self, percent):  # ComfyUI's convention: 0 -> huge, 1 -> 0
        return 1e9 if percent <= 0 else (0.0 if percent >= 1 else 10.0 * (1 - percent))


class BaseModel(torch.nn.Module):
    def __init__(self, unet):
        super().__init__()
        self.diffusion_model = unet
        self.model_sampling = Sampling()


class StandInPatcher:
    """The ModelPatcher surface tome uses, with ComfyUI's storage layout for patches."""

    def __init__(self, model):
        self.model = model
        self.model_options = {"transformer_options": {}}
        self.clones = 0

    def clone(self):
        other = StandInPatcher(self.model)
        other.model_options = copy.deepcopy(self.model_options)
        self.clones += 1
        return other

    def _add(self, name, patch):
        patches = self.model_options["transformer_options"].setdefault("patches", {})
        patches[name] = patches.get(name, []) + [patch]

    def set_model_attn1_patch(self, patch):
        self._add("attn1_patch", patch)

    def set_model_attn1_output_patch(self, patch):
        self._add("attn1_output_patch", patch)

    def set_model_attn2_patch(self, patch):
        self._add("attn2_patch", patch)

    def set_model_attn2_output_patch(self, patch):
        self._add("attn2_output_patch", patch)

    def patch_names(self):
        patches = self.model_options["transformer_options"].get("patches", {})
        return {name: [p.__name__ for p in chain] for name, chain in patches.items()}


def extra(h=8, w=8, batch=2, sigma=5.0):
    return {"original_shape": [batch, 4, h, w], "sigmas": torch.full((batch,), sigma), "block": ("input", 1),
            "transformer_index": 0}


# -- the package and its nodes -------------------------------------------------------------------

def _model_nodes(mappings: dict) -> dict:
    """The pack's MODEL nodes: the WanVideoWrapper node registered beside them takes a WANVIDEOMODEL
    (test_comfy_wanvideo.py checks it)."""
    return {key: value for key, value in mappings.items() if key != "TomeCoreToMeWanVideo"}


def test_root_package_exports_the_nodes_without_comfyui(tome_package):
    assert set(_model_nodes(tome_package.NODE_CLASS_MAPPINGS)) == {"TomeCoreToMe", "TomeCoreToMeAdvanced"}
    assert "TomePatchModel" not in tome_package.NODE_CLASS_MAPPINGS  # core's id: ComfyUI would skip ours
    assert _model_nodes(tome_package.NODE_DISPLAY_NAME_MAPPINGS) == {"TomeCoreToMe": "ToMe",
                                                                     "TomeCoreToMeAdvanced": "ToMe (advanced)"}
    assert (REPO / tome_package.WEB_DIRECTORY / "tome.js").is_file()


def test_every_input_has_a_tooltip_and_every_node_a_description(tome_package):
    for key, node in tome_package.NODE_CLASS_MAPPINGS.items():
        model_type = "WANVIDEOMODEL" if key == "TomeCoreToMeWanVideo" else "MODEL"
        assert node.CATEGORY == "model_patches/unet" and node.RETURN_TYPES == (model_type,)
        assert node.DESCRIPTION and "\n" not in node.DESCRIPTION
        inputs = node.INPUT_TYPES()
        for name, spec in dict(inputs["required"], **inputs.get("optional", {})).items():
            assert spec[1].get("tooltip"), name
    advanced = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMeAdvanced"].INPUT_TYPES()["required"]
    assert list(advanced) == ["model", "ratio", "max_downsample", "sx", "sy", "use_rand", "tome_seed", "mode",
                              "merge_crossattn", "start_percent", "end_percent", "min_tokens"]
    optional = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMeAdvanced"].INPUT_TYPES()["optional"]
    assert list(optional) == ["kv_downsample", "block_start", "block_end", "matching", "speed_check", "match_every"]
    assert optional["kv_downsample"][0] == ["nearest", "avg"]

def advanced_values(**changes):
    values = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0, mode="merge",
                  merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0)
    values.update(changes)
    return values


def declared(node, values: dict) -> dict:
    """The values ComfyUI passes to VALIDATE_INPUTS: those of the inputs it declares
    (execution.py validate_inputs, getfullargspec(...).args)."""
    names = inspect.getfullargspec(node.VALIDATE_INPUTS).args
    return {name: value for name, value in values.items() if name in names}


def test_validation_declares_only_the_inputs_of_its_rules(tome_package):
    """ComfyUI reports a failed validation on every declared input and skips its own checks for them:
    the basic node declares only max_downsample (ratio's fixed bound is ComfyUI's own max check); the
    advanced node only mode (ComfyUI 0.3.75 checks no V3 dropdown), every range is ComfyUI's."""
    from tome_custom_node_under_test.nodes import tome_nodes

    assert inspect.getfullargspec(tome_nodes.ToMe.VALIDATE_INPUTS).args == ["cls", "max_downsample"]
    advanced = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMeAdvanced"]
    assert inspect.getfullargspec(advanced.VALIDATE_INPUTS).args == ["cls", *tome_nodes.RULE_INPUTS] == ["cls", "mode"]
    for name in ("tome_seed", "min_tokens"):  # left to ComfyUI's own min check, on that input alone
        assert advanced.spec()[name][1]["min"] == 0


def test_validate_inputs_names_the_bad_mode(tome_package):
    node = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMeAdvanced"]
    assert node.VALIDATE_INPUTS(**declared(node, advanced_values())) is True
    assert node.VALIDATE_INPUTS(mode=None) is True  # linked: checked when the node runs
    message = node.VALIDATE_INPUTS(**declared(node, advanced_values(mode="avg")))
    assert isinstance(message, str) and message.startswith("ToMe:") and "mode" in message and "'avg'" in message


@pytest.mark.parametrize("changes, fields", [
    (dict(ratio=0.9), ("ratio", "sx", "sy")), (dict(max_downsample=3), ("max_downsample",)),
    (dict(sx=1, sy=1), ("ratio", "sx", "sy")), (dict(start_percent=0.7, end_percent=0.1), ("start_percent", "end_percent")),
    (dict(mode="kv", merge_crossattn=True), ("mode", "merge_crossattn")), (dict(sx=9), ("sx",)),
    (dict(mode="kv", kv_downsample="max"), ("kv_downsample",)),
])
def test_rules_across_inputs_are_refused_when_the_node_runs_naming_their_inputs(tome_package, changes, fields):
    """What one validation function cannot report on its own inputs only is checked before patching."""
    node = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMeAdvanced"]
    with pytest.raises(ValueError) as caught:
        node().patch(StandInPatcher(BaseModel(StandInUNet())), **advanced_values(**changes))
    message = str(caught.value)
    assert message.startswith("ToMe:") and all(field in message for field in fields), message


def test_linked_widget_values_are_checked_when_the_node_runs(tome_package):
    node = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMe"]
    assert node.VALIDATE_INPUTS(max_downsample=None) is True
    with pytest.raises(ValueError, match="ratio"):
        node().patch(StandInPatcher(BaseModel(StandInUNet())), ratio=0.8, max_downsample=1)


def test_node_returns_a_patched_clone_and_reports_the_level(tome_package):
    source = StandInPatcher(BaseModel(StandInUNet(sdxl=True)))
    out = tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMe"]().patch(source, ratio=0.4, max_downsample=1)
    (patched,) = out["result"]
    assert patched is not source and source.model_options == {"transformer_options": {}}
    assert patched.patch_names() == {"attn1_patch": ["tome_attn1_patch"],
                                     "attn1_output_patch": ["tome_attn1_output_patch"]}
    info = out["ui"]["tome"][0]
    assert info["base_downsample"] == 2 and info["model_type"] == "BaseModel" and info["ratio"] == 0.4
    json.dumps(out["ui"])  # sent to the browser as JSON


# -- tome_core.adapters.model_patcher.unet ---------------------------------------------------------------------

def test_patcher_registers_the_right_patch_pairs():
    source = StandInPatcher(BaseModel(StandInUNet()))
    assert patch_model_patcher(source, ToMeConfig(ratio=0.0)).patch_names() == {}
    both = patch_model_patcher(source, ToMeConfig(merge_crossattn=True)).patch_names()
    assert set(both) == {"attn1_patch", "attn1_output_patch", "attn2_patch", "attn2_output_patch"}
    cross_only = patch_model_patcher(source, ToMeConfig(merge_attn=False, merge_crossattn=True)).patch_names()
    assert set(cross_only) == {"attn2_patch", "attn2_output_patch"}
    assert source.model_options == {"transformer_options": {}} and source.clones == 3


def test_patcher_refuses_what_it_cannot_do():
    source = StandInPatcher(BaseModel(StandInUNet()))
    with pytest.raises(ValueError, match="merge_mlp"):
        patch_model_patcher(source, ToMeConfig(merge_mlp=True))
    with pytest.raises(TypeError, match="set_model_attn1_patch"):
        patch_model_patcher(object(), ToMeConfig())

    class Flux(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.diffusion_model = torch.nn.Linear(2, 2)

    with pytest.raises(UnsupportedModelError, match=r"Flux model .*Supported: SD1\.x"):
        patch_model_patcher(StandInPatcher(Flux()), ToMeConfig())
    assert source.clones == 0


def test_match_every_is_refused_where_the_host_has_no_model_wrapper():
    """Forge and the 2024 ComfyUI call no per-call wrapper, so no matching could be kept: refused before cloning."""
    source = StandInPatcher(BaseModel(StandInUNet()))
    with pytest.raises(ValueError, match="match_every=2 .* needs ComfyUI 0.3's model wrappers.*set match_every=1"):
        patch_model_patcher(source, ToMeConfig(matching="level", match_every=2))
    with pytest.raises(ValueError, match="matching='level'"):
        patch_model_patcher(source, ToMeConfig(match_every=2))
    assert source.clones == 0


def test_merge_mode_merges_keys_values_and_restores_the_output():
    patches = make_patches(ToMeConfig(ratio=0.5), base_downsample=1)
    n = torch.randn(2, 64, 16)
    q, k, v = patches.attn1(n, n, n, extra())
    assert q.shape == (2, 32, 16) and torch.equal(q, k) and torch.equal(k, v)
    out = patches.attn1_output(q * 2, extra())
    assert out.shape == n.shape
    assert torch.unique(out[0], dim=0).shape[0] == 32  # every token gets its merged token's output back


def test_kv_mode_keeps_queries_and_pools_keys_values():
    patches = make_patches(ToMeConfig(ratio=0.75, mode="kv"), base_downsample=1)
    n = torch.randn(2, 64, 16)
    q, k, v = patches.attn1(n, n, n, extra())
    assert q is n and k.shape == v.shape == (2, 16, 16)
    # nearest downsampling: every key is a real token of its own 2x2 window, the value the same token
    window_rows = n[:, [0, 1, 8, 9]]
    assert any(torch.equal(k[:, 0], window_rows[:, i]) for i in range(4))
    assert torch.equal(k, v)
    assert patches.attn1_output(q, extra()) is q


def test_cond_and_uncond_chunks_share_one_partition():
    """ComfyUI may evaluate cond and uncond in separate calls at the same sigma."""
    n = torch.randn(4, 64, 16)
    batched = make_patches(ToMeConfig(ratio=0.5, seed=3), 1)
    chunked = make_patches(ToMeConfig(ratio=0.5, seed=3), 1)
    whole = batched.attn1_output(batched.attn1(n, n, n, extra(batch=4))[0] * 3, extra(batch=4))
    parts = []
    for chunk in n.split(2):
        q, _, _ = chunked.attn1(chunk, chunk, chunk, extra(batch=2))
        parts.append(chunked.attn1_output(q * 3, extra(batch=2)))
    assert torch.equal(whole, torch.cat(parts))


def test_deeper_levels_schedule_and_regrouped_tokens_are_left_alone():
    patches = make_patches(ToMeConfig(ratio=0.5), 1, SigmaWindow(high=8.0, low=2.0))
    n = torch.randn(2, 64, 16)
    assert patches.attn1(n, n, n, extra(sigma=5.0))[0].shape[1] == 32
    assert patches.attn1(n, n, n, extra(sigma=9.0))[0] is n  # outside the window
    deeper = torch.randn(2, 16, 16)  # 4x4 tokens of an 8x8 latent: level 2x, above max_downsample=1
    assert patches.attn1(deeper, deeper, deeper, extra())[0] is deeper
    tiled = torch.randn(8, 16, 16)  # HyperTile-style regrouping: batch no longer the latent's
    assert patches.attn1(tiled, tiled, tiled, extra())[0] is tiled


def test_of_two_tome_patches_on_one_block_only_the_first_acts():
    first = make_patches(ToMeConfig(ratio=0.5), 1)
    second = make_patches(ToMeConfig(ratio=0.75, mode="kv"), 1)
    n, options = torch.randn(2, 64, 16), extra()
    q, k, v = first.attn1(n, n, n, options)
    q2, k2, v2 = second.attn1(q, k, v, options)
    assert q2 is q and k2 is k and v2 is v and q.shape[1] == 32
    out = second.attn1_output(first.attn1_output(q, options), options)
    assert out.shape == n.shape
    fresh = extra()  # the next block call starts unclaimed
    assert second.attn1(n, n, n, fresh)[1].shape[1] == 16


def test_a_patch_that_regroups_tokens_after_tome_fails_loudly():
    patches = make_patches(ToMeConfig(ratio=0.5), 1)
    n = torch.randn(2, 64, 16)
    q, _, _ = patches.attn1(n, n, n, extra())
    with pytest.raises(RuntimeError, match="HyperTile"):
        patches.attn1_output(q.reshape(8, 8, 16), extra())


def test_schedule_window_uses_the_models_percent_to_sigma():
    source = StandInPatcher(BaseModel(StandInUNet()))
    patched = patch_model_patcher(source, ToMeConfig(start_percent=0.2, end_percent=0.6))
    attn1 = patched.model_options["transformer_options"]["patches"]["attn1_patch"][0]
    n = torch.randn(2, 64, 16)
    assert attn1(n, n, n, extra(sigma=8.0))[0].shape[1] == 32  # sigma(0.2) = 8 >= 8.0 >= sigma(0.6) = 4
    assert attn1(n, n, n, extra(sigma=9.0))[0] is n
    assert attn1(n, n, n, extra(sigma=3.0))[0] is n


# -- web/ mirrors the engine's arithmetic --------------------------------------------------------

@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_web_token_counts_match_the_engine():
    cases = [
        dict(width=512, height=512, base=1, s=dict(ratio=0.5, max_downsample=2)),
        dict(width=1024, height=768, base=2, s=dict(ratio=0.6, max_downsample=1, sx=3, sy=2)),
        dict(width=520, height=392, base=1, s=dict(ratio=0.75, mode="kv", max_downsample=4)),
        dict(width=512, height=512, base=1, s=dict(ratio=0.4, min_tokens=2000, max_downsample=8)),
        dict(width=1024, height=1024, base=2, s=dict(ratio=0.88, mode="kv", sx=3, sy=3, max_downsample=1)),
        dict(width=768, height=512, base=1, s=dict(ratio=0.3, mode="kv", max_downsample=2)),
        dict(width=768, height=512, base=1, s=dict(ratio=0.25, mode="kv", max_downsample=1)),
    ]
    script = (
        f"import {{ tokenLevels }} from {json.dumps((REPO / 'web' / 'tome_levels.js').as_uri())};\n"
        f"const cases = {json.dumps(cases)};\n"
        "console.log(JSON.stringify(cases.map(c => tokenLevels(c.width, c.height, c.s, c.base))));\n"
    )
    rows = json.loads(subprocess.run(["node", "--input-type=module", "-e", script], capture_output=True,
                                     text=True, check=True).stdout)
    for case, levels in zip(cases, rows):
        s = case["s"]
        config = ToMeConfig(ratio=s["ratio"], max_downsample=s["max_downsample"], sx=s.get("sx", 2),
                            sy=s.get("sy", 2), mode=s.get("mode", "merge"), min_tokens=s.get("min_tokens", 0))
        merger = TokenMerger(config, case["base"])
        latent = (-(-case["height"] // 8), -(-case["width"] // 8))
        for row in levels:
            hidden = torch.randn(1, row["tokens"], 8)
            plan = merger.plan(hidden, latent, 1.0)
            assert plan.merge(hidden).shape[1] == row["kept"], (case, row)
            keys = plan.reduce_kv(hidden) if config.mode == "kv" else plan.merge(hidden)  # attention's key count
            assert keys.shape[1] == row["keys"], (case, row)
            assert plan.active == row["active"], (case, row)


def test_tome_core_exposes_what_the_glue_uses():
    assert callable(tome_core.attention_base_downsample) and tome_core.TokenMerger is TokenMerger


# -- example_workflows/ --------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["ToMe_SD15_basic", "ToMe_SD15_advanced", "ToMe_SD15_compare"])
def test_ui_and_api_example_workflows_agree(tome_package, name):
    """The UI file (template browser) and the API file (POST /prompt) describe the same graph."""
    ui = json.loads((REPO / "example_workflows" / f"{name}.json").read_text())
    ui["nodes"] = [node for node in ui["nodes"] if node["type"] not in ("Note", "MarkdownNote")]  # the frontend's own
    api = json.loads((REPO / "example_workflows" / "api" / f"{name}.api.json").read_text())
    assert sorted(node["type"] for node in ui["nodes"]) == sorted(node["class_type"] for node in api.values())
    node_ids = {str(node["id"]): node for node in ui["nodes"]}
    assert set(node_ids) == set(api)
    for link_id, origin, origin_slot, target, target_slot, kind in ui["links"]:
        target_node = node_ids[str(target)]
        input_name = next(i["name"] for i in target_node["inputs"] if i.get("link") == link_id)
        assert api[str(target)]["inputs"][input_name] == [str(origin), origin_slot], (name, link_id)
    (tome,) = [node for node in ui["nodes"] if node["type"] in tome_package.NODE_CLASS_MAPPINGS]
    node_class = tome_package.NODE_CLASS_MAPPINGS[tome["type"]]
    inputs = node_class.INPUT_TYPES()
    widgets = [name for name in dict(inputs["required"], **inputs.get("optional", {})) if name != "model"]
    values = dict(zip(widgets, tome["widgets_values"], strict=True))
    assert values == {k: v for k, v in api[str(tome["id"])]["inputs"].items() if k != "model"}
    assert node_class.VALIDATE_INPUTS(**declared(node_class, values)) is True
