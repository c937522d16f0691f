"""Tiny seeded Forge Neo models for CI, built the way Neo builds them (not a Neo module; it sits beside the
``backend`` stand-in package, which must be importable as ``backend``).

Mirrors the loader and the engines: ``backend/loader.py:357-406`` (the DiT class per diffusers class name) and
``:494-498`` (``storage_dtype``, ``computation_dtype``, ``load_device``, ``initial_device``, ``offload_device`` set on
the DiT), ``backend/diffusion_engine/base.py:49-53`` (``PredictionDiscreteFlow`` for FLOW models, else
``PredictionFlux``) with ``sampling_settings`` from huggingface_guess ``model_list.py``, and the engines'
``UnetPatcher.from_model(model=..., diffusers_scheduler=None, k_predictor=..., config=...)``
(``diffusion_engine/flux.py:30-32`` and its siblings). Conds follow ``backend/sampling/condition.py:91-117``
(``c_crossattn``, plus ``y`` and ``guidance`` for Flux) as plain tensors (see sampling_function's docstring).

Weights: a seeded ``torch.Generator``; norms 1, biases 0, other matrices N(0, 1/fan_in), other parameters
(Wan's modulations, Z-Image's pad tokens) N(0, 0.25). Float32, eval mode, on the CPU. Sizes: 16 latent channels,
16x16 latents with 2x2 patches (64 image tokens; Wan: 5 latent frames of 8x8, 80 tokens), 8 text tokens.
"""
from types import SimpleNamespace

import torch

from backend.modules.k_prediction import PredictionDiscreteFlow, PredictionFlux
from backend.nn.chroma import IntegratedChromaTransformer2DModel
from backend.nn.flux import IntegratedFluxTransformer2DModel
from backend.nn.lumina import NextDiT
from backend.nn.qwen import QwenImageTransformer2DModel
from backend.nn.svdq import NunchakuQwenImageTransformer2DModel, SVDQFluxTransformer2DModel
from backend.nn.wan import WanModel
from backend.patcher.unet import UnetPatcher

FAMILIES = ("flux", "chroma", "qwen_image", "wan", "z_image", "svdq_flux", "nunchaku_qwen")
TEXT_TOKENS, TEXT_DIM, VEC_DIM, GUIDANCE = 8, 32, 16, 3.5
_FLUX = dict(in_channels=16, out_channels=16, vec_in_dim=VEC_DIM, context_in_dim=TEXT_DIM, hidden_size=32,
             mlp_ratio=2.0, num_heads=2, depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000, patch_size=2,
             qkv_bias=True, guidance_embed=True)
_CHROMA = dict(in_channels=64, out_channels=64, context_in_dim=TEXT_DIM, hidden_size=32, mlp_ratio=2.0, num_heads=2,
               depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000, patch_size=2, qkv_bias=True, in_dim=64,
               out_dim=32, hidden_dim=32, n_layers=2)
_QWEN = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
             joint_attention_dim=TEXT_DIM, axes_dims_rope=(4, 6, 6))
_WAN = dict(model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=32, ffn_dim=64, freq_dim=32, text_dim=TEXT_DIM,
            out_dim=16, num_heads=2, num_layers=2)
# Z-Image needs dim >= 256: its t_embedder outputs 256 features and adaLN reads min(dim, 256) (lumina.py:283, 141).
_ZIMAGE = dict(patch_size=2, in_channels=16, dim=256, n_layers=2, n_refiner_layers=1, n_heads=4, n_kv_heads=4,
               multiple_of=64, ffn_dim_multiplier=8.0 / 3.0, norm_eps=1e-5, qk_norm=True, cap_feat_dim=TEXT_DIM,
               axes_dims=(16, 24, 24), rope_theta=256.0, z_image_modulation=True, time_scale=1000.0,
               pad_tokens_multiple=32)
_SVDQ_FLUX = dict(in_channels=64, context_in_dim=TEXT_DIM, hidden_size=32, num_heads=2, vec_in_dim=VEC_DIM,
                  guidance_embed=True, patch_size=2)

