"""Plan, then attach: a ComfyUI/Forge patch validated and described before anything is registered.

``plan_patch`` routes the model to the UNet patch or the DiT patch (the catalogue decides which), runs every
refusal, and describes what the patch will do: kind, family, levels or blocks, the key/value window, the
speed check. The ComfyUI nodes show that description as it is; ``attach`` then returns the patched clone.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict

from ...engine.config import ToMeConfig
from ...engine.kv import window_for_dims
from .dit import block_count, check_dit_model_patcher, dit_family, merges, patch_dit_model_patcher
from .unet import base_downsample_of, check_model_patcher, model_type_name, patch_model_patcher


def is_dit(patcher: Any) -> bool:
    """Whether the catalogue knows the patcher's model as a transformer (DiT) family."""
    return dit_family(patcher) is not None


def default_mode(patcher: Any) -> str:
    """The mode used where none is asked for: the DiT family's (``ModelFamily.default_mode``) where this class takes
    it (else kv), tomesd's merge on UNets."""
    family = dit_family(patcher)
    if family is None:
        return "merge"
    return family.mode_for(merges(patcher))


@dataclass(frozen=True)
class PatchPlan:
    """A validated patch: ``description`` (what the node shows) and ``attach`` (the patched clone)."""

    kind: str
    description: Dict[str, Any]
    attach: Callable[[], Any]


def plan_patch(patcher: Any, config: ToMeConfig) -> PatchPlan:
    """Validate ``config`` on ``patcher`` and describe the patch; refusals raise here, before any clone."""
    model_type = model_type_name(patcher)
    family = dit_family(patcher)
    if family is None:
        base, _ = check_model_patcher(patcher, config)
        description = dict(config.as_dict(), kind="unet", base_downsample=base, model_type=model_type)
        return PatchPlan("unet", description, lambda: patch_model_patcher(patcher, config))
    chosen = check_dit_model_patcher(patcher, config)  # every refusal, naming the model
    count = block_count(patcher)
    kv_window = window_for_dims(config.ratio, family.grid_dims, config.sx, config.sy) if config.mode == "kv" else ()
    description = dict(config.as_dict(), kind="dit", base_downsample=1, model_type=model_type, family=family.name,
                       title=family.title, kv_window=list(kv_window),
                       blocks=[count if chosen is None else sum(chosen), count],
                       merge_attention=family.attention_for(config) if config.mode == "merge" else None)
    return PatchPlan("dit", description, lambda: patch_dit_model_patcher(patcher, config))


__all__ = ["PatchPlan", "base_downsample_of", "default_mode", "is_dit", "plan_patch"]
