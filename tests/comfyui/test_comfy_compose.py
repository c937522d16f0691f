"""ToMe beside every core ComfyUI node that patches the same model, in both orders, modes merge and kv.

Each combination runs on the real server (tiny seeded SD1.5 checkpoint, 64x64, 2 steps) and ends in
one of two ways: both act (the image differs from the partner alone, from ToMe alone and from the
plain run), or the prompt is refused before any sampling math with a message naming the partner.
Never a silent drop. Three partners need more than that run (second part of the file): FreeU/FreeU_V2
scale only the widths model_channels x 2 and x 4, which the 320-wide tiny checkpoint lacks, so they
run on a seeded tiny UNet with a 640-wide level (UNETLoader); EasyCache/LazyCache skip nothing in a
2-step run, so they run 5 steps; a ControlNet goes on the conditioning (a seeded ControlNet of the tiny
UNet's layout, ControlNetLoader + ControlNetApply[Advanced]). The table is published in
docs/COMFYUI.md ("How it patches, and how it composes").
"""
from __future__ import annotations

import os
from pathlib import Path

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


class Runs:
    """Runs a chain of MODEL -> MODEL nodes once per module and keeps its image (or the failed result)
    and what the server logged meanwhile. ``steps``: the sampler's steps; ``unet``: a UNETLoader file
    that replaces the checkpoint's model; ``control``: (ControlNet apply node, its widgets) on the
    prompts, with the seeded ControlNet and hint image of ``control_files``."""

    def __init__(self, comfy) -> None:
        self.comfy, self.done, self.logs = comfy, {}, {}

    def __call__(self, *chain: dict, steps: int = 2, unet: str = "", control: tuple = ()):
        key = repr((chain, steps, unet, control))
        if key not in self.done:
            nodes = list(chain)
            prompt = api_prompt(nodes[-1] if nodes else None, pre_nodes=nodes[:-1], steps=steps,
                                prefix=f"compose{len(self.done)}")
            if unet:
                use_unet(self.comfy, prompt, unet)
            if control:
                use_control(prompt, *control)
            start = self.comfy.log_path.stat().st_size
            result = self.comfy.run(prompt)
            with open(self.comfy.log_path, "rb") as log:
                log.seek(start)
                self.logs[key] = log.read().decode(errors="replace")
            self.done[key] = pixels(result.images[0]) if result.success and len(result.images) == 1 else result
        return self.done[key]

    def log(self, *chain: dict, **options) -> str:
        """What the server logged while running this chain (run it first)."""
        return self.logs[repr((chain, options.get("steps", 2), options.get("unet", ""), options.get("control", ())))]


@pytest.fixture(scope="module")
def images(comfy, checkpoint):
    return Runs(comfy)


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


# ---------------------------------------------------------------- partners that need a longer run, wider
# channels or a model file of their own

UNET_640 = "tiny_sd15_unet_640_v1.safetensors"  # bump when its writer changes
CONTROLNET = "tiny_sd15_controlnet_v1.safetensors"
HINT = "tome_compose_hint.png"


def model_file(comfy, folder: str, name: str, write) -> str:
    """``name`` in the server's ``folder`` (models folders of ComfyServer), written once per
    TOME_COMFY_CACHE like the tiny checkpoint (``write(path)`` with ComfyUI importable)."""
    target = comfy.workdir / folder / name
    cache = os.environ.get("TOME_COMFY_CACHE")
    source = Path(cache).resolve() / name if cache else target
    if not source.exists():
        comfy_env.import_comfy(comfy.comfy_dir)
        write(source)
    if source != target and not target.exists():
        target.symlink_to(source)
    return name


def use_unet(comfy, prompt: dict, name: str) -> None:
    """The prompt's model comes from UNETLoader(name) instead of the checkpoint (CLIP and VAE still do)."""
    inputs = {"unet_name": name}
    if "weight_dtype" in comfy.object_info("UNETLoader")["input"]["required"]:
        inputs["weight_dtype"] = "default"
    prompt["8"] = {"class_type": "UNETLoader", "inputs": inputs}
    for node in list(prompt.values()):
        for key, value in node["inputs"].items():
            if value == ["1", 0]:
                node["inputs"][key] = ["8", 0]


def use_control(prompt: dict, apply_node: str, strength: float) -> None:
    """ControlNetLoader(CONTROLNET) and LoadImage(HINT) -> apply_node on the sampler's conditioning."""
    prompt["20"] = {"class_type": "ControlNetLoader", "inputs": {"control_net_name": CONTROLNET}}
    prompt["21"] = {"class_type": "LoadImage", "inputs": {"image": HINT}}
    common = {"control_net": ["20", 0], "image": ["21", 0], "strength": strength}
    if apply_node == "ControlNetApply":
        prompt["22"] = {"class_type": apply_node, "inputs": dict(common, conditioning=["2", 0])}
        prompt["5"]["inputs"]["positive"] = ["22", 0]
    else:
        prompt["22"] = {"class_type": apply_node, "inputs": dict(
            common, positive=["2", 0], negative=["3", 0], start_percent=0.0, end_percent=1.0)}
        prompt["5"]["inputs"].update(positive=["22", 0], negative=["22", 1])