# family: (DiT factory, its config, predictor class, sampling_settings (model_list.py), latent shape of one sample)
_SPECS = {
    "flux": (lambda c: IntegratedFluxTransformer2DModel(**c), _FLUX, PredictionFlux, {}, (16, 16, 16)),
    "chroma": (lambda c: IntegratedChromaTransformer2DModel(**c), _CHROMA, PredictionDiscreteFlow,
               {"multiplier": 1.0, "shift": 1.0}, (16, 16, 16)),
    "qwen_image": (lambda c: QwenImageTransformer2DModel(**c), _QWEN, PredictionDiscreteFlow,
                   {"multiplier": 1.0, "shift": 1.15}, (16, 1, 16, 16)),
    "wan": (lambda c: WanModel(**c), _WAN, PredictionDiscreteFlow, {"shift": 8.0}, (16, 5, 8, 8)),
    "z_image": (lambda c: NextDiT(**c), _ZIMAGE, PredictionDiscreteFlow, {"multiplier": 1.0, "shift": 3.0},
                (16, 16, 16)),
    "svdq_flux": (lambda c: SVDQFluxTransformer2DModel(dict(c)), _SVDQ_FLUX, PredictionFlux, {}, (16, 16, 16)),
    "nunchaku_qwen": (lambda c: NunchakuQwenImageTransformer2DModel(**c), _QWEN, PredictionDiscreteFlow,
                      {"multiplier": 1.0, "shift": 1.15}, (16, 1, 16, 16)),
}


def latent_shape(family, batch_size=1):
    """The latent [B, C, (T,) H, W] a family's engine samples (Qwen-Image: [B, C, 1, H, W]; Wan: 5 frames)."""
    return (batch_size,) + _SPECS[family][4]


def init_weights(module, seed):
    """Seeded weights: norms 1, biases 0, matrices N(0, 1/fan_in), other parameters N(0, 0.25)."""
    g = torch.Generator().manual_seed(seed)
    norms = {id(p) for m in module.modules() if isinstance(m, (torch.nn.LayerNorm, torch.nn.RMSNorm))
             for p in m.parameters(recurse=False)}
    with torch.no_grad():
        for name, p in module.named_parameters():
            if id(p) in norms:
                p.fill_(1.0 if name.endswith("weight") else 0.0)
            elif name.endswith("bias"):
                p.zero_()
            elif name.endswith("weight") and p.ndim >= 2:
                p.copy_(torch.randn(p.shape, generator=g) * p[0].numel() ** -0.5)
            else:
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)


def build_dit(family, seed=0):
    """The family's DiT as backend/loader.py:357-498 leaves it (weights seeded, dtype/device attributes set)."""
    make, config, _, _, _ = _SPECS[family]
    model = make(dict(config)).float()
    init_weights(model, seed)
    model.config = dict(config)
    model.storage_dtype = model.computation_dtype = torch.float32
    model.load_device = model.initial_device = model.offload_device = torch.device("cpu")
    return model.eval()


def build_patcher(family, seed=0):
    """(UnetPatcher (NunchakuPatcher for nunchaku_qwen) around KModel(DiT, predictor), make_conds) for a family.

    ``make_conds(batch_size=1, seed=1) -> (cond, uncond)``: one entry each, in sampling_function's cond format.
    """
    _, config, predictor_class, sampling_settings, _ = _SPECS[family]
    estimated_config = SimpleNamespace(sampling_settings=dict(sampling_settings), memory_usage_factor=2.0,
                                       unet_config=dict(config))
    unet = UnetPatcher.from_model(model=build_dit(family, seed), diffusers_scheduler=None,
                                  k_predictor=predictor_class(estimated_config), config=estimated_config)
    unet.model.eval()

    def make_conds(batch_size=1, seed=1):
        """One cond and one uncond entry for a batch: c_crossattn (+ y and guidance for Flux and SVDQ Flux)."""
        g = torch.Generator().manual_seed(seed)
        entries = []
        for _ in range(2):
            entry = {"c_crossattn": torch.randn((batch_size, TEXT_TOKENS, TEXT_DIM), generator=g)}
            if family in ("flux", "svdq_flux"):
                entry["y"] = torch.randn((batch_size, VEC_DIM), generator=g)
                entry["guidance"] = torch.full((batch_size,), GUIDANCE)
            entries.append(entry)
        return [entries[0]], [entries[1]]

    return unet, make_conds
