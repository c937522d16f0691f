"""Mode "kv" on ComfyUI DiT families of the table beyond test_comfy_dit's four: Flux.2 (the Flux class
with Flux.2 parameters), Qwen-Image (and its edit models' reference latents), Lumina 2 and Z-Image (NextDiT),
LTX-Video (LTXV, with guide frames), LTX-2 (LTXAV: video beside audio); AuraFlow, whose class is also named MMDiT, is refused naming it.

Reduced-size models built from comfy.supported_models classes with seeded weights, sampled by ComfyUI
(comfy.sample.sample), attention inputs recorded by an override chained after ToMe's. Needs ComfyUI >=
0.3.6x (.venv-comfy-next: ComfyUI 0.3.75); a family whose class the running ComfyUI lacks is skipped,
naming the class.
"""
from __future__ import annotations

import importlib
import inspect
import re
import types

import pytest
import torch

from test_comfy_dit import _as_detected, _patcher, comfy, host_where, sample, spy_on  # noqa: F401

from tome_core.engine.config import ToMeConfig
from tome_core.adapters.model_patcher.dit import dit_family, patch_dit_model_patcher


def _require(module: str, name: str):
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
        pytest.skip(f"this ComfyUI has no {module}.{name}")


def _cond(text: int, dim: int, **extra):
    return [[torch.randn(1, text, dim, generator=torch.Generator().manual_seed(1)), dict(extra)]]


def flux2(comfy):
    flux_model = _require("comfy.ldm.flux.model", "Flux")
    params = importlib.import_module("comfy.ldm.flux.model").FluxParams
    if "global_modulation" not in getattr(params, "__dataclass_fields__", {}):
        pytest.skip(f"this ComfyUI's {flux_model.__module__}.FluxParams has no Flux.2 parameters")
    config_cls = _require("comfy.supported_models", "Flux2")
    patcher = _patcher(comfy, config_cls, _as_detected(params, dict(
        image_model="flux2", in_channels=16, patch_size=1, out_channels=16, vec_in_dim=None, context_in_dim=32,
        hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 4, 4, 4],
        theta=2000, qkv_bias=False, guidance_embed=False, global_modulation=True, mlp_silu_act=True, ops_bias=False,
        default_ref_method="index", ref_index_scale=10.0), txt_ids_dims=[3]))
    # ComfyUI's Flux2 model pads the text to 512 tokens before the call: the prefix is 512 long
    return patcher, torch.zeros(1, 16, 5, 7), _cond(5, 32, pooled_output=torch.zeros(1, 32)), \
        dict(prefix=512, grid=35, suffix=0), 3


def longcat_image(comfy):
    """LongCat-Image: ComfyUIs from 2026 run it through the Flux class (no vector_in, no guidance, text ids on two
    axes, RoPE shifted past the text); [text, image], Flux's default range (its single blocks)."""
    config_cls = _require("comfy.supported_models", "LongCatImage")
    params = importlib.import_module("comfy.ldm.flux.model").FluxParams
    patcher = _patcher(comfy, config_cls, _as_detected(params, dict(
        image_model="flux", in_channels=16, patch_size=2, out_channels=16, vec_in_dim=None, context_in_dim=32,
        hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
        qkv_bias=True, guidance_embed=False), txt_ids_dims=[1, 2]))
    return patcher, torch.zeros(1, 16, 10, 13), _cond(5, 32), dict(prefix=5, grid=35, suffix=0), 2


def krea2(comfy, refs: bool = False):
    """Krea 2 (ComfyUIs from 2026): [text 5, image 35] single-stream blocks after a text-fusion stack; its context
    packs 2 text-encoder layers per token. With ``refs`` a reference latent's 3 x 4 tokens follow the grid."""
    config_cls = _require("comfy.supported_models", "Krea2")
    patcher = _patcher(comfy, config_cls, dict(
        image_model="krea2", features=32, tdim=16, txtdim=16, heads=2, kvheads=1, multiplier=2, layers=2, patch=2,
        channels=16, txtlayers=2, txtheads=2, txtkvheads=2))
    extra = {}
    if refs:
        extra = dict(reference_latents=[torch.randn(1, 16, 1, 6, 8, generator=torch.Generator().manual_seed(5))],
                     reference_latents_method="index")
    return patcher, torch.zeros(1, 16, 1, 10, 13), _cond(5, 32, **extra), dict(prefix=5, grid=35, suffix=0), 2


def joyimage(comfy, refs: bool = False):
    """JoyImage Edit (ComfyUIs from 2026): [image 15, references, text 5]; its RoPE fixes the head width at 128
    (unet_extra_config). With ``refs`` a reference latent's 3 x 4 tokens follow the grid."""
    config_cls = _require("comfy.supported_models", "JoyImage")
    patcher = _patcher(comfy, config_cls, dict(
        image_model="joyimage", in_channels=16, out_channels=16, hidden_size=256, num_attention_heads=2, text_dim=32,
        mlp_width_ratio=1.0, num_layers=2))
    extra = {}
    if refs:
        extra = dict(reference_latents=[torch.randn(1, 16, 1, 6, 8, generator=torch.Generator().manual_seed(5))])
    return patcher, torch.zeros(1, 16, 1, 6, 10), _cond(5, 32, **extra), dict(prefix=0, grid=15, suffix=0), 2


def mage_flow(comfy, refs: bool = False):
    """Mage-Flow (ComfyUIs from 2026): Qwen-Image's blocks, [text 5, image 35, references], patch 1. With ``refs``
    a 3 x 4 reference latent follows the grid."""
    config_cls = _require("comfy.supported_models", "MageFlow")
    patcher = _patcher(comfy, config_cls, dict(
        image_model="mage_flow", in_channels=16, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))
    extra = {}
    if refs:
        extra = dict(reference_latents=[torch.randn(1, 16, 3, 4, generator=torch.Generator().manual_seed(5))])
    return patcher, torch.zeros(1, 16, 5, 7), _cond(5, 32, **extra), dict(prefix=5, grid=35, suffix=0), 2


