"""DiT families for the benchmark: real diffusers architectures (Flux, SD3, Wan) at full width, fewer blocks.

Full depth does not fit a 2-core CPU; every block has the real width, heads and token counts, so
per-block attention cost and the share of time in attention are those of the real model.
Weights are seeded (the global RNG is untouched). All three families RMS-normalise q and k after
their projections, so the sharpness of attention is set by those norms' weights, not by the
projections: they start at ``QK_NORM_INIT`` and ``peaked`` scales them (``peaked_attention``), as
the UNet bench scales its q/k projections. ``scale="tiny"`` (2 heads, width 16-32) is for tests
and ``--tiny`` only: the real block layout, not the real cost.
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

DIT_FAMILIES = ("flux", "sd3", "wan")
TEXT_TOKENS = {"flux": 512, "sd3": 333, "wan": 512}  # T5 512 (Flux, Wan); CLIP 77 + T5 256 (SD3)
DIT_SCALES = ("full", "tiny")
# Blocks of the released models, for the report: Flux.1 19 double + 38 single, SD3.5 medium 24, Wan 2.1 1.3B 30.
REAL_DEPTH = {"flux": "19+38", "sd3": "24", "wan": "30"}
# Start of the q/k RMSNorm weights: unpeaked logits then spread as in the UNet bench's seeded UNets
# (std ~0.33, almost uniform attention), so --peaked 3 means the same in both benches (std ~3).
QK_NORM_INIT = 3 ** -0.5
_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_QK_PROJECTIONS = ("to_q", "to_k", "add_q_proj", "add_k_proj")


def dit_config(family: str, blocks: int = 2, scale: str = "full") -> Tuple[str, dict]:
    """(diffusers class name, config) of the architecture with ``blocks`` blocks of each kind.

    scale: "full" (the released width) or "tiny" (tests and --tiny only: 2 small heads).
    """
    if scale not in DIT_SCALES:
        raise ValueError(f"ToMe bench: DiT scale must be one of {DIT_SCALES}, got {scale!r}.")
    tiny = scale == "tiny"
    if family == "flux":  # FLUX.1-dev
        return "FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=blocks, num_single_layers=2 * blocks, guidance_embeds=True,
            **(dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32,
                    axes_dims_rope=(4, 6, 6)) if tiny else
               dict(attention_head_dim=128, num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768,
                    axes_dims_rope=(16, 56, 56))))
    if family == "sd3":  # SD3.5 medium (dual attention in its first blocks)
        return "SD3Transformer2DModel", dict(
            patch_size=2, in_channels=16, num_layers=blocks, out_channels=16, qk_norm="rms_norm",
            dual_attention_layers=tuple(range(min(blocks, 13))),
            **(dict(sample_size=16, attention_head_dim=8, num_attention_heads=2, joint_attention_dim=32,
                    caption_projection_dim=16, pooled_projection_dim=32, pos_embed_max_size=64) if tiny else
               dict(sample_size=128, attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                    caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=384)))
    if family == "wan":  # Wan 2.1 T2V 1.3B
        return "WanTransformer3DModel", dict(
            patch_size=(1, 2, 2), in_channels=16, out_channels=16, num_layers=blocks, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6,
            **(dict(num_attention_heads=2, attention_head_dim=12, text_dim=32, freq_dim=32, ffn_dim=32,
                    rope_max_seq_len=64) if tiny else
               dict(num_attention_heads=12, attention_head_dim=128, text_dim=4096, freq_dim=256, ffn_dim=8960,
                    rope_max_seq_len=1024)))
    raise ValueError(f"ToMe bench: DiT family must be one of {DIT_FAMILIES}, got {family!r}.")


def _qk_parameters(model: torch.nn.Module) -> List[torch.Tensor]:
    """What sets the logit scale of every attention mode "kv" reduces: the q/k RMSNorm weights where
    the attention has them (all three families), else the q/k projections. Cross-attention is left alone."""
    from ..dit.families import family_of

    found = []
    for _, attn, _ in family_of(model).attentions(model):
        norms = [getattr(attn, n, None) for n in _QK_NORMS]
        norms = [n for n in norms if getattr(n, "weight", None) is not None]
        if norms:
            found += [n.weight for n in norms]
        else:
            projections = [getattr(attn, n, None) for n in _QK_PROJECTIONS]
            found += [p for lin in projections if lin is not None for p in (lin.weight, lin.bias) if p is not None]
    return found


@contextlib.contextmanager
def peaked_attention(model: torch.nn.Module, factor: float) -> Iterator[torch.nn.Module]:
    """Temporarily scale q and k of every self/joint attention by ``factor`` (logits by factor**2).

    Seeded random weights give almost uniform attention, which hides the error of dropping keys;
    3.0 stands in for trained, peaked attention (as ``models.peaked_attention`` for UNets). The
    original weights are restored exactly on exit.
    """
    saved = []
    if factor != 1.0:
        with torch.no_grad():
            for p in _qk_parameters(model):
                saved.append((p, p.detach().clone()))
                p.mul_(factor)
    try:
        yield model
    finally:
        with torch.no_grad():
            for p, orig in saved:
                p.copy_(orig)


def _is_norm_weight(module: torch.nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    return "Norm" in type(module).__name__ and isinstance(weight, torch.Tensor) and weight.dim() == 1


def build_dit(family: str, blocks: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
              peaked: float = 1.0, scale: str = "full") -> torch.nn.Module:
    """The ``family`` DiT with seeded weights (every weight, so no zero-initialised layer hides errors).

    Normalisation weights start at 1 (as in diffusers), the q/k norms at ``QK_NORM_INIT``; ``peaked``
    scales q/k permanently (the bench uses ``peaked_attention`` instead, which restores them).
    """
    import diffusers  # the bench is host glue: diffusers only when a DiT bench runs

    cls_name, cfg = dit_config(family, blocks, scale)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(diffusers, cls_name)(**cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 64
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
        for name, module in model.named_modules():
            if _is_norm_weight(module):
                module.weight.fill_(QK_NORM_INIT if name.rsplit(".", 1)[-1] in _QK_NORMS else 1.0)
    if dtype != torch.float32:
        model = model.to(dtype)
    model = model.eval().requires_grad_(False)
    if peaked != 1.0:
        with torch.no_grad():
            for p in _qk_parameters(model):
                p.mul_(peaked)
    return model


def latent_frames(frames: int) -> int:
    """Wan's VAE: 1 + (frames - 1) / 4 latent frames (frames = 4k + 1)."""
    return (frames - 1) // 4 + 1


