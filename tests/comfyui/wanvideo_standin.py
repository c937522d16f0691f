"""A stand-in of kijai's ComfyUI-WanVideoWrapper for CI, which cannot fetch the wrapper (its code is not ours to vendor).

It mirrors, at v1.4.7 (kijai 088128b), only what ToMe relies on, each piece naming the file and line it mirrors:

- ``WanVideoModel`` (nodes_model_loading.py:63): an ``nn.Module`` holding the transformer as ``diffusion_model`` and
  the loader's settings in ``pipeline`` (``model["compile_args"]``), wrapped by ComfyUI's own ``ModelPatcher``
  (nodes_model_loading.py:1708) whose ``model_options["transformer_options"]`` the wrapper's nodes set keys in
  (nodes_model_loading.py:1048, 1835).
- ``WanModel.forward`` (wanvideo/modules/model.py:2307): keyword inputs (``x`` a list of [C, F, H, W] latents, ``t``,
  ``context`` a list, ``seq_len``, ``fun_ref``, ``phantom_ref``, ``vace_data``, ``current_step``,
  ``current_step_percentage``, ``transformer_options``, ...), the tokens laid out (f h w) with Fun's reference image's
  tokens before them (model.py:2621-2626) and Phantom's frames after them (model.py:2628-2643), padded to ``seq_len``
  (model.py:2646), the per-token RoPE table of rope_func "comfy" over every frame (model.py:2663-2716), the
  modulation ``e0`` [B, 6, C] or, with a per-frame timestep (Wan 2.2 5B), [B, 6, L, C] (model.py:2806-2817), skip
  layer guidance (model.py:3262-3265) and each block called as ``block(x, x_ip=..., ..., **kwargs)``
  (model.py:3274), ``kwargs`` holding ``transformer_options`` (model.py:3113-3156) and, as the newest wrapper read
  (kijai 0cf30c63) hands them, every other feature's block input at rest (``FEATURES_OFF``); VACE's hints from its own
  blocks, called through ``.forward`` (model.py:2097-2144).
- ``WanAttentionBlock.forward`` (model.py:1002) on its plain path: modulation (``get_mod``, model.py:966), the
  self-attention's q/k with the per-token table (``_qkv_fn_with_rope``, model.py:424, ``apply_rope_comfy1``), the
  attention (attention.py ``attention``: sdpa on [B, H, L, D], or "comfy" through ComfyUI's optimized_attention), the
  in-place residual ``x.addcmul_(y, gate_msa)`` (model.py:1301), the text cross-attention, the feed-forward, the
  output tuple (x, x_ip, lynx_ref_feature, x_ovi); ``BaseWanAttentionBlock.forward`` adding VACE's hints after it
  (model.py:1526-1534).
- The sampler's deep copy of the patcher's transformer_options at every run (nodes_sampler.py:99) and its
  ``compile_model`` of each block (utils.py:616-641).

The arithmetic is Wan's (as in ComfyUI's own comfy/ldm/wan/model.py), so the parameter names match a Wan checkpoint
and the same weights can be loaded into ComfyUI's WanModel for a comparison with ToMe's native Wan path.
"""
from __future__ import annotations

import copy
import math
from typing import Any, List, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

MODULE = "ComfyUI-WanVideoWrapper.wanvideo.modules.model"  # ComfyUI names a custom node's modules after its folder


def sinusoidal_embedding_1d(dim: int, position: torch.Tensor) -> torch.Tensor:  # model.py:186
    half = dim // 2
    position = position.type(torch.float32)
    sinusoid = torch.outer(position, torch.pow(10000, -torch.arange(half).to(position).div(half)))
    return torch.cat([torch.cos(sinusoid), torch.sin(sinusoid)], dim=1)