def _chroma_config(params: str = "comfy.ldm.chroma.model.ChromaParams", **config) -> dict:
    """Chroma's approximator turns 344 inputs of 64 features (16 timestep + 16 guidance + 32 index channels,
    fixed in forward_orig) into one modulation vector each, of the model width: in_dim is 64, out_dim the
    hidden size, whatever the model's size (model_detection sets 64 and 3072). Newer ComfyUIs' params also
    want the keys their model_detection sets for a Chroma checkpoint (no vector_in, zero text ids)."""
    module, name = params.rsplit(".", 1)
    return _as_detected(getattr(importlib.import_module(module), name), dict(dict(
        image_model="chroma", in_channels=64, out_channels=64, patch_size=2, context_in_dim=32, hidden_size=32,
        mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000, qkv_bias=True,
        in_dim=64, out_dim=32, hidden_dim=32, n_layers=1), **config),
        txt_ids_dims=[], vec_in_dim=None, use_x0=False, use_sequential_txt_ids=False)


def chroma(comfy):
    _require("comfy.ldm.chroma.model", "Chroma")
    patcher = _patcher(comfy, comfy.supported_models.Chroma, _chroma_config())
    return patcher, torch.zeros(1, 16, 10, 13), _cond(5, 32, pooled_output=torch.zeros(1, 32)), \
        dict(prefix=5, grid=35, suffix=0), 3


def chroma_radiance(comfy):
    """Pixel space: a [B, 3, H, W] image, patched by a conv (patch 4 here, 16 in the released model)."""
    _require("comfy.ldm.chroma_radiance.model", "ChromaRadiance")
    patcher = _patcher(comfy, comfy.supported_models.ChromaRadiance, _chroma_config(
        "comfy.ldm.chroma_radiance.model.ChromaRadianceParams", image_model="chroma_radiance", in_channels=3,
        out_channels=3, patch_size=4, nerf_hidden_size=16,
        nerf_mlp_ratio=2, nerf_depth=1, nerf_max_freqs=4, nerf_tile_size=512, nerf_final_head_type="linear",
        nerf_embedder_dtype=torch.float32))
    return patcher, torch.zeros(1, 3, 20, 26), _cond(5, 32, pooled_output=torch.zeros(1, 32)), \
        dict(prefix=5, grid=35, suffix=0), 3


def qwen_image(comfy, refs: bool = False):
    _require("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel")
    patcher = _patcher(comfy, comfy.supported_models.QwenImage, dict(
        image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))
    extra = {}
    if refs:  # Qwen-Image-Edit: a reference latent appended after the grid (3 x 4 = 12 tokens)
        extra["reference_latents"] = [torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(5))]
        extra["reference_latents"] = [extra["reference_latents"][0][:, :, None]]
    # A Wan 2.1-format latent [B, C, 1, H, W]: the frame axis is one image
    return patcher, torch.zeros(1, 16, 1, 10, 13), _cond(6, 32, **extra), dict(prefix=6, grid=35, suffix=0), 2


def _lumina(comfy, config_cls, **config):
    _require("comfy.ldm.lumina.model", "NextDiT")
    return _patcher(comfy, config_cls, dict(dict(
        image_model="lumina2", patch_size=2, in_channels=16, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2,
        n_kv_heads=1, multiple_of=16, ffn_dim_multiplier=2.0, qk_norm=True, cap_feat_dim=32, axes_dims=[8, 4, 4],
        axes_lens=[300, 32, 32]), **config))


def lumina2(comfy):
    patcher = _lumina(comfy, comfy.supported_models.Lumina2)
    return patcher, torch.zeros(1, 16, 12, 10), _cond(5, 32), dict(prefix=5, grid=30, suffix=0), 2


def z_image(comfy):
    """Z-Image pads caption and image to 32 tokens each: [caption 5 + 27, image 30 + 2]."""
    config_cls = _require("comfy.supported_models", "ZImage")
    patcher = _lumina(comfy, config_cls, z_image_modulation=True, pad_tokens_multiple=32, time_scale=1000.0,
                      dim=256, axes_dims=[32, 48, 48])  # its modulation takes a 256-wide time embedding
    return patcher, torch.zeros(1, 16, 12, 10), _cond(5, 32), dict(prefix=32, grid=30, suffix=2), 2


def omnigen2(comfy, refs: bool = False):
    """OmniGen2: main layers over [text 5, image 5 x 7] after refiners over each alone (counted); with ``refs`` a
    reference latent's 3 x 4 tokens (padded to the patch: odd sides) sit between the text and the image."""
    config_cls = _require("comfy.supported_models", "Omnigen2")
    patcher = _patcher(comfy, config_cls, dict(
        image_model="omnigen2", patch_size=2, in_channels=16, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(4, 6, 6), axes_lens=(300, 64, 64),
        text_feat_dim=32))
    extra = dict(attention_mask=torch.ones(1, 5, dtype=torch.long))  # as its text encoder hands it over
    if refs:
        extra["reference_latents"] = [torch.randn(1, 16, 5, 7, generator=torch.Generator().manual_seed(5))]
    return patcher, torch.zeros(1, 16, 10, 13), _cond(5, 32, **extra), \
        dict(prefix=5 + (12 if refs else 0), grid=35, suffix=0), 2


def ltxv(comfy):
    _require("comfy.ldm.lightricks.model", "LTXVModel")
    patcher = _patcher(comfy, comfy.supported_models.LTXV, dict(
        image_model="ltxv", in_channels=16, cross_attention_dim=32, attention_head_dim=16, num_attention_heads=2,
        caption_channels=32, num_layers=2))
    return patcher, torch.zeros(1, 16, 3, 6, 5), _cond(7, 32, attention_mask=torch.ones(1, 7)), \
        dict(prefix=0, grid=90, suffix=0), 2


def ideogram4(comfy, text: bool = True):
    """Ideogram 4: [text 6, image 5 x 7] in one stream (its 2x2-packed latent: one cell, one token); without text
    (its unconditional pass) the image alone. The shipped config's sizes are class attributes of
    supported_models.Ideogram4, which override any unet_config: a subclass carries the reduced ones."""
    config_cls = _require("comfy.supported_models", "Ideogram4")
    tiny = type("TinyIdeogram4", (config_cls,), {"unet_extra_config": dict(
        num_attention_heads=2, attention_head_dim=16, intermediate_size=32, adaln_dim=16, llm_features_dim=32,
        rope_theta=10000, mrope_section=[4, 2, 2], norm_eps=1e-5)})
    patcher = _patcher(comfy, tiny, dict(image_model="ideogram4", in_channels=16, num_layers=2))
    cond = _cond(6, 32) if text else [[None, {}]]
    return patcher, torch.zeros(1, 16, 5, 7), cond, dict(prefix=6 if text else 0, grid=35, suffix=0), 2


