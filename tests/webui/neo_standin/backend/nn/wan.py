"""Stand-in of Neo's ``backend/nn/wan.py`` (de2193d9; from ComfyUI v0.3.64 comfy/ldm/wan/model.py): the module
function ``attention`` (18-19, "for Radial Attention"), ``sinusoidal_embedding_1d`` (22-31), ``WanSelfAttention``
(34-82), ``WanT2VCrossAttention`` (85-102), ``repeat_e`` (146-152), ``WanAttentionBlock`` (155-210), ``Head``
(213-243) and ``WanModel`` (266-430: ``forward_orig`` 333-387, ``forward`` 389-419, ``unpatchify`` 421-430).

Self-attention calls the module function ``attention`` (which forwards to the module global ``attention_function``);
cross-attention calls ``attention_function`` directly; q/k/v are [B, L, H*D]. Blocks' replace key is
("double_block", i) with args {img, txt, vec, pe, transformer_options} -> {img}; block_type "double" and
block_index are written in the call's transformer_options. The rope table is [B, L, 1, D/2, 2, 2] (token axis 1).
Not modelled: i2v (``WanI2VCrossAttention``, ``MLPProj``/``img_emb``; ``clip_fea`` only sets ``context_img_len``),
``time_dim_concat``. The i2v concat latent from ``dynamic_args.concat_latent`` (392-398) is kept.
"""
import math

import torch
import torch.nn as nn

from backend import args
from backend.attention import attention_function
from backend.memory_management import cast_to_device
from backend.nn.flux import EmbedND, apply_rope1
from backend.utils import pad_to_patch_size


def attention(*args, **kwargs):  # for Radial Attention
    """Mirrors wan.py:18-19: the self-attention's slot, forwarding to the module global attention_function."""
    return attention_function(*args, **kwargs)


def sinusoidal_embedding_1d(dim, position):
    """Mirrors wan.py:22-31."""
    assert dim % 2 == 0
    half = dim // 2
    position = position.type(torch.float32)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


class WanSelfAttention(nn.Module):
    """Mirrors wan.py:34-82: q/k RMS-normed over the full width, RoPE per head, then ``attention``."""

    def __init__(self, dim, num_heads, window_size=(-1, -1), qk_norm=True, eps=1e-6):
        assert dim % num_heads == 0
        super().__init__()
        self.dim, self.num_heads, self.head_dim = dim, num_heads, dim // num_heads
        self.window_size, self.qk_norm, self.eps = window_size, qk_norm, eps
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q = nn.RMSNorm(dim, eps=eps) if qk_norm else nn.Identity()
        self.norm_k = nn.RMSNorm(dim, eps=eps) if qk_norm else nn.Identity()

    def forward(self, x, freqs, transformer_options={}):
        b, s, n, d = *x.shape[:2], self.num_heads, self.head_dim
        q = apply_rope1(self.norm_q(self.q(x)).view(b, s, n, d), freqs)
        k = apply_rope1(self.norm_k(self.k(x)).view(b, s, n, d), freqs)
        x = attention(q.view(b, s, n * d), k.view(b, s, n * d), self.v(x).view(b, s, n * d), heads=self.num_heads,
                      transformer_options=transformer_options)
        return self.o(x)


class WanT2VCrossAttention(WanSelfAttention):
    """Mirrors wan.py:85-102: text cross-attention straight through attention_function."""

    def forward(self, x, context, **kwargs):
        q = self.norm_q(self.q(x))
        k = self.norm_k(self.k(context))
        v = self.v(context)
        return self.o(attention_function(q, k, v, heads=self.num_heads))


WAN_CROSSATTENTION_CLASSES = {"t2v_cross_attn": WanT2VCrossAttention}  # wan.py:140-143 (i2v not modelled)


def repeat_e(e, x):
    """Mirrors wan.py:146-152."""
    repeats = x.shape[1] // e.shape[1] if e.shape[1] > 1 else 1
    return e if repeats == 1 else torch.repeat_interleave(e, repeats, dim=1)


