"""Mode "kv" on the diffusers DiT families added from the family table (tome_core.catalogue.diffusers_dits): Chroma,
Flux.2, Qwen-Image (and its edit models' reference tokens), Lumina 2, Z-Image, LTX-Video, LTX-2; their
real classes, reduced in size, seeded weights. Also: models the table does not hold are refused naming
them (AuraFlow; a class with a supported name from another module), and diffusers' step caches that
skip an attention compose with kv on Flux."""
from __future__ import annotations

import contextlib

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tome_core import apply_patch, is_patched, remove_patch  # noqa: E402
from conftest import SpyAttention, check_identity_at_ratio_zero_and_after_removal, check_reduced_output  # noqa: E402
from conftest import seed_weights as _seed_weights  # noqa: E402
from tome_core.adapters.hooks.dit import STATE_ATTR  # noqa: E402
from tome_core.catalogue.diffusers_lookup import family_of  # noqa: E402


def _raster_ids(h: int, w: int, columns: int, first: float = 0.0) -> torch.Tensor:
    ids = torch.zeros(h, w, columns)
    ids[..., 0] = first
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    return ids.reshape(-1, columns)


def chroma(h: int = 6, w: int = 7, batch: int = 1, text: int = 5):
    model = _seed_weights(diffusers.ChromaTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6), approximator_num_channels=8, approximator_hidden_dim=32,
        approximator_layers=1))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, h * w, 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g), timestep=torch.full((batch,), 0.6),
                  img_ids=_raster_ids(h, w, 3), txt_ids=torch.zeros(text, 3))
    return model, inputs, dict(prefix=text, suffix=0, grid=(h, w))


def flux2(h: int = 6, w: int = 7, batch: int = 1, text: int = 5, refs: bool = False):
    """ids (t, h, w, l); with ``refs`` a 3 x 4 reference image follows the grid with t = 10 (Flux2Pipeline)."""
    model = _seed_weights(diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, timestep_guidance_channels=16, mlp_ratio=2.0, axes_dims_rope=(4, 4, 4, 4),
        guidance_embeds=False))
    g = torch.Generator().manual_seed(1)
    ids = _raster_ids(h, w, 4)
    if refs:
        ids = torch.cat([ids, _raster_ids(3, 4, 4, first=10.0)])
    inputs = dict(hidden_states=torch.randn(batch, ids.shape[0], 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g), timestep=torch.full((batch,), 0.6),
                  img_ids=ids, txt_ids=torch.zeros(text, 4))
    return model, inputs, dict(prefix=text, suffix=ids.shape[0] - h * w, grid=(h, w))


