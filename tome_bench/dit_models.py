"""DiT families for the benchmark: real diffusers architectures (Flux, SD3, Wan, Z-Image, Qwen-Image,
LTX-2) at full width, fewer blocks.

Full depth does not fit a 2-core CPU; every block has the real width, heads and token counts, so
per-block attention cost and the share of time in attention are those of the real model.
Weights are seeded (the global RNG is untouched). All six families RMS-normalise q and k after
their projections, so the sharpness of attention is set by those norms' weights, not by the
projections: they start at ``QK_NORM_INIT`` and ``peaked`` scales them (``peaked_attention``), as
the UNet bench scales its q/k projections. ``scale="tiny"`` (2 heads, width 16-32) is for tests
and ``--tiny`` only: the real block layout, not the real cost.
"""
from __future__ import annotations

import contextlib
import time
from dataclasses import dataclass
from typing import Dict, Iterator, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from .content import photo_like
from .models import scaled_parameters

DIT_FAMILIES = ("flux", "sd3", "wan", "z_image", "qwen_image", "ltx2")  # the catalogue's names (tested)
FAMILY_ALIASES = {"zimage": "z_image", "qwen": "qwen_image"}  # the names of earlier releases, still taken
VIDEO_FAMILIES = ("wan", "ltx2")  # the ones --frames applies to
# Text tokens: T5 padded to 512 (Flux, Wan); CLIP 77 + T5 256 (SD3); Z-Image (Qwen3) and Qwen-Image
# (Qwen2.5-VL) pass the prompt's own tokens, unpadded: 128 stands for a detailed prompt; LTX-2's Gemma
# prompt is padded to 1024 (its cross-attention only: never in the reduced self-attention).
TEXT_TOKENS = {"flux": 512, "sd3": 333, "wan": 512, "z_image": 128, "qwen_image": 128, "ltx2": 1024}
DIT_SCALES = ("full", "tiny")
# Blocks of the released model of the width --blocks builds, for the report: Flux.1 19 double + 38 single, SD3.5
# medium 24, Wan 2.1 1.3B 30, Z-Image 30 (+ 2 noise and 2 caption refiners), Qwen-Image 60, LTX-2 48.
REAL_DEPTH = {"flux": "19+38", "sd3": "24", "wan": "30", "z_image": "30+2+2", "qwen_image": "60", "ltx2": "48"}
DEPTHS = ("blocks", "released")


@dataclass(frozen=True)
class Release:
    """The released model ``--depth released`` builds: its name, its blocks of each kind as ``dit_config`` counts
    them (Flux: double blocks, twice as many single ones follow; Z-Image: layers, its refiners in proportion), and
    the config entries where its width differs from the width ``--blocks`` builds (Wan: 14B, not 1.3B)."""

    title: str
    blocks: int
    width: Tuple[Tuple[str, object], ...] = ()


# From the released configs (diffusers' constructor defaults are these checkpoints' config.json): FLUX.1-dev 19 + 38
# blocks of 3072; SD3.5 medium 24 of 1536; Wan 2.1 T2V 14B 40 of 5120, ffn 13824 (each of Wan 2.2 A14B's two
# experts is the same transformer); Z-Image 30 layers of 3840 + 2 + 2 refiners; Qwen-Image 60 of 3072; LTX-2 48
# (video 4096 wide, audio 2048).
RELEASED = {"flux": Release("FLUX.1-dev", 19), "sd3": Release("SD3.5 medium", 24),
            "wan": Release("Wan 2.1 T2V 14B / Wan 2.2 A14B expert", 40,
                           (("num_attention_heads", 40), ("ffn_dim", 13824))),
            "z_image": Release("Z-Image 6B", 30), "qwen_image": Release("Qwen-Image 20B", 60),
            "ltx2": Release("LTX-2 19B", 48)}
# Batch of one forward: 2 = [uncond; cond] CFG (SD3, Wan, Qwen-Image's true CFG, LTX-2's pipeline guidance
# 3); Flux is guidance-distilled and Z-Image-Turbo runs at CFG 1 (ComfyUI's template, diffusers' guidance 0).
DEFAULT_BATCH = {"flux": 1, "z_image": 1}
# VAE compression (frames, pixels per latent): Wan 4 and 8, LTX-2 8 and 32; the images 8.
_VAE = {"wan": (4, 8), "ltx2": (8, 32)}
PATCH = {"ltx2": 1}  # latent cells per token side; the others 2 (Flux and Qwen-Image: 2x2 packing)
# Start of the q/k RMSNorm weights: unpeaked logits then spread as in the UNet bench's seeded UNets
# (std ~0.33, almost uniform attention), so --peaked 3 means the same in both benches (std ~3).
QK_NORM_INIT = 3 ** -0.5
_QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k")
_QK_PROJECTIONS = ("to_q", "to_k", "add_q_proj", "add_k_proj")