def token_counts(family: str, height_px: int, width_px: int, frames: int = 1,
                 text_tokens: Optional[int] = None) -> Tuple[int, int]:
    """(image or video tokens, text tokens) of one sample: latent = px / 8, then 2x2 patches (Flux: packing)."""
    grid = (height_px // 8 // 2) * (width_px // 8 // 2)
    if family == "wan":
        grid *= latent_frames(frames)
    return grid, TEXT_TOKENS[family] if text_tokens is None else text_tokens


def make_dit_inputs(model: torch.nn.Module, family: str, batch: int, height_px: int, width_px: int,
                    frames: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32,
                    text_tokens: Optional[int] = None) -> dict:
    """Keyword inputs of one forward for an image (or ``frames``-frame video) of height_px x width_px.

    With an even batch the halves are an unconditional/conditional CFG pair (same latents and step).
    Flux is guidance-distilled: its batch is all conditional, guidance 3.5. Text embeddings have
    ``TEXT_TOKENS[family]`` tokens unless ``text_tokens`` is given; widths come from the model's config.
    """
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    h, w = height_px // 8, width_px // 8
    pair = batch % 2 == 0 and family != "flux"
    n = batch // 2 if pair else batch
    text_dim = cfg.text_dim if family == "wan" else cfg.joint_attention_dim
    text = torch.randn(batch, TEXT_TOKENS[family] if text_tokens is None else text_tokens, text_dim,
                       generator=gen, dtype=torch.float32)
    if family == "flux":
        hh, ww = h // 2, w // 2
        latents = torch.randn(n, hh * ww, cfg.in_channels, generator=gen)
        ids = torch.zeros(hh, ww, 3)
        ids[..., 1], ids[..., 2] = torch.arange(hh)[:, None], torch.arange(ww)[None, :]
        out = dict(hidden_states=latents, encoder_hidden_states=text,
                   pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=gen),
                   timestep=torch.full((batch,), 0.5), img_ids=ids.reshape(-1, 3),
                   txt_ids=torch.zeros(text.shape[1], 3), guidance=torch.full((batch,), 3.5))
    elif family == "sd3":
        latents = torch.randn(n, cfg.in_channels, h, w, generator=gen)
        out = dict(hidden_states=latents.repeat(2, 1, 1, 1) if pair else latents, encoder_hidden_states=text,
                   pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=gen),
                   timestep=torch.full((batch,), 500.0))
    else:
        latents = torch.randn(n, cfg.in_channels, latent_frames(frames), h, w, generator=gen)
        out = dict(hidden_states=latents.repeat(2, 1, 1, 1, 1) if pair else latents, encoder_hidden_states=text,
                   timestep=torch.full((batch,), 500.0))
    return {k: v.to(dtype) if v.is_floating_point() and "ids" not in k else v for k, v in out.items()}


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs, return_dict=False)[0]


