"""Stand-in of Neo's ``backend/nn/qwen.py`` (de2193d9; from ComfyUI v0.3.64 comfy/ldm/qwen_image/model.py):
``get_timestep_embedding`` (18-48), ``TimestepEmbedding``/``Timesteps`` (51-115), ``GELU``/``FeedForward``
(118-145), ``apply_rotary_emb`` (148-154), ``QwenTimestepProjEmbeddings`` (157-166), ``Attention`` (169-243),
``QwenImageTransformerBlock`` (246-318), ``LastLayer`` (321-332), ``QwenImageTransformer2DModel`` (335-483:
``process_img`` 371-389, ``forward`` 391-483).

The latent is 5-D [B, C, 1, H, W] (Neo's Qwen engine sets ``is_wan``); the replace args are {img, txt, vec, pe}
only (no transformer_options, no attn_mask) and nothing reports block_type/block_index; the rotary table is
[B, L, 1, D/2, 2, 2] (token axis 1); the joint attention calls this module's ``attention_function`` positionally with
[B, L, H*D] inputs and the (unused, always None) ``attention_mask``, without transformer_options.
Not modelled: ControlNet residuals, the guidance-embedding variant of ``time_text_embed``.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.args import dynamic_args
from backend.attention import attention_function
from backend.nn.flux import EmbedND
from backend.utils import pad_to_patch_size


def get_timestep_embedding(timesteps, embedding_dim, flip_sin_to_cos=False, downscale_freq_shift=1, scale=1,
                           max_period=10000):
    """Mirrors qwen.py:18-48 (diffusers' sinusoidal embedding)."""
    half_dim = embedding_dim // 2
    exponent = -math.log(max_period) * torch.arange(start=0, end=half_dim, dtype=torch.float32, device=timesteps.device)
    exponent = exponent / (half_dim - downscale_freq_shift)
    emb = scale * (timesteps[:, None].float() * torch.exp(exponent)[None, :])
    emb = torch.cat([torch.sin(emb), torch.cos(emb)], dim=-1)
    if flip_sin_to_cos:
        emb = torch.cat([emb[:, half_dim:], emb[:, :half_dim]], dim=-1)
    return F.pad(emb, (0, 1, 0, 0)) if embedding_dim % 2 == 1 else emb


class TimestepEmbedding(nn.Module):
    """Mirrors qwen.py:51-96 (linear, SiLU, linear)."""

    def __init__(self, in_channels, time_embed_dim):
        super().__init__()
        self.linear_1 = nn.Linear(in_channels, time_embed_dim)
        self.act = nn.SiLU()
        self.linear_2 = nn.Linear(time_embed_dim, time_embed_dim)

    def forward(self, sample):
        return self.linear_2(self.act(self.linear_1(sample)))


class QwenTimestepProjEmbeddings(nn.Module):
    """Mirrors qwen.py:157-166 with Timesteps (99-115): 256 channels, flip_sin_to_cos, scale 1000."""

    def __init__(self, embedding_dim, pooled_projection_dim):
        super().__init__()
        self.timestep_embedder = TimestepEmbedding(in_channels=256, time_embed_dim=embedding_dim)

    def forward(self, timestep, hidden_states):
        timesteps_proj = get_timestep_embedding(timestep, 256, flip_sin_to_cos=True, downscale_freq_shift=0, scale=1000)
        return self.timestep_embedder(timesteps_proj.to(dtype=hidden_states.dtype))


class GELU(nn.Module):
    """Mirrors qwen.py:118-127."""

    def __init__(self, dim_in, dim_out, approximate="none", bias=True):
        super().__init__()
        self.proj = nn.Linear(dim_in, dim_out, bias=bias)
        self.approximate = approximate

    def forward(self, hidden_states):
        return F.gelu(self.proj(hidden_states), approximate=self.approximate)


class FeedForward(nn.Module):
    """Mirrors qwen.py:130-145."""

    def __init__(self, dim, dim_out=None, mult=4, dropout=0.0, inner_dim=None, bias=True):
        super().__init__()
        inner_dim = inner_dim or int(dim * mult)
        self.net = nn.ModuleList([GELU(dim, inner_dim, approximate="tanh", bias=bias), nn.Dropout(dropout),
                                  nn.Linear(inner_dim, dim_out or dim, bias=bias)])

    def forward(self, hidden_states, *args, **kwargs):
        for module in self.net:
            hidden_states = module(hidden_states)
        return hidden_states


def apply_rotary_emb(x, freqs_cis):
    """Mirrors qwen.py:148-154: x [B, L, H, D], freqs [B, L, 1, D/2, 2, 2]."""
    if x.shape[1] == 0:
        return x
    t_ = x.reshape(*x.shape[:-1], -1, 1, 2)
    return (freqs_cis[..., 0] * t_[..., 0] + freqs_cis[..., 1] * t_[..., 1]).reshape(*x.shape)


class Attention(nn.Module):
    """Mirrors qwen.py:169-243: joint [txt, img] attention through the module global attention_function."""

    def __init__(self, query_dim, dim_head=64, heads=8, dropout=0.0, bias=False, eps=1e-5, out_bias=True, out_dim=None):
        super().__init__()
        self.inner_dim = out_dim if out_dim is not None else dim_head * heads
        self.heads, self.dim_head = heads, dim_head
        self.norm_q = nn.RMSNorm(dim_head, eps=eps, elementwise_affine=True)
        self.norm_k = nn.RMSNorm(dim_head, eps=eps, elementwise_affine=True)
        self.norm_added_q = nn.RMSNorm(dim_head, eps=eps)
        self.norm_added_k = nn.RMSNorm(dim_head, eps=eps)
        self.to_q, self.to_k, self.to_v = (nn.Linear(query_dim, self.inner_dim, bias=bias) for _ in range(3))
        self.add_q_proj, self.add_k_proj, self.add_v_proj = (nn.Linear(query_dim, self.inner_dim, bias=bias)
                                                             for _ in range(3))
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, query_dim, bias=out_bias), nn.Dropout(dropout)])
        self.to_add_out = nn.Linear(self.inner_dim, query_dim, bias=out_bias)

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, attention_mask=None,
                image_rotary_emb=None):
        seq_txt = encoder_hidden_states.shape[1]
        img_query, img_key, img_value = (f(hidden_states).unflatten(-1, (self.heads, -1))
                                         for f in (self.to_q, self.to_k, self.to_v))
        txt_query, txt_key, txt_value = (f(encoder_hidden_states).unflatten(-1, (self.heads, -1))
                                         for f in (self.add_q_proj, self.add_k_proj, self.add_v_proj))
        img_query, img_key = self.norm_q(img_query), self.norm_k(img_key)
        txt_query, txt_key = self.norm_added_q(txt_query), self.norm_added_k(txt_key)
        joint_query = apply_rotary_emb(torch.cat([txt_query, img_query], dim=1), image_rotary_emb).flatten(start_dim=2)
        joint_key = apply_rotary_emb(torch.cat([txt_key, img_key], dim=1), image_rotary_emb).flatten(start_dim=2)
        joint_value = torch.cat([txt_value, img_value], dim=1).flatten(start_dim=2)
        joint_hidden_states = attention_function(joint_query, joint_key, joint_value, self.heads, attention_mask)
        txt_attn_output, img_attn_output = joint_hidden_states[:, :seq_txt, :], joint_hidden_states[:, seq_txt:, :]
        return self.to_out[1](self.to_out[0](img_attn_output)), self.to_add_out(txt_attn_output)


