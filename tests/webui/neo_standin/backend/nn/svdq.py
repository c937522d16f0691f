"""Stand-in of Neo's ``backend/nn/svdq.py`` (de2193d9), the Nunchaku (SVDQuant) models: ``NunchakuModelMixin``
(32-57), ``SVDQFluxTransformer2DModel`` (65-210), the Qwen part's attention global (248-253), ``Attention``
(320-420), ``NunchakuQwenImageTransformerBlock`` (423-530) and ``NunchakuQwenImageTransformer2DModel`` (532-796).

``SVDQFluxTransformer2DModel`` runs nunchaku's own transformer (``self.model``): no replace patches, no Neo attention
global. Here that inner model is a tiny stand-in (``NunchakuFluxTransformer2dModel``: embed, one joint SDPA layer,
project) that calls torch's SDPA directly. ``NunchakuQwenImageTransformer2DModel`` honours the ("double_block", i)
replaces with {img, txt, vec, pe} as Neo's does (686-720), has no ``patches["double_block"]`` loop, reads references
only from ``dynamic_args``, and its attention calls THIS module's ``attention_function`` (attention_pytorch; Neo
picks attention_xformers when xformers is on). A Nunchaku model gets a ``NunchakuPatcher`` (patcher/unet.py:16-17).
Not modelled: quantized linears, LoRA composition, first-block cache, CPU offload, ControlNet residuals, Nunchaku
Z-Image (``patch_nunchaku_zimage``: a ``lumina.NextDiT`` whose layers are patched, 1043-).
"""
import torch
import torch.nn as nn
import torch.nn.functional as F

from backend.args import dynamic_args
from backend.attention import attention_pytorch as attention_function  # svdq.py:251-253 (xformers off)
from backend.nn.flux import EmbedND, timestep_embedding
from backend.nn.qwen import (LastLayer, QwenImageTransformer2DModel, QwenImageTransformerBlock,
                             QwenTimestepProjEmbeddings, apply_rotary_emb)
from backend.utils import process_img


class NunchakuModelMixin(nn.Module):
    """Mirrors svdq.py:32-57: ``to`` never casts the dtype, and does not move an offloaded model."""

    offload = False

    def set_offload(self, offload, use_pin_memory, num_blocks_on_gpu):
        self.offload = offload

    def to(self, *args, **kwargs):
        args = [a for a in args if not isinstance(a, torch.dtype)]
        kwargs.pop("dtype", None)
        if self.offload and (args or kwargs.get("device") is not None):
            return self
        return super().to(*args, **kwargs)


class NunchakuFluxTransformer2dModel(nn.Module):
    """Tiny stand-in of nunchaku's NunchakuFluxTransformer2dModel (its own attention; no Neo hooks)."""

    def __init__(self, in_channels, context_in_dim, hidden_size, num_heads, vec_in_dim):
        super().__init__()
        self.num_heads = num_heads
        self.x_embedder = nn.Linear(in_channels, hidden_size)
        self.context_embedder = nn.Linear(context_in_dim, hidden_size)
        self.time_in = nn.Linear(256, hidden_size)
        self.vector_in = nn.Linear(vec_in_dim, hidden_size)
        self.qkv = nn.Linear(hidden_size, 3 * hidden_size)
        self.proj_out = nn.Linear(hidden_size, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                guidance=None, **kwargs):
        img, txt = self.x_embedder(hidden_states), self.context_embedder(encoder_hidden_states)
        vec = self.time_in(timestep_embedding(timestep, 256)) + self.vector_in(pooled_projections)
        x = torch.cat((txt, img), 1) + vec[:, None]
        q, k, v = self.qkv(x).unflatten(-1, (3, self.num_heads, -1)).permute(2, 0, 3, 1, 4)
        x = x + F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)
        return self.proj_out(x[:, txt.shape[1] :])


