"""ToMe beside every core ComfyUI node that patches the same model, in both orders, modes merge and kv.

Each combination runs on the real server (tiny seeded SD1.5 checkpoint, 64x64, 2 steps) and ends in
one of two ways: both act (the image differs from the partner alone, from ToMe alone and from the
plain run), or the prompt is refused before any sampling math with a message naming the partner.
Never a silent drop. FreeU/FreeU_V2 are not in the table: they scale the channels of SD's real widths
(model_channels x 4 and x 2) and leave the tiny test UNet unchanged; EasyCache/LazyCache reuse nothing
in a 2-step run (the image equals the plain one), so they need a longer run than this file affords. The table is published in docs/COMFYUI.md ("How it patches, and how it composes").
"""
from __future__ import annotations

import numpy as np
import pytest

import comfy_env
from comfy_env import advanced, api_prompt, pixels

PARTNERS = {
    "TomePatchModel": {"ratio": 0.3},
    "HyperTile": {"tile_size": 32, "swap_size": 1, "max_depth": 0, "scale_depth": False},  # 2x2 tiles at 64x64
    "SelfAttentionGuidance": {"scale": 0.5, "blur_sigma": 2.0},
    "PerturbedAttentionGuidance": {"scale": 3.0},
    "PatchModelAddDownscale": {"block_number": 3, "downscale_factor": 2.0, "start_percent": 0.0, "end_percent": 0.35,
                               "downscale_after_skip": True, "downscale_method": "bicubic", "upscale_method": "bicubic"},
    "TomeTestSeededLora": {"seed": 1},  # LoraLoaderModelOnly's load_lora_for_models, seeded LoRA in memory
    "TomeTestAttentionOverride": {"scale": 0.8},  # sets transformer_options["optimized_attention_override"]
}
MODES = ("merge", "kv")
ORDERS = ("tome_first", "partner_first")
# (partner, mode, order) -> (node that fails, words of its message); every other combination: both act.
REFUSED = {
    ("HyperTile", "merge", "tome_first"): ("5", ("ToMe", "HyperTile is applied after ToMe", "mode kv")),
    ("HyperTile", "merge", "partner_first"): ("11", ("ToMe", "HyperTile is applied before ToMe", "mode kv")),
    ("TomePatchModel", "merge", "tome_first"): ("5", ("ToMe", "TomePatchModel is applied after ToMe",
                                                      "Put TomePatchModel before ToMe")),
}


def tome(mode: str) -> dict:
    return advanced(mode=mode)


def partner(name: str) -> dict:
    return {"class_type": name, "inputs": dict(PARTNERS[name])}


@pytest.fixture(scope="module")
def images(comfy, checkpoint):
    """Runs a chain of MODEL -> MODEL nodes once per module and keeps its image (or the failed result)."""
    done: dict = {}

    def run(*chain: dict):
        key = repr(chain)
        if key not in done:
            nodes = list(chain)
            prompt = api_prompt(nodes[-1] if nodes else None, pre_nodes=nodes[:-1], prefix=f"compose{len(done)}")
            result = comfy.run(prompt)
            done[key] = pixels(result.images[0]) if result.success and len(result.images) == 1 else result
        return done[key]

    return run


@pytest.fixture(scope="module")
def available(comfy):
    return set(comfy.get_json("/object_info"))


def host_has_attention_override(comfy) -> bool:
    source = comfy.comfy_dir / "comfy" / "ldm" / "modules" / "attention.py"
    return "optimized_attention_override" in source.read_text()


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(PARTNERS))
def test_tome_beside_a_core_partner_both_act_or_is_refused_naming_it(comfy, images, available, name, mode, order):
    if name not in available:
        pytest.skip(f"this ComfyUI has no {name} node")
    if name == "TomeTestAttentionOverride" and not host_has_attention_override(comfy):
        pytest.skip("this ComfyUI has no optimized_attention_override")
    plain, alone, tome_alone = images(), images(partner(name)), images(tome(mode))
    assert isinstance(alone, np.ndarray) and isinstance(tome_alone, np.ndarray), (alone, tome_alone)
    assert not np.array_equal(alone, plain), f"{name} does not act in this setup"
    chain = (tome(mode), partner(name)) if order == "tome_first" else (partner(name), tome(mode))
    both = images(*chain)
    if (name, mode, order) in REFUSED:
        node, words = REFUSED[(name, mode, order)]
        assert not isinstance(both, np.ndarray), "refused combination ran"
        assert not both.images, both.images
        error = both.error_message()
        assert error["node_id"] == node, error
        assert all(word in error["exception_message"] for word in words), error["exception_message"]
        return
    assert isinstance(both, np.ndarray), both.error_message()
    assert not np.array_equal(both, alone), f"ToMe lost beside {name}"
    assert not np.array_equal(both, tome_alone), f"{name} lost beside ToMe"
    assert not np.array_equal(both, plain)


@pytest.mark.parametrize("chain", [
    ("HyperTile", "kv"), ("TomePatchModel", "merge"),
], ids=lambda chain: "->".join(chain))
def test_the_new_compositions_repeat_exactly_on_a_fresh_executor(comfy, images, chain):
    nodes = [tome(step) if step in MODES else partner(step) for step in chain]
    first = images(*nodes)
    result = comfy.run_fresh(api_prompt(nodes[-1], pre_nodes=nodes[:-1], prefix="compose_repeat"))
    assert result.success, result.error_message()
    assert np.array_equal(pixels(result.images[0]), first)


def test_kv_and_hypertile_give_the_same_image_in_either_order(images):
    """kv reduces only keys/values, HyperTile only tiles queries: the order does not matter."""
    first = images(tome("kv"), partner("HyperTile"))
    second = images(partner("HyperTile"), tome("kv"))
    assert isinstance(first, np.ndarray) and np.array_equal(first, second)