def qwen_image(h: int = 6, w: int = 7, batch: int = 1, text: int = 5, refs: bool = False):
    """[text, image, references]: with ``refs`` an edit model's 3 x 4 reference image follows the grid."""
    model = _seed_weights(diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    shapes = [(1, h, w)] + ([(1, 3, 4)] if refs else [])
    n = sum(f * a * b for f, a, b in shapes)
    inputs = dict(hidden_states=torch.randn(batch, n, 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
                  encoder_hidden_states_mask=torch.ones(batch, text, dtype=torch.long),
                  timestep=torch.full((batch,), 0.6), img_shapes=[shapes] * batch)
    return model, inputs, dict(prefix=text, suffix=n - h * w, grid=(h, w))


def lumina2(h: int = 12, w: int = 14, batch: int = 1, text: int = 5):
    """[caption, image]; the timestep rises 0 -> 1 over sampling (Lumina2Pipeline passes 1 - t/1000)."""
    model = _seed_weights(diffusers.Lumina2Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, hidden_size=32, num_layers=2, num_refiner_layers=1,
        num_attention_heads=2, num_kv_heads=1, multiple_of=16, axes_dim_rope=(8, 4, 4), axes_lens=(64, 32, 32),
        cap_feat_dim=32))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, h, w, generator=g), timestep=torch.full((batch,), 0.4),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
                  encoder_attention_mask=torch.ones(batch, text, dtype=torch.long))
    return model, inputs, dict(prefix=text, suffix=0, grid=(h // 2, w // 2))


def z_image(h: int = 12, w: int = 14, batch: int = 1, text: int = 5):
    """[image, image padding, caption, caption padding], each part padded to 32 tokens; rising timestep."""
    model = _seed_weights(diffusers.ZImageTransformer2DModel(
        in_channels=4, dim=32, n_layers=2, n_refiner_layers=1, n_heads=2, n_kv_heads=2, cap_feat_dim=32,
        axes_dims=[8, 4, 4], axes_lens=[256, 32, 32]))
    g = torch.Generator().manual_seed(1)
    inputs = dict(x=[torch.randn(4, 1, h, w, generator=g) for _ in range(batch)], t=torch.full((batch,), 0.4),
                  cap_feats=[torch.randn(text, 32, generator=g) for _ in range(batch)])
    n = (h // 2) * (w // 2)
    return model, inputs, dict(prefix=0, suffix=(-n) % 32 + text + (-text) % 32, grid=(h // 2, w // 2))


def ltx_video(frames: int = 3, h: int = 6, w: int = 5, batch: int = 1, text: int = 5):
    model = _seed_weights(diffusers.LTXVideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        num_layers=2, caption_channels=16))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, frames * h * w, 8, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 16, generator=g), timestep=torch.full((batch,), 600.0),
                  encoder_attention_mask=torch.ones(batch, text, dtype=torch.long), num_frames=frames, height=h, width=w)
    return model, inputs, dict(prefix=0, suffix=0, grid=(frames, h, w))


def ltx2(frames: int = 3, h: int = 6, w: int = 5, batch: int = 1, text: int = 5, audio: int = 7,
         rope_type: str = "interleaved"):
    """Video and audio streams: per block video self-attention (reduced), audio self-attention, text
    cross-attentions and audio <-> video cross-attentions (every key kept). ``rope_type`` "split": the released
    LTX-2's rotary tables [B, heads, tokens, D/2] (default "interleaved": [B, tokens, D])."""
    model = _seed_weights(diffusers.LTX2VideoTransformer3DModel(
        in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
        audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
        audio_cross_attention_dim=16, num_layers=2, caption_channels=16, rope_type=rope_type))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, frames * h * w, 8, generator=g),
                  audio_hidden_states=torch.randn(batch, audio, 8, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                  audio_encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                  timestep=torch.full((batch,), 600.0), encoder_attention_mask=torch.ones(batch, text, dtype=torch.long),
                  audio_encoder_attention_mask=torch.ones(batch, text, dtype=torch.long),
                  num_frames=frames, height=h, width=w, audio_num_frames=audio)
    return model, inputs, dict(prefix=0, suffix=0, grid=(frames, h, w))


def _wan_inputs(batch: int, channels: int, frames: int, h: int, w: int, **extra):
    g = torch.Generator().manual_seed(1)
    return dict(hidden_states=torch.randn(batch, channels, frames, h, w, generator=g),
                encoder_hidden_states=torch.randn(batch, 7, 16, generator=g), timestep=torch.full((batch,), 600.0),
                **{key: torch.randn(batch, *shape, generator=g) for key, shape in extra.items()})


_WAN = dict(patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, out_channels=4, text_dim=16, freq_dim=32,
            ffn_dim=32, rope_max_seq_len=32)


def wan_vace(frames: int = 3, h: int = 10, w: int = 6, batch: int = 1):
    """Two VACE blocks (the control video over the same grid, run first) and three main blocks: five grid
    self-attentions."""
    model = _seed_weights(diffusers.WanVACETransformer3DModel(
        in_channels=4, num_layers=3, vace_layers=[0, 2], vace_in_channels=8, **_WAN))
    inputs = _wan_inputs(batch, 4, frames, h, w, control_hidden_states=(8, frames, h, w))
    return model, inputs, dict(prefix=0, suffix=0, grid=(frames, h // 2, w // 2))


def wan_animate(frames: int = 3, h: int = 10, w: int = 6, batch: int = 1):
    """Latent [B, 2C + 4, 1 + frames, H, W]: the first latent frame is the reference image (kept whole), the pose
    latents are added to the frames after it; a face adapter after each block (not reduced)."""
    model = _seed_weights(diffusers.WanAnimateTransformer3DModel(
        in_channels=None, latent_channels=4, num_layers=2, image_dim=None, motion_encoder_channel_sizes={"8": 8, "4": 8},
        motion_encoder_size=8, motion_style_dim=8, motion_dim=4, motion_encoder_dim=8, face_encoder_hidden_dim=16,
        face_encoder_num_heads=2, inject_face_latents_blocks=1, **_WAN))
    inputs = _wan_inputs(batch, 12, 1 + frames, h, w, pose_hidden_states=(4, frames, h, w),
                         face_pixel_values=(3, 4 * frames - 3, 8, 8))
    return model, inputs, dict(prefix=(h // 2) * (w // 2), suffix=0, grid=(frames, h // 2, w // 2))


def _texts(batch: int, g: torch.Generator, **lengths) -> dict:
    """Text inputs [B, n, 32] with their masks [B, n] (the last token of each masked as padding)."""
    out = {}
    for name, (n, mask) in lengths.items():
        out[name] = torch.randn(batch, n, 32, generator=g)
        if mask:
            out[mask] = torch.ones(batch, n, dtype=torch.long)
            out[mask][:, -1] = 0
    return out


def hunyuan_video15(frames: int = 3, h: int = 6, w: int = 5, batch: int = 1):
    """[video, text]: text = 3 image-embedding tokens + 4 byT5 + 5 MLLM tokens (padding masked), after the grid."""
    model = _seed_weights(diffusers.HunyuanVideo15Transformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=2, num_refiner_layers=1,
        mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=32, image_embed_dim=32, rope_axes_dim=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=g), timestep=torch.full((batch,), 600.0),
                  **_texts(batch, g, encoder_hidden_states=(5, "encoder_attention_mask"),
                           encoder_hidden_states_2=(4, "encoder_attention_mask_2"), image_embeds=(3, None)))
    return model, inputs, dict(prefix=0, suffix=12, grid=(frames, h, w) if frames > 1 else (h, w))


def hunyuan_image(h: int = 6, w: int = 7, batch: int = 1):
    """HunyuanImage 2.1: [image, text], text = 5 MLLM + 4 byT5 tokens (padding masked), after the grid."""
    model = _seed_weights(diffusers.HunyuanImageTransformer2DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1, num_single_layers=2,
        num_refiner_layers=1, mlp_ratio=2.0, text_embed_dim=32, text_embed_2_dim=32, rope_axes_dim=(8, 8)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, h, w, generator=g), timestep=torch.full((batch,), 600.0),
                  **_texts(batch, g, encoder_hidden_states=(5, "encoder_attention_mask"),
                           encoder_hidden_states_2=(4, "encoder_attention_mask_2")))
    return model, inputs, dict(prefix=0, suffix=9, grid=(h, w))


def hidream(h: int = 6, w: int = 6, batch: int = 1):
    """HiDream I1: [image, text], text = 5 T5 + 2 x 4 Llama tokens; a non-square latent is padded to max_seq
    (here 8 x 8 = 64 tokens) with masked image tokens, kept whole after the grid."""
    model = _seed_weights(diffusers.HiDreamImageTransformer2DModel(
        patch_size=2, in_channels=4, out_channels=4, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, caption_channels=[32, 32], text_emb_dim=32, num_routed_experts=2,
        num_activated_experts=1, axes_dims_rope=(8, 4, 4), max_resolution=(16, 16), llama_layers=[0, 1, 2]))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, 2 * h, 2 * w, generator=g), timesteps=torch.full((batch,), 600.0),
                  encoder_hidden_states_t5=torch.randn(batch, 5, 32, generator=g),
                  encoder_hidden_states_llama3=torch.randn(3, batch, 4, 32, generator=g),
                  pooled_embeds=torch.randn(batch, 32, generator=g))
    padding = 64 - h * w if h != w else 0
    return model, inputs, dict(prefix=0, suffix=padding + 13, grid=(h, w))


def kandinsky5(frames: int = 3, h: int = 6, w: int = 10, batch: int = 1, text: int = 5):
    """Channels-last latent [B, F, H, W, C]; text blocks (text alone), then visual blocks (self-attention over the
    grid, cross-attention to the text)."""
    model = _seed_weights(diffusers.Kandinsky5Transformer3DModel(
        in_visual_dim=4, in_text_dim=32, in_text_dim2=32, time_dim=32, out_visual_dim=4, patch_size=(1, 2, 2),
        model_dim=32, ff_dim=32, num_text_blocks=1, num_visual_blocks=2, axes_dims=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, frames, h, w, 4, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g), timestep=torch.full((batch,), 600.0),
                  pooled_projections=torch.randn(batch, 32, generator=g), text_rope_pos=torch.arange(text),
                  visual_rope_pos=(torch.arange(frames), torch.arange(h // 2), torch.arange(w // 2)))
    return model, inputs, dict(prefix=0, suffix=0, grid=(frames, h // 2, w // 2) if frames > 1 else (h // 2, w // 2))


def cogvideox(frames: int = 3, h: int = 6, w: int = 10, batch: int = 1, text: int = 5):
    """[text, video]; latent [B, F, C, H, W], rotary positions (CogVideoX 1.0 5B style)."""
    model = _seed_weights(diffusers.CogVideoXTransformer3DModel(
        num_attention_heads=2, attention_head_dim=16, in_channels=4, out_channels=4, time_embed_dim=32,
        text_embed_dim=32, num_layers=2, sample_width=w, sample_height=h, sample_frames=4 * frames - 3,
        patch_size=2, max_text_seq_length=text, use_rotary_positional_embeddings=True))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, frames, 4, h, w, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g), timestep=torch.full((batch,), 600))
    inputs["image_rotary_emb"] = diffusers.models.embeddings.get_3d_rotary_pos_embed(  # as CogVideoXPipeline does
        16, ((0, 0), (h // 2, w // 2)), (h // 2, w // 2), frames)
    return model, inputs, dict(prefix=text, suffix=0, grid=(frames, h // 2, w // 2) if frames > 1 else (h // 2, w // 2))


def mochi(frames: int = 3, h: int = 6, w: int = 10, batch: int = 1, text: int = 6):
    """[video, valid text] per sample (the last text token masked as padding); rising timestep."""
    model = _seed_weights(diffusers.MochiTransformer3DModel(
        patch_size=2, num_attention_heads=2, attention_head_dim=16, num_layers=2, pooled_projection_dim=16,
        in_channels=4, text_embed_dim=32, time_embed_dim=16, max_sequence_length=text))
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[:, -1] = 0
    inputs = dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=g), timestep=torch.full((batch,), 400.0),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g), encoder_attention_mask=mask)
    return model, inputs, dict(prefix=0, suffix=text - 1, grid=(frames, h // 2, w // 2) if frames > 1 else (h // 2, w // 2))


def _longcat_ids(h: int, w: int, modality: int, start: int) -> torch.Tensor:
    """LongCat's image ids: (modality, start + row, start + column), as its pipelines build them."""
    return _raster_ids(h, w, 3, first=float(modality)) + torch.tensor([0.0, start, start])


def longcat_image(h: int = 6, w: int = 7, batch: int = 1, text: int = 5, refs: bool = False):
    """[text, image, reference]: image ids start at the text length; with ``refs`` the edit model's 3 x 4
    reference image (modality 2) follows the grid."""
    model = _seed_weights(diffusers.LongCatImageTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=[4, 6, 6]))
    g = torch.Generator().manual_seed(1)
    ids = _longcat_ids(h, w, 1, text)
    if refs:
        ids = torch.cat([ids, _longcat_ids(3, 4, 2, text)])
    text_ids = torch.zeros(text, 3)
    text_ids[:, 1] = text_ids[:, 2] = torch.arange(text)
    inputs = dict(hidden_states=torch.randn(batch, ids.shape[0], 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g), timestep=torch.full((batch,), 0.6),
                  img_ids=ids, txt_ids=text_ids)
    return model, inputs, dict(prefix=text, suffix=ids.shape[0] - h * w, grid=(h, w))


def krea2(h: int = 6, w: int = 7, batch: int = 1, text: int = 5):
    """[text, image] single-stream blocks after a text-fusion stack (text alone); position ids from Krea2Pipeline."""
    model = _seed_weights(diffusers.Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=32, num_text_layers=2, text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=32, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, h * w, 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 2, 32, generator=g), timestep=torch.full((batch,), 0.6),
                  position_ids=diffusers.Krea2Pipeline.prepare_position_ids(text, h, w, "cpu"))
    return model, inputs, dict(prefix=text, suffix=0, grid=(h, w))


def ernie_image(h: int = 6, w: int = 7, batch: int = 1, text: int = 5):
    """[image, text]; the text's last token is padding (text_lens), masked."""
    model = _seed_weights(diffusers.ErnieImageTransformer2DModel(
        hidden_size=32, num_attention_heads=2, num_layers=2, ffn_hidden_size=32, in_channels=4, out_channels=4,
        patch_size=1, text_in_dim=32, rope_axes_dim=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, h, w, generator=g), timestep=torch.full((batch,), 600.0),
                  text_bth=torch.randn(batch, text, 32, generator=g), text_lens=torch.full((batch,), text - 1))
    return model, inputs, dict(prefix=0, suffix=text, grid=(h, w))


def pixart(h: int = 6, w: int = 8, batch: int = 1, text: int = 5):
    """PixArt-α/Σ: attn1 over the image grid alone (patch 2), attn2 to the T5 text."""
    model = _seed_weights(diffusers.PixArtTransformer2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, out_channels=8, num_layers=2, sample_size=h,
        cross_attention_dim=16, caption_channels=16))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, h, w, generator=g), timestep=torch.full((batch,), 600.0),
                  encoder_hidden_states=torch.randn(batch, text, 16, generator=g),
                  added_cond_kwargs={"resolution": None, "aspect_ratio": None})
    return model, inputs, dict(prefix=0, suffix=0, grid=(h // 2, w // 2))


def ideogram4(h: int = 6, w: int = 7, batch: int = 1, text: int = 5):
    """Packed [left padding, text, image] rows built by Ideogram4Pipeline._prepare_ids (the first sample's text one
    token shorter: one padding token); rising model time."""
    model = _seed_weights(diffusers.Ideogram4Transformer2DModel(
        in_channels=4, num_layers=2, attention_head_dim=32, num_attention_heads=2, intermediate_size=32, adaln_dim=16,
        llm_features_dim=32, mrope_section=(4, 2, 2)))
    g = torch.Generator().manual_seed(1)
    lengths = [text - 1] + [text] * (batch - 1)
    position_ids, segment_ids, indicator = diffusers.Ideogram4Pipeline._prepare_ids(lengths, h, w, text, "cpu")
    n = text + h * w
    inputs = dict(hidden_states=torch.randn(batch, n, 4, generator=g), timestep=torch.full((batch,), 0.4),
                  encoder_hidden_states=torch.randn(batch, n, 32, generator=g), position_ids=position_ids,
                  segment_ids=segment_ids, indicator=indicator)
    return model, inputs, dict(prefix=text, suffix=0, grid=(h, w))


def joyimage(h: int = 6, w: int = 10, batch: int = 1, text: int = 5, refs: bool = False):
    """[image, text]; with ``refs`` a [B, 2, C, 1, H, W] input: the model moves the target (last item) first and
    the reference image's 3 x 5 tokens follow the grid."""
    model = _seed_weights(diffusers.JoyImageEditTransformer3DModel(
        patch_size=[1, 2, 2], in_channels=4, hidden_size=32, num_attention_heads=2, text_dim=32, mlp_width_ratio=2.0,
        num_layers=2, rope_dim_list=[4, 6, 6]))
    g = torch.Generator().manual_seed(1)
    shape = (batch, 2, 4, 1, h, w) if refs else (batch, 4, 1, h, w)
    inputs = dict(hidden_states=torch.randn(*shape, generator=g), timestep=torch.full((batch,), 600.0),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g))
    return model, inputs, dict(prefix=0, suffix=text + (h // 2) * (w // 2) * refs, grid=(h // 2, w // 2))


FAMILIES = {"chroma": chroma, "flux2": flux2, "qwen_image": qwen_image, "lumina2": lumina2, "z_image": z_image,
            "ltx_video": ltx_video, "ltx2": ltx2, "wan_vace": wan_vace, "wan_animate": wan_animate,
            "hunyuan_video15": hunyuan_video15, "hunyuan_image": hunyuan_image, "hidream": hidream,
            "kandinsky5": kandinsky5, "cogvideox": cogvideox, "mochi": mochi, "longcat_image": longcat_image,
            "krea2": krea2, "ernie_image": ernie_image, "ideogram4": ideogram4,
            "joyimage": joyimage, "pixart": pixart}
# Self-attentions over the layout per model call, in order: the ones the default range reduces.
DEFAULT_REDUCED = {"chroma": 3, "flux2": 3, "qwen_image": 2, "lumina2": 2, "z_image": 2, "ltx_video": 2, "ltx2": 2,
                   "wan_vace": 5, "wan_animate": 2,
                   "hunyuan_video15": 2, "hunyuan_image": 3, "hidream": 3, "kandinsky5": 2,
                   "cogvideox": 2, "mochi": 2, "longcat_image": 3, "krea2": 2, "ernie_image": 2, "ideogram4": 2, "joyimage": 2,
                   "pixart": 2}


def run(model, inputs) -> torch.Tensor:
    with torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out  # Z-Image returns one tensor per sample


def spied(model, inputs):
    spy = SpyAttention()
    with spy:
        out = run(model, inputs)
    return out, spy.calls


def _length(where) -> int:
    return where["prefix"] + int(torch.tensor(where["grid"]).prod()) + where["suffix"]


def _reduced(vanilla, patched):
    return [kb.shape[-2] < ka.shape[-2] for (_, ka, _), (_, kb, _) in zip(vanilla, patched)]


@pytest.mark.parametrize("family", FAMILIES)
def test_the_table_matches_the_real_class_by_module(family):
    model, _, _ = FAMILIES[family]()
    assert family_of(model).name == family


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_and_removal_are_bit_identical(family):
    model, inputs, _ = FAMILIES[family]()
    state = check_identity_at_ratio_zero_and_after_removal(model, inputs, run, apply_patch, remove_patch, is_patched,
                                                           STATE_ATTR)
    assert state.reduced_calls == DEFAULT_REDUCED[family]


def _check_kept(family, vanilla, patched, where):
    """Every query kept everywhere; only self-attentions over the whole layout are shortened; in the first
    of them (same inputs with and without the patch) the text and the tokens after the grid keep every
    key/value and each kept grid key is a real key of a different position."""
    length, pre, suf = _length(where), where["prefix"], where["suffix"]
    assert len(patched) == len(vanilla)
    for (qa, ka, _), (qb, kb, vb) in zip(vanilla, patched):
        assert qa.shape == qb.shape and kb.shape[-2] == vb.shape[-2]
        over_layout = ka.shape[-2] == length == qa.shape[-2]
        assert (kb.shape[-2] < ka.shape[-2]) == over_layout, (qa.shape, ka.shape, kb.shape)
    first = next(i for i, (q, k, _) in enumerate(vanilla) if k.shape[-2] == length == q.shape[-2])
    (q0, k0, v0), (q1, k1, v1) = vanilla[first], patched[first]
    assert torch.equal(q0, q1)
    n, m = k0.shape[-2], k1.shape[-2]
    for kept, full in ((k1, k0), (v1, v0)):
        assert torch.equal(kept[..., :pre, :], full[..., :pre, :])
        assert torch.equal(kept[..., m - suf:, :], full[..., n - suf:, :])
    img0, img1 = k0[0, 0, pre:n - suf], k1[0, 0, pre:m - suf]
    match = (img1[:, None, :] == img0[None, :, :]).all(-1)
    assert (match.sum(1) >= 1).all() and match.float().argmax(1).unique().numel() == img1.shape[0] < img0.shape[0]


@pytest.mark.parametrize("family", FAMILIES)
def test_queries_text_and_non_grid_tokens_keep_every_key(family):
    model, inputs, where = FAMILIES[family]()
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", seed=4)
    _, patched = spied(model, inputs)
    _check_kept(family, vanilla, patched, where)


@pytest.mark.parametrize("family", ["flux2", "qwen_image", "longcat_image", "joyimage"])
def test_reference_image_tokens_after_the_grid_keep_every_key(family):
    """Flux.2's reference images (ids with t = 10), Qwen-Image-Edit's (img_shapes after the first) and
    LongCat-Image-Edit's (ids of modality 2) and JoyImage Edit's (items after the target) follow the grid: the
    grid is reduced, every reference key/value is kept."""
    model, inputs, where = FAMILIES[family](refs=True)
    assert where["suffix"] == (5 + 15 if family == "joyimage" else 12)
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", seed=4)
    _, patched = spied(model, inputs)
    _check_kept(family, vanilla, patched, where)


def test_hidream_non_square_padding_keeps_every_key():
    """A non-square HiDream latent is padded to max_seq with masked image tokens after the grid: kept whole."""
    model, inputs, where = hidream(h=5, w=7)
    assert where["suffix"] == 64 - 35 + 13
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", seed=4)
    _, patched = spied(model, inputs)
    _check_kept("hidream", vanilla, patched, where)


def test_ltx2_reduces_the_video_self_attention_only():
    """Audio self-attention, text cross-attentions and both audio-video cross-attentions (whose keys are the
    video tokens in video-to-audio) keep every key; the hooks sit on attn1 alone."""
    model, inputs, where = ltx2()
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv")
    _, patched = spied(model, inputs)
    grid = _length(where)
    assert sorted({name.rsplit(".", 1)[1] for name, _, _ in model.__dict__[STATE_ATTR].modules}) == ["attn1"]
    video_to_audio = [i for i, (q, k, _) in enumerate(vanilla) if k.shape[-2] == grid != q.shape[-2]]
    assert video_to_audio and all(patched[i][1].shape == vanilla[i][1].shape for i in video_to_audio)
    assert sum(_reduced(vanilla, patched)) == 2  # one video self-attention per block


@pytest.mark.parametrize("family,size", [("chroma", dict(h=5, w=3)), ("flux2", dict(h=3, w=7)), ("pixart", dict(h=6, w=10)),
                                         ("qwen_image", dict(h=5, w=9)), ("lumina2", dict(h=10, w=6)),
                                         ("z_image", dict(h=6, w=10)), ("ltx_video", dict(frames=1, h=5, w=7)),
                                         ("ltx2", dict(frames=2, h=3, w=5)),
                                         ("wan_vace", dict(frames=1, h=14, w=6)),
                                         ("wan_animate", dict(frames=2, h=6, w=10)),
                                         ("hunyuan_video15", dict(frames=1, h=5, w=7)),
                                         ("hunyuan_image", dict(h=3, w=9)),
                                         ("hidream", dict(h=5, w=7)),
                                         ("kandinsky5", dict(frames=1, h=10, w=14)),
                                         ("cogvideox", dict(frames=2, h=10, w=6)),
                                         ("mochi", dict(frames=1, h=10, w=14)),
                                         ("longcat_image", dict(h=5, w=3)),
                                         ("krea2", dict(h=3, w=9)),
                                         ("ernie_image", dict(h=9, w=5)),
                                         ("ideogram4", dict(h=5, w=3)),
                                         ("joyimage", dict(h=10, w=6))])
@pytest.mark.parametrize("batch", [1, 3])
def test_odd_sizes_and_batches(family, size, batch):
    model, inputs, _ = FAMILIES[family](batch=batch, **size)
    state = check_reduced_output(model, inputs, run, apply_patch, STATE_ATTR)
    per_sample = batch if family == "mochi" else 1  # Mochi runs one attention call per sample
    assert state.reduced_calls == DEFAULT_REDUCED[family] * per_sample


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16(family):
    model, inputs, _ = FAMILIES[family]()
    model = model.to(torch.bfloat16)
    if family == "kandinsky5":  # runs only as from_pretrained(torch_dtype=bf16) loads it: these modules in float32
        for name, module in model.named_modules():
            if set(name.split(".")) & set(model._keep_in_fp32_modules):
                module.float()

    def cast(value):
        if isinstance(value, list):
            return [cast(v) for v in value]
        return value.to(torch.bfloat16) if isinstance(value, torch.Tensor) and value.is_floating_point() else value

    inputs = {k: v if "ids" in k else cast(v) for k, v in inputs.items()}
    expected = run(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv")
    out = run(model, inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all() and not torch.equal(out, expected)
    remove_patch(model)
    assert torch.equal(run(model, inputs), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_default_block_range_is_every_block_and_a_range_picks_blocks(family):
    """No block_start: every block of these families (only Flux.1 was measured to do better on its single
    blocks); block_start=0.5 reduces the second half of the blocks, checked on the keys each attention gets."""
    model, inputs, where = FAMILIES[family]()
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv")
    _, default = spied(model, inputs)
    over = [k.shape[-2] == _length(where) == q.shape[-2] for q, k, _ in vanilla]
    assert _reduced(vanilla, default) == over and sum(over) == DEFAULT_REDUCED[family]
    apply_patch(model, ratio=0.5, mode="kv", block_start=0.5)
    _, half = spied(model, inputs)
    indices = [i for i, o in enumerate(over) if o]
    half_reduced = [i for i, r in enumerate(_reduced(vanilla, half)) if r]
    assert half_reduced == indices[len(indices) // 2:]


@pytest.mark.parametrize("family", ["lumina2", "z_image"])
def test_a_rising_timestep_drives_the_schedule(family):
    """Lumina 2 / Z-Image get t rising 0 -> 1 over sampling: t = 0.4 is 40 % of the way."""
    model, inputs, _ = FAMILIES[family]()
    expected = run(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", start_percent=0.5)
    assert torch.equal(run(model, inputs), expected)
    apply_patch(model, ratio=0.5, mode="kv", end_percent=0.3)
    assert torch.equal(run(model, inputs), expected)
    apply_patch(model, ratio=0.5, mode="kv", start_percent=0.3, end_percent=0.5)
    assert not torch.equal(run(model, inputs), expected)


def test_z_image_captions_of_different_lengths_stay_after_the_grid():
    """Samples padded to the longest caption: the grid starts at 0 in each, the rest keeps every key."""
    model, inputs, where = z_image(batch=2)
    inputs["cap_feats"][1] = torch.randn(40, 32, generator=torch.Generator().manual_seed(3))  # 64 tokens padded
    where = dict(where, suffix=where["suffix"] - 32 + 64)
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", seed=4)
    _, patched = spied(model, inputs)
    _check_kept("z_image", vanilla, patched, where)


def test_lumina2_captions_of_different_lengths_are_left_unreduced(caplog):
    """Lumina 2 puts each sample's image after its own caption length: no single layout, nothing reduced."""
    model, inputs, _ = lumina2(batch=2)
    inputs["encoder_attention_mask"][1, -2:] = 0
    expected = run(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv")
    with caplog.at_level("WARNING"):
        assert torch.equal(run(model, inputs), expected)
    assert model.__dict__[STATE_ATTR].reduced_calls == 0
    assert "Lumina2Transformer2DModel: could not place the image tokens" in caplog.text


def test_auraflow_is_refused_naming_it():
    model = diffusers.AuraFlowTransformer2DModel(
        sample_size=8, patch_size=2, in_channels=4, num_mmdit_layers=1, num_single_dit_layers=1,
        attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16, caption_projection_dim=16,
        out_channels=4, pos_embed_max_size=16)
    with pytest.raises(TypeError, match="AuraFlowTransformer2DModel has no UNet.*not a DiT.*supported DiTs.*"
                                        "FluxTransformer2DModel"):
        apply_patch(model, ratio=0.5, mode="kv")
    assert not is_patched(model)


def test_a_supported_class_name_from_another_module_is_refused():
    """Classes are matched by module and name: a subclass named like Flux's, defined elsewhere, is refused."""
    FluxTransformer2DModel = type("FluxTransformer2DModel", (diffusers.FluxTransformer2DModel,), {})
    model = FluxTransformer2DModel(patch_size=1, in_channels=16, num_layers=1, num_single_layers=1,
                                   attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32,
                                   pooled_projection_dim=32, axes_dims_rope=(4, 6, 6))
    assert family_of(model) is None
    with pytest.raises(TypeError, match="FluxTransformer2DModel has no UNet.*not a DiT"):
        apply_patch(model, ratio=0.5, mode="kv")
    assert not is_patched(model)


# diffusers' step caches on a tiny Flux.1 (every block reduced, so the cached attentions are hooked ones).
_CACHES = {
    "taylorseer": lambda now: diffusers.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1,
                                                              taylor_factors_dtype=torch.float32),
    "pyramid_attention_broadcast": lambda now: diffusers.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=2, spatial_attention_timestep_skip_range=(-1, 1001),
        current_timestep_callback=lambda: now[0]),
    "first_block_cache": lambda now: diffusers.FirstBlockCacheConfig(threshold=0.5),
    "mag_cache": lambda now: diffusers.MagCacheConfig(threshold=0.5, num_inference_steps=5, mag_ratios=[1.0] * 5),
}


def _sampling_loop(model, inputs, now) -> torch.Tensor:
    outs = []
    for step in (0.9, 0.8, 0.7, 0.6, 0.5):
        now[0] = step * 1000
        inputs["timestep"] = torch.full((1,), step)
        context = model.cache_context("cond") if hasattr(model, "_diffusers_hook") else contextlib.nullcontext()
        with context:
            outs.append(run(model, inputs))
    return torch.stack(outs)


@pytest.mark.parametrize("cache", _CACHES)
@pytest.mark.parametrize("order", ["cache_first", "tome_first"])
def test_diffusers_caches_that_skip_an_attention_compose_with_kv(cache, order):
    """A cached/skipped attention computes nothing (no projection, no SDPA): ToMe leaves it alone instead of
    taking it for a non-SDPA backend (issue 20). Both act: at ratio 0 the cache's own output, at 0.5 another
    one with attention calls reduced. FasterCache is not here: on Flux it fails without ToMe too (0.42.1)."""
    sys_flux = pytest.importorskip("test_dit_diffusers").flux
    model, inputs, _ = sys_flux(h=6, w=6)
    now = [0.0]
    vanilla = _sampling_loop(model, inputs, now)
    model.enable_cache(_CACHES[cache](now))
    cached = _sampling_loop(model, inputs, now)
    assert not torch.equal(cached, vanilla)  # the cache acts
    results = {}
    for ratio in (0.0, 0.5):
        model.disable_cache()
        remove_patch(model)
        if order == "cache_first":
            model.enable_cache(_CACHES[cache](now))
            apply_patch(model, ratio=ratio, mode="kv", block_start=0.0)
        else:
            apply_patch(model, ratio=ratio, mode="kv", block_start=0.0)
            model.enable_cache(_CACHES[cache](now))
        results[ratio] = _sampling_loop(model, inputs, now)
        reduced = model.__dict__[STATE_ATTR].reduced_calls
    assert torch.equal(results[0.0], cached)
    assert reduced > 0 and not torch.equal(results[0.5], cached) and torch.isfinite(results[0.5]).all()


def test_ltx2_projects_only_the_kept_video_tokens_for_keys_and_values(monkeypatch):
    """LTX-2's attention takes its keys' inputs apart (encoder_hidden_states, key_rotary_emb): the video
    self-attention's key/value projections see only the kept tokens, and the result equals reducing the keys
    at the attention itself (the table without ``key_inputs``), in float32 and bf16 (split and interleaved RoPE:
    both keep a token's own rotation)."""
    import dataclasses

    from tome_core.catalogue import diffusers_dits, diffusers_lookup

    for dtype, rope in ((torch.float32, "split"), (torch.float32, "interleaved"), (torch.bfloat16, "split")):
        model, inputs, where = ltx2(batch=2)
        for block in model.transformer_blocks:
            block.attn1.rope_type = rope
        model.rope.rope_type = rope
        model = model.to(dtype)
        inputs = {k: v.to(dtype) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                  for k, v in inputs.items()}
        rows = []
        handle = model.transformer_blocks[0].attn1.to_k.register_forward_pre_hook(
            lambda m, args: rows.append(args[0].shape[1]))
        apply_patch(model, ratio=0.5, mode="kv", seed=2)
        cut = run(model, inputs)
        remove_patch(model)
        entry = family_of(model)
        monkeypatch.setitem(diffusers_lookup.by_class(), diffusers_dits.class_path(model),
                            dataclasses.replace(entry, key_inputs=None))
        apply_patch(model, ratio=0.5, mode="kv", seed=2)
        whole = run(model, inputs)
        remove_patch(model)
        monkeypatch.undo()
        handle.remove()
        grid = _length(where)
        assert rows == [3 * 6 * 3, grid], rows  # 1x2 windows on 3x6x5: kept tokens only; all of them without
        tolerance = 1e-5 if dtype == torch.float32 else 2e-2
        assert torch.allclose(cut.float(), whole.float(), rtol=tolerance, atol=tolerance), (dtype, rope)