def lens(comfy):
    """Lens: [image 5 x 7, text 6] in one joint attention, blocks reported; a packed latent (one cell, one token);
    multi-layer text features (2 layers of 16, concatenated) as ComfyUI's text encoder hands them over."""
    config_cls = _require("comfy.supported_models", "Lens")
    patcher = _patcher(comfy, config_cls, dict(
        image_model="lens", in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        enc_hidden_dim=16, axes_dims_rope=(4, 6, 6), selected_layer_index=(0, 1)))
    return patcher, torch.zeros(1, 16, 5, 7), _cond(6, 32), dict(prefix=0, grid=35, suffix=6), 2


def anima(comfy):
    """Anima: self-attention over a 1 x 5 x 7 grid (a 1 x 9 x 13 latent padded to the 2 x 2 patch: odd sides), the
    text (already adapted: no t5xxl_ids, so its LLM adapter does not run) through cross-attention."""
    config_cls = _require("comfy.supported_models", "Anima")
    patcher = _patcher(comfy, config_cls, dict(
        image_model="anima", max_img_h=16, max_img_w=16, max_frames=4, in_channels=16, out_channels=16,
        patch_spatial=2, patch_temporal=1, concat_padding_mask=True, model_channels=32, num_blocks=2, num_heads=2,
        crossattn_emb_channels=32, pos_emb_cls="rope3d", pos_emb_learnable=True, use_adaln_lora=True,
        adaln_lora_dim=16))
    return patcher, torch.zeros(1, 16, 1, 9, 13), _cond(6, 32), dict(prefix=0, grid=35, suffix=0), 2


def ltxav(comfy, audio_frames: int = 7):
    """LTX-2: a [video 3 x 6 x 5, audio] nested latent (as LTXVConcatAVLatent makes it); the text comes fully
    processed (caption_channels * 2 wide), so the text connectors do not run."""
    _require("comfy.ldm.lightricks.av_model", "LTXAVModel")
    import comfy.nested_tensor

    patcher = _patcher(comfy, comfy.supported_models.LTXAV, dict(
        image_model="ltxav", in_channels=16, audio_in_channels=128, cross_attention_dim=32, audio_cross_attention_dim=16,
        attention_head_dim=16, audio_attention_head_dim=8, num_attention_heads=2, audio_num_attention_heads=2,
        caption_channels=32, num_layers=2, connector_attention_head_dim=16, connector_num_attention_heads=2,
        connector_num_layers=1))
    latent = comfy.nested_tensor.NestedTensor([torch.zeros(1, 16, 3, 6, 5), torch.zeros(1, 8, audio_frames, 16)])
    return patcher, latent, _cond(7, 64, attention_mask=torch.ones(1, 7)), dict(prefix=0, grid=90, suffix=0), 2


_WAN = dict(image_model="wan2.1", patch_size=(1, 2, 2), in_dim=16, dim=32, ffn_dim=32, freq_dim=32, text_dim=32,
            out_dim=16, num_heads=2, num_layers=2)


def wan_phantom(comfy):
    """WanModel with time_dim_concat (Phantom's subject images): 2 whole latent frames after the 3 video frames."""
    patcher = _patcher(comfy, comfy.supported_models.WAN21_T2V, dict(_WAN, model_type="t2v"))
    concat = torch.randn(1, 16, 2, 6, 10, generator=torch.Generator().manual_seed(5))
    return patcher, torch.zeros(1, 16, 3, 6, 10), _cond(7, 32, time_dim_concat=concat), \
        dict(prefix=0, grid=45, suffix=30), 2


def wan_vace(comfy):
    """Wan VACE: one vace block (over the control video, the default zero frames and full mask) before main block 0,
    its hint added to the video after it."""
    patcher = _patcher(comfy, comfy.supported_models.WAN21_Vace, dict(_WAN, model_type="vace", vace_layers=1,
                                                                       vace_in_dim=96))
    return patcher, torch.zeros(1, 16, 3, 6, 10), _cond(7, 32), dict(prefix=0, grid=45, suffix=0), 2


def wan_humo(comfy):
    """HuMo: its reference latent (one frame, 3 x 5 tokens) follows the video in the self-attention."""
    _require("comfy.ldm.wan.model", "HumoWanModel")
    patcher = _patcher(comfy, comfy.supported_models.WAN21_HuMo, dict(_WAN, model_type="humo"))
    reference = torch.randn(1, 16, 1, 6, 10, generator=torch.Generator().manual_seed(5))
    return patcher, torch.zeros(1, 16, 3, 6, 10), _cond(7, 32, reference_latents=[reference]), \
        dict(prefix=0, grid=45, suffix=15), 2


def wan_animate(comfy):
    """Wan 2.2 Animate: the latent's first frame is the reference image (kept whole); pose latents are added to
    the frames after it."""
    _require("comfy.ldm.wan.model_animate", "AnimateWanModel")
    patcher = _patcher(comfy, comfy.supported_models.WAN22_Animate, dict(_WAN, model_type="animate"))
    pose = torch.randn(1, 16, 3, 6, 10, generator=torch.Generator().manual_seed(5))
    return patcher, torch.zeros(1, 16, 4, 6, 10), _cond(7, 32, pose_video_latent=pose), \
        dict(prefix=15, grid=45, suffix=0), 2


def _reached(comfy, patcher, latent, cond) -> bool:
    """Whether any attention of a model call gets transformer_options on this ComfyUI (so an override reaches it)."""
    probe = patcher.clone()
    calls = spy_on(probe)
    sample(comfy, probe, latent, cond, steps=1)
    return bool(calls)


def wan_s2v(comfy, refs: bool = False):
    """Wan 2.2 S2V where its blocks are reached (2026 ComfyUIs; 0.3.x calls them without transformer_options)."""
    built = _wan_s2v(comfy, refs)
    if not _reached(comfy, *built[:3]):
        pytest.skip("this ComfyUI's comfy.ldm.wan.model.WanModel_S2V calls its blocks without transformer_options: "
                    "no override reaches them (test_wan_s2v_out_of_reach_is_refused_before_sampling covers it)")
    return built


