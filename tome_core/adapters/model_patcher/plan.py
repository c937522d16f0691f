"""Resolve, plan, then attach: a ComfyUI/Forge patch validated and described before anything is registered.

``resolve`` reads the patcher's model once: the catalogue's reading of a DiT (its binding, family, block lists and
default range: ``comfy_lookup.comfy_model``), or a UNet. ``plan_patch`` routes that value to the UNet patch or the
DiT patch, runs every refusal, and describes what the patch will do: kind, family, levels or blocks, the key/value
window, the speed check. The ComfyUI nodes show that description as it is; ``attach`` then returns the patched
clone from what the plan found, never asking the patcher again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional

from ...catalogue.comfy_lookup import ComfyModel
from ...catalogue.families import TOMESD_RATIO, short_title
from ...catalogue.quality import trade
from ...catalogue.unets import unet_title
from ...engine.config import ToMeConfig
from ...engine.kv import window_for_dims
from .dit import check_dit_model_patcher, patch_dit_model_patcher, resolve_dit
from .unet import base_downsample_of, check_model_patcher, model_type_name, patch_model_patcher


@dataclass(frozen=True)
class ResolvedModel:
    """A patcher's model, resolved once per patch: its type's name, and the catalogue's reading of it where it is a
    DiT (None: a UNet, or a model the UNet patch refuses by name)."""

    patcher: Any
    model_type: str
    dit: Optional[ComfyModel]


def resolve(patcher: Any) -> ResolvedModel:
    """The patcher's model as the catalogue knows it (a ``ResolvedModel`` is returned as it is)."""
    if isinstance(patcher, ResolvedModel):
        return patcher
    return ResolvedModel(patcher, model_type_name(patcher), resolve_dit(patcher))


def is_dit(patcher: Any) -> bool:
    """Whether the catalogue knows the patcher's model as a transformer (DiT) family."""
    return resolve(patcher).dit is not None


def default_mode(patcher: Any) -> str:
    """The mode used where none is asked for: the DiT family's (``ModelFamily.default_mode``) where this class takes
    it (else kv), tomesd's merge on UNets."""
    dit = resolve(patcher).dit
    return "merge" if dit is None else dit.family.mode_for(dit.merges)


def default_ratio(patcher: Any, mode: str) -> float:
    """The ratio used where none is asked for, in ``mode``: the DiT family's (``ModelFamily.ratio_for``), tomesd's
    0.5 on UNets."""
    dit = resolve(patcher).dit
    return TOMESD_RATIO if dit is None else dit.family.ratio_for(mode)


@dataclass(frozen=True)
class PatchPlan:
    """A validated patch: ``description`` (what the node shows) and ``attach`` (the patched clone)."""

    kind: str
    description: Dict[str, Any]
    attach: Callable[[], Any]


def plan_patch(patcher: Any, config: ToMeConfig) -> PatchPlan:
    """Validate ``config`` on ``patcher`` (or the ``ResolvedModel`` of it) and describe the patch; refusals raise
    here, before any clone."""
    resolved = resolve(patcher)
    patcher, model_type, dit = resolved.patcher, resolved.model_type, resolved.dit
    if dit is None:
        checked = check_model_patcher(patcher, config)
        config_name = type(getattr(getattr(patcher, "model", None), "model_config", None)).__name__
        description = dict(config.as_dict(), kind="unet", base_downsample=checked[0], model_type=model_type,
                           name=unet_title(config_name, checked[0]))
        return PatchPlan("unet", description, lambda: patch_model_patcher(patcher, config, checked))
    chosen = check_dit_model_patcher(patcher, config, dit)  # every refusal, naming the model
    count, family = dit.block_count, dit.family
    kv_window = window_for_dims(config.ratio, family.grid_dims, config.sx, config.sy) if config.mode == "kv" else ()
    description = dict(config.as_dict(), kind="dit", base_downsample=1, model_type=model_type, family=family.name,
                       title=family.title, name=short_title(family), kv_window=list(kv_window),
                       blocks=[count if chosen is None else sum(chosen), count],
                       merge_attention=family.attention_for(config) if config.mode == "merge" else None,
                       quality=trade(family.name, short_title(family)))
    return PatchPlan("dit", description, lambda: patch_dit_model_patcher(patcher, config, dit, (chosen,)))


__all__ = ["PatchPlan", "ResolvedModel", "base_downsample_of", "default_mode", "default_ratio", "is_dit", "plan_patch", "resolve"]
