"""Test-only nodes that put the in-process tests' reduced transformer models in front of a real ComfyUI server.

``TomeTestTinyDiT`` builds one of the tiny seeded models of ``test_comfy_dit`` / ``test_comfy_families`` (the same
builder functions, imported from the test folder: ComfyUI's own ``comfy.supported_models`` classes) and hands out its
MODEL, its seeded CONDITIONING and its LATENT, so a prompt can sample it with ComfyUI's KSampler and any MODEL node
(ToMe, EasyCache, ...) between the two. ``TomeTestKeySpy`` sets ``transformer_options["optimized_attention_override"]``
to a function that records each attention call's key count and step and passes the call on unchanged (ToMe chains an
override set before it, so it sees the keys ToMe hands on); when sampling ends it writes them to the server log.
``TomeTestSaveLatent`` saves the sampled latent (flattened: LTX-2's [video, audio] included) as a float32 safetensors
file in the output folder and names it in its UI output, so a test compares samples bit for bit.
"""
from __future__ import annotations

import json
import logging
import sys
import uuid
from pathlib import Path

HERE = Path(__file__).resolve().parent.parent  # tests/comfyui: the builders' modules and comfy_env
KEY_SPY_LOG = "TomeTestKeySpy: "


def _builders() -> dict:
    """Every builder of the in-process tests, by the name they use (test_comfy_families' after test_comfy_dit's)."""
    for path in (str(HERE), str(HERE.parents[1])):  # the repository root: the tests import tome_core
        if path not in sys.path:
            sys.path.append(path)
    import test_comfy_dit
    import test_comfy_families

    return dict(test_comfy_dit.FAMILIES, **test_comfy_families.FAMILIES)


class TomeTestTinyDiT:
    """A reduced seeded model of ``family`` (ComfyUI's own classes), its conditioning and latent."""

    RETURN_TYPES = ("MODEL", "CONDITIONING", "LATENT")
    FUNCTION = "load"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"family": ("STRING", {"default": "flux"})}}

    def load(self, family):
        import comfy
        import comfy.model_patcher
        import comfy.sample
        import comfy.supported_models

        builders = _builders()
        if family not in builders:
            raise ValueError(f"TomeTestTinyDiT: no builder named {family!r}")
        try:
            built = builders[family](comfy)
        except BaseException as error:  # pytest.skip (the ComfyUI lacks the class) is a BaseException
            if type(error).__name__ == "Skipped":
                raise RuntimeError(f"TomeTestTinyDiT unavailable: {error}") from None
            raise
        patcher, latent, cond = built[:3]
        latent_format = patcher.model.latent_format
        if not getattr(latent, "is_nested", False) and latent.shape[1] != latent_format.latent_channels:
            # KSampler widens an all-zero latent to the format's channels (comfy.sample.fix_empty_latent_channels);
            # a constant one keeps the model's; at denoise 1 a flow model's first step weighs it by 1 - sigma_max = 0
            latent = latent + 0.5
        return (patcher, cond, {"samples": latent})


_INSIDE = []  # one entry per diffusion-model forward running now (the spy counts the attention calls inside one)


def _mark_forwards(module) -> None:
    """Forward hooks on the (shared) diffusion model that tell the spy a model forward is running, once per module:
    an attention call outside one (ToMe's mask probe, run from its APPLY_MODEL wrapper) is not the model's."""
    if getattr(module, "_tome_test_spy_hooks", False):
        return

    def enter(mod, args):
        _INSIDE.append(True)

    def leave(mod, args, out):  # returns None: the output stays the model's
        _INSIDE.pop()

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, always_call=True)
    module._tome_test_spy_hooks = True


class TomeTestKeySpy:
    """Records the key count and step (``transformer_options["sigmas"]``) of every attention call a diffusion-model
    forward makes (through ComfyUI's attention override) and logs them per sampling run:
    ``TomeTestKeySpy: {"calls": n, "keys": {"40": n, ...}, "steps": steps with attention}``."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    def patch(self, model):
        import comfy.patcher_extension

        keys, steps = [], set()

        def spy(func, *args, **kwargs):
            if _INSIDE:
                k = args[1]
                keys.append(int(k.shape[2 if kwargs.get("skip_reshape", False) else 1]))
                sigmas = (kwargs.get("transformer_options") or {}).get("sigmas")
                steps.add(None if sigmas is None else float(sigmas.flatten()[0]))
            return func(*args, **kwargs)

        def outer_sample(executor, *args, **kwargs):
            keys.clear(), steps.clear()
            try:
                return executor(*args, **kwargs)
            finally:
                counts = {}
                for n in keys:
                    counts[str(n)] = counts.get(str(n), 0) + 1
                logging.info(KEY_SPY_LOG + json.dumps({"calls": len(keys), "keys": counts, "steps": len(steps)},
                                                      sort_keys=True))

        _mark_forwards(model.model.diffusion_model)
        patched = model.clone()
        patched.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = spy
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.OUTER_SAMPLE, "tome_test_key_spy", outer_sample)
        return (patched,)


class TomeTestSaveLatent:
    """Saves the LATENT's samples (nested ones flattened and joined) as float32 in the output folder."""

    RETURN_TYPES = ()
    FUNCTION = "save"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"samples": ("LATENT",), "filename_prefix": ("STRING", {"default": "tome_latent"})}}

    def save(self, samples, filename_prefix):
        import folder_paths
        import safetensors.torch
        import torch

        latent = samples["samples"]
        if getattr(latent, "is_nested", False):
            latent = torch.cat([t.flatten(1) for t in latent.unbind()], 1)
        name = f"{filename_prefix}_{uuid.uuid4().hex[:12]}.safetensors"
        path = Path(folder_paths.get_output_directory()) / name
        safetensors.torch.save_file({"samples": latent.float().contiguous().cpu()}, str(path))
        return {"ui": {"tome_latents": [{"filename": name}]}}


# dict(...), not a literal: ComfyUI-Manager's scanner reads literal mappings in every .py of the repository,
# and these test nodes are not the pack's (tests/test_registry.py).
NODE_CLASS_MAPPINGS = dict(TomeTestTinyDiT=TomeTestTinyDiT, TomeTestKeySpy=TomeTestKeySpy,
                           TomeTestSaveLatent=TomeTestSaveLatent)