class QwenImageTransformerBlock(nn.Module):
    """Mirrors qwen.py:246-318: returns (txt, img)."""

    def __init__(self, dim, num_attention_heads, attention_head_dim, eps=1e-6):
        super().__init__()
        self.dim, self.num_attention_heads, self.attention_head_dim = dim, num_attention_heads, attention_head_dim
        for side in ("img", "txt"):
            setattr(self, f"{side}_mod", nn.Sequential(nn.SiLU(), nn.Linear(dim, 6 * dim, bias=True)))
            setattr(self, f"{side}_norm1", nn.LayerNorm(dim, elementwise_affine=False, eps=eps))
            setattr(self, f"{side}_norm2", nn.LayerNorm(dim, elementwise_affine=False, eps=eps))
            setattr(self, f"{side}_mlp", FeedForward(dim=dim, dim_out=dim))
        self.attn = Attention(query_dim=dim, dim_head=attention_head_dim, heads=num_attention_heads, out_dim=dim,
                              bias=True, eps=eps)

    def _modulate(self, x, mod_params):
        shift, scale, gate = torch.chunk(mod_params, 3, dim=-1)
        return torch.addcmul(shift.unsqueeze(1), x, 1 + scale.unsqueeze(1)), gate.unsqueeze(1)

    def forward(self, hidden_states, encoder_hidden_states, encoder_hidden_states_mask, temb, image_rotary_emb=None):
        img_mod1, img_mod2 = self.img_mod(temb).chunk(2, dim=-1)
        txt_mod1, txt_mod2 = self.txt_mod(temb).chunk(2, dim=-1)
        img_modulated, img_gate1 = self._modulate(self.img_norm1(hidden_states), img_mod1)
        txt_modulated, txt_gate1 = self._modulate(self.txt_norm1(encoder_hidden_states), txt_mod1)
        img_attn_output, txt_attn_output = self.attn(hidden_states=img_modulated, encoder_hidden_states=txt_modulated,
                                                     encoder_hidden_states_mask=encoder_hidden_states_mask,
                                                     image_rotary_emb=image_rotary_emb)
        hidden_states = hidden_states + img_gate1 * img_attn_output
        encoder_hidden_states = encoder_hidden_states + txt_gate1 * txt_attn_output
        img_modulated2, img_gate2 = self._modulate(self.img_norm2(hidden_states), img_mod2)
        hidden_states = torch.addcmul(hidden_states, img_gate2, self.img_mlp(img_modulated2))
        txt_modulated2, txt_gate2 = self._modulate(self.txt_norm2(encoder_hidden_states), txt_mod2)
        encoder_hidden_states = torch.addcmul(encoder_hidden_states, txt_gate2, self.txt_mlp(txt_modulated2))
        return encoder_hidden_states, hidden_states