class WanAttentionBlock(nn.Module):
    """Mirrors wan.py:155-210: self-attention, text cross-attention, FFN, with the 6-way modulation."""

    def __init__(self, cross_attn_type, dim, ffn_dim, num_heads, window_size=(-1, -1), qk_norm=True,
                 cross_attn_norm=False, eps=1e-6):
        super().__init__()
        self.dim, self.ffn_dim, self.num_heads = dim, ffn_dim, num_heads
        self.window_size, self.qk_norm, self.cross_attn_norm, self.eps = window_size, qk_norm, cross_attn_norm, eps
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = WanSelfAttention(dim, num_heads, window_size, qk_norm, eps)
        self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=True) if cross_attn_norm else nn.Identity()
        self.cross_attn = WAN_CROSSATTENTION_CLASSES[cross_attn_type](dim, num_heads, (-1, -1), qk_norm, eps)
        self.norm2 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.empty(1, 6, dim))

    def forward(self, x, e, freqs, context, context_img_len=257, transformer_options={}):
        if e.ndim < 4:
            e = (cast_to_device(self.modulation, dtype=x.dtype, device=x.device) + e).chunk(6, dim=1)
        else:
            e = (cast_to_device(self.modulation, dtype=x.dtype, device=x.device).unsqueeze(0) + e).unbind(2)
        y = self.self_attn(self.norm1(x) * (1 + repeat_e(e[1], x)) + repeat_e(e[0], x), freqs,
                           transformer_options=transformer_options)
        x = x + y * repeat_e(e[2], x)
        x = x + self.cross_attn(self.norm3(x), context, context_img_len=context_img_len)
        y = self.ffn(self.norm2(x) * (1 + repeat_e(e[4], x)) + repeat_e(e[3], x))
        return x + y * repeat_e(e[5], x)


class Head(nn.Module):
    """Mirrors wan.py:213-243."""

    def __init__(self, dim, out_dim, patch_size, eps=1e-6):
        super().__init__()
        self.dim, self.out_dim, self.patch_size, self.eps = dim, out_dim, patch_size, eps
        self.norm = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.modulation = nn.Parameter(torch.empty(1, 2, dim))

    def forward(self, x, e):
        if e.ndim < 3:
            e = (cast_to_device(self.modulation, dtype=x.dtype, device=x.device) + e.unsqueeze(1)).chunk(2, dim=1)
        else:
            modulation = cast_to_device(self.modulation, dtype=x.dtype, device=x.device)
            e = (modulation.unsqueeze(0) + e.unsqueeze(2)).unbind(2)
        return self.head(self.norm(x) * (1 + repeat_e(e[1], x)) + repeat_e(e[0], x))