def _wan_s2v(comfy, refs: bool = False):
    """Wan 2.2 S2V: self-attention over a 3 x 4 x 8 grid; with ``refs`` its reference image (1 x 4 x 8 tokens) and
    packed motion frames (4 x 8 + 1 x 2 x 4 + 4 x 1 x 2 tokens) follow it."""
    _require("comfy.ldm.wan.model", "WanModel_S2V")
    patcher = _patcher(comfy, comfy.supported_models.WAN22_S2V, dict(
        _WAN, model_type="s2v", audio_dim=32, num_audio_token=2, audio_inject_layers=[0]))
    extra = {}
    if refs:
        g = torch.Generator().manual_seed(5)
        extra = dict(reference_latents=[torch.randn(1, 16, 1, 8, 16, generator=g)],
                     reference_motion=torch.randn(1, 16, 19, 8, 16, generator=g))
    return patcher, torch.zeros(1, 16, 3, 8, 16), _cond(7, 32, **extra), dict(prefix=0, grid=96, suffix=0), 2


def wan_scail(comfy):
    """SCAIL (2026 ComfyUIs): [reference frame 3 x 5, video 3 x 3 x 5, pose 3 x 3 x 5] in one self-attention; the
    reference is concatenated before the video in time, the pose tokens follow it; blocks reported."""
    config_cls = _require("comfy.supported_models", "WAN21_SCAIL")
    patcher = _patcher(comfy, config_cls, dict(_WAN, model_type="scail", in_dim=20))
    g = torch.Generator().manual_seed(5)
    cond = _cond(7, 32, reference_latents=[torch.randn(1, 16, 1, 6, 10, generator=g)],
                 pose_video_latent=torch.randn(1, 16, 3, 6, 10, generator=g))
    return patcher, torch.zeros(1, 16, 3, 6, 10), cond, dict(prefix=15, grid=45, suffix=0), 2


def wan_dancer(comfy):
    """WanDancer (2026 ComfyUIs): WanModel's self-attention over the video; its music attentions never reach
    ComfyUI's override (called without transformer_options)."""
    config_cls = _require("comfy.supported_models", "WAN22_WanDancer")
    patcher = _patcher(comfy, config_cls, dict(_WAN, model_type="wandancer", music_dim=16, music_heads=2,
                                               music_latent_dim=16, audio_inject_layers=[0]))
    return patcher, torch.zeros(1, 16, 3, 6, 10), _cond(7, 32), dict(prefix=0, grid=45, suffix=0), 2


def hidream(comfy, image_cond: bool = False):
    """HiDream I1: [image, text], text = 5 T5 + 2 x 4 Llama tokens (the joint attention told apart by length: the
    model reports no blocks). With image_cond (E1: the reference concatenated along the width) left unreduced."""
    _require("comfy.ldm.hidream.model", "HiDreamImageTransformer2DModel")
    patcher = _patcher(comfy, comfy.supported_models.HiDream, dict(
        image_model="hidream", patch_size=2, in_channels=16, out_channels=16, num_layers=1, num_single_layers=2,
        attention_head_dim=16, num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=32,
        num_routed_experts=2, num_activated_experts=1, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16),
        llama_layers=[0, 1, 2]))
    g = torch.Generator().manual_seed(5)
    extra = dict(pooled_output=torch.randn(1, 32, generator=g), conditioning_llama3=torch.randn(1, 3, 4, 32, generator=g))
    if image_cond:
        extra["concat_latent_image"] = torch.randn(1, 16, 10, 13, generator=g)
    return patcher, torch.zeros(1, 16, 10, 13), _cond(5, 32, **extra), dict(prefix=0, grid=35, suffix=13), 3


def hidream_o1(comfy):
    """HiDream O1 (2026 ComfyUIs): a Qwen3-VL decoder over [text 13 (its chat template, ending in the timestep
    token), image 3 x 5 (32 x 32 pixel patches of a 96 x 160 image)]; the causal text runs outside ComfyUI's
    attention, the generation queries (from the timestep token on: 16 of 28) attend every key."""
    config_cls = _require("comfy.supported_models", "HiDreamO1")
    o1 = importlib.import_module("comfy.text_encoders.hidream_o1")
    patcher = _patcher(comfy, config_cls, dict(image_model="hidream_o1", text_config_overrides=dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
        head_dim=16, rope_dims=[4, 2, 2]), vision_config_overrides=dict(
        hidden_size=32, num_heads=2, intermediate_size=32, depth=1, num_position_embeddings=64)))
    ids = [o1.IM_START_ID, o1.USER_ID, o1.NEWLINE_ID, 100, 200, o1.IM_END_ID, o1.NEWLINE_ID, o1.IM_START_ID,
           o1.ASSISTANT_ID, o1.NEWLINE_ID, o1.BOI_TOKEN_ID, 300, o1.TMS_TOKEN_ID]
    ids = torch.tensor([ids])
    cond = [[ids.unsqueeze(-1).float(), {"text_input_ids": ids}]]  # its text encoder's stand-in context and ids
    return patcher, torch.zeros(1, 3, 96, 160), cond, dict(prefix=13, grid=15, suffix=0), 2


def _hunyuan_patcher(comfy, config_cls, **config):
    params = importlib.import_module("comfy.ldm.hunyuan_video.model").HunyuanVideoParams
    if "vision_in_dim" not in getattr(params, "__dataclass_fields__", {}):
        pytest.skip("this ComfyUI's HunyuanVideoParams has no HunyuanVideo 1.5 / HunyuanImage 2.1 parameters")
    return _patcher(comfy, config_cls, _as_detected(params, dict(dict(
        image_model="hunyuan_video", in_channels=16, out_channels=16, vec_in_dim=None, context_in_dim=32,
        hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=1, theta=256, qkv_bias=True,
        guidance_embed=False, byt5=True, meanflow=False, use_cond_type_embedding=False, vision_in_dim=None), **config),
        meanflow_sum=False))


def hunyuan_video15(comfy):
    """HunyuanVideo 1.5 through ComfyUI's HunyuanVideo class with its own parameters (patch 1, byT5, cond-type
    embedding, vision tokens; image + mask channels concatenated): [video, byT5 + text + vision tokens]."""
    config_cls = _require("comfy.supported_models", "HunyuanVideo15")
    patcher = _hunyuan_patcher(comfy, config_cls, in_channels=33, patch_size=[1, 1, 1], axes_dim=[4, 6, 6],
                       use_cond_type_embedding=True, vision_in_dim=32)
    g = torch.Generator().manual_seed(5)
    vision = types.SimpleNamespace(last_hidden_state=torch.randn(1, 3, 32, generator=g))
    cond = _cond(7, 32, conditioning_byt5small=torch.randn(1, 4, 1472, generator=g), clip_vision_output=vision,
                 pooled_output=torch.zeros(1, 32))  # model_base.HunyuanVideo asks for it; vec_in_dim None ignores it
    return patcher, torch.zeros(1, 16, 3, 6, 5), cond, host_where(patcher, dict(prefix=0, grid=90, suffix=0), 14), 2


