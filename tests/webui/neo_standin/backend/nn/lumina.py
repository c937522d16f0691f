"""Stand-in of Neo's ``backend/nn/lumina.py`` (de2193d9; from ComfyUI v0.3.77 comfy/ldm/lumina/model.py), which
Lumina 2 and Z-Image use: ``modulate`` (17-18), ``timestep_embedding`` (21-31), ``TimestepEmbedder`` (34-48),
``JointAttention`` (51-97), ``FeedForward`` (100-115), ``JointTransformerBlock`` (118-188), ``FinalLayer``
(191-212) and ``NextDiT`` (215-419: ``unpatchify`` 332-343, ``patchify_and_embed`` 345-386, ``forward`` 388-419).

Caption padded to ``pad_tokens_multiple`` with ``cap_pad_token`` and refined alone (``context_refiner``), image
tokens padded with ``x_pad_token`` and refined alone (``noise_refiner``), joint = cat(cap, x); the main ``layers``
are called as ``layer(x, mask, freqs_cis, adaln_input, transformer_options=...)`` with no replace patches and no
block reports; ``JointAttention`` calls this module's ``attention_function(xq, xk, xv, n_heads, x_mask,
skip_reshape=True, transformer_options=...)`` (mask positional); ``forward`` returns ``-x``.
Not modelled: the pooled-CLIP branch (``clip_text_pooled_proj``/``time_text_embed``, Neta Lumina).
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.attention import attention_function
from backend.nn.flux import EmbedND, apply_rope
from backend.utils import fp16_fix as clamp_fp16
from backend.utils import pad_to_patch_size


def modulate(x, scale):
    """Mirrors lumina.py:17-18."""
    return x * (1 + scale.unsqueeze(1))


def timestep_embedding(timesteps, dim, max_period=10000):
    """Mirrors lumina.py:21-31 (the non repeat_only branch)."""
    half = dim // 2
    freqs = torch.arange(start=0, end=half, dtype=torch.float32, device=timesteps.device)
    freqs = torch.exp(-math.log(max_period) * freqs / half)
    args = timesteps[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1) if dim % 2 else embedding


class TimestepEmbedder(nn.Module):
    """Mirrors lumina.py:34-48."""

    def __init__(self, hidden_size, frequency_embedding_size=256, output_size=None):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(frequency_embedding_size, hidden_size, bias=True), nn.SiLU(),
                                 nn.Linear(hidden_size, output_size or hidden_size, bias=True))
        self.frequency_embedding_size = frequency_embedding_size

    def forward(self, t, dtype, **kwargs):
        return self.mlp(timestep_embedding(t, self.frequency_embedding_size).to(dtype))


class JointAttention(nn.Module):
    """Mirrors lumina.py:51-97: fused qkv, per-head RMS norm, RoPE, GQA repeat, the module global attention_function."""

    def __init__(self, dim, n_heads, n_kv_heads, qk_norm, out_bias=False):
        super().__init__()
        self.n_kv_heads = n_heads if n_kv_heads is None else n_kv_heads
        self.n_local_heads, self.n_local_kv_heads = n_heads, self.n_kv_heads
        self.n_rep = self.n_local_heads // self.n_local_kv_heads
        self.head_dim = dim // n_heads
        self.qkv = nn.Linear(dim, (n_heads + self.n_kv_heads + self.n_kv_heads) * self.head_dim, bias=False)
        self.out = nn.Linear(n_heads * self.head_dim, dim, bias=out_bias)
        if qk_norm:
            self.q_norm = nn.RMSNorm(self.head_dim, elementwise_affine=True)
            self.k_norm = nn.RMSNorm(self.head_dim, elementwise_affine=True)
        else:
            self.q_norm = self.k_norm = nn.Identity()

    def forward(self, x, x_mask, freqs_cis, transformer_options={}):
        bsz, seqlen, _ = x.shape
        kv_width = self.n_local_kv_heads * self.head_dim
        xq, xk, xv = torch.split(self.qkv(x), [self.n_local_heads * self.head_dim, kv_width, kv_width], dim=-1)
        xq = self.q_norm(xq.view(bsz, seqlen, self.n_local_heads, self.head_dim))
        xk = self.k_norm(xk.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim))
        xv = xv.view(bsz, seqlen, self.n_local_kv_heads, self.head_dim)
        xq, xk = apply_rope(xq, xk, freqs_cis)
        n_rep = self.n_local_heads // self.n_local_kv_heads
        if n_rep >= 1:
            xk = xk.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
            xv = xv.unsqueeze(3).repeat(1, 1, 1, n_rep, 1).flatten(2, 3)
        output = attention_function(xq.movedim(1, 2), xk.movedim(1, 2), xv.movedim(1, 2), self.n_local_heads, x_mask,
                                    skip_reshape=True, transformer_options=transformer_options)
        return self.out(output)


class FeedForward(nn.Module):
    """Mirrors lumina.py:100-115 (SiLU-gated)."""

    def __init__(self, dim, hidden_dim, multiple_of, ffn_dim_multiplier):
        super().__init__()
        if ffn_dim_multiplier is not None:
            hidden_dim = int(ffn_dim_multiplier * hidden_dim)
        hidden_dim = multiple_of * ((hidden_dim + multiple_of - 1) // multiple_of)
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)

    def forward(self, x):
        return self.w2(clamp_fp16(F.silu(self.w1(x)) * self.w3(x)))


class JointTransformerBlock(nn.Module):
    """Mirrors lumina.py:118-188 (modulated for noise_refiner/layers, plain for context_refiner)."""

    def __init__(self, layer_id, dim, n_heads, n_kv_heads, multiple_of, ffn_dim_multiplier, norm_eps, qk_norm,
                 modulation=True, z_image_modulation=False, attn_out_bias=False):
        super().__init__()
        self.dim, self.head_dim, self.layer_id = dim, dim // n_heads, layer_id
        self.attention = JointAttention(dim, n_heads, n_kv_heads, qk_norm, out_bias=attn_out_bias)
        self.feed_forward = FeedForward(dim=dim, hidden_dim=dim, multiple_of=multiple_of,
                                        ffn_dim_multiplier=ffn_dim_multiplier)
        self.attention_norm1 = nn.RMSNorm(dim, eps=norm_eps, elementwise_affine=True)
        self.ffn_norm1 = nn.RMSNorm(dim, eps=norm_eps, elementwise_affine=True)
        self.attention_norm2 = nn.RMSNorm(dim, eps=norm_eps, elementwise_affine=True)
        self.ffn_norm2 = nn.RMSNorm(dim, eps=norm_eps, elementwise_affine=True)
        self.modulation = modulation
        if modulation:
            if z_image_modulation:
                self.adaLN_modulation = nn.Sequential(nn.Linear(min(dim, 256), 4 * dim, bias=True))
            else:
                self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(dim, 1024), 4 * dim, bias=True))

    def forward(self, x, x_mask, freqs_cis, adaln_input=None, transformer_options={}):
        if self.modulation:
            assert adaln_input is not None
            scale_msa, gate_msa, scale_mlp, gate_mlp = self.adaLN_modulation(adaln_input).chunk(4, dim=1)
            attn = self.attention(modulate(self.attention_norm1(x), scale_msa), x_mask, freqs_cis,
                                  transformer_options=transformer_options)
            x = x + gate_msa.unsqueeze(1).tanh() * self.attention_norm2(clamp_fp16(attn))
            ffn = self.feed_forward(modulate(self.ffn_norm1(x), scale_mlp))
            x = x + gate_mlp.unsqueeze(1).tanh() * self.ffn_norm2(clamp_fp16(ffn))
        else:
            assert adaln_input is None
            attn = self.attention(self.attention_norm1(x), x_mask, freqs_cis, transformer_options=transformer_options)
            x = x + self.attention_norm2(clamp_fp16(attn))
            x = x + self.ffn_norm2(self.feed_forward(self.ffn_norm1(x)))
        return x


class FinalLayer(nn.Module):
    """Mirrors lumina.py:191-212."""

    def __init__(self, hidden_size, patch_size, out_channels, z_image_modulation=False):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=True)
        min_mod = 256 if z_image_modulation else 1024
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(min(hidden_size, min_mod), hidden_size, bias=True))

    def forward(self, x, c):
        return self.linear(modulate(self.norm_final(x), self.adaLN_modulation(c)))


class NextDiT(nn.Module):
    """Mirrors lumina.py:215-419 NextDiT."""

    def __init__(self, patch_size=2, in_channels=4, dim=4096, n_layers=32, n_refiner_layers=2, n_heads=32,
                 n_kv_heads=None, multiple_of=256, ffn_dim_multiplier=4.0, norm_eps=1e-5, qk_norm=False,
                 cap_feat_dim=5120,
                 axes_dims=(16, 56, 56), axes_lens=(1, 512, 512), rope_theta=10000.0, z_image_modulation=False,
                 time_scale=1.0, pad_tokens_multiple=None):
        super().__init__()
        self.in_channels = self.out_channels = in_channels
        self.patch_size, self.time_scale, self.pad_tokens_multiple = patch_size, time_scale, pad_tokens_multiple
        self.x_embedder = nn.Linear(in_features=patch_size * patch_size * in_channels, out_features=dim, bias=True)
        block_args = (dim, n_heads, n_kv_heads, multiple_of, ffn_dim_multiplier, norm_eps, qk_norm)
        self.noise_refiner = nn.ModuleList(JointTransformerBlock(i, *block_args, modulation=True,
                                                                 z_image_modulation=z_image_modulation)
                                           for i in range(n_refiner_layers))
        self.context_refiner = nn.ModuleList(JointTransformerBlock(i, *block_args, modulation=False)
                                             for i in range(n_refiner_layers))
        self.t_embedder = TimestepEmbedder(min(dim, 1024), output_size=256 if z_image_modulation else None)
        self.cap_embedder = nn.Sequential(nn.RMSNorm(cap_feat_dim, eps=norm_eps, elementwise_affine=True),
                                          nn.Linear(cap_feat_dim, dim, bias=True))
        self.clip_text_pooled_proj = None
        self.layers = nn.ModuleList(JointTransformerBlock(i, *block_args, z_image_modulation=z_image_modulation,
                                                          attn_out_bias=False) for i in range(n_layers))
        self.final_layer = FinalLayer(dim, patch_size, self.out_channels, z_image_modulation=z_image_modulation)
        if self.pad_tokens_multiple is not None:
            self.x_pad_token = nn.Parameter(torch.empty((1, dim)))
            self.cap_pad_token = nn.Parameter(torch.empty((1, dim)))
        assert (dim // n_heads) == sum(axes_dims)
        self.axes_dims, self.axes_lens = axes_dims, axes_lens
        self.rope_embedder = EmbedND(dim=dim // n_heads, theta=rope_theta, axes_dim=axes_dims)
        self.dim, self.n_heads = dim, n_heads

    def unpatchify(self, x, img_size, cap_size, return_tensor=False):
        """Mirrors lumina.py:332-343: the image tokens after each caption back to [C, H, W]."""
        pH = pW = self.patch_size
        imgs = []
        for i in range(x.size(0)):
            H, W = img_size[i]
            begin = cap_size[i]
            end = begin + (H // pH) * (W // pW)
            img = x[i][begin:end].view(H // pH, W // pW, pH, pW, self.out_channels)
            imgs.append(img.permute(4, 0, 2, 1, 3).flatten(3, 4).flatten(1, 2))
        return torch.stack(imgs, dim=0) if return_tensor else imgs

    def patchify_and_embed(self, x, cap_feats, cap_mask, t, num_tokens, transformer_options={}):
        """Mirrors lumina.py:345-386: pad, refine caption and image apart, join [cap, x], freqs token axis 1."""
        bsz = len(x)
        pH = pW = self.patch_size
        device = x[0].device
        dtype = x[0].dtype
        if self.pad_tokens_multiple is not None:
            pad_extra = (-cap_feats.shape[1]) % self.pad_tokens_multiple
            pad = self.cap_pad_token.to(device=cap_feats.device, dtype=cap_feats.dtype, copy=True)
            cap_feats = torch.cat((cap_feats, pad.unsqueeze(0).repeat(cap_feats.shape[0], pad_extra, 1)), dim=1)
        cap_pos_ids = torch.zeros(bsz, cap_feats.shape[1], 3, dtype=torch.float32, device=device)
        cap_pos_ids[:, :, 0] = torch.arange(cap_feats.shape[1], dtype=torch.float32, device=device) + 1.0
        B, C, H, W = x.shape
        x = self.x_embedder(x.view(B, C, H // pH, pH, W // pW, pW).permute(0, 2, 4, 3, 5, 1).flatten(3).flatten(1, 2))
        H_tokens, W_tokens = H // pH, W // pW
        x_pos_ids = torch.zeros((bsz, x.shape[1], 3), dtype=torch.float32, device=device)
        x_pos_ids[:, :, 0] = cap_feats.shape[1] + 1
        rows = torch.arange(H_tokens, dtype=torch.float32, device=device)
        cols = torch.arange(W_tokens, dtype=torch.float32, device=device)
        x_pos_ids[:, :, 1] = rows.view(-1, 1).repeat(1, W_tokens).flatten()
        x_pos_ids[:, :, 2] = cols.view(1, -1).repeat(H_tokens, 1).flatten()
        if self.pad_tokens_multiple is not None:
            pad_extra = (-x.shape[1]) % self.pad_tokens_multiple
            pad = self.x_pad_token.to(device=x.device, dtype=dtype, copy=True)
            x = torch.cat((x, pad.unsqueeze(0).repeat(x.shape[0], pad_extra, 1)), dim=1)
            x_pos_ids = torch.nn.functional.pad(x_pos_ids, (0, 0, 0, pad_extra))
        freqs_cis = self.rope_embedder(torch.cat((cap_pos_ids, x_pos_ids), dim=1)).movedim(1, 2).to(dtype)
        for layer in self.context_refiner:
            cap_feats = layer(cap_feats, cap_mask, freqs_cis[:, : cap_pos_ids.shape[1]],
                              transformer_options=transformer_options)
        padded_img_mask = None
        for layer in self.noise_refiner:
            x = layer(x, padded_img_mask, freqs_cis[:, cap_pos_ids.shape[1] :], t,
                      transformer_options=transformer_options)
        padded_full_embed = torch.cat((cap_feats, x), dim=1)
        return padded_full_embed, None, [(H, W)] * bsz, [cap_feats.shape[1]] * bsz, freqs_cis

    def forward(self, x, timesteps, context, num_tokens=None, attention_mask=None, transformer_options={}, **kwargs):
        """Mirrors lumina.py:388-419: t = 1 - sigma (scaled by time_scale), layers called directly, returns -x."""
        t = 1.0 - timesteps
        cap_feats, cap_mask = context, attention_mask
        bs, c, h, w = x.shape
        x = pad_to_patch_size(x, (self.patch_size, self.patch_size))
        t = self.t_embedder(t * self.time_scale, dtype=x.dtype)
        adaln_input = t
        cap_feats = self.cap_embedder(cap_feats)
        x_is_tensor = isinstance(x, torch.Tensor)
        x, mask, img_size, cap_size, freqs_cis = self.patchify_and_embed(x, cap_feats, cap_mask, t, num_tokens,
                                                                         transformer_options=transformer_options)
        freqs_cis = freqs_cis.to(x.device)
        for layer in self.layers:
            x = layer(x, mask, freqs_cis, adaln_input, transformer_options=transformer_options)
        x = self.final_layer(x, adaln_input)
        x = self.unpatchify(x, img_size, cap_size, return_tensor=x_is_tensor)[:, :, :h, :w]
        return -x