def rope(pos: torch.Tensor, dim: int, theta: float = 10000.0) -> torch.Tensor:  # comfy.ldm.flux.math.rope
    scale = torch.linspace(0, (dim - 2) / dim, steps=dim // 2, dtype=torch.float64, device=pos.device)
    omega = 1.0 / (theta ** scale)
    out = torch.einsum("...n,d->...nd", pos.to(torch.float32), omega)
    out = torch.stack([torch.cos(out), -torch.sin(out), torch.sin(out), torch.cos(out)], dim=-1)
    return out.reshape(*out.shape[:-1], 2, 2).float()


def apply_rope1(x: torch.Tensor, freqs_cis: torch.Tensor) -> torch.Tensor:  # comfy.ldm.flux.math.apply_rope1
    x_ = x.to(dtype=freqs_cis.dtype).reshape(*x.shape[:-1], -1, 1, 2)
    x_out = freqs_cis[..., 0] * x_[..., 0] + freqs_cis[..., 1] * x_[..., 1]
    return x_out.reshape(*x.shape).type_as(x)


class RMSNorm(nn.Module):  # model.py:288 WanRMSNorm
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(dim=-1, keepdim=True) + self.eps) * self.weight


def attention(q, k, v, attention_mode: str = "sdpa", heads: int = 1):  # attention.py attention(), two of its modes
    if attention_mode == "comfy":
        from comfy.ldm.modules.attention import optimized_attention
        return optimized_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), heads=heads,
                                   skip_reshape=True)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2)


class Attention(nn.Module):  # model.py:365 WanSelfAttention (and :639 WanT2VCrossAttention)
    def __init__(self, dim: int, heads: int) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim), RMSNorm(dim)
        self.attention_mode = "sdpa"
        self.seen: Optional[List[tuple]] = None  # a test's list: (queries, keys, seq_lens) of each call

    def forward(self, q, k, v, seq_lens, attention_mode: Optional[str] = None):  # model.py:470
        if self.seen is not None:
            self.seen.append((q.shape[1], k.shape[1], seq_lens.clone() if seq_lens is not None else None))
        x = attention(q, k, v, attention_mode or self.attention_mode, self.num_heads)
        return self.o(x.flatten(2))

    def cross(self, x, context):  # model.py:647 (t2v)
        b, n, d = x.shape[0], self.num_heads, self.head_dim
        q = self.norm_q(self.q(x)).view(b, -1, n, d)
        k = self.norm_k(self.k(context)).view(b, -1, n, d)
        v = self.v(context).view(b, -1, n, d)
        return self.o(attention(q, k, v, "sdpa", n).flatten(2))


class WanAttentionBlock(nn.Module):  # model.py:884
    def __init__(self, dim: int, ffn_dim: int, heads: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.num_heads = heads
        self.norm1 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.self_attn = Attention(dim, heads)
        self.norm3 = nn.LayerNorm(dim, eps, elementwise_affine=True)
        self.cross_attn = Attention(dim, heads)
        self.norm2 = nn.LayerNorm(dim, eps, elementwise_affine=False)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)
        self.rope_func = "comfy"

    def get_mod(self, e):  # model.py:966
        if e.dim() == 3:
            return (self.modulation + e).chunk(6, dim=1)
        e_mod = self.modulation.unsqueeze(2) + e
        return [ei.squeeze(1) for ei in e_mod.unbind(dim=1)]

    def forward(self, x, e, seq_lens, grid_sizes, freqs, context, current_step, last_step=False, clip_embed=None,
                num_latent_frames=21, original_seq_len=None, x_ip=None, lynx_ref_feature=None, x_ovi=None,
                attention_mode_override=None, frame_tokens=None, transformer_options={}, **features):
        b, s, n, d = x.shape[0], x.shape[1], self.num_heads, x.shape[2] // self.num_heads
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = self.get_mod(e.to(x.device))
        input_x = torch.addcmul(shift_msa, self.norm1(x), 1 + scale_msa)
        attn = self.self_attn
        q = apply_rope1(attn.norm_q(attn.q(input_x)).view(b, s, n, d), freqs)  # model.py:424-451
        k = apply_rope1(attn.norm_k(attn.k(input_x)).view(b, s, n, d), freqs)
        v = attn.v(input_x).view(b, s, n, d)
        y = attn.forward(q, k, v, seq_lens, attention_mode_override)  # model.py:1264: .forward, not a module call
        x.addcmul_(y, gate_msa)  # model.py:1301: in place
        x += self.cross_attn.cross(self.norm3(x), context)
        mod_x = torch.addcmul(shift_mlp, self.norm2(x), 1 + scale_mlp)
        x = x.addcmul(self.ffn(mod_x), gate_mlp)
        return x, x_ip, lynx_ref_feature, x_ovi