def hunyuan_image21(comfy):
    """HunyuanImage 2.1 through the HunyuanVideo class: a 2-d patch on a [B, C, H, W] latent, byT5 tokens."""
    config_cls = _require("comfy.supported_models", "HunyuanImage21")
    patcher = _hunyuan_patcher(comfy, config_cls, patch_size=[1, 1], axes_dim=[8, 8])
    g = torch.Generator().manual_seed(5)
    return patcher, torch.zeros(1, 16, 5, 7), _cond(7, 32, conditioning_byt5small=torch.randn(1, 4, 1472, generator=g)), \
        host_where(patcher, dict(prefix=0, grid=35, suffix=0), 11), 2


def kandinsky5(comfy, image_to_video: bool = False):
    """Kandinsky 5 (ComfyUIs from 2026): text blocks, then visual blocks whose self-attention sees the grid alone.
    With ``image_to_video`` time_dim_replace writes a conditioning latent over the first frame: kept whole."""
    config_cls = _require("comfy.supported_models", "Kandinsky5")
    patcher = _patcher(comfy, config_cls, dict(
        image_model="kandinsky5", in_visual_dim=16, out_visual_dim=16, in_text_dim=32, in_text_dim2=32, time_dim=32,
        model_dim=32, ff_dim=32, visual_embed_dim=(16 + 16 + 1) * 4, patch_size=(1, 2, 2), num_text_blocks=1,
        num_visual_blocks=2, axes_dims=(4, 6, 6)))
    g = torch.Generator().manual_seed(5)
    extra = dict(pooled_output=torch.randn(1, 32, generator=g))
    if image_to_video:
        extra["time_dim_replace"] = torch.randn(1, 16, 1, 6, 10, generator=g)
    return patcher, torch.zeros(1, 16, 3, 6, 10), _cond(7, 32, **extra), \
        dict(prefix=15 if image_to_video else 0, grid=30 if image_to_video else 45, suffix=0), 2


FAMILIES = {"flux2": flux2, "chroma": chroma, "chroma_radiance": chroma_radiance, "qwen_image": qwen_image,
            "lumina2": lumina2, "z_image": z_image, "ltxv": ltxv, "ltxav": ltxav, "ideogram4": ideogram4, "lens": lens, "anima": anima, "wan_phantom": wan_phantom, "wan_humo": wan_humo,
            "wan_animate": wan_animate, "hidream": hidream, "hunyuan_video15": hunyuan_video15,
            "hunyuan_image21": hunyuan_image21, "kandinsky5": kandinsky5, "longcat_image": longcat_image,
            "krea2": krea2, "joyimage": joyimage, "mage_flow": mage_flow, "wan_s2v": wan_s2v, "wan_scail": wan_scail,
            "wan_dancer": wan_dancer, "hidream_o1": hidream_o1, "omnigen2": omnigen2}
# each fixture's family in the catalogue (tome_core/catalogue/families.py), where its name differs
TABLE_NAME = {"flux2": "flux", "lumina2": "z_image", "chroma_radiance": "chroma", "wan_phantom": "wan",
              "hunyuan_video15": "hunyuan_video", "hunyuan_image21": "hunyuan_video", "longcat_image": "flux",
              "wan_dancer": "wan", "ltxv": "ltx_video", "ltxav": "ltx2", "wan_humo": "wan", "wan_animate": "wan",
              "wan_s2v": "wan", "wan_scail": "wan", "hidream_o1": "hidream"}
PARTIAL_QUERIES = {"hidream_o1"}  # its generation queries are fewer than its keys


def _seq(call) -> int:
    return 2 if call[3] else 1


def _spied(comfy, patcher, latent, cond, config=None):
    base = patcher.clone()
    calls = spy_on(base)
    model = base if config is None else patch_dit_model_patcher(base, config)
    sample(comfy, model, latent, cond, steps=1)
    return calls


def _check_kept(vanilla, patched, where, reduced_count, partial=False):
    """Every query kept; only self-attentions over the layout shortened (their count given; with ``partial``, HiDream
    O1's, fewer queries than keys); in the first one (same inputs with and without the patch) text and tokens after
    the grid keep every key/value and the kept grid keys are real keys of different positions."""
    length = where["prefix"] + where["grid"] + where["suffix"]
    assert len(vanilla) == len(patched) > 0
    shortened = []
    for a, b in zip(vanilla, patched):
        s = _seq(a)
        assert a[0].shape == b[0].shape and b[1].shape[s] == b[2].shape[s]
        shortened.append(b[1].shape[s] < a[1].shape[s])
        if shortened[-1]:
            queries, keys = a[0].shape[s], a[1].shape[s]
            assert keys >= length and (queries < keys if partial else queries == keys)
    assert sum(shortened) == reduced_count
    first = shortened.index(True)
    (q0, k0, v0, _), (q1, k1, v1, _) = vanilla[first], patched[first]
    s, pre = _seq(vanilla[first]), where["prefix"]
    n, m = k0.shape[s], k1.shape[s]
    after = n - pre - where["grid"]  # suffix plus tokens the model appends (references)
    assert torch.equal(q0, q1)
    for kept, full in ((k1, k0), (v1, v0)):
        assert torch.equal(kept.narrow(s, 0, pre), full.narrow(s, 0, pre))
        assert torch.equal(kept.narrow(s, m - after, after), full.narrow(s, n - after, after))
    img0 = k0.narrow(s, pre, where["grid"]).movedim(s, 1).flatten(2)[0]
    img1 = k1.narrow(s, pre, m - pre - after).movedim(s, 1).flatten(2)[0]
    match = (img1[:, None] == img0[None]).all(-1)
    assert (match.sum(1) >= 1).all() and match.float().argmax(1).unique().numel() == img1.shape[0] < img0.shape[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_bounded_change_and_original_untouched(comfy, family):
    patcher, latent, cond, _, _ = FAMILIES[family](comfy)
    assert dit_family(patcher).name == TABLE_NAME.get(family, family)
    expected = sample(comfy, patcher, latent, cond)
    assert torch.isfinite(expected).all()
    assert torch.equal(sample(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.0, mode="kv")),
                              latent, cond), expected)
    on = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    changed = sample(comfy, on, latent, cond)
    rel = ((changed - expected).norm() / expected.norm()).item()
    assert 0 < rel < 1.0, rel
    assert torch.equal(sample(comfy, patcher, latent, cond), expected) and not patcher.wrappers.get("apply_model")


