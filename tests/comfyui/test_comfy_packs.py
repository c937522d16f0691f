"""Community speed packs that replace a DiT's forward, beside ToMe on ComfyUI's own Flux: never a silent drop.

ComfyUI-TeaCache (welltop-cn/ComfyUI-TeaCache 91dff8e, nodes.py) and Comfy-WaveSpeed's First Block Cache
(chengzeyi/Comfy-WaveSpeed 8253745, first_block_cache.py) install a ``model_function_wrapper`` that swaps
``diffusion_model.forward_orig`` for their own copy for each call (``unittest.mock.patch``); the copy calls the blocks
without ``transformer_options``. Neither is on PyPI, so ``apply_teacache`` mirrors ``TeaCache.apply_teacache`` and
``teacache_flux_forward`` mirrors its Flux forward (its caching, which starts after the first step, left out; named as
ComfyUI's ``nodes.load_custom_node`` names a pack's module). With ToMe in either order, in either mode, the first model
call stops the prompt naming the pack; TeaCache alone runs.
"""
from __future__ import annotations

import unittest.mock

import pytest
import torch

from test_comfy_dit import comfy, flux, sample  # noqa: F401

from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
from tome_core.engine.config import ToMeConfig

TEACACHE_MODULE = "/opt/ComfyUI/custom_nodes/ComfyUI-TeaCache.nodes"  # nodes.load_custom_node's module name


def teacache_flux_forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, control=None,
                          transformer_options={}, attn_mask=None, **kwargs):  # noqa: B006 - mirrors the pack
    """ComfyUI-TeaCache's ``teacache_flux_forward``: Flux's forward with the blocks (and the dit replace patches)
    called without transformer_options. ``**kwargs``: the 2026 ComfyUI also passes ``timestep_zero_index``, which
    the pack's own signature lacks (its issue #187)."""
    from comfy.ldm.flux.layers import timestep_embedding

    patches_replace = transformer_options.get("patches_replace", {})
    img = self.img_in(img)
    vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
    if self.params.guidance_embed:
        vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
    vec = vec + self.vector_in(y[:, :self.params.vec_in_dim])
    txt = self.txt_in(txt)
    pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
    blocks_replace = patches_replace.get("dit", {})
    for i, block in enumerate(self.double_blocks):
        if ("double_block", i) in blocks_replace:
            def block_wrap(args, block=block):
                out = {}
                out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                               attn_mask=args.get("attn_mask"))
                return out
            out = blocks_replace[("double_block", i)]({"img": img, "txt": txt, "vec": vec, "pe": pe,
                                                       "attn_mask": attn_mask}, {"original_block": block_wrap})
            txt, img = out["txt"], out["img"]
        else:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask)
    img = torch.cat((txt, img), 1)
    for i, block in enumerate(self.single_blocks):
        if ("single_block", i) in blocks_replace:
            def block_wrap(args, block=block):
                return {"img": block(args["img"], vec=args["vec"], pe=args["pe"], attn_mask=args.get("attn_mask"))}
            img = blocks_replace[("single_block", i)]({"img": img, "vec": vec, "pe": pe, "attn_mask": attn_mask},
                                                      {"original_block": block_wrap})["img"]
        else:
            img = block(img, vec=vec, pe=pe, attn_mask=attn_mask)
    img = img[:, txt.shape[1]:, ...]
    return self.final_layer(img, vec)


teacache_flux_forward.__module__ = TEACACHE_MODULE


def apply_teacache(patcher):
    """``TeaCache.apply_teacache``: a clone whose model_function_wrapper swaps forward_orig for each call."""
    new_model = patcher.clone()
    diffusion_model = new_model.get_model_object("diffusion_model")
    context = unittest.mock.patch.multiple(
        diffusion_model, forward_orig=teacache_flux_forward.__get__(diffusion_model, diffusion_model.__class__))

    def unet_wrapper_function(model_function, kwargs):
        with context:
            return model_function(kwargs["input"], kwargs["timestep"], **kwargs["c"])

    new_model.set_model_unet_function_wrapper(unet_wrapper_function)
    return new_model


@pytest.mark.parametrize("mode", ["kv", "merge"])
@pytest.mark.parametrize("order", ["tome_first", "teacache_first"])
def test_a_forward_replacing_cache_stops_the_prompt_naming_the_pack(comfy, mode, order):
    patcher, latent, cond, _ = flux(comfy)
    config = ToMeConfig(ratio=0.5, mode=mode, block_start=0.0)
    alone = sample(comfy, apply_teacache(patcher), latent, cond, steps=1)
    assert torch.isfinite(alone).all()  # the stand-in runs by itself
    both = apply_teacache(patch_dit_model_patcher(patcher, config)) if order == "tome_first" else \
        patch_dit_model_patcher(apply_teacache(patcher), config)
    what = "attention" if mode == "kv" else "block"
    with pytest.raises(RuntimeError, match=f"mode {mode} reached no {what} of Flux's first model call: "
                                           "ComfyUI-TeaCache's teacache_flux_forward \\(in place of Flux.forward_orig\\)"):
        sample(comfy, both, latent, cond, steps=1)
    with pytest.raises(RuntimeError, match="ComfyUI-TeaCache"):  # every run, until one of the two goes
        sample(comfy, both, latent, cond, steps=1)