class BaseWanAttentionBlock(WanAttentionBlock):  # model.py:1498 (VACE's main blocks)
    def __init__(self, *args: Any, block_id: Optional[int] = None) -> None:
        super().__init__(*args)
        if block_id is not None:
            self.register_buffer("block_id", torch.tensor(block_id, dtype=torch.long))
        else:
            self.block_id = None

    def forward(self, x, vace_hints=None, vace_context_scale=[1.0], **kwargs):  # model.py:1526
        x, x_ip, lynx_ref_feature, x_ovi = super().forward(x, **kwargs)
        if vace_hints is None:
            return x, x_ip, lynx_ref_feature, x_ovi
        if self.block_id is not None:
            for i in range(len(vace_hints)):
                x.add_(vace_hints[i][self.block_id].to(x.device), alpha=vace_context_scale[i])
        return x, x_ip, lynx_ref_feature, x_ovi


class Head(nn.Module):  # model.py:1536
    def __init__(self, dim: int, out_dim: int, patch_size) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim, 1e-6, elementwise_affine=False)
        self.head = nn.Linear(dim, math.prod(patch_size) * out_dim)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)

    def forward(self, x, e):
        if e.dim() == 2:
            e = (self.modulation + e.unsqueeze(1)).chunk(2, dim=1)
        else:
            e = [ei.squeeze(1) for ei in (self.modulation.unsqueeze(2) + e.unsqueeze(1)).chunk(2, dim=1)]
        return self.head(self.norm(x) * (1 + e[1]) + e[0])


WanAttentionBlock.__module__ = BaseWanAttentionBlock.__module__ = MODULE

# The block inputs of the features that are off in a plain call, as the newest wrapper read hands them to every block
# (kijai 0cf30c63, model.py WanModel.forward, its block call and the kwargs built before it): ToMe accepts each at
# rest. ``later_block_inputs`` (a test's) stands for what a later wrapper may add.
FEATURES_OFF = dict(chunked_self_attention=False, seq_chunks=0, camera_embed=None, audio_proj=None,
                    enhance_enabled=False, audio_scale=1.0, nag_params={}, nag_context=None,
                    multitalk_audio_embedding=None, ref_target_masks=None, human_num=0, inner_t=None, inner_c=None,
                    cross_freqs=None, freqs_ip=None, e_ip=None, adapter_proj=None, ip_scale=None, reverse_time=False,
                    mtv_motion_tokens=None, mtv_motion_rotary_emb=None, mtv_strength=1.0, mtv_freqs=None,
                    humo_audio_input=None, humo_audio_scale=1.0, lynx_x_ip=None, lynx_ip_scale=1.0,
                    lynx_ref_scale=1.0, longcat_num_cond_latents=0, longcat_avatar_options=None, onetoall_ref_scale=1.0,
                    e_tr=None, tr_start=0, tr_num=0)


