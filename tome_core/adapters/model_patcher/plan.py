"""Resolve, plan, then attach: a ComfyUI/Forge patch validated and described before anything is registered.

``resolve`` reads the patcher's model once: the catalogue's reading of a DiT (its binding, family, block lists and
default range: ``comfy_lookup.comfy_model``), or a UNet, and its defaults (``catalogue.defaults``). ``plan_request``
settles what a host asked (mode and ratio left to the model) against them, once, and plans it; ``plan_patch`` routes
that value to the UNet patch or the DiT patch, runs every refusal, and describes what the patch will do: kind,
family, levels or blocks, the key/value window, the speed check. The ComfyUI nodes show that description as it is;
``attach`` then returns the patched clone from what the plan found, never asking the patcher again.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Mapping, Optional

from ...catalogue.comfy_lookup import ComfyModel
from ...catalogue.defaults import UNET_DEFAULTS, ModelDefaults
from ...catalogue.families import short_title
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

    @property
    def defaults(self) -> ModelDefaults:
        """What "model default" means for this model (mode and ratio): the DiT family's, tomesd's on UNets."""
        return UNET_DEFAULTS if self.dit is None else ModelDefaults(self.dit.family, self.dit.merges)


def resolve(patcher: Any) -> ResolvedModel:
    """The patcher's model as the catalogue knows it (a ``ResolvedModel`` is returned as it is)."""
    if isinstance(patcher, ResolvedModel):
        return patcher
    return ResolvedModel(patcher, model_type_name(patcher), resolve_dit(patcher))


def is_dit(patcher: Any) -> bool:
    """Whether the catalogue knows the patcher's model as a transformer (DiT) family."""
    return resolve(patcher).dit is not None


@dataclass(frozen=True)
class PatchPlan:
    """A validated patch: ``description`` (what the node shows) and ``attach`` (the patched clone)."""

    kind: str
    description: Dict[str, Any]
    attach: Callable[[], Any]


def plan_request(patcher: Any, asked: Mapping[str, Any],
                 build: Callable[..., ToMeConfig] = ToMeConfig) -> PatchPlan:
    """Plan what a host asked: ``asked`` (config values; mode, ratio and block_start may be left to the model: None,
    -1 or "default") settled against the model's defaults, built into a config by ``build`` (a host's own checks
    and messages; ``ToMeConfig`` by default) and planned. The description says which settings were the model's
    (``defaults``) and the model's ratio in the mode that runs (``default_ratio``)."""
    resolved = resolve(patcher)
    settled = resolved.defaults.settle(asked)
    plan = plan_patch(resolved, build(**settled.values))
    return PatchPlan(plan.kind, dict(plan.description, **settled.describe()), plan.attach)


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


__all__ = ["PatchPlan", "ResolvedModel", "base_downsample_of", "is_dit", "plan_patch", "plan_request", "resolve"]
