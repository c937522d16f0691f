"""One node call resolves its model once: the catalogue is asked who the model is one time per patch.

Followed through the ToMe (advanced) node's ``patch`` on ComfyUI's own model classes (a tiny SD1.5 UNet and a tiny
Flux, seeded), with a counter on each look-up the catalogue offers: the binding by class, the ComfyUI model's
reading (blocks, offsets, default range, sequence order), the UNet's first attention level and its levels. Every
later step of the patch takes the resolved value (``model_patcher/plan.resolve``) and never asks the patcher again.
"""
from __future__ import annotations

import importlib
from collections import Counter

import pytest
import torch

import comfy_env
from test_comfy_dit import comfy, flux, tome_package  # noqa: F401

ADVANCED = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0, merge_crossattn=False,
                start_percent=0.0, end_percent=1.0, min_tokens=0)


def _counted(monkeypatch, package: str) -> Counter:
    """Count the catalogue's look-ups in the node's own copy of tome_core (ComfyUI imports the pack as a package)."""
    counts: Counter = Counter()
    targets = {"catalogue.comfy_lookup": ("family_of", "comfy_model"),
               "catalogue.comfy_dits": ("block_offsets", "default_start", "grid_last", "unreached"),
               "catalogue.unets": ("attention_base_downsample", "attention_levels", "level_blocks")}
    for module_name, names in targets.items():
        module = importlib.import_module(f"{package}.tome_core.{module_name}")
        for name in names:
            real = getattr(module, name)

            def counting(*args, real=real, name=name, **kwargs):
                counts[name] += 1
                return real(*args, **kwargs)

            for holder in [m for key, m in list(importlib.sys.modules.items())
                           if key.startswith(f"{package}.tome_core") and getattr(m, name, None) is real]:
                monkeypatch.setattr(holder, name, counting)
    return counts


def _sd15(comfy):
    import comfy.model_patcher
    import comfy.supported_models

    model = comfy.supported_models.SD15(comfy_env.tiny_sd15_unet_config()).get_model({})
    comfy_env._seeded_init(model.diffusion_model, 0)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


@pytest.mark.parametrize("mode", ["kv", "merge"])
def test_a_dit_node_call_reads_the_catalogue_once(comfy, tome_package, monkeypatch, mode):
    tome_nodes = importlib.import_module(f"{tome_package.__name__}.nodes.tome_nodes")
    patcher = flux(comfy)[0]
    counts = _counted(monkeypatch, tome_package.__name__)
    result = tome_nodes.ToMeAdvanced().patch(patcher, mode=mode, **ADVANCED)
    assert result["ui"]["tome"][0]["family"] == "flux"
    assert counts["comfy_model"] == 1 and counts["family_of"] == 1, dict(counts)
    assert counts["block_offsets"] == counts["default_start"] == counts["grid_last"] == counts["unreached"] == 1


def test_a_unet_node_call_reads_the_catalogue_once(comfy, tome_package, monkeypatch):
    tome_nodes = importlib.import_module(f"{tome_package.__name__}.nodes.tome_nodes")
    patcher = _sd15(comfy)
    counts = _counted(monkeypatch, tome_package.__name__)
    result = tome_nodes.ToMeAdvanced().patch(patcher, mode="merge", **ADVANCED)
    assert result["ui"]["tome"][0]["kind"] == "unet"
    assert counts["comfy_model"] == 1 and counts["family_of"] == 1, dict(counts)  # not a DiT: asked once
    assert counts["attention_base_downsample"] == 1 and counts["attention_levels"] == 1, dict(counts)
