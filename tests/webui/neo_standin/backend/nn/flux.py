"""Stand-in of Neo's ``backend/nn/flux.py`` (de2193d9; from ComfyUI v0.9.0 comfy/ldm/flux): ``attention`` (18-23),
``rope`` (26-38), ``timestep_embedding`` (41-52), ``EmbedND`` (55-68), ``MLPEmbedder`` (71-79), ``QKNorm``
(114-123), ``SelfAttention`` (126-134), ``ModulationOut``/``Modulation``/``apply_mod`` (137-173),
``DoubleStreamBlock`` (186-264), ``SingleStreamBlock`` (267-329), ``LastLayer`` (332-346) and
``IntegratedFluxTransformer2DModel`` (349-634: ``forward_orig`` 447-556, ``process_img`` 558-577, ``forward``
579-634); ``apply_rope``/``apply_rope1`` are comfy_kitchen 0.2.19's eager backend (backends/eager/rope.py:9-20),
which Neo imports here.

Not modelled: Flux.2's ``global_modulation``/``mlp_silu_act``/``yak_mlp``/``txt_norm``/``txt_ids_dims`` options,
``modulation_dims`` (None in every Neo call), ControlNet residuals, ``patches["post_input"]``. ``fp16_fix`` is kept.
"""
import math
from dataclasses import dataclass

import torch
from torch import nn

from backend.args import dynamic_args
from backend.attention import attention_function
from backend.utils import fp16_fix, pad_to_patch_size


def apply_rope1(x, freqs_cis):
    """Mirrors comfy_kitchen backends/eager/rope.py:9-16 apply_rope1 (interleaved pairs; pe cut to x on axis 2)."""
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    if x_.shape[2] != 1 and freqs_cis.shape[2] != 1 and x_.shape[2] != freqs_cis.shape[2]:
        freqs_cis = freqs_cis[:, :, : x_.shape[2]]
    x_out = freqs_cis[..., 0] * x_[..., 0]
    x_out.addcmul_(freqs_cis[..., 1], x_[..., 1])
    return x_out.reshape(*x.shape).type_as(x)


def apply_rope(xq, xk, freqs_cis):
    """Mirrors comfy_kitchen backends/eager/rope.py:19-20 apply_rope."""
    return apply_rope1(xq, freqs_cis), apply_rope1(xk, freqs_cis)


def attention(q, k, v, pe, mask=None, transformer_options={}):
    """Mirrors flux.py:18-23: RoPE on q/k [B, H, L, D], then the module global attention_function."""
    if pe is not None:
        q, k = apply_rope(q, k, pe)
    heads = q.shape[1]
    x = attention_function(q, k, v, heads, skip_reshape=True, mask=mask, transformer_options=transformer_options)
    return x


def rope(pos, dim, theta):
    """Mirrors flux.py:26-38: [..., n] positions to [..., n, dim/2, 2, 2] rotation matrices."""
    assert dim % 2 == 0
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64, device=pos.device)
    omega = 1.0 / (theta**scale)
    out = torch.einsum("...n,d->...nd", pos.to(dtype=torch.float32), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).to(dtype=torch.float32)


def timestep_embedding(t, dim, max_period=10000, time_factor=1000.0):
    """Mirrors flux.py:41-52 (t scaled by 1000)."""
    t = time_factor * t
    half = dim // 2
    freqs = torch.arange(start=0, end=half, dtype=torch.float32, device=t.device)
    freqs = torch.exp(-math.log(max_period) * freqs / half)
    args = t[:, None].float() * freqs[None]
    embedding = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    if dim % 2:
        embedding = torch.cat([embedding, torch.zeros_like(embedding[:, :1])], dim=-1)
    return embedding.to(t) if torch.is_floating_point(t) else embedding