def assert_both_act(both, alone, tome_alone, plain, name: str) -> None:
    assert isinstance(plain, np.ndarray) and isinstance(alone, np.ndarray) and isinstance(tome_alone, np.ndarray), (
        plain, alone, tome_alone)
    assert not np.array_equal(alone, plain), f"{name} does not act in this setup"
    assert not np.array_equal(tome_alone, plain), "ToMe does not act in this setup"
    assert isinstance(both, np.ndarray), both.error_message()
    assert not np.array_equal(both, alone), f"ToMe lost beside {name}"
    assert not np.array_equal(both, tome_alone), f"{name} lost beside ToMe"
    assert not np.array_equal(both, plain)


# EasyCache / LazyCache skip whole model calls once the estimated change since the last computed step
# stays below reuse_threshold; they need two computed steps to estimate it, so a 2-step run skips
# nothing. 5 steps from start_percent 0 with the highest threshold: they skip steps 3 to 5.
CACHE_STEPS = 5
CACHES = {name: {"reuse_threshold": 3.0, "start_percent": 0.0, "end_percent": 1.0, "verbose": False}
          for name in ("EasyCache", "LazyCache")}


def skipped_steps(log: str, name: str) -> int:
    """The steps ``name`` reports skipping in its closing log line ("EasyCache - skipped 3/5 steps")."""
    lines = [line for line in log.splitlines() if f"{name} - skipped " in line]
    assert len(lines) == 1, log[-3000:]
    return int(lines[0].split(f"{name} - skipped ")[1].split("/")[0])


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(CACHES))
def test_tome_beside_easycache_and_lazycache_both_act(comfy, images, available, name, mode, order):
    """The caches skip whole UNet calls (DIFFUSION_MODEL / PREDICT_NOISE wrappers); ToMe merges in the
    calls they let through: both act, the cache still skips steps beside ToMe, the same image in either
    order."""
    if name not in available:
        pytest.skip(f"this ComfyUI has no {name} node")
    cache = {"class_type": name, "inputs": dict(CACHES[name])}
    plain, alone, tome_alone = images(steps=CACHE_STEPS), images(cache, steps=CACHE_STEPS), images(
        tome(mode), steps=CACHE_STEPS)
    assert skipped_steps(images.log(cache, steps=CACHE_STEPS), name) >= 1
    chain = (tome(mode), cache) if order == "tome_first" else (cache, tome(mode))
    both = images(*chain, steps=CACHE_STEPS)
    assert_both_act(both, alone, tome_alone, plain, name)
    assert skipped_steps(images.log(*chain, steps=CACHE_STEPS), name) >= 1
    other = (cache, tome(mode)) if order == "tome_first" else (tome(mode), cache)
    assert np.array_equal(images(*other, steps=CACHE_STEPS), both), "the node order changed the image"


# FreeU scales the output blocks whose width is model_channels x 4 or x 2 (1280, 640 on SD1.5); the
# tiny checkpoint is 320 wide throughout, so these rows use a tiny UNet whose second level is 640 wide.
FREEU = {"FreeU": {"b1": 1.1, "b2": 1.2, "s1": 0.9, "s2": 0.2},
         "FreeU_V2": {"b1": 1.3, "b2": 1.4, "s1": 0.9, "s2": 0.2}}


@pytest.fixture(scope="module")
def unet_640(comfy):
    return model_file(comfy, "unet", UNET_640, lambda path: comfy_env.write_tiny_sd15_unet(path, channel_mult=[1, 2]))


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", list(FREEU))
def test_tome_beside_freeu_both_act(comfy, images, unet_640, name, mode, order):
    """FreeU patches output blocks (set_model_output_block_patch), ToMe the attention of level 0: both
    act, the same image in either order."""
    freeu = {"class_type": name, "inputs": dict(FREEU[name])}
    plain, alone, tome_alone = images(unet=unet_640), images(freeu, unet=unet_640), images(tome(mode), unet=unet_640)
    chain = (tome(mode), freeu) if order == "tome_first" else (freeu, tome(mode))
    both = images(*chain, unet=unet_640)
    assert_both_act(both, alone, tome_alone, plain, name)
    assert np.array_equal(images(*reversed(chain), unet=unet_640), both), "the node order changed the image"


def test_freeu_leaves_the_tiny_checkpoint_unchanged(images):
    """Why FreeU needs the wider UNet above: on the 320-wide tiny checkpoint it scales nothing."""
    plain = images()
    assert isinstance(plain, np.ndarray) and np.array_equal(images({"class_type": "FreeU", "inputs": FREEU["FreeU"]}), plain)


@pytest.fixture(scope="module")
def control_files(comfy):
    """The seeded ControlNet in the server's controlnet folder and a seeded-noise hint image in its input."""
    from PIL import Image

    hint = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    Image.fromarray(hint).save(comfy.workdir / "input" / HINT)
    return model_file(comfy, "controlnet", CONTROLNET, comfy_env.write_tiny_controlnet)


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("apply_node", ["ControlNetApply", "ControlNetApplyAdvanced"])
def test_tome_beside_a_controlnet_both_act(comfy, images, available, control_files, apply_node, mode):
    """A ControlNet goes on the conditioning, not on the MODEL chain, so there is no node order to swap:
    its residuals are added to the UNet's blocks, ToMe merges inside them; the ControlNet model itself
    is not patched (ComfyUI calls it without the UNet's transformer_options)."""
    if apply_node not in available:
        pytest.skip(f"this ComfyUI has no {apply_node} node")
    control = (apply_node, 0.5)
    plain, alone = images(), images(control=control)
    tome_alone, both = images(tome(mode)), images(tome(mode), control=control)
    assert_both_act(both, alone, tome_alone, plain, apply_node)
    assert "missing controlnet keys" not in images.log(control=control)
