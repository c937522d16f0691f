"""Stand-in of Neo's ``backend/nn/chroma.py`` (de2193d9; from ComfyUI v0.10.0 comfy/ldm/chroma):
``ChromaModulationOut`` (20-27), ``Approximator`` (30-46), ``LastLayer`` (50-62), ``ChromaParams`` (65-84) and
``IntegratedChromaTransformer2DModel`` (87-262: ``get_modulations`` 123-145, ``forward_orig`` 147-242, ``forward``
244-262).

Chroma reuses flux.py's ``DoubleStreamBlock``/``SingleStreamBlock`` (imported, chroma.py:9-16), so its attention
goes through ``backend.nn.flux.attention_function``; this module has no attention global of its own. The
modulation approximator is Neo's (344 modulation vectors, fixed as in Neo, whatever the block counts).
Not modelled: ControlNet residuals.
"""
from dataclasses import dataclass

import torch
from torch import nn

from backend.nn.flux import (DoubleStreamBlock, EmbedND, MLPEmbedder, ModulationOut, SingleStreamBlock,
                             timestep_embedding)
from backend.utils import fp16_fix, pad_to_patch_size


class ChromaModulationOut(ModulationOut):
    """Mirrors chroma.py:20-27."""

    @classmethod
    def from_offset(cls, tensor, offset=0):
        return cls(shift=tensor[:, offset : offset + 1, :], scale=tensor[:, offset + 1 : offset + 2, :],
                   gate=tensor[:, offset + 2 : offset + 3, :])


class Approximator(nn.Module):
    """Mirrors chroma.py:30-46 (the distilled guidance layer)."""

    def __init__(self, in_dim, out_dim, hidden_dim, n_layers=5):
        super().__init__()
        self.in_proj = nn.Linear(in_dim, hidden_dim, bias=True)
        self.layers = nn.ModuleList([MLPEmbedder(hidden_dim, hidden_dim) for _ in range(n_layers)])
        self.norms = nn.ModuleList([nn.RMSNorm(hidden_dim) for _ in range(n_layers)])
        self.out_proj = nn.Linear(hidden_dim, out_dim)

    def forward(self, x):
        x = self.in_proj(x)
        for layer, norms in zip(self.layers, self.norms):
            x = x + layer(norms(x))
        return self.out_proj(x)