class EmbedND(nn.Module):
    """Mirrors flux.py:55-68 EmbedND: ids [B, L, n_axes] -> pe [B, 1, L, D/2, 2, 2]."""

    def __init__(self, dim, theta, axes_dim):
        super().__init__()
        self.dim, self.theta, self.axes_dim = dim, theta, axes_dim

    def forward(self, ids):
        n_axes = ids.shape[-1]
        return torch.cat([rope(ids[..., i], self.axes_dim[i], self.theta) for i in range(n_axes)], dim=-3).unsqueeze(1)


class MLPEmbedder(nn.Module):
    """Mirrors flux.py:71-79."""

    def __init__(self, in_dim, hidden_dim, bias=True):
        super().__init__()
        self.in_layer = nn.Linear(in_dim, hidden_dim, bias=bias)
        self.silu = nn.SiLU()
        self.out_layer = nn.Linear(hidden_dim, hidden_dim, bias=bias)

    def forward(self, x):
        return self.out_layer(self.silu(self.in_layer(x)))


class QKNorm(nn.Module):
    """Mirrors flux.py:114-123."""

    def __init__(self, dim):
        super().__init__()
        self.query_norm = nn.RMSNorm(dim)
        self.key_norm = nn.RMSNorm(dim)

    def forward(self, q, k, v):
        return self.query_norm(q).to(v), self.key_norm(k).to(v)


class SelfAttention(nn.Module):
    """Mirrors flux.py:126-134 (weights only; the blocks run it)."""

    def __init__(self, dim, num_heads=8, qkv_bias=False, proj_bias=True):
        super().__init__()
        self.num_heads = num_heads
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.norm = QKNorm(dim // num_heads)
        self.proj = nn.Linear(dim, dim, bias=proj_bias)


@dataclass
class ModulationOut:
    """Mirrors flux.py:137-141."""

    shift: torch.Tensor
    scale: torch.Tensor
    gate: torch.Tensor


class Modulation(nn.Module):
    """Mirrors flux.py:144-159."""

    def __init__(self, dim, double, bias=True):
        super().__init__()
        self.is_double = double
        self.multiplier = 6 if double else 3
        self.lin = nn.Linear(dim, self.multiplier * dim, bias=bias)

    def forward(self, vec):
        if vec.ndim == 2:
            vec = vec[:, None, :]
        out = self.lin(nn.functional.silu(vec)).chunk(self.multiplier, dim=-1)
        return ModulationOut(*out[:3]), ModulationOut(*out[3:]) if self.is_double else None


def apply_mod(tensor, m_mult, m_add=None):
    """Mirrors flux.py:162-173 apply_mod with modulation_dims None."""
    return torch.addcmul(m_add, tensor, m_mult) if m_add is not None else tensor * m_mult


def _mlp(hidden_size, mlp_hidden_dim):
    """Mirrors flux.py build_mlp's default branch (97-111)."""
    return nn.Sequential(nn.Linear(hidden_size, mlp_hidden_dim), nn.GELU(approximate="tanh"),
                         nn.Linear(mlp_hidden_dim, hidden_size))


class DoubleStreamBlock(nn.Module):
    """Mirrors flux.py:186-264: joint [txt, img] attention, in-place residual adds."""

    def __init__(self, hidden_size, num_heads, mlp_ratio, qkv_bias=False, modulation=True, proj_bias=True):
        super().__init__()
        self.num_heads, self.hidden_size, self.modulation = num_heads, hidden_size, modulation
        for side in ("img", "txt"):
            if modulation:
                setattr(self, f"{side}_mod", Modulation(hidden_size, double=True))
            setattr(self, f"{side}_norm1", nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6))
            setattr(self, f"{side}_attn", SelfAttention(hidden_size, num_heads, qkv_bias, proj_bias))
            setattr(self, f"{side}_norm2", nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6))
            setattr(self, f"{side}_mlp", _mlp(hidden_size, int(hidden_size * mlp_ratio)))

    def _qkv(self, x, norm1, attn, mod1):
        qkv = attn.qkv(apply_mod(norm1(x), 1 + mod1.scale, mod1.shift))
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = attn.norm(q, k, v)
        return q, k, v

    def forward(self, img, txt, vec, pe, attn_mask=None, modulation_dims_img=None, modulation_dims_txt=None,
                transformer_options={}):
        if self.modulation:
            img_mod1, img_mod2 = self.img_mod(vec)
            txt_mod1, txt_mod2 = self.txt_mod(vec)
        else:
            (img_mod1, img_mod2), (txt_mod1, txt_mod2) = vec
        img_q, img_k, img_v = self._qkv(img, self.img_norm1, self.img_attn, img_mod1)
        txt_q, txt_k, txt_v = self._qkv(txt, self.txt_norm1, self.txt_attn, txt_mod1)
        q, k, v = torch.cat((txt_q, img_q), dim=2), torch.cat((txt_k, img_k), dim=2), torch.cat((txt_v, img_v), dim=2)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        txt_attn, img_attn = attn[:, : txt.shape[1]], attn[:, txt.shape[1] :]
        img += apply_mod(self.img_attn.proj(img_attn), img_mod1.gate)
        img += apply_mod(self.img_mlp(apply_mod(self.img_norm2(img), 1 + img_mod2.scale, img_mod2.shift)),
                         img_mod2.gate)
        txt += apply_mod(self.txt_attn.proj(txt_attn), txt_mod1.gate)
        txt += apply_mod(self.txt_mlp(apply_mod(self.txt_norm2(txt), 1 + txt_mod2.scale, txt_mod2.shift)),
                         txt_mod2.gate)
        return img, fp16_fix(txt)