class LastLayer(nn.Module):
    """Mirrors qwen.py:321-332."""

    def __init__(self, embedding_dim, conditioning_embedding_dim, eps=1e-6):
        super().__init__()
        self.silu = nn.SiLU()
        self.linear = nn.Linear(conditioning_embedding_dim, embedding_dim * 2, bias=True)
        self.norm = nn.LayerNorm(embedding_dim, eps, elementwise_affine=False)

    def forward(self, x, conditioning_embedding):
        scale, shift = torch.chunk(self.linear(self.silu(conditioning_embedding)), 2, dim=1)
        return torch.addcmul(shift[:, None, :], self.norm(x), (1 + scale)[:, None, :])


class QwenImageTransformer2DModel(nn.Module):
    """Mirrors qwen.py:335-483 QwenImageTransformer2DModel."""

    def __init__(self, patch_size=2, in_channels=64, out_channels=16, num_layers=60, attention_head_dim=128,
                 num_attention_heads=24, joint_attention_dim=3584, pooled_projection_dim=768, guidance_embeds=False,
                 axes_dims_rope=(16, 56, 56), image_model=None, final_layer=True):
        super().__init__()
        self.patch_size, self.in_channels = patch_size, in_channels
        self.out_channels = out_channels or in_channels
        self.inner_dim = num_attention_heads * attention_head_dim
        self.pe_embedder = EmbedND(dim=attention_head_dim, theta=10000, axes_dim=list(axes_dims_rope))
        self.time_text_embed = QwenTimestepProjEmbeddings(self.inner_dim, pooled_projection_dim)
        self.txt_norm = nn.RMSNorm(joint_attention_dim, eps=1e-6)
        self.img_in = nn.Linear(in_channels, self.inner_dim)
        self.txt_in = nn.Linear(joint_attention_dim, self.inner_dim)
        self.transformer_blocks = nn.ModuleList(
            QwenImageTransformerBlock(self.inner_dim, num_attention_heads, attention_head_dim)
            for _ in range(num_layers))
        if final_layer:
            self.norm_out = LastLayer(self.inner_dim, self.inner_dim)
            self.proj_out = nn.Linear(self.inner_dim, patch_size * patch_size * self.out_channels, bias=True)

    def process_img(self, x, index=0, h_offset=0, w_offset=0):
        """Mirrors qwen.py:371-389: [B, C, 1, H, W] -> 2x2 tokens (h w) (c 2 2), ids (index, h, w) centred."""
        bs, c, t, h, w = x.shape
        p = self.patch_size
        hidden_states = pad_to_patch_size(x, (1, p, p))
        orig_shape = hidden_states.shape
        hidden_states = hidden_states.view(orig_shape[0], orig_shape[1], orig_shape[-2] // 2, 2, orig_shape[-1] // 2, 2)
        hidden_states = hidden_states.permute(0, 2, 4, 1, 3, 5)
        hidden_states = hidden_states.reshape(orig_shape[0], (orig_shape[-2] // 2) * (orig_shape[-1] // 2),
                                              orig_shape[1] * 4)
        h_len, w_len = (h + (p // 2)) // p, (w + (p // 2)) // p
        h_offset, w_offset = (h_offset + (p // 2)) // p, (w_offset + (p // 2)) // p
        img_ids = torch.zeros((h_len, w_len, 3), device=x.device)
        img_ids[:, :, 0] = index
        rows = torch.linspace(h_offset, h_len - 1 + h_offset, steps=h_len, device=x.device, dtype=x.dtype)
        cols = torch.linspace(w_offset, w_len - 1 + w_offset, steps=w_len, device=x.device, dtype=x.dtype)
        img_ids[:, :, 1] += rows.unsqueeze(1) - (h_len // 2)
        img_ids[:, :, 2] += cols.unsqueeze(0) - (w_len // 2)
        return hidden_states, img_ids.reshape(1, h_len * w_len, 3).repeat(bs, 1, 1), orig_shape

    def _embed(self, x, context, ref_latents, kwargs):
        """qwen.py:396-429: image (+ reference) tokens, text ids from txt_start, the rotary table (token axis 1)."""
        hidden_states, img_ids, orig_shape = self.process_img(x)
        num_embeds = hidden_states.shape[1]
        ref_latents = ref_latents or dynamic_args.ref_latents
        if ref_latents is not None:
            index_ref_method = kwargs.get("ref_latents_method", "index") == "index"
            h = w = index = 0
            for ref in ref_latents:
                h_offset = w_offset = 0
                if index_ref_method:
                    index += 1
                else:
                    index = 1
                    if ref.shape[-2] + h > ref.shape[-1] + w:
                        w_offset = w
                    else:
                        h_offset = h
                    h, w = max(h, ref.shape[-2] + h_offset), max(w, ref.shape[-1] + w_offset)
                kontext, kontext_ids, _ = self.process_img(ref.to(x), index=index, h_offset=h_offset, w_offset=w_offset)
                hidden_states = torch.cat([hidden_states, kontext], dim=1)
                img_ids = torch.cat([img_ids, kontext_ids], dim=1)
        p = self.patch_size
        txt_start = round(max(((x.shape[-1] + (p // 2)) // p) // 2, ((x.shape[-2] + (p // 2)) // p) // 2))
        txt_ids = torch.arange(txt_start, txt_start + context.shape[1], device=x.device)
        txt_ids = txt_ids.reshape(1, -1, 1).repeat(x.shape[0], 1, 3)
        image_rotary_emb = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1)).squeeze(1).unsqueeze(2).to(x.dtype)
        return hidden_states, num_embeds, orig_shape, image_rotary_emb

    def _unpatch(self, hidden_states, num_embeds, orig_shape, x):
        """qwen.py:478-483: drop the reference tokens, tokens back to [B, C, 1, H, W]."""
        hidden_states = hidden_states[:, :num_embeds].view(orig_shape[0], orig_shape[-2] // 2, orig_shape[-1] // 2,
                                                           orig_shape[1], 2, 2)
        return hidden_states.permute(0, 3, 1, 4, 2, 5).reshape(orig_shape)[:, :, :, : x.shape[-2], : x.shape[-1]]

    def forward(self, x, timesteps, context, attention_mask=None, guidance=None, ref_latents=None,
                transformer_options={}, control=None, **kwargs):
        """Mirrors qwen.py:391-483: ("double_block", i) replaces with {img, txt, vec, pe}; patches["double_block"]."""
        encoder_hidden_states_mask = attention_mask
        hidden_states, num_embeds, orig_shape, image_rotary_emb = self._embed(x, context, ref_latents, kwargs)
        hidden_states = self.img_in(hidden_states)
        encoder_hidden_states = self.txt_in(self.txt_norm(context))
        temb = self.time_text_embed(timesteps, hidden_states)
        patches_replace = transformer_options.get("patches_replace", {})
        patches = transformer_options.get("patches", {})
        blocks_replace = patches_replace.get("dit", {})
        for i, block in enumerate(self.transformer_blocks):
            if ("double_block", i) in blocks_replace:

                def block_wrap(args):
                    out = {}
                    out["txt"], out["img"] = block(hidden_states=args["img"], encoder_hidden_states=args["txt"],
                                                   encoder_hidden_states_mask=encoder_hidden_states_mask,
                                                   temb=args["vec"], image_rotary_emb=args["pe"])
                    return out

                out = blocks_replace[("double_block", i)]({"img": hidden_states, "txt": encoder_hidden_states,
                                                           "vec": temb, "pe": image_rotary_emb},
                                                          {"original_block": block_wrap})
                hidden_states = out["img"]
                encoder_hidden_states = out["txt"]
            else:
                encoder_hidden_states, hidden_states = block(hidden_states=hidden_states,
                                                             encoder_hidden_states=encoder_hidden_states,
                                                             encoder_hidden_states_mask=encoder_hidden_states_mask,
                                                             temb=temb, image_rotary_emb=image_rotary_emb)
            if "double_block" in patches:
                for p in patches["double_block"]:
                    out = p({"img": hidden_states, "txt": encoder_hidden_states, "x": x, "block_index": i})
                    hidden_states = out["img"]
                    encoder_hidden_states = out["txt"]
        hidden_states = self.proj_out(self.norm_out(hidden_states, temb))
        return self._unpatch(hidden_states, num_embeds, orig_shape, x)