@pytest.mark.parametrize("family", FAMILIES)
def test_queries_text_and_non_grid_tokens_keep_every_key(comfy, family):
    """The default block range (every block of these families; Flux.2 runs through the Flux class, whose
    default is its single blocks) on the real attention inputs."""
    patcher, latent, cond, where, reduced = FAMILIES[family](comfy)
    vanilla = _spied(comfy, patcher, latent, cond)
    patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", seed=3))
    _check_kept(vanilla, patched, where, 2 if family == "flux2" else reduced, partial=family in PARTIAL_QUERIES)


def _seeded_patcher(comfy, model):
    """A ModelPatcher of ``model`` with every diffusion-model weight seeded (ComfyUI's ops skip weight init)."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.diffusion_model.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 16
            p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


@pytest.mark.parametrize("family", ["chroma", "chroma_radiance", "hidream", "wan_phantom", "wan_humo", "wan_animate",
                                    "wan_s2v", "wan_scail", "hidream_o1", "omnigen2"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_of_three_and_bf16(comfy, family, dtype):
    """Odd-sized latents in a batch of 3 (conditioning repeated by ComfyUI), the model in float32 or bf16: ratio 0
    is the unpatched output bit for bit, 0.5 changes it and stays finite, the input MODEL is untouched."""
    patcher, latent, cond, _, _ = FAMILIES[family](comfy)
    if dtype != torch.float32:  # as ComfyUI loads a bf16 checkpoint: its operations built for that dtype
        config = patcher.model.model_config
        config.set_inference_dtype(dtype, None)
        patcher = _seeded_patcher(comfy, config.get_model({}))
        assert patcher.model.get_dtype() == dtype
    latent = latent.expand(3, *latent.shape[1:]).clone()
    expected = sample(comfy, patcher, latent, cond, steps=1)
    assert torch.equal(sample(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.0, mode="kv")), latent, cond,
                              steps=1), expected)
    changed = sample(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv")), latent, cond, steps=1)
    assert changed.shape == expected.shape and torch.isfinite(changed).all() and not torch.equal(changed, expected)
    assert torch.equal(sample(comfy, patcher, latent, cond, steps=1), expected)


def test_hunyuan_video15_byt5_and_vision_tokens_keep_every_key(comfy):
    """HunyuanVideo 1.5's joint attention is [video 90, byT5 4 + text 7 + vision 3]: the 14 tokens the model adds
    after the grid keep every key, the video's keys are reduced."""
    patcher, latent, cond, where, reduced = hunyuan_video15(comfy)
    vanilla = _spied(comfy, patcher, latent, cond)
    assert max(a[1].shape[_seq(a)] for a in vanilla) == where["grid"] + 4 + 7 + 3
    patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", seed=3))
    _check_kept(vanilla, patched, where, reduced)


def test_kandinsky5_image_to_video_first_frame_keeps_every_key(comfy):
    """Kandinsky 5 image-to-video writes the image latent over the first frame (time_dim_replace): that frame's
    15 tokens keep every key, the other two frames are reduced."""
    patcher, latent, cond, where, reduced = kandinsky5(comfy, image_to_video=True)
    vanilla = _spied(comfy, patcher, latent, cond)
    patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", seed=3))
    _check_kept(vanilla, patched, where, reduced)


@pytest.mark.parametrize("family", ["krea2", "joyimage", "mage_flow"])
def test_reference_latent_tokens_keep_every_key(comfy, family):
    """Krea 2's, JoyImage Edit's and Mage-Flow's reference latents (3 x 4 tokens) follow the grid: kept whole."""
    patcher, latent, cond, where, reduced = FAMILIES[family](comfy, refs=True)
    vanilla = _spied(comfy, patcher, latent, cond)
    text_after = 5 if family == "joyimage" else 0  # JoyImage: [image, references, text]
    assert max(a[1].shape[_seq(a)] for a in vanilla) == where["prefix"] + where["grid"] + 12 + text_after
    patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", seed=3))
    _check_kept(vanilla, patched, where, reduced)


def test_omnigen2_reference_latent_tokens_keep_every_key(comfy):
    """OmniGen2's reference latent (5 x 7, padded to 6 x 8: 3 x 4 tokens) sits between its text and its image in the
    main layers: text and reference keep every key, the image's keys are reduced in both layers."""
    patcher, latent, cond, where, reduced = omnigen2(comfy, refs=True)
    vanilla = _spied(comfy, patcher, latent, cond)
    assert max(a[1].shape[_seq(a)] for a in vanilla) == where["prefix"] + where["grid"]
    patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", seed=3))
    _check_kept(vanilla, patched, where, reduced)


def test_qwen_image_edit_reference_tokens_keep_every_key(comfy):
    patcher, latent, cond, where, reduced = qwen_image(comfy, refs=True)
    vanilla = _spied(comfy, patcher, latent, cond)
    assert vanilla[0][1].shape[_seq(vanilla[0])] == where["prefix"] + where["grid"] + 12
    patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", seed=3))
    _check_kept(vanilla, patched, where, reduced)


@pytest.mark.parametrize("family", ["chroma", "qwen_image", "lumina2", "ltxv", "ltxav", "ideogram4", "lens",
                                    "anima", "hidream", "kandinsky5", "wan_s2v", "wan_scail", "wan_dancer",
                                    "hidream_o1", "omnigen2"])