class SingleStreamBlock(nn.Module):
    """Mirrors flux.py:267-329: fused qkv+mlp on the joint sequence, in-place residual add."""

    def __init__(self, hidden_size, num_heads, mlp_ratio=4.0, qk_scale=None, modulation=True, bias=True):
        super().__init__()
        self.hidden_dim = self.hidden_size = hidden_size
        self.num_heads = num_heads
        head_dim = hidden_size // num_heads
        self.scale = qk_scale or head_dim**-0.5
        self.mlp_hidden_dim = self.mlp_hidden_dim_first = int(hidden_size * mlp_ratio)
        self.mlp_act = nn.GELU(approximate="tanh")
        self.linear1 = nn.Linear(hidden_size, hidden_size * 3 + self.mlp_hidden_dim_first, bias=bias)
        self.linear2 = nn.Linear(hidden_size + self.mlp_hidden_dim, hidden_size, bias=bias)
        self.norm = QKNorm(head_dim)
        self.pre_norm = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.modulation = Modulation(hidden_size, double=False) if modulation else None

    def forward(self, x, vec, pe, attn_mask=None, modulation_dims=None, transformer_options={}):
        mod = self.modulation(vec)[0] if self.modulation else vec
        qkv, mlp = torch.split(self.linear1(apply_mod(self.pre_norm(x), 1 + mod.scale, mod.shift)),
                               [3 * self.hidden_size, self.mlp_hidden_dim_first], dim=-1)
        q, k, v = qkv.view(qkv.shape[0], qkv.shape[1], 3, self.num_heads, -1).permute(2, 0, 3, 1, 4)
        q, k = self.norm(q, k, v)
        attn = attention(q, k, v, pe=pe, mask=attn_mask, transformer_options=transformer_options)
        output = self.linear2(torch.cat((attn, self.mlp_act(mlp)), 2))
        x += apply_mod(output, mod.gate)
        return fp16_fix(x)


class LastLayer(nn.Module):
    """Mirrors flux.py:332-346."""

    def __init__(self, hidden_size, patch_size, out_channels, bias=True):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, patch_size * patch_size * out_channels, bias=bias)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(hidden_size, 2 * hidden_size, bias=bias))

    def forward(self, x, vec, modulation_dims=None):
        if vec.ndim == 2:
            vec = vec[:, None, :]
        shift, scale = self.adaLN_modulation(vec).chunk(2, dim=-1)
        return self.linear(apply_mod(self.norm_final(x), 1 + scale, shift))


