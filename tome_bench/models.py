"""Real Stable Diffusion UNet architectures with seeded random weights (no downloads).

``build_unet`` gives a ``diffusers.UNet2DConditionModel`` with the SD1.5, SD2 or SDXL config
("full") or a reduced-channel copy that keeps the level layout and where attention sits
("tiny", for CI). ``make_inputs`` gives matching UNet inputs.

diffusers is imported lazily: ``import tome_bench`` works without it.
"""
from __future__ import annotations

import contextlib
import importlib
from typing import Iterator

import torch

from .content import photo_like

FAMILIES = ("sd15", "sd2", "sdxl")
SCALES = ("full", "tiny")

# Full configs follow the published model configs (attention_head_dim keeps diffusers' naming:
# for SD1.5/SD2 it is the number of heads).
_FULL = {
    "sd15": dict(
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=768,
        attention_head_dim=8,
        sample_size=64,
    ),
    "sd2": dict(
        block_out_channels=(320, 640, 1280, 1280),
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
        cross_attention_dim=1024,
        attention_head_dim=(5, 10, 20, 20),
        use_linear_projection=True,
        sample_size=96,
    ),
    "sdxl": dict(
        block_out_channels=(320, 640, 1280),
        down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
        up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
        transformer_layers_per_block=(1, 2, 10),
        attention_head_dim=(5, 10, 20),
        cross_attention_dim=2048,
        addition_embed_type="text_time",
        addition_time_embed_dim=256,
        projection_class_embeddings_input_dim=2816,  # 1280 pooled text + 6 * 256 time ids
        use_linear_projection=True,
        sample_size=128,
    ),
}

# Tiny: same block types (so the same levels carry attention), far fewer channels and layers.
_TINY = {
    "sd15": dict(block_out_channels=(32, 64, 64, 64), cross_attention_dim=32,
                 attention_head_dim=4),
    "sd2": dict(block_out_channels=(32, 64, 64, 64), cross_attention_dim=48,
                attention_head_dim=(2, 4, 4, 4)),
    "sdxl": dict(block_out_channels=(32, 64, 64), cross_attention_dim=48,
                 transformer_layers_per_block=(1, 2, 2), attention_head_dim=(2, 4, 4),
                 addition_time_embed_dim=8,
                 projection_class_embeddings_input_dim=32 + 6 * 8),
}


def _import_diffusers():
    try:  # imported on use only: tome_core itself never depends on a host package
        return importlib.import_module("diffusers")
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError(
            "the benchmark builds diffusers UNets; install diffusers first: pip install diffusers"
        ) from e


def unet_config(family: str, scale: str = "full") -> dict:
    """The ``UNet2DConditionModel`` keyword arguments for ``family`` at ``scale``."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {FAMILIES}, got {family!r}")
    if scale not in SCALES:
        raise ValueError(f"scale must be one of {SCALES}, got {scale!r}")
    cfg = dict(in_channels=4, out_channels=4, layers_per_block=2, norm_num_groups=32)
    cfg.update(_FULL[family])
    if scale == "tiny":
        cfg.update(_TINY[family], norm_num_groups=8, sample_size=8)
    return cfg


@contextlib.contextmanager
def _default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def self_attention_modules(unet: torch.nn.Module) -> list[torch.nn.Module]:
    """The self-attention (``attn1``) modules of every transformer block."""
    return [m for name, m in unet.named_modules() if name.endswith(".attn1")]


def _qk_parameters(unet: torch.nn.Module) -> list[torch.Tensor]:
    """The weights and biases of every self-attention's q and k projections."""
    return [p for attn in self_attention_modules(unet) for lin in (attn.to_q, attn.to_k)
            for p in (lin.weight, lin.bias) if p is not None]


@contextlib.contextmanager
def scaled_parameters(parameters: list[torch.Tensor], factor: float) -> Iterator[None]:
    """Multiply ``parameters`` by ``factor`` in place for the block; restored exactly on exit."""
    saved = []
    if factor != 1.0:
        with torch.no_grad():
            for p in parameters:
                saved.append((p, p.detach().clone()))
                p.mul_(factor)
    try:
        yield
    finally:
        with torch.no_grad():
            for p, original in saved:
                p.copy_(original)