class SVDQFluxTransformer2DModel(nn.Module):
    """Mirrors svdq.py:65-210 SVDQFluxTransformer2DModel: Flux through nunchaku's own transformer, no replaces."""

    def __init__(self, config):
        super().__init__()
        self.model = NunchakuFluxTransformer2dModel(config["in_channels"], config["context_in_dim"],
                                                    config["hidden_size"], config["num_heads"], config["vec_in_dim"])
        self.dtype = next(self.model.parameters()).dtype
        self.config = config
        self.loras = []

    def forward(self, x, timestep, context, y, guidance, control=None, transformer_options={}, **kwargs):
        bs, c, h_orig, w_orig = x.shape
        patch_size = self.config.get("patch_size", 2)
        h_len, w_len = (h_orig + (patch_size // 2)) // patch_size, (w_orig + (patch_size // 2)) // patch_size
        img, img_ids = process_img(x)
        img_tokens = img.shape[1]
        for ref in dynamic_args.ref_latents or []:
            kontext, kontext_ids = process_img(ref.to(x), index=1)
            img, img_ids = torch.cat([img, kontext], dim=1), torch.cat([img_ids, kontext_ids], dim=1)
        txt_ids = torch.zeros((bs, context.shape[1], 3), device=x.device, dtype=x.dtype)
        out = self.model(hidden_states=img, encoder_hidden_states=context, pooled_projections=y, timestep=timestep,
                         img_ids=img_ids, txt_ids=txt_ids, guidance=guidance if self.config["guidance_embed"] else None)
        out = out[:, :img_tokens].reshape(bs, h_len, w_len, -1, patch_size, patch_size).permute(0, 3, 1, 4, 2, 5)
        return out.reshape(bs, -1, h_len * patch_size, w_len * patch_size)[:, :, :h_orig, :w_orig]


class Attention(nn.Module):
    """Mirrors svdq.py:320-420: fused to_qkv / add_qkv_proj, joint attention through this module's global."""

    def __init__(self, dim, heads, dim_head, eps=1e-6):
        super().__init__()
        self.heads, self.inner_dim = heads, heads * dim_head
        self.to_qkv = nn.Linear(dim, 3 * self.inner_dim)
        self.add_qkv_proj = nn.Linear(dim, 3 * self.inner_dim)
        self.norm_q, self.norm_k = nn.RMSNorm(dim_head, eps=eps), nn.RMSNorm(dim_head, eps=eps)
        self.norm_added_q, self.norm_added_k = nn.RMSNorm(dim_head, eps=eps), nn.RMSNorm(dim_head, eps=eps)
        self.to_out = nn.ModuleList([nn.Linear(self.inner_dim, dim), nn.Dropout(0.0)])
        self.to_add_out = nn.Linear(self.inner_dim, dim)

    def forward(self, hidden_states, encoder_hidden_states=None, encoder_hidden_states_mask=None, attention_mask=None,
                image_rotary_emb=None):
        seq_txt = encoder_hidden_states.shape[1]
        img_q, img_k, img_v = (t.unflatten(-1, (self.heads, -1)) for t in self.to_qkv(hidden_states).chunk(3, dim=-1))
        txt_qkv = self.add_qkv_proj(encoder_hidden_states).chunk(3, dim=-1)
        txt_q, txt_k, txt_v = (t.unflatten(-1, (self.heads, -1)) for t in txt_qkv)
        img_q, img_k = self.norm_q(img_q), self.norm_k(img_k)
        txt_q, txt_k = self.norm_added_q(txt_q), self.norm_added_k(txt_k)
        joint_q = apply_rotary_emb(torch.cat([txt_q, img_q], dim=1), image_rotary_emb).flatten(start_dim=2)
        joint_k = apply_rotary_emb(torch.cat([txt_k, img_k], dim=1), image_rotary_emb).flatten(start_dim=2)
        joint_v = torch.cat([txt_v, img_v], dim=1).flatten(start_dim=2)
        out = attention_function(joint_q, joint_k, joint_v, self.heads, attention_mask)
        return self.to_out[1](self.to_out[0](out[:, seq_txt:])), self.to_add_out(out[:, :seq_txt])


class NunchakuQwenImageTransformerBlock(QwenImageTransformerBlock):
    """Mirrors svdq.py:423-530 (Qwen's block arithmetic with the Nunchaku attention)."""

    def __init__(self, dim, num_attention_heads, attention_head_dim, eps=1e-6, **kwargs):
        super().__init__(dim, num_attention_heads, attention_head_dim, eps)
        self.attn = Attention(dim, num_attention_heads, attention_head_dim, eps)


class NunchakuQwenImageTransformer2DModel(NunchakuModelMixin, QwenImageTransformer2DModel):
    """Mirrors svdq.py:532-796 NunchakuQwenImageTransformer2DModel."""

    def __init__(self, filename=None, patch_size=2, in_channels=64, out_channels=16, num_layers=60,
                 attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584, pooled_projection_dim=768,
                 guidance_embeds=False,
                 axes_dims_rope=(16, 56, 56), scale_shift=1.0, **kwargs):
        super(QwenImageTransformer2DModel, self).__init__()
        self.patch_size = patch_size
        self.out_channels = out_channels or in_channels
        self.inner_dim = num_attention_heads * attention_head_dim
        self.pe_embedder = EmbedND(dim=attention_head_dim, theta=10000, axes_dim=list(axes_dims_rope))
        self.time_text_embed = QwenTimestepProjEmbeddings(self.inner_dim, pooled_projection_dim)
        self.txt_norm = nn.RMSNorm(joint_attention_dim, eps=1e-6)
        self.img_in = nn.Linear(in_channels, self.inner_dim)
        self.txt_in = nn.Linear(joint_attention_dim, self.inner_dim)
        self.transformer_blocks = nn.ModuleList(
            NunchakuQwenImageTransformerBlock(self.inner_dim, num_attention_heads, attention_head_dim)
            for _ in range(num_layers))
        self.norm_out = LastLayer(self.inner_dim, self.inner_dim)
        self.proj_out = nn.Linear(self.inner_dim, patch_size * patch_size * self.out_channels, bias=True)
        self.set_offload(offload=False, use_pin_memory=False, num_blocks_on_gpu=1)
        self.loras, self._applied_loras = [], []

    def forward(self, x, timesteps, context, attention_mask=None, guidance=None, ref_latents=None,
                transformer_options={}, control=None, **kwargs):
        """Mirrors svdq.py:599-753: Qwen's forward and replace loop, without the patches["double_block"] callbacks,
        its references from dynamic_args only (svdq.py:623)."""
        options = dict(transformer_options)
        options["patches"] = {k: v for k, v in options.get("patches", {}).items() if k != "double_block"}
        return super().forward(x, timesteps, context, attention_mask=attention_mask, guidance=guidance,
                               ref_latents=None, transformer_options=options, control=control, **kwargs)