class IntegratedFluxTransformer2DModel(nn.Module):
    """Mirrors flux.py:349-634 IntegratedFluxTransformer2DModel (Flux.1 options)."""

    def __init__(self, in_channels, out_channels, vec_in_dim, context_in_dim, hidden_size, mlp_ratio, num_heads, depth,
                 depth_single_blocks, axes_dim, theta, patch_size, qkv_bias, guidance_embed,
                 default_ref_method="offset", ref_index_scale=1.0):
        super().__init__()
        self.guidance_embed = guidance_embed
        self.patch_size = patch_size
        self.in_channels = in_channels * patch_size * patch_size
        self.out_channels = out_channels * patch_size * patch_size
        pe_dim = hidden_size // num_heads
        if sum(axes_dim) != pe_dim:
            raise ValueError(f"Got {axes_dim} but expected positional dim {pe_dim}")
        self.axes_dim, self.hidden_size, self.num_heads = axes_dim, hidden_size, num_heads
        self.pe_embedder = EmbedND(dim=pe_dim, theta=theta, axes_dim=axes_dim)
        self.img_in = nn.Linear(self.in_channels, hidden_size)
        self.time_in = MLPEmbedder(in_dim=256, hidden_dim=hidden_size)
        if vec_in_dim is not None:
            self.vec_in_dim = vec_in_dim
            self.vector_in = MLPEmbedder(vec_in_dim, hidden_size)
        self.guidance_in = MLPEmbedder(in_dim=256, hidden_dim=hidden_size) if guidance_embed else nn.Identity()
        self.txt_in = nn.Linear(context_in_dim, hidden_size)
        self.double_blocks = nn.ModuleList(DoubleStreamBlock(hidden_size, num_heads, mlp_ratio, qkv_bias)
                                           for _ in range(depth))
        self.single_blocks = nn.ModuleList(SingleStreamBlock(hidden_size, num_heads, mlp_ratio)
                                           for _ in range(depth_single_blocks))
        self.final_layer = LastLayer(hidden_size, 1, self.out_channels)
        self.default_ref_method, self.ref_index_scale = default_ref_method, ref_index_scale

    def forward_orig(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, control=None,
                     transformer_options={}, attn_mask=None):
        """Mirrors flux.py:447-556: double blocks, img = cat(txt, img), single blocks; replace keys/args, reports."""
        patches_replace = transformer_options.get("patches_replace", {})
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
        if self.guidance_embed and guidance is not None:
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        if hasattr(self, "vec_in_dim"):
            if y is None:
                y = torch.zeros((img.shape[0], self.vec_in_dim), device=img.device, dtype=img.dtype)
            vec = vec + self.vector_in(y[:, : self.vec_in_dim])
        txt = self.txt_in(txt)
        vec_orig = vec
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1)) if img_ids is not None else None

        blocks_replace = patches_replace.get("dit", {})
        transformer_options["total_blocks"] = len(self.double_blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.double_blocks):
            transformer_options["block_index"] = i
            if ("double_block", i) in blocks_replace:

                def block_wrap(args):
                    out = {}
                    out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                                   attn_mask=args.get("attn_mask"),
                                                   transformer_options=args.get("transformer_options"))
                    return out

                out = blocks_replace[("double_block", i)]({"img": img, "txt": txt, "vec": vec, "pe": pe,
                                                           "attn_mask": attn_mask,
                                                           "transformer_options": transformer_options},
                                                          {"original_block": block_wrap})
                txt = out["txt"]
                img = out["img"]
            else:
                img, txt = block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask,
                                 transformer_options=transformer_options)

        img = fp16_fix(img)
        img = torch.cat((txt, img), 1)
        transformer_options["total_blocks"] = len(self.single_blocks)
        transformer_options["block_type"] = "single"
        for i, block in enumerate(self.single_blocks):
            transformer_options["block_index"] = i
            if ("single_block", i) in blocks_replace:

                def block_wrap(args):
                    out = {}
                    out["img"] = block(args["img"], vec=args["vec"], pe=args["pe"], attn_mask=args.get("attn_mask"),
                                       transformer_options=args.get("transformer_options"))
                    return out

                out = blocks_replace[("single_block", i)]({"img": img, "vec": vec, "pe": pe, "attn_mask": attn_mask,
                                                           "transformer_options": transformer_options},
                                                          {"original_block": block_wrap})
                img = out["img"]
            else:
                img = block(img, vec=vec, pe=pe, attn_mask=attn_mask, transformer_options=transformer_options)

        img = img[:, txt.shape[1] :, ...]
        return self.final_layer(img, vec_orig)

    def process_img(self, x, index=0, h_offset=0, w_offset=0):
        """Mirrors flux.py:558-577: [B, C, H, W] -> patch tokens (h w) (c ph pw) and (index, h, w) ids."""
        bs, c, h, w = x.shape
        p = self.patch_size
        x = pad_to_patch_size(x, (p, p))
        h_len, w_len = (h + (p // 2)) // p, (w + (p // 2)) // p
        img = x.reshape(bs, c, h_len, p, w_len, p).permute(0, 2, 4, 1, 3, 5).reshape(bs, h_len * w_len, c * p * p)
        h_offset, w_offset = (h_offset + (p // 2)) // p, (w_offset + (p // 2)) // p
        img_ids = torch.zeros((h_len, w_len, len(self.axes_dim)), device=x.device, dtype=torch.float32)
        img_ids[:, :, 0] = index
        img_ids[:, :, 1] += torch.linspace(h_offset, h_len - 1 + h_offset, steps=h_len, device=x.device).unsqueeze(1)
        img_ids[:, :, 2] += torch.linspace(w_offset, w_len - 1 + w_offset, steps=w_len, device=x.device).unsqueeze(0)
        return img, img_ids.reshape(1, h_len * w_len, -1).repeat(bs, 1, 1)

    def forward(self, x, timestep, context, y=None, guidance=None, ref_latents=None, control=None,
                transformer_options={}, **kwargs):
        """Mirrors flux.py:579-634 (references appended after the image tokens; "offset"/"index" methods)."""
        bs, c, h_orig, w_orig = x.shape
        p = self.patch_size
        h_len, w_len = (h_orig + (p // 2)) // p, (w_orig + (p // 2)) // p
        img, img_ids = self.process_img(x)
        img_tokens = img.shape[1]
        ref_latents = ref_latents or dynamic_args.ref_latents
        if ref_latents is not None:
            h = w = 0
            index = 0
            for ref in ref_latents:
                if kwargs.get("ref_latents_method", self.default_ref_method) == "index":
                    index += self.ref_index_scale
                    h_offset = w_offset = 0
                else:
                    index, h_offset, w_offset = 1, 0, 0
                    if ref.shape[-2] + h > ref.shape[-1] + w:
                        w_offset = w
                    else:
                        h_offset = h
                    h, w = max(h, ref.shape[-2] + h_offset), max(w, ref.shape[-1] + w_offset)
                kontext, kontext_ids = self.process_img(ref.to(x), index=index, h_offset=h_offset, w_offset=w_offset)
                img = torch.cat([img, kontext.expand(img.shape[0], *kontext.shape[1:])], dim=1)
                img_ids = torch.cat([img_ids, kontext_ids.expand(img_ids.shape[0], *kontext_ids.shape[1:])], dim=1)
        txt_ids = torch.zeros((bs, context.shape[1], len(self.axes_dim)), device=x.device, dtype=torch.float32)
        out = self.forward_orig(img, img_ids, context, txt_ids, timestep, y, guidance, control, transformer_options,
                                attn_mask=kwargs.get("attention_mask", None))
        out = out[:, :img_tokens]
        out = out.reshape(bs, h_len, w_len, -1, p, p).permute(0, 3, 1, 4, 2, 5).reshape(bs, -1, h_len * p, w_len * p)
        return out[:, :, :h_orig, :w_orig]