class WanModel(nn.Module):  # model.py:1727
    def __init__(self, dim: int = 32, heads: int = 2, layers: int = 3, ffn_dim: int = 48, in_dim: int = 16,
                 out_dim: int = 16, text_dim: int = 32, freq_dim: int = 32, patch_size=(1, 2, 2),
                 vace_layers: Optional[List[int]] = None, add_ref_conv: bool = False) -> None:
        super().__init__()
        self.dim, self.num_heads, self.freq_dim, self.out_dim = dim, heads, freq_dim, out_dim
        self.patch_size, self.text_len = patch_size, 512
        self.attention_mode, self.rope_func, self.model_type, self.base_dtype = "sdpa", "comfy", "t2v", torch.float32
        self.is_longcat, self.video_attention_split_steps, self.slg_blocks = False, [], None
        self.enable_teacache = self.enable_magcache = self.enable_easycache = False
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        if vace_layers is None:
            self.vace_layers = None
            self.blocks = nn.ModuleList(WanAttentionBlock(dim, ffn_dim, heads) for _ in range(layers))
        else:
            self.vace_layers = vace_layers
            self.vace_blocks = nn.ModuleList(WanAttentionBlock(dim, ffn_dim, heads) for _ in vace_layers)
            self.vace_patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=patch_size, stride=patch_size)
            mapping = {layer: n for n, layer in enumerate(vace_layers)}
            self.blocks = nn.ModuleList(BaseWanAttentionBlock(dim, ffn_dim, heads, block_id=mapping.get(i))
                                        for i in range(layers))
        self.ref_conv = nn.Conv2d(in_dim, dim, kernel_size=patch_size[1:], stride=patch_size[1:]) \
            if add_ref_conv else None
        self.head = Head(dim, out_dim, patch_size)

    def rope_freqs(self, frames: int, h: int, w: int) -> torch.Tensor:  # model.py:2207 rope_encode_comfy
        d = self.dim // self.num_heads
        axes = (d - 4 * (d // 6), 2 * (d // 6), 2 * (d // 6))
        ids = torch.zeros(frames, h, w, 3)
        ids[..., 0] += torch.arange(frames).view(-1, 1, 1)
        ids[..., 1] += torch.arange(h).view(1, -1, 1)
        ids[..., 2] += torch.arange(w).view(1, 1, -1)
        ids = ids.reshape(1, -1, 3)
        emb = torch.cat([rope(ids[..., i], axes[i]) for i in range(3)], dim=-3)
        return emb.unsqueeze(1).movedim(1, 2)  # [1, L, 1, D/2, 2, 2]

    def forward(self, x, t, context, seq_len, is_uncond=False, current_step_percentage=0.0, current_step=0,
                fun_ref=None, phantom_ref=None, vace_data=None, transformer_options={}, later_block_inputs=None,
                **features):
        frames = x[0].shape[1]
        x = [self.patch_embedding(u.unsqueeze(0).float()) for u in x]
        grid = x[0].shape[2:]
        grid_sizes = torch.tensor([list(grid)], dtype=torch.long)
        f, h, w = (int(n) for n in grid)
        x = [u.flatten(2).transpose(1, 2) for u in x]
        original_seq_len = x[0].shape[1]
        if self.ref_conv is not None and fun_ref is not None:  # model.py:2621
            fun_ref = self.ref_conv(fun_ref).flatten(2).transpose(1, 2)
            seq_len += fun_ref.size(1)
            frames += 1
            x = [torch.cat([fun_ref[i:i + 1], u], dim=1) for i, u in enumerate(x)]
        if phantom_ref is not None:  # model.py:2628
            frames += phantom_ref.size(1)
            ref = self.patch_embedding(phantom_ref.unsqueeze(0).float()).flatten(2).transpose(1, 2)
            seq_len += ref.size(1)
            x = [torch.cat([u, ref], dim=1) for u in x]
        seq_lens = torch.tensor([u.size(1) for u in x], dtype=torch.int32)  # model.py:2600
        x = torch.cat([torch.cat([u, u.new_zeros(1, seq_len - u.size(1), u.size(2))], dim=1) for u in x])
        freqs = self.rope_freqs(frames // self.patch_size[0], h, w)
        per_frame = t.dim() == 2  # model.py:2738: Wan 2.2 5B's per-frame timesteps
        e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t.flatten()))
        e0 = self.time_projection(e).unflatten(1, (6, self.dim))
        if per_frame:  # model.py:2806
            b, nf = t.shape
            e = e.view(b, nf, 1, 1, self.dim).expand(b, nf, h, w, self.dim).flatten(1, 3)
            e0 = e0.view(b, nf, 1, 1, 6, self.dim).expand(b, nf, h, w, 6, self.dim).flatten(1, 3).transpose(1, 2)
        context = self.text_embedding(torch.stack([torch.cat([u, u.new_zeros(self.text_len - u.size(0), u.size(1))])
                                                   for u in context]))
        kwargs = dict(e=e0, seq_lens=seq_lens, grid_sizes=grid_sizes, freqs=freqs, context=context, clip_embed=None,
                      current_step=torch.tensor(current_step), last_step=torch.tensor(False, dtype=torch.bool),
                      num_latent_frames=frames, original_seq_len=original_seq_len,
                      frame_tokens=x.shape[1] // frames, transformer_options=transformer_options,
                      **dict(FEATURES_OFF, **(later_block_inputs or {})))
        if vace_data is not None:  # model.py:3165-3182, forward_vace at model.py:2097
            kwargs["vace_hints"] = [self.forward_vace(x, vace_data, kwargs)]
            kwargs["vace_context_scale"] = [1.0]
        for b, block in enumerate(self.blocks):
            if self.slg_blocks is not None and b in self.slg_blocks and is_uncond:  # model.py:3262
                continue
            x, _, _, _ = block(x, x_ip=None, lynx_ref_feature=None, x_ovi=None, x_onetoall_ref=None,
                               onetoall_freqs=None, attention_mode_override=None, **kwargs)  # model.py:3274
        if self.ref_conv is not None and fun_ref is not None:
            x = x[:, fun_ref.size(1):]
        x = x[:, :original_seq_len]
        x = self.head(x, e)
        c = self.out_dim
        u = x[0].view(f, h, w, *self.patch_size, c)
        u = torch.einsum("fhwpqrc->cfphqwr", u).reshape(c, *[i * j for i, j in zip((f, h, w), self.patch_size)])
        return [u.float()], None, None

    def forward_vace(self, x, vace_context, kwargs):  # model.py:2097
        c = torch.cat([self.vace_patch_embedding(u.unsqueeze(0).float()).flatten(2).transpose(1, 2)
                       for u in vace_context])
        hints, current = [], c
        for n, block in enumerate(self.vace_blocks):
            current = block.forward(current + x if n == 0 else current, **kwargs)[0]
            hints.append(current * 0.5)
        return hints


WanModel.__module__ = MODULE


class WanVideoModel(nn.Module):  # nodes_model_loading.py:63
    def __init__(self, transformer: WanModel) -> None:
        super().__init__()
        self.diffusion_model = transformer
        self.pipeline = {}
        self.model_config = None

    def __getitem__(self, k):
        return self.pipeline[k]

    def __setitem__(self, k, v):
        self.pipeline[k] = v


WanVideoModel.__module__ = "ComfyUI-WanVideoWrapper.nodes_model_loading"


def seeded(transformer: nn.Module, seed: int = 0) -> nn.Module:
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in transformer.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 16
            p.copy_(torch.randn(p.shape, generator=generator) / fan_in ** 0.5)
    return transformer


def patcher(comfy: Any, transformer: WanModel, compile_args: Optional[dict] = None) -> Any:
    """The loader's ModelPatcher (nodes_model_loading.py:1708-1836) around a WanVideoModel."""
    model = WanVideoModel(transformer)
    model["compile_args"] = compile_args
    cpu = torch.device("cpu")
    found = comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)
    found.model_options.setdefault("transformer_options", {})["merge_loras"] = False
    return found


