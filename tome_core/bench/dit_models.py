"""DiT families for the benchmark: real diffusers architectures (Flux, SD3, Wan) at full width, fewer blocks.

Full depth does not fit a 2-core CPU; every block has the real width, heads and token counts, so
per-block attention cost and the share of time in attention are those of the real model.
Weights are seeded (the global RNG is untouched); ``peaked`` scales q/k projections as the UNet
bench does (3.0 stands in for trained, peaked attention).
"""
from __future__ import annotations

import contextlib
import time
from typing import Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

DIT_FAMILIES = ("flux", "sd3", "wan")
TEXT_TOKENS = {"flux": 512, "sd3": 333, "wan": 512}  # T5 512 (Flux, Wan); CLIP 77 + T5 256 (SD3)


def dit_config(family: str, blocks: int = 2) -> Tuple[str, dict]:
    """(diffusers class name, config) of the full-width architecture with ``blocks`` blocks of each kind."""
    if family == "flux":  # FLUX.1-dev
        return "FluxTransformer2DModel", dict(
            patch_size=1, in_channels=64, num_layers=blocks, num_single_layers=2 * blocks, attention_head_dim=128,
            num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=True,
            axes_dims_rope=(16, 56, 56))
    if family == "sd3":  # SD3.5 medium (dual attention in its first blocks)
        return "SD3Transformer2DModel", dict(
            sample_size=128, patch_size=2, in_channels=16, num_layers=blocks, attention_head_dim=64,
            num_attention_heads=24, joint_attention_dim=4096, caption_projection_dim=1536,
            pooled_projection_dim=2048, out_channels=16, pos_embed_max_size=384, qk_norm="rms_norm",
            dual_attention_layers=tuple(range(min(blocks, 13))))
    if family == "wan":  # Wan 2.1 T2V 1.3B
        return "WanTransformer3DModel", dict(
            patch_size=(1, 2, 2), num_attention_heads=12, attention_head_dim=128, in_channels=16, out_channels=16,
            text_dim=4096, freq_dim=256, ffn_dim=8960, num_layers=blocks, cross_attn_norm=True,
            qk_norm="rms_norm_across_heads", eps=1e-6, rope_max_seq_len=1024)
    raise ValueError(f"ToMe bench: DiT family must be one of {DIT_FAMILIES}, got {family!r}.")


def _scale_qk(model: torch.nn.Module, factor: float) -> None:
    if factor == 1.0:
        return
    with torch.no_grad():
        for name, module in model.named_modules():
            if name.rsplit(".", 1)[-1] in ("to_q", "to_k", "add_q_proj", "add_k_proj") and \
                    ("attn" in name and "attn2" not in name or name.endswith("attn2.to_q") and "transformer_blocks" in name
                     or name.endswith("attn2.to_k") and "transformer_blocks" in name):
                for p in (module.weight, module.bias):
                    if p is not None:
                        p.mul_(factor)


def build_dit(family: str, blocks: int = 2, seed: int = 0, dtype: torch.dtype = torch.float32,
              peaked: float = 1.0) -> torch.nn.Module:
    """The ``family`` DiT with seeded weights (every weight, so no zero-initialised layer hides errors)."""
    import diffusers  # the bench is host glue: diffusers only when a DiT bench runs

    cls_name, cfg = dit_config(family, blocks)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(diffusers, cls_name)(**cfg)
    gen = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 64
            p.copy_(torch.randn(p.shape, generator=gen) / fan_in ** 0.5)
    if dtype != torch.float32:
        model = model.to(dtype)
    model = model.eval().requires_grad_(False)
    _scale_qk(model, peaked)
    return model


def make_dit_inputs(model: torch.nn.Module, family: str, batch: int, height_px: int, width_px: int,
                    frames: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32) -> dict:
    """Keyword inputs of one forward for an image (or ``frames``-frame video) of height_px x width_px.

    With an even batch the halves are an unconditional/conditional CFG pair (same latents and step).
    Flux is guidance-distilled: its batch is all conditional, guidance 3.5.
    """
    gen = torch.Generator().manual_seed(seed)
    h, w = height_px // 8, width_px // 8
    pair = batch % 2 == 0 and family != "flux"
    n = batch // 2 if pair else batch
    text = torch.randn(batch, TEXT_TOKENS[family], 4096, generator=gen, dtype=torch.float32)
    if family == "flux":
        hh, ww = h // 2, w // 2
        latents = torch.randn(n, hh * ww, 64, generator=gen)
        ids = torch.zeros(hh, ww, 3)
        ids[..., 1], ids[..., 2] = torch.arange(hh)[:, None], torch.arange(ww)[None, :]
        out = dict(hidden_states=latents, encoder_hidden_states=text, pooled_projections=torch.randn(batch, 768, generator=gen),
                   timestep=torch.full((batch,), 0.5), img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text.shape[1], 3),
                   guidance=torch.full((batch,), 3.5))
    elif family == "sd3":
        latents = torch.randn(n, 16, h, w, generator=gen)
        out = dict(hidden_states=latents.repeat(2, 1, 1, 1) if pair else latents, encoder_hidden_states=text,
                   pooled_projections=torch.randn(batch, 2048, generator=gen), timestep=torch.full((batch,), 500.0))
    else:
        latents = torch.randn(n, 16, (frames - 1) // 4 + 1, h, w, generator=gen)
        out = dict(hidden_states=latents.repeat(2, 1, 1, 1, 1) if pair else latents, encoder_hidden_states=text,
                   timestep=torch.full((batch,), 500.0))
    return {k: v.to(dtype) if v.is_floating_point() and "ids" not in k else v for k, v in out.items()}


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs, return_dict=False)[0]


class _AttentionTimer(TorchFunctionMode):
    """Wall time spent inside scaled_dot_product_attention (CPU: synchronous, so wall time is compute)."""

    def __init__(self) -> None:
        super().__init__()
        self.seconds = 0.0

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if func is F.scaled_dot_product_attention:
            start = time.perf_counter()
            out = func(*args, **(kwargs or {}))
            self.seconds += time.perf_counter() - start
            return out
        return func(*args, **(kwargs or {}))


def attention_share(model: torch.nn.Module, inputs: dict) -> Tuple[float, float]:
    """(seconds of one forward, share of it in attention); the ceiling of any kv speed-up is 1/(1-share)."""
    timer = _AttentionTimer()
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