@contextlib.contextmanager
def peaked_attention(unet: torch.nn.Module, factor: float) -> Iterator[torch.nn.Module]:
    """Temporarily scale every self-attention ``to_q``/``to_k`` by ``factor``.

    Attention logits grow by ``factor**2``, so softmax is peaked as in trained models (seeded
    random weights give almost uniform attention, which hides merging errors). The original
    weights are restored exactly on exit.
    """
    with scaled_parameters(_qk_parameters(unet), factor):
        yield unet


def _reinit_zero_layers(unet: torch.nn.Module, gen: torch.Generator) -> int:
    """Give any all-zero weight matrix/kernel a random init; returns how many were changed.

    Zero-initialised output layers (LDM's ``proj_out``) make every block an identity and
    comparisons pass trivially. diffusers initialises most layers randomly, but check anyway.
    """
    n = 0
    with torch.no_grad():
        for p in unet.parameters():
            if p.ndim >= 2 and not p.any():
                fan_in = p[0].numel()
                noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
                p.copy_(noise / fan_in**0.5)
                n += 1
    return n


def build_unet(family: str, scale: str = "full", seed: int = 0,
               dtype: torch.dtype = torch.float32, peaked: float = 1.0):
    """A ``diffusers.UNet2DConditionModel`` with the ``family`` architecture and seeded weights.

    family: "sd15" | "sd2" | "sdxl"; scale: "full" (real channel counts) | "tiny" (for tests).
    Weights are created directly in ``dtype`` (an SDXL UNet is ~10 GB in fp32), in eval mode;
    the global RNG stream is left untouched. ``peaked`` scales self-attention q/k projections
    (see ``peaked_attention``); 3.0 is a reasonable stand-in for trained attention.
    """
    diffusers = _import_diffusers()
    cfg = unet_config(family, scale)
    with torch.random.fork_rng(devices=[]), _default_dtype(dtype):
        torch.manual_seed(seed)
        unet = diffusers.UNet2DConditionModel(**cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    _reinit_zero_layers(unet, gen)
    # built in ``dtype`` already; ModelMixin.to(dtype) would only warn about fp32-kept modules
    unet = unet.eval().requires_grad_(False)
    with torch.no_grad():
        for p in _qk_parameters(unet) if peaked != 1.0 else ():
            p.mul_(peaked)  # a lasting scale: the model is built peaked
    return unet


def make_inputs(unet, family: str, batch: int, height_px: int, width_px: int,
                seed: int = 0, dtype: torch.dtype = torch.float32, content: str = "noise",
                photo: str = "astronaut"):
    """UNet inputs for a ``height_px`` x ``width_px`` image (latent = px // 8).

    Returns ``(sample [B,4,h,w], timestep [B], encoder_hidden_states [B,77,D],
    added_cond_kwargs)``; ``added_cond_kwargs`` is ``{"text_embeds": [B,P], "time_ids": [B,6]}``
    for SDXL, else None.
    With an even batch the first half plays the unconditional and the second the conditional
    half of a classifier-free-guidance batch: the same latents and timestep, different text
    embeddings. content "noise": the latents are seeded noise; "photo": that noise at timestep
    500 over ``photo`` (``content.photo_like``; every other input the same).
    """
    cfg = unet.config
    gen = torch.Generator().manual_seed(seed)
    h, w = max(1, height_px // 8), max(1, width_px // 8)
    cfg_pair = batch % 2 == 0
    n = batch // 2 if cfg_pair else batch
    sample = torch.randn(n, cfg.in_channels, h, w, generator=gen)
    if content == "photo":
        sample = photo_like(sample, family, 1, h, w, photo)
    elif content != "noise":
        raise ValueError(f"content must be 'noise' or 'photo', got {content!r}")
    timestep = torch.full((n,), 500.0)
    if cfg_pair:
        sample, timestep = sample.repeat(2, 1, 1, 1), timestep.repeat(2)
    ctx = torch.randn(batch, 77, cfg.cross_attention_dim, generator=gen)
    added = None
    if family == "sdxl":
        text_dim = cfg.projection_class_embeddings_input_dim - 6 * cfg.addition_time_embed_dim
        # original size, crop top-left, target size
        time_ids = torch.tensor([height_px, width_px, 0, 0, height_px, width_px],
                                dtype=torch.float32)
        added = {"text_embeds": torch.randn(batch, text_dim, generator=gen).to(dtype),
                 "time_ids": time_ids.repeat(batch, 1).to(dtype)}
    return sample.to(dtype), timestep, ctx.to(dtype), added