def test_block_range_reduces_the_second_half(comfy, family):
    """Block range 0.5-1: of the self-attentions whose keys span the layout (SCAIL's pose tokens after it; HiDream
    O1's fewer queries), exactly the second half is shortened."""
    patcher, latent, cond, where, reduced = FAMILIES[family](comfy)
    vanilla = _spied(comfy, patcher, latent, cond)
    patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", block_start=0.5))
    shortened = [b[1].shape[_seq(a)] < a[1].shape[_seq(a)] for a, b in zip(vanilla, patched)]
    over = [i for i, a in enumerate(vanilla) if a[1].shape[_seq(a)] >= where["prefix"] + where["grid"] + where["suffix"]
            and (a[0].shape[_seq(a)] == a[1].shape[_seq(a)] or family in PARTIAL_QUERIES)]
    assert len(over) == reduced and [i for i, s in enumerate(shortened) if s] == over[reduced // 2:]


def test_wan_s2v_reference_and_motion_tokens_keep_every_key(comfy, caplog):
    """S2V's reference image (1 x 4 x 8 tokens) and packed motion frames (32 + 8 + 8 tokens) follow the video in its
    self-attention: they keep every key, the video's keys are reduced in each block (read from the block report);
    no warning that the model is out of reach."""
    patcher, latent, cond, where, reduced = wan_s2v(comfy, refs=True)
    vanilla = _spied(comfy, patcher, latent, cond)
    assert max(a[1].shape[_seq(a)] for a in vanilla) == where["grid"] + 32 + 48
    with caplog.at_level("WARNING", logger="tome.dit"):
        patched = _spied(comfy, patcher, latent, cond, ToMeConfig(ratio=0.5, mode="kv", seed=3))
    _check_kept(vanilla, patched, where, reduced)
    assert not [r for r in caplog.records if "reduces nothing" in r.getMessage()]


def test_wan_s2v_out_of_reach_is_refused_before_sampling(comfy):
    """ComfyUI 0.3.x calls S2V's blocks without transformer_options, so no override could reach them: the node is
    refused before sampling, naming the class, the method and the fix (never accepted and left unreduced)."""
    patcher, latent, cond, _, _ = _wan_s2v(comfy)
    if _reached(comfy, patcher, latent, cond):
        pytest.skip("this ComfyUI passes transformer_options to WanModel_S2V's blocks: reached (the wan_s2v tests run)")
    with pytest.raises(TypeError) as refused:
        patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    assert str(refused.value) == (
        "ToMe: WanModel_S2V cannot be reduced here: this ComfyUI's comfy.ldm.wan.model.WanModel_S2V.forward_orig "
        "calls its blocks without transformer_options, so no attention override reaches them; update ComfyUI (2026 "
        "ComfyUIs pass them).")


def test_hidream_o1_cached_pass_is_reduced(comfy):
    """HiDream O1 caches its text's keys/values after the first step; the later steps run only the fresh queries
    (the generation's) against cached + fresh keys. Both passes are reduced in every layer: 2 steps x 2 layers, each
    call's queries untouched and its 13 text keys kept."""
    patcher, latent, cond, where, reduced = hidream_o1(comfy)
    base = patcher.clone()
    calls = spy_on(base)
    sample(comfy, patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv")), latent, cond, steps=2)
    assert patcher.model.diffusion_model._kv_cache_entries  # the second step ran from the cache
    length = where["prefix"] + where["grid"]
    shortened = [(q.shape[2], k.shape[2]) for q, k, _, _ in calls if k.shape[2] < length]
    assert len(shortened) == 2 * reduced and all(q == length - 12 and k < length for q, k in shortened)


@pytest.mark.parametrize("module, name, config, model_type", [
    ("comfy.ldm.wan.model_animate2", "WanAnimate2Model", "WAN_Animate2", "animate2"),
    ("comfy.ldm.wan.ar_model", "CausalWanModel", "WAN21_CausalAR_T2V", "t2v")])
def test_wan_classes_out_of_reach_are_refused_naming_them(comfy, module, name, config, model_type):
    """Wan Animate 2 (with its pose video the generation runs one frame's queries at a time against every key plus
    that frame's pose tokens) and the causal Wan (its autoregressive sampler calls the blocks without
    transformer_options, each chunk against a key/value cache of the earlier ones) are refused before sampling,
    naming module and class; nothing is patched."""
    _require(module, name)
    patcher = _patcher(comfy, _require("comfy.supported_models", config), dict(_WAN, model_type=model_type))
    assert type(patcher.model.diffusion_model).__name__ == name and dit_family(patcher) is None
    with pytest.raises(TypeError, match=rf"{name} is not a DiT .*\({re.escape(module)}\.{name}\)"):
        patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    assert not patcher.wrappers.get("apply_model")




def test_hidream_e1_image_cond_is_left_unreduced(comfy):
    """HiDream E1 concatenates its reference along the width (each token row mixes both images): its sequence is
    longer than the I1 layout, so such a call is left whole, bit-identical to the unpatched model, while the same
    patched model without image_cond is reduced."""
    patcher, latent, cond, _, _ = hidream(comfy, image_cond=True)
    expected = sample(comfy, patcher, latent, cond)
    patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    assert torch.equal(sample(comfy, patched, latent, cond), expected)
    _, _, plain, _, _ = hidream(comfy)
    assert not torch.equal(sample(comfy, patched, latent, plain), sample(comfy, patcher, latent, plain))


def test_auraflow_is_refused_naming_it_not_taken_for_sd3(comfy):
    """ComfyUI's AuraFlow diffusion model is also a class named MMDiT (comfy.ldm.aura.mmdit): refused, naming
    its module, not patched as SD3."""
    _require("comfy.ldm.aura.mmdit", "MMDiT")
    patcher = _patcher(comfy, comfy.supported_models.AuraFlow, dict(
        in_channels=4, out_channels=4, patch_size=2, dim=32, n_layers=2, n_double_layers=1,
        n_heads=2, global_conddim=32, cond_seq_dim=32, max_seq=64))
    assert type(patcher.model.diffusion_model).__name__ == "MMDiT" and dit_family(patcher) is None
    with pytest.raises(TypeError, match=r"MMDiT is not a DiT .*\(comfy\.ldm\.aura\.mmdit\.MMDiT\)"):
        patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    assert not patcher.wrappers.get("apply_model")


def test_hunyuan_video_layout_follows_the_host(comfy, monkeypatch):
    """ComfyUI 0.13+ dropped DoubleStreamBlock's flipped_img_txt and runs HunyuanVideo as [text, video] (0.3.x:
    [video, text]). The table reads which from the host's class: the real one here (the 2026-08 ComfyUI: grid last;
    0.3.75: grid first), and a block without that parameter (simulated) reads as grid last. The other HunyuanVideo
    tests check the kept keys on the running host's real order."""
    import comfy.ldm.flux.layers as layers

    from tome_core.catalogue.comfy_lookup import comfy_model

    patcher = _hunyuan_patcher(comfy, _require("comfy.supported_models", "HunyuanVideo15"), in_channels=33,
                               patch_size=[1, 1, 1], axes_dim=[4, 6, 6], use_cond_type_embedding=True, vision_in_dim=32)
    model = patcher.model.diffusion_model
    text_first = "flipped_img_txt" not in inspect.signature(layers.DoubleStreamBlock.__init__).parameters
    assert comfy_model(model).grid_last == text_first
    assert patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv")) is not patcher

    class TextFirstDoubleStreamBlock(layers.DoubleStreamBlock):
        def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=False, dtype=None, device=None,
                     operations=None):
            super().__init__(hidden_size, num_heads, mlp_ratio, qkv_bias=qkv_bias, dtype=dtype, device=device,
                             operations=operations)

    monkeypatch.setattr(layers, "DoubleStreamBlock", TextFirstDoubleStreamBlock)
    assert comfy_model(model).grid_last


def test_z_image_calls_with_reference_latents_are_left_whole(comfy):
    """The 2026 NextDiT (Z-Image Omni / edit) adds reference latents and SigLIP features to the sequence;
    the table cannot place them, so such a call has no layout (nothing reduced), while a plain call has one."""
    from tome_core.adapters.model_patcher.layout import token_layout

    patcher, latent, cond, where, _ = FAMILIES["z_image"](comfy)
    model = patcher.model.diffusion_model
    context = cond[0][0]
    plain = token_layout(model, latent, context, {})
    assert plain is not None and plain.grid_tokens == where["grid"]
    for key in ("ref_latents", "siglip_feats"):
        assert token_layout(model, latent, context, {key: [torch.zeros(1, 16, 12, 10)]}) is None


def test_ltxav_audio_as_long_as_the_video_is_left_whole(comfy):
    """LTX-2's audio self-attention has no block report: with as many audio tokens (90) as video tokens it cannot be
    told from the video's, so the call is left whole (bit-identical to the unpatched model); 7 audio tokens: reduced."""
    patcher, latent, cond, _, _ = ltxav(comfy, audio_frames=90)
    expected = sample(comfy, patcher, latent, cond, steps=1)
    patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    assert torch.equal(sample(comfy, patched, latent, cond, steps=1), expected)
    _, short, _, _, _ = ltxav(comfy)
    assert not torch.equal(sample(comfy, patched, short, cond, steps=1), sample(comfy, patcher, short, cond, steps=1))


def test_ltxav_stg_blocks_are_skipped_in_the_block_count(comfy):
    """LTXVSpatioTemporalGuidance's pass computes no self-attention in its blocks (stg_self_attn_blocks): with block 0
    perturbed, the first video self-attention is block 1's, and the range 0.5-1 (block 1 only) reduces it."""
    patcher, latent, cond, where, _ = ltxav(comfy)
    stg = patcher.clone()
    stg.model_options.setdefault("transformer_options", {})["stg_self_attn_blocks"] = frozenset({0})
    vanilla = _spied(comfy, stg, latent, cond)
    patched = _spied(comfy, stg, latent, cond, ToMeConfig(ratio=0.5, mode="kv", block_start=0.5))
    over = [i for i, a in enumerate(vanilla) if a[1].shape[1] == a[0].shape[1] == where["grid"]]
    shortened = [i for i, (a, b) in enumerate(zip(vanilla, patched)) if b[1].shape[1] < a[1].shape[1]]
    assert len(over) == 1 and shortened == over


@pytest.mark.parametrize("family", ["qwen_image", "ideogram4", "lens"])
def test_text_mask_follows_the_kept_keys(comfy, family):
    """A padded prompt (a text attention mask): Qwen-Image and Ideogram 4 hand ComfyUI's attention the mask by
    position (``(q, k, v, heads, mask)``); its key columns are cut with the keys, so every reduced call gets a mask
    as long as its keys (on the 2026-08 ComfyUI Qwen-Image crashed in the attention before; Lens passes it by
    keyword), and the image changes but stays finite."""
    from test_comfy_dit import OVERRIDE

    patcher, latent, _, where, reduced = FAMILIES[family](comfy)
    mask = torch.ones(1, 6)
    mask[0, -2:] = 0
    cond = _cond(6, 32, attention_mask=mask)
    seen = []

    def spy(func, *args, **kwargs):
        given = args[4] if len(args) >= 5 else kwargs.get("mask")
        if isinstance(given, torch.Tensor):
            seen.append((args[1].shape[2 if kwargs.get("skip_reshape") else 1], given.shape[-1]))
        return func(*args, **kwargs)

    base = patcher.clone()
    base.model_options.setdefault("transformer_options", {})[OVERRIDE] = spy
    on = patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv"))
    out = sample(comfy, on, latent, cond, steps=1)
    length = where["prefix"] + where["grid"]
    shortened = [keys for keys, _ in seen if keys < length]
    if not seen:
        pytest.skip(f"this ComfyUI's {family} passes no text mask to the attention")
    assert shortened and len(shortened) % reduced == 0 and all(keys == columns for keys, columns in seen)
    expected = sample(comfy, patcher, latent, cond, steps=1)
    assert torch.isfinite(out).all() and not torch.equal(out, expected)


def test_ideogram4_call_without_text_is_the_image_alone(comfy):
    """Ideogram 4 runs its unconditional pass without text ([image] alone): that call's layout is the grid with no
    prefix, not an unknown one."""
    from tome_core.adapters.model_patcher.layout import token_layout

    patcher, latent, cond, where, _ = ideogram4(comfy)
    model = patcher.model.diffusion_model
    alone, joint = token_layout(model, latent, None, {}), token_layout(model, latent, cond[0][0], {})
    assert (alone.prefix, alone.grid_tokens, alone.length) == (0, 35, 35)
    assert (joint.prefix, joint.grid_tokens, joint.length) == (6, 35, 41)


@pytest.mark.parametrize("mode", ["kv", "merge"])
def test_z_image_calls_with_reference_latents_stop_the_prompt(comfy, mode):
    """A Z-Image Omni / edit call (reference latents in the conditioning: ComfyUIs whose Lumina2 takes them) cannot be
    placed: rather than an image without ToMe under a node that says otherwise, sampling stops naming the inputs."""
    import inspect

    model_base = importlib.import_module("comfy.model_base")
    if "reference_latents" not in inspect.getsource(model_base.Lumina2.extra_conds):
        pytest.skip("this ComfyUI's Lumina2 takes no reference latents (no Z-Image Omni)")
    patcher, latent, _, _, _ = FAMILIES["z_image"](comfy)
    cond = _cond(5, 32, reference_latents=[torch.zeros(1, 16, 12, 10)])
    patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode))
    with pytest.raises(ValueError, match="NextDiT call carries ref_latents, whose tokens ToMe cannot place.*remove the ToMe node"):
        sample(comfy, patched, latent, cond, steps=1)