def dit_config(family: str, blocks: Optional[int] = None, scale: str = "full",
               released: bool = False) -> Tuple[str, dict]:
    """(diffusers class name, config) of the architecture with ``blocks`` blocks of each kind (None: 2).

    scale: "full" (the released width) or "tiny" (tests and --tiny only: 2 small heads). released: the released
    model (``RELEASED``): at full scale its width, and its depth where ``blocks`` is None.
    """
    if scale not in DIT_SCALES:
        raise ValueError(f"ToMe bench: DiT scale must be one of {DIT_SCALES}, got {scale!r}.")
    if released:
        release = RELEASED[family]
        cls_name, config = dit_config(family, release.blocks if blocks is None else blocks, scale)
        return cls_name, config if scale == "tiny" else {**config, **dict(release.width)}
    blocks = 2 if blocks is None else blocks
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
    if family == "z_image":  # Z-Image(-Turbo) 6B; refiners in the released proportion, 2 per 30 layers
        refiners = refiner_layers(blocks, scale)
        return "ZImageTransformer2DModel", dict(
            in_channels=16, n_layers=blocks, n_refiner_layers=refiners, axes_lens=[1024, 512, 512],
            **(dict(dim=32, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[8, 4, 4]) if tiny else
               dict(dim=3840, n_heads=30, n_kv_heads=30, cap_feat_dim=2560, axes_dims=[32, 48, 48])))
    if family == "qwen_image":  # Qwen-Image (2512 and the edit models: the same transformer)
        return "QwenImageTransformer2DModel", dict(
            patch_size=2, in_channels=64, out_channels=16, num_layers=blocks, guidance_embeds=False,
            **(dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
               if tiny else dict(attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                 axes_dims_rope=(16, 56, 56))))
    if family == "ltx2":  # LTX-2 19B: video 32 x 128 wide, audio 32 x 64, Gemma 3 text (3840)
        return "LTX2VideoTransformer3DModel", dict(
            num_layers=blocks,
            **(dict(in_channels=8, out_channels=8, num_attention_heads=2, attention_head_dim=8, cross_attention_dim=16,
                    audio_in_channels=8, audio_out_channels=8, audio_num_attention_heads=2, audio_attention_head_dim=8,
                    audio_cross_attention_dim=16, caption_channels=16) if tiny else
               dict(in_channels=128, out_channels=128, num_attention_heads=32, attention_head_dim=128,
                    cross_attention_dim=4096, audio_in_channels=128, audio_out_channels=128,
                    audio_num_attention_heads=32, audio_attention_head_dim=64, audio_cross_attention_dim=2048,
                    caption_channels=3840)))
    raise ValueError(f"ToMe bench: DiT family must be one of {DIT_FAMILIES}, got {family!r}.")


def refiner_layers(blocks: int, scale: str = "full") -> int:
    """Z-Image's noise and caption refiners (each): 2 per 30 layers as released, so a reduced-depth model
    keeps the released share of unreduced work (none below 8 layers); tiny: 1, so tests run the real layout."""
    return 1 if scale == "tiny" else round(blocks * 2 / 30)


def _qk_parameters(model: torch.nn.Module) -> List[torch.Tensor]:
    """What sets the logit scale of every attention mode "kv" reduces: the q/k RMSNorm weights where
    the attention has them (all three families), else the q/k projections. Cross-attention is left alone."""
    from tome_core.catalogue.diffusers_lookup import family_of

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
    with scaled_parameters(_qk_parameters(model), factor):
        yield model


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
    seed_parameters(model, torch.Generator().manual_seed(seed + 1))
    if dtype != torch.float32:  # torch's own Module.to: diffusers' warns about an empty list of fp32 modules
        model = torch.nn.Module.to(model, dtype)
    model = model.eval().requires_grad_(False)
    if peaked != 1.0:
        with torch.no_grad():
            for p in _qk_parameters(model):
                p.mul_(peaked)
    return model


def seed_parameters(model: torch.nn.Module, generator: torch.Generator) -> None:
    """Every parameter drawn in place from ``generator`` (on the parameters' device): normal / sqrt(fan-in), so no
    zero-initialised layer hides errors; normalisation weights at 1, the q/k norms at ``QK_NORM_INIT``."""
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 64
            p.normal_(generator=generator).div_(fan_in ** 0.5)
        for name, module in model.named_modules():
            if _is_norm_weight(module):
                module.weight.fill_(QK_NORM_INIT if name.rsplit(".", 1)[-1] in _QK_NORMS else 1.0)