def compile_blocks(transformer: WanModel, compile_args: dict) -> None:  # utils.py:632-636 compile_model
    for i, block in enumerate(transformer.blocks):
        if hasattr(block, "_orig_mod"):
            block = block._orig_mod
        transformer.blocks[i] = torch.compile(block, fullgraph=compile_args.get("fullgraph", False),
                                              dynamic=compile_args.get("dynamic", False),
                                              backend=compile_args.get("backend", "inductor"))


def sample(patcher: Any, latent: torch.Tensor, context: torch.Tensor, steps: int = 2, cfg: bool = True,
           **features: Any) -> torch.Tensor:
    """The wrapper's sampler loop in small (nodes_sampler.py): a deep copy of the patcher's transformer_options per
    run (:99), the blocks compiled where the loader was given compile_args (:143-145), then per step a conditional and
    (cfg) an unconditional call with the same latent and timestep, Euler on the flow prediction."""
    transformer = patcher.model.diffusion_model
    options = copy.deepcopy(patcher.model_options.get("transformer_options"))
    compile_args = patcher.model["compile_args"]
    if compile_args is not None:
        compile_blocks(transformer, compile_args)
    z = latent.clone()
    sigmas = torch.linspace(1.0, 0.0, steps + 1)
    seq_len = math.ceil(z.shape[2] * z.shape[3] / 4 * z.shape[1])
    with torch.no_grad():
        for i in range(steps):
            timestep = (sigmas[i] * 1000).reshape(1)
            call = dict(t=timestep, seq_len=seq_len, current_step=i, current_step_percentage=i / steps,
                        transformer_options=options, **features)
            cond = transformer(x=[z], context=[context], **call)[0][0]
            if cfg:
                uncond = transformer(x=[z], context=[torch.zeros_like(context)], is_uncond=True, **call)[0][0]
                cond = uncond + 3.0 * (cond - uncond)
            z = z + (sigmas[i + 1] - sigmas[i]) * cond
    return z