class AttentionTimer(TorchFunctionMode):
    """Wall time spent inside scaled_dot_product_attention (CPU: synchronous, so wall time is compute;
    CUDA: ``sync=True`` synchronises around each call, which slows the forward a little)."""

    def __init__(self, sync: bool = False) -> None:
        super().__init__()
        self.seconds, self.sync = 0.0, sync

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if func is F.scaled_dot_product_attention:
            if self.sync:
                torch.cuda.synchronize()
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            if self.sync:
                torch.cuda.synchronize()
            self.seconds += time.perf_counter() - start
            return out
        return func(*args, **(kwargs or {}))


def attention_share(model: torch.nn.Module, inputs: dict) -> Tuple[float, float]:
    """(seconds of one forward, share of it in attention); the ceiling of any kv speed-up is 1/(1-share)."""
    timer = AttentionTimer()
    start = time.perf_counter()
    with timer:
        forward(model, inputs)
    total = time.perf_counter() - start
    return total, timer.seconds / total


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def guided(output: torch.Tensor, family: str, scale: float = 5.0) -> torch.Tensor:
    """The CFG-combined prediction of a [uncond; cond] batch; Flux (guidance-distilled): the output itself."""
    if family == "flux" or output.shape[0] % 2:
        return output
    uncond, cond = output.chunk(2)
    return uncond + scale * (cond - uncond)


def kv_errors(model: torch.nn.Module, family: str, inputs: dict, ratio: float,
              blocks: Optional[list] = None, seed: int = 0) -> Dict[str, float]:
    """Relative error of mode "kv" against the unpatched model: raw output and CFG-combined (or distilled)."""
    from ..config import ToMeConfig
    from ..dit import diffusers_dit

    expected = forward(model, inputs)
    diffusers_dit.install(model, ToMeConfig(ratio=ratio, mode="kv", seed=seed), blocks=blocks)
    try:
        actual = forward(model, inputs)
    finally:
        diffusers_dit.uninstall(model)
    return {"output": relative_error(actual, expected),
            "guided": relative_error(guided(actual, family), guided(expected, family))}


@contextlib.contextmanager
def patched(model: torch.nn.Module, ratio: float, blocks: Optional[list] = None) -> Iterator[torch.nn.Module]:
    """The model with mode "kv" on for the duration (for timing loops)."""
    from ..config import ToMeConfig
    from ..dit import diffusers_dit

    diffusers_dit.install(model, ToMeConfig(ratio=ratio, mode="kv"), blocks=blocks)
    try:
        yield model
    finally:
        diffusers_dit.uninstall(model)