def latent_frames(frames: int, family: str = "wan") -> int:
    """Latent frames of a ``frames``-frame video: 1 + (frames - 1) / 4 (Wan, frames = 4k + 1) or / 8 (LTX-2, 8k + 1)."""
    return (frames - 1) // _VAE.get(family, (4, 8))[0] + 1


def latent_shape(family: str, height_px: int, width_px: int, frames: int = 1) -> Tuple[int, int, int]:
    """(frames, height, width) of the latent: images 1 frame at px / 8; LTX-2 px / 32."""
    temporal, spatial = _VAE.get(family, (1, 8))
    f = latent_frames(frames, family) if family in VIDEO_FAMILIES else 1
    return f, height_px // spatial, width_px // spatial


def audio_tokens(frames: int, fps: float = 24.0) -> int:
    """LTX-2's audio latents for a ``frames``-frame clip: 16 kHz, hop 160, 4x compression = 25 per second
    (diffusers' LTX2Pipeline: 121 frames at 24 fps -> 126)."""
    return round(frames / fps * 16000 / 160 / 4)


def distilled(family: str, batch: int) -> bool:
    """Whether the output is the prediction itself (no CFG pair): Flux always; Z-Image at an odd batch (Turbo)."""
    return family == "flux" or (family == "z_image" and batch % 2 == 1)


def token_counts(family: str, height_px: int, width_px: int, frames: int = 1,
                 text_tokens: Optional[int] = None) -> Tuple[int, int]:
    """(image or video tokens, text tokens) of one sample: the latent in patches (2x2; LTX-2 1x1 at px / 32)."""
    f, h, w = latent_shape(family, height_px, width_px, frames)
    patch = PATCH.get(family, 2)
    return f * (h // patch) * (w // patch), TEXT_TOKENS[family] if text_tokens is None else text_tokens


def make_dit_inputs(model: torch.nn.Module, family: str, batch: int, height_px: int, width_px: int,
                    frames: int = 1, seed: int = 0, dtype: torch.dtype = torch.float32,
                    text_tokens: Optional[int] = None, content: str = "noise", photo: str = "astronaut") -> dict:
    """Keyword inputs of one forward for an image (or ``frames``-frame video) of height_px x width_px.

    With an even batch the halves are an unconditional/conditional CFG pair (same latents and step).
    Flux is guidance-distilled: its batch is all conditional, guidance 3.5. Text embeddings have
    ``TEXT_TOKENS[family]`` tokens unless ``text_tokens`` is given; widths come from the model's config.
    content "noise": the latents are seeded noise; "photo": that noise at the bench's step over ``photo``
    (``content.photo_like``; every other input the same).
    """
    cfg = model.config
    gen = torch.Generator().manual_seed(seed)
    pair = batch % 2 == 0 and family != "flux"
    n = batch // 2 if pair else batch
    text_dim = {"wan": "text_dim", "z_image": "cap_feat_dim", "ltx2": "caption_channels"}.get(
        family, "joint_attention_dim")
    text = torch.randn(batch, TEXT_TOKENS[family] if text_tokens is None else text_tokens, getattr(cfg, text_dim),
                       generator=gen, dtype=torch.float32)
    f, h, w = latent_shape(family, height_px, width_px, frames)
    out = _INPUTS[family](cfg, gen, n, text, (f, h, w), frames)
    if content == "photo":
        key = "x" if family == "z_image" else "hidden_states"
        value = out[key]
        out[key] = ([photo_like(v, family, f, h, w, photo) for v in value] if isinstance(value, list)
                    else photo_like(value, family, f, h, w, photo))
    elif content != "noise":
        raise ValueError(f"content must be 'noise' or 'photo', got {content!r}")
    # the CFG pair's halves share latents (and step): repeat what has one entry per sample
    if pair:
        for key in ("hidden_states", "audio_hidden_states", "x"):
            if key in out:
                value = out[key]
                out[key] = value + value if isinstance(value, list) else torch.cat([value, value])
    return _cast(out, dtype)


def _cast(value, dtype: torch.dtype):
    if isinstance(value, dict):
        return {k: v if "ids" in k else _cast(v, dtype) for k, v in value.items()}
    if isinstance(value, list):
        return [_cast(v, dtype) for v in value]
    return value.to(dtype) if isinstance(value, torch.Tensor) and value.is_floating_point() else value


def to_device(inputs: dict, device: torch.device) -> dict:
    """``inputs`` on ``device`` (Z-Image takes lists of per-sample tensors)."""
    def move(value):
        if isinstance(value, list):
            return [move(v) for v in value]
        return value.to(device) if isinstance(value, torch.Tensor) else value
    return {k: move(v) for k, v in inputs.items()}


def _flux_inputs(cfg, gen, n, text, latent, frames):
    batch, (_, h, w) = text.shape[0], latent
    hh, ww = h // 2, w // 2
    ids = torch.zeros(hh, ww, 3)
    ids[..., 1], ids[..., 2] = torch.arange(hh)[:, None], torch.arange(ww)[None, :]
    return dict(hidden_states=torch.randn(n, hh * ww, cfg.in_channels, generator=gen), encoder_hidden_states=text,
                pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=gen),
                timestep=torch.full((batch,), 0.5), img_ids=ids.reshape(-1, 3),
                txt_ids=torch.zeros(text.shape[1], 3), guidance=torch.full((batch,), 3.5))