class LastLayer(nn.Module):
    """Mirrors chroma.py:50-62."""

    def __init__(self, hidden_size, patch_size, out_channels):
        super().__init__()
        self.norm_final = nn.LayerNorm(hidden_size, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(hidden_size, out_channels, bias=True)

    def forward(self, x, vec):
        shift, scale = vec
        shift, scale = shift.squeeze(1), scale.squeeze(1)
        return self.linear(torch.addcmul(shift[:, None, :], 1 + scale[:, None, :], self.norm_final(x)))


@dataclass
class ChromaParams:
    """Mirrors chroma.py:65-84 (txt_ids_dims / vec_in_dim defaulted: unused by the class)."""

    in_channels: int
    out_channels: int
    context_in_dim: int
    hidden_size: int
    mlp_ratio: float
    num_heads: int
    depth: int
    depth_single_blocks: int
    axes_dim: list
    theta: int
    patch_size: int
    qkv_bias: bool
    in_dim: int
    out_dim: int
    hidden_dim: int
    n_layers: int
    txt_ids_dims: list = None
    vec_in_dim: int = None


class IntegratedChromaTransformer2DModel(nn.Module):
    """Mirrors chroma.py:87-262 IntegratedChromaTransformer2DModel."""

    def __init__(self, **kwargs):
        super().__init__()
        params = self.params = ChromaParams(**kwargs)
        self.patch_size = params.patch_size
        self.in_channels, self.out_channels = params.in_channels, params.out_channels
        pe_dim = params.hidden_size // params.num_heads
        if sum(params.axes_dim) != pe_dim:
            raise ValueError(f"Got {params.axes_dim} but expected positional dim {pe_dim}")
        self.hidden_size, self.num_heads = params.hidden_size, params.num_heads
        self.in_dim, self.out_dim = params.in_dim, params.out_dim
        self.hidden_dim, self.n_layers = params.hidden_dim, params.n_layers
        self.pe_embedder = EmbedND(dim=pe_dim, theta=params.theta, axes_dim=params.axes_dim)
        self.img_in = nn.Linear(self.in_channels, self.hidden_size, bias=True)
        self.txt_in = nn.Linear(params.context_in_dim, self.hidden_size)
        self.distilled_guidance_layer = Approximator(in_dim=self.in_dim, hidden_dim=self.hidden_dim,
                                                     out_dim=self.out_dim, n_layers=self.n_layers)
        self.double_blocks = nn.ModuleList(
            DoubleStreamBlock(self.hidden_size, self.num_heads, mlp_ratio=params.mlp_ratio, qkv_bias=params.qkv_bias,
                              modulation=False) for _ in range(params.depth))
        self.single_blocks = nn.ModuleList(
            SingleStreamBlock(self.hidden_size, self.num_heads, mlp_ratio=params.mlp_ratio, modulation=False)
            for _ in range(params.depth_single_blocks))
        self.final_layer = LastLayer(self.hidden_size, 1, self.out_channels)
        self.skip_mmdit, self.skip_dit, self.lite = [], [], False

    def get_modulations(self, tensor, block_type, *, idx=0):
        """Mirrors chroma.py:123-145: slices of [single 3/blk, double_img 6/blk, double_txt 6/blk, final 2]."""
        if block_type == "final":
            return (tensor[:, -2:-1, :], tensor[:, -1:, :])
        offset = 3 * idx
        if block_type == "single":
            return ChromaModulationOut.from_offset(tensor, offset)
        offset = offset * 2 + 3 * self.params.depth_single_blocks
        if block_type == "double_txt":
            offset += 6 * self.params.depth
        return ChromaModulationOut.from_offset(tensor, offset), ChromaModulationOut.from_offset(tensor, offset + 3)

    def forward_orig(self, img, img_ids, txt, txt_ids, timesteps, guidance=None, control=None, transformer_options={},
                     attn_mask=None):
        """Mirrors chroma.py:147-242: Flux's replace keys/args and block reports; vec is the per-block modulation."""
        patches_replace = transformer_options.get("patches_replace", {})
        img = self.img_in(img)
        mod_index_length = 344
        distill_timestep = timestep_embedding(timesteps.detach().clone(), 16).to(img.device, img.dtype)
        distil_guidance = timestep_embedding(guidance.detach().clone(), 16).to(img.device, img.dtype)
        modulation_index = timestep_embedding(torch.arange(mod_index_length, device=img.device), 32)
        modulation_index = modulation_index.to(img.device, img.dtype)
        modulation_index = modulation_index.unsqueeze(0).repeat(img.shape[0], 1, 1)
        timestep_guidance = torch.cat([distill_timestep, distil_guidance], dim=1)
        timestep_guidance = timestep_guidance.unsqueeze(1).repeat(1, mod_index_length, 1)
        mod_vectors = self.distilled_guidance_layer(torch.cat([timestep_guidance, modulation_index], dim=-1))
        txt = self.txt_in(txt)
        pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))

        blocks_replace = patches_replace.get("dit", {})
        transformer_options["total_blocks"] = len(self.double_blocks)
        transformer_options["block_type"] = "double"
        for i, block in enumerate(self.double_blocks):
            transformer_options["block_index"] = i
            if i not in self.skip_mmdit:
                double_mod = (self.get_modulations(mod_vectors, "double_img", idx=i),
                              self.get_modulations(mod_vectors, "double_txt", idx=i))
                if ("double_block", i) in blocks_replace:

                    def block_wrap(args):
                        out = {}
                        out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                                       attn_mask=args.get("attn_mask"),
                                                       transformer_options=args.get("transformer_options"))
                        return out

                    out = blocks_replace[("double_block", i)]({"img": img, "txt": txt, "vec": double_mod, "pe": pe,
                                                               "attn_mask": attn_mask,
                                                               "transformer_options": transformer_options},
                                                              {"original_block": block_wrap})
                    txt = out["txt"]
                    img = out["img"]
                else:
                    img, txt = block(img=img, txt=txt, vec=double_mod, pe=pe, attn_mask=attn_mask,
                                     transformer_options=transformer_options)

        img = fp16_fix(img)
        img = torch.cat((txt, img), 1)
        transformer_options["total_blocks"] = len(self.single_blocks)
        transformer_options["block_type"] = "single"
        for i, block in enumerate(self.single_blocks):
            transformer_options["block_index"] = i
            if i not in self.skip_dit:
                single_mod = self.get_modulations(mod_vectors, "single", idx=i)
                if ("single_block", i) in blocks_replace:

                    def block_wrap(args):
                        out = {}
                        out["img"] = block(args["img"], vec=args["vec"], pe=args["pe"], attn_mask=args.get("attn_mask"),
                                           transformer_options=args.get("transformer_options"))
                        return out

                    out = blocks_replace[("single_block", i)]({"img": img, "vec": single_mod, "pe": pe,
                                                               "attn_mask": attn_mask,
                                                               "transformer_options": transformer_options},
                                                              {"original_block": block_wrap})
                    img = out["img"]
                else:
                    img = block(img, vec=single_mod, pe=pe, attn_mask=attn_mask,
                                transformer_options=transformer_options)

        img = img[:, txt.shape[1] :, ...]
        return self.final_layer(img, vec=self.get_modulations(mod_vectors, "final"))

    def forward(self, x, timestep, context, guidance=None, control=None, transformer_options={}, **kwargs):
        """Mirrors chroma.py:244-262 (text ids all zero, image ids (0, h, w))."""
        bs, c, h, w = x.shape
        p = self.patch_size
        x = pad_to_patch_size(x, (p, p))
        h_len, w_len = (h + (p // 2)) // p, (w + (p // 2)) // p
        img = x.reshape(bs, c, h_len, p, w_len, p).permute(0, 2, 4, 1, 3, 5).reshape(bs, h_len * w_len, c * p * p)
        img_ids = torch.zeros((h_len, w_len, 3), device=x.device, dtype=x.dtype)
        img_ids[:, :, 1] += torch.linspace(0, h_len - 1, steps=h_len, device=x.device, dtype=x.dtype).unsqueeze(1)
        img_ids[:, :, 2] += torch.linspace(0, w_len - 1, steps=w_len, device=x.device, dtype=x.dtype).unsqueeze(0)
        img_ids = img_ids.reshape(1, h_len * w_len, 3).repeat(bs, 1, 1)
        txt_ids = torch.zeros((bs, context.shape[1], 3), device=x.device, dtype=x.dtype)
        out = self.forward_orig(img, img_ids, context, txt_ids, timestep, guidance or torch.zeros_like(timestep),
                                control, transformer_options, attn_mask=kwargs.get("attention_mask", None))
        out = out.reshape(bs, h_len, w_len, -1, p, p).permute(0, 3, 1, 4, 2, 5).reshape(bs, -1, h_len * p, w_len * p)
        return out[:, :, :h, :w]