class WanModel(nn.Module):
    """Mirrors wan.py:266-430 WanModel (t2v)."""

    def __init__(self, model_type="t2v", patch_size=(1, 2, 2), text_len=512, in_dim=16, dim=2048, ffn_dim=8192,
                 freq_dim=256, text_dim=4096, out_dim=16, num_heads=16, num_layers=32, window_size=(-1, -1),
                 qk_norm=True, cross_attn_norm=True, eps=1e-6, flf_pos_embed_token_number=None):
        super().__init__()
        assert model_type == "t2v", "the stand-in models t2v only"
        self.model_type, self.patch_size, self.text_len = model_type, patch_size, text_len
        self.in_dim, self.dim, self.ffn_dim, self.freq_dim = in_dim, dim, ffn_dim, freq_dim
        self.text_dim, self.out_dim = text_dim, out_dim
        self.num_heads, self.num_layers, self.window_size = num_heads, num_layers, window_size
        self.qk_norm, self.cross_attn_norm, self.eps = qk_norm, cross_attn_norm, eps
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList(WanAttentionBlock("t2v_cross_attn", dim, ffn_dim, num_heads, window_size, qk_norm,
                                                      cross_attn_norm, eps) for _ in range(num_layers))
        self.head = Head(dim, out_dim, patch_size, eps)
        d = dim // num_heads
        self.rope_embedder = EmbedND(dim=d, theta=10000.0, axes_dim=[d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6)])
        self.img_emb = None

    def forward_orig(self, x, t, context, clip_fea=None, freqs=None, transformer_options={}, **kwargs):
        """Mirrors wan.py:333-387: patch embed, time modulation e0 [B, 1, 6, C], blocks (replace/reports), head."""
        x = self.patch_embedding(x).to(x.dtype)
        grid_sizes = x.shape[2:]
        x = x.flatten(2).transpose(1, 2)
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()).to(dtype=x[0].dtype))
        e = e.reshape(t.shape[0], -1, e.shape[-1])
        e0 = self.time_projection(e).unflatten(2, (6, self.dim))
        context = self.text_embedding(context)
        context_img_len = None
        if clip_fea is not None:
            context_img_len = clip_fea.shape[-2]

        patches_replace = transformer_options.get("patches_replace", {})
        blocks_replace = patches_replace.get("dit", {})
        transformer_options["total_blocks"] = len(self.blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.blocks):
            transformer_options["block_index"] = i
            if ("double_block", i) in blocks_replace:

                def block_wrap(args):
                    out = {}
                    out["img"] = block(args["img"], context=args["txt"], e=args["vec"], freqs=args["pe"],
                                       context_img_len=context_img_len, transformer_options=args["transformer_options"])
                    return out

                out = blocks_replace[("double_block", i)]({"img": x, "txt": context, "vec": e0, "pe": freqs,
                                                           "transformer_options": transformer_options},
                                                          {"original_block": block_wrap})
                x = out["img"]
            else:
                x = block(x, e=e0, freqs=freqs, context=context, context_img_len=context_img_len,
                          transformer_options=transformer_options)

        x = self.head(x, e)
        return self.unpatchify(x, grid_sizes)

    def forward(self, x, timestep, context, clip_fea=None, time_dim_concat=None, transformer_options={}, **kwargs):
        """Mirrors wan.py:389-419: i2v concat latent, (t, h, w) ids, freqs = rope(ids).movedim(1, 2)."""
        bs, c, t, h, w = x.shape
        if c < self.in_dim:
            assert args.dynamic_args.concat_latent is not None
            r = args.dynamic_args.concat_latent.to(x)
            if x.shape[0] == 2:  # batch_cond_uncond
                r = torch.cat((r, r), dim=0)
            x = torch.cat((x, r), dim=1)
            bs, c, t, h, w = x.shape
        x = pad_to_patch_size(x, self.patch_size)
        p = self.patch_size
        t_len, h_len, w_len = (t + (p[0] // 2)) // p[0], (h + (p[1] // 2)) // p[1], (w + (p[2] // 2)) // p[2]
        img_ids = torch.zeros((t_len, h_len, w_len, 3), device=x.device, dtype=x.dtype)
        for axis, n in enumerate((t_len, h_len, w_len)):
            shape = [1, 1, 1]
            shape[axis] = -1
            img_ids[:, :, :, axis] += torch.linspace(0, n - 1, steps=n, device=x.device, dtype=x.dtype).reshape(shape)
        img_ids = img_ids.reshape(1, t_len * h_len * w_len, 3).repeat(bs, 1, 1)
        freqs = self.rope_embedder(img_ids).movedim(1, 2)
        out = self.forward_orig(x, timestep, context, clip_fea=clip_fea, freqs=freqs,
                                transformer_options=transformer_options, **kwargs)
        return out[:, :, :t, :h, :w]

    def unpatchify(self, x, grid_sizes):
        """Mirrors wan.py:421-430."""
        c, b = self.out_dim, x.shape[0]
        u = x[:, : math.prod(grid_sizes)].view(b, *grid_sizes, *self.patch_size, c)
        u = torch.einsum("bfhwpqrc->bcfphqwr", u)
        return u.reshape(b, c, *[i * j for i, j in zip(grid_sizes, self.patch_size)])