def _sd3_inputs(cfg, gen, n, text, latent, frames):
    batch, (_, h, w) = text.shape[0], latent
    return dict(hidden_states=torch.randn(n, cfg.in_channels, h, w, generator=gen), encoder_hidden_states=text,
                pooled_projections=torch.randn(batch, cfg.pooled_projection_dim, generator=gen),
                timestep=torch.full((batch,), 500.0))


def _wan_inputs(cfg, gen, n, text, latent, frames):
    return dict(hidden_states=torch.randn(n, cfg.in_channels, *latent, generator=gen), encoder_hidden_states=text,
                timestep=torch.full((text.shape[0],), 500.0))


def _zimage_inputs(cfg, gen, n, text, latent, frames):
    """Per-sample lists, as ZImagePipeline passes them: latents [C, 1, H, W], captions [L, 2560]; t rises
    0 -> 1 over sampling (the pipeline passes (1000 - t) / 1000)."""
    return dict(x=[torch.randn(cfg.in_channels, *latent, generator=gen) for _ in range(n)],
                t=torch.full((text.shape[0],), 0.5), cap_feats=list(text.unbind(0)))


def _qwen_inputs(cfg, gen, n, text, latent, frames):
    """Packed latents [B, (H/2)(W/2), 64] and ``img_shapes``; no text mask (QwenImagePipeline drops an all-ones
    mask); timestep / 1000."""
    batch, (_, h, w) = text.shape[0], latent
    return dict(hidden_states=torch.randn(n, (h // 2) * (w // 2), cfg.in_channels, generator=gen),
                encoder_hidden_states=text, timestep=torch.full((batch,), 0.5),
                img_shapes=[[(1, h // 2, w // 2)]] * batch)


def _ltx2_inputs(cfg, gen, n, text, latent, frames):
    """Packed video latents [B, F*H*W, 128] and audio latents [B, A, 128] (A: ``audio_tokens``), the same
    prompt embeddings for both streams' cross-attentions (LTX2Pipeline's connectors give both widths 3840)."""
    batch, (f, h, w) = text.shape[0], latent
    audio = audio_tokens(frames)
    mask = torch.ones(batch, text.shape[1], dtype=torch.long)
    return dict(hidden_states=torch.randn(n, f * h * w, cfg.in_channels, generator=gen),
                audio_hidden_states=torch.randn(n, audio, cfg.audio_in_channels, generator=gen),
                encoder_hidden_states=text, audio_encoder_hidden_states=text.clone(),
                timestep=torch.full((batch,), 500.0), encoder_attention_mask=mask, audio_encoder_attention_mask=mask,
                num_frames=f, height=h, width=w, fps=24.0, audio_num_frames=audio)


_INPUTS = {"flux": _flux_inputs, "sd3": _sd3_inputs, "wan": _wan_inputs, "z_image": _zimage_inputs,
           "qwen_image": _qwen_inputs, "ltx2": _ltx2_inputs}


def forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    """The model's prediction (LTX-2: the video's; Z-Image's per-sample list stacked)."""
    with torch.inference_mode():
        out = model(**inputs, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out


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
    """The CFG-combined prediction of a [uncond; cond] batch; distilled (Flux, Z-Image-Turbo): the output itself."""
    if distilled(family, output.shape[0]) or output.shape[0] % 2:
        return output
    uncond, cond = output.chunk(2)
    return uncond + scale * (cond - uncond)


def kv_errors(model: torch.nn.Module, family: str, inputs: dict, ratio: float,
              blocks: Optional[list] = None, seed: int = 0) -> Dict[str, float]:
    """Relative error of mode "kv" against the unpatched model: raw output and CFG-combined (or distilled)."""
    from tome_core.engine.config import ToMeConfig
    from tome_core.adapters.hooks import dit as diffusers_dit

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
    from tome_core.engine.config import ToMeConfig
    from tome_core.adapters.hooks import dit as diffusers_dit

    diffusers_dit.install(model, ToMeConfig(ratio=ratio, mode="kv"), blocks=blocks)
    try:
        yield model
    finally:
        diffusers_dit.uninstall(model)
