"""The SDXL path of the AUTOMATIC1111 script, on a stand-in for SGM (Stability's ``sgm`` package,
which the WebUI uses for SDXL and which is not on PyPI).

What stands in for SGM, and how:
- The UNet is ldm's ``UNetModel`` (same ``input_blocks``/``middle_block``/``output_blocks`` module
  tree as sgm's openaimodel) built with SDXL's level layout: ``channel_mult=(1, 2, 4)``, no
  attention at the full-resolution level, attention at the 2x and 4x levels, linear projections
  in the spatial transformers. Channels, heads, context width and transformer depth are reduced.
- Its transformer blocks get SGM's call signature: ``BasicTransformerBlock.forward(x, context=None,
  additional_tokens=None, n_times_crossframe_attn_in_self=0)``, calling ``attn1``/``attn2`` with
  those keyword arguments as sgm/modules/attention.py does, and attention modules that accept them.
- The model wrapper is named like SGM's ``DiffusionEngine`` with ``.model`` (``OpenAIWrapper``)
  holding ``.diffusion_model`` (the WebUI's SDXL ``sd_model``).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tome_core
import webui_doubles as wd
from webui_helpers import make_p, reinit_zero_layers, require, script_args

ldm_attention = require("ldm.modules.attention")


class CrossAttention(ldm_attention.CrossAttention):
    """sgm CrossAttention.forward's signature; extra tokens / cross-frame attention are unused in
    SDXL text-to-image, where sgm then computes exactly what ldm does."""

    def forward(self, x, context=None, mask=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        assert additional_tokens is None and n_times_crossframe_attn_in_self == 0
        return super().forward(x, context=context, mask=mask)


class BasicTransformerBlock(ldm_attention.BasicTransformerBlock):
    """sgm BasicTransformerBlock's forward/_forward signature and attention calls."""

    def forward(self, x, context=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        return self._forward(x, context, additional_tokens=additional_tokens,
                             n_times_crossframe_attn_in_self=n_times_crossframe_attn_in_self)

    def _forward(self, x, context=None, additional_tokens=None, n_times_crossframe_attn_in_self=0):
        crossframe = 0 if self.disable_self_attn else n_times_crossframe_attn_in_self
        x = self.attn1(self.norm1(x), context=context if self.disable_self_attn else None,
                       additional_tokens=additional_tokens, n_times_crossframe_attn_in_self=crossframe) + x
        x = self.attn2(self.norm2(x), context=context, additional_tokens=additional_tokens) + x
        return self.ff(self.norm3(x)) + x


class OpenAIWrapper(torch.nn.Module):
    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model


class DiffusionEngine(torch.nn.Module):
    def __init__(self, diffusion_model):
        super().__init__()
        self.model = OpenAIWrapper(diffusion_model)


def build_sdxl_standin(seed: int = 0) -> DiffusionEngine:
    UNetModel = require("ldm.modules.diffusionmodules.openaimodel").UNetModel

    torch.manual_seed(seed)
    unet = UNetModel(
        image_size=32, in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[2, 4],
        num_res_blocks=2, channel_mult=[1, 2, 4], num_head_channels=16, use_spatial_transformer=True,
        transformer_depth=1, context_dim=32, use_checkpoint=False, legacy=False, use_linear_in_transformer=True,
    )
    for m in unet.modules():
        if type(m) is ldm_attention.BasicTransformerBlock:
            m.__class__ = BasicTransformerBlock
        elif type(m) is ldm_attention.CrossAttention:
            m.__class__ = CrossAttention
    reinit_zero_layers(unet, seed)
    return DiffusionEngine(unet.eval())


@pytest.fixture(scope="module")
def sdxl_model():
    return build_sdxl_standin()


def count_query_tokens(model):
    tokens, handles = [], []
    for m in model.model.diffusion_model.modules():
        if isinstance(m, BasicTransformerBlock):
            handles.append(m.attn1.to_q.register_forward_pre_hook(lambda mod, args: tokens.append(args[0].shape[1])))
    return tokens, handles


@pytest.mark.parametrize("max_downsample, merged", [("1", [32] * 5), ("2", [32] * 5 + [8] * 6)])
def test_sdxl_is_merged_from_its_first_attention_level(script, host, sdxl_model, max_downsample, merged):
    model = copy.deepcopy(sdxl_model)
    assert tome_core.attention_base_downsample(model.model.diffusion_model) == 2
    tokens, handles = count_query_tokens(model)
    wd.txt2img(make_p(model, host, script, script_args(max_downsample=max_downsample), steps=1))
    for h in handles:
        h.remove()
    # 128 px -> a 16x16 latent: 64 tokens at the 2x level (5 blocks), 16 at the 4x level (6 blocks)
    assert sorted((n for n in tokens if n not in (64, 16)), reverse=True) == merged
    assert len(tokens) == 11


def test_sdxl_output_changes_and_the_model_is_restored_exactly(script, host, sdxl_model):
    model = copy.deepcopy(sdxl_model)
    ref = wd.txt2img(make_p(copy.deepcopy(sdxl_model), host, None, [], steps=2))
    out = wd.txt2img(make_p(model, host, script, script_args(), steps=2))
    plain = wd.txt2img(make_p(model, host, None, [], steps=2))
    assert not torch.equal(out.images[0], ref.images[0])
    assert torch.equal(plain.images[0], ref.images[0])
    assert not tome_core.is_patched(model)
