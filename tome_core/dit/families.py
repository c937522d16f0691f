"""Which diffusers DiTs mode "kv" reaches, and where their tokens sit (by class name: no diffusers import)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from .grid import TokenLayout

# Families whose default block range (no block_start given) is their single blocks only: on Flux nearly
# all of kv's error comes from the double blocks (python -m tome_core.bench.dit_blocks; README "Which
# blocks"), so reducing only the single blocks gives the lowest error per unit of speed-up. Other
# families start at their first block. Shared by the diffusers and ComfyUI adapters.
SINGLE_BLOCKS_BY_DEFAULT = frozenset({"flux"})


def default_block_start(family: str, single_from: int, count: int) -> float:
    """The block_start a family uses when none is given: ``single_from / count`` (the first single
    block's share of the depth) for SINGLE_BLOCKS_BY_DEFAULT families that have single blocks, else 0."""
    return single_from / count if family in SINGLE_BLOCKS_BY_DEFAULT and 0 < single_from < count else 0.0


@dataclass(frozen=True)
class Family:
    """name: family id; progress_scale: the timestep the model receives at the first step (t -> 0 at the end)."""

    name: str
    progress_scale: float
    attentions: Callable[[torch.nn.Module], List[Tuple[str, torch.nn.Module, str]]]
    layout: Callable[[torch.nn.Module, dict], Optional[TokenLayout]]


def _sd3_attentions(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
    found = []
    for i, block in enumerate(model.transformer_blocks):
        found.append((f"transformer_blocks.{i}.attn", block.attn, "joint"))
        if getattr(block, "attn2", None) is not None:  # SD3.5's dual attention: image tokens only
            found.append((f"transformer_blocks.{i}.attn2", block.attn2, "image"))
    return found


def _wan_attentions(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
    return [(f"blocks.{i}.attn1", b.attn1, "image") for i, b in enumerate(model.blocks)]  # attn2: text only


def _double_single_attentions(model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
    """Flux and HunyuanVideo: double blocks (text joined inside the processor), then single blocks (joined before)."""
    found = [(f"transformer_blocks.{i}.attn", b.attn, "joint") for i, b in enumerate(model.transformer_blocks)]
    found += [(f"single_transformer_blocks.{i}.attn", b.attn, "joint")
              for i, b in enumerate(model.single_transformer_blocks)]
    return found


def _arg(args: tuple, kwargs: dict, index: int, name: str):
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _flux_layout(model: torch.nn.Module, call: dict) -> Optional[TokenLayout]:
    """The image grid from ``img_ids`` (row, column per token), text first; None unless a plain raster.

    One small host copy per transformer call (not per block). Anything else (Kontext's reference
    tokens with a non-zero first id, shuffled ids) is left alone rather than mis-placed.
    """
    args, kwargs = call["args"], call["kwargs"]
    hidden, text, ids = _arg(args, kwargs, 0, "hidden_states"), _arg(args, kwargs, 1, "encoder_hidden_states"), \
        _arg(args, kwargs, 4, "img_ids")
    if hidden is None or text is None or ids is None:
        return None
    ids = ids[0] if ids.ndim == 3 else ids
    ids = ids.detach().to("cpu", torch.float64)
    if ids.shape[0] != hidden.shape[1] or ids.shape[0] == 0:
        return None
    h, w = int(ids[:, 1].max()) + 1, int(ids[:, 2].max()) + 1
    rows = torch.arange(h, dtype=torch.float64).repeat_interleave(w)
    cols = torch.arange(w, dtype=torch.float64).repeat(h)
    if h * w != ids.shape[0] or not (torch.equal(ids[:, 0], torch.zeros_like(rows)) and torch.equal(ids[:, 1], rows)
                                     and torch.equal(ids[:, 2], cols)):
        return None
    return TokenLayout((h, w), prefix=text.shape[1])


def _sd3_layout(model: torch.nn.Module, call: dict) -> Optional[TokenLayout]:
    """Latent [B, C, H, W] -> grid (H/p, W/p); SD3's joint attention puts its text last."""
    args, kwargs = call["args"], call["kwargs"]
    hidden, text = _arg(args, kwargs, 0, "hidden_states"), _arg(args, kwargs, 1, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim != 4:
        return None
    p = model.config.patch_size
    return TokenLayout((hidden.shape[-2] // p, hidden.shape[-1] // p), suffix=text.shape[1])


def _hunyuan_video_layout(model: torch.nn.Module, call: dict) -> Optional[TokenLayout]:
    """Latent [B, C, F, H, W] -> grid (F/pt, H/p, W/p); HunyuanVideo's joint attention puts its text last
    (its padded text tokens are masked; the mask's key axis is shortened with the keys)."""
    args, kwargs = call["args"], call["kwargs"]
    hidden, text = _arg(args, kwargs, 0, "hidden_states"), _arg(args, kwargs, 2, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim != 5:
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t
    return TokenLayout((hidden.shape[2] // pt, hidden.shape[3] // p, hidden.shape[4] // p), suffix=text.shape[1])


def _wan_layout(model: torch.nn.Module, call: dict) -> Optional[TokenLayout]:
    """Latent [B, C, F, H, W] -> grid (F/pt, H/ph, W/pw); attn1 sees video tokens only."""
    hidden = _arg(call["args"], call["kwargs"], 0, "hidden_states")
    if hidden is None or hidden.ndim != 5:
        return None
    pt, ph, pw = model.config.patch_size
    return TokenLayout((hidden.shape[2] // pt, hidden.shape[3] // ph, hidden.shape[4] // pw))


FAMILIES: Dict[str, Family] = {
    "FluxTransformer2DModel": Family("flux", 1.0, _double_single_attentions, _flux_layout),
    "SD3Transformer2DModel": Family("sd3", 1000.0, _sd3_attentions, _sd3_layout),
    "WanTransformer3DModel": Family("wan", 1000.0, _wan_attentions, _wan_layout),
    "HunyuanVideoTransformer3DModel": Family("hunyuan_video", 1000.0, _double_single_attentions, _hunyuan_video_layout),
}

TIMESTEP_ARG = {"flux": (3, "timestep"), "sd3": (3, "timestep"), "wan": (1, "timestep"),
                "hunyuan_video": (1, "timestep")}


def find_dit(model: object) -> Optional[torch.nn.Module]:
    """The supported DiT in ``model`` (itself or a pipeline's ``.transformer``), else None."""
    for candidate in (model, getattr(model, "transformer", None)):
        if isinstance(candidate, torch.nn.Module) and type(candidate).__name__ in FAMILIES:
            return candidate
    return None


def unsupported_dit(model: object) -> Optional[str]:
    """Class name of a transformer-only model that mode "kv" cannot reach (e.g. PixArt), else None."""
    for candidate in (model, getattr(model, "transformer", None)):
        name = type(candidate).__name__
        if isinstance(candidate, torch.nn.Module) and name not in FAMILIES and (
                name.endswith("Transformer2DModel") or name.endswith("Transformer3DModel")
                or hasattr(candidate, "transformer_blocks") and not hasattr(candidate, "down_blocks")):
            return name
    return None
