"""Finding a ComfyUI model's binding in the catalogue, and reading one model through it once.

A diffusion model's binding is found by its class's module and name (``comfy.ldm.aura.mmdit.MMDiT``, AuraFlow, is not
SD3's ``comfy.ldm.modules.diffusionmodules.mmdit.MMDiT``), seen through torch.compile's wrapper. ``comfy_model`` reads
once what a patch needs of a model (its binding and family, its block lists' offsets and counts, the default block
range, whether mode merge reaches its class, how this host lays out its sequence and whether its blocks reach the
attention override): a patch resolves its model with it once and never asks again. The binding type
(``comfy_dits``) knows nothing of the list; this module reads it.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional

from .comfy_dits import ComfyDiT, base_model, block_offsets, default_start, grid_last, unreached
from .families import CATALOGUE, ModelFamily, family_of_binding, host_bindings


def binding_named(name: str) -> ComfyDiT:
    return host_bindings("comfy")[1][name]  # type: ignore[return-value]


def family_of(diffusion_model: Any) -> Optional[ComfyDiT]:
    """The table entry of a diffusion model's class (module and class name), else None: ComfyUI's classes
    (``comfy.ldm``) and Forge Neo's ports of them (``backend.nn``, ``NeoDiT``), whose patchers are alike."""
    cls = type(base_model(diffusion_model))
    name = f"{cls.__module__}.{cls.__qualname__}"
    found = host_bindings("comfy")[2].get(name) or host_bindings("neo")[2].get(name)
    return found  # type: ignore[return-value]


def merging_names(host: str = "comfy") -> str:
    """The families whose blocks mode "merge" reaches on ``host`` ("comfy", "neo"), for messages."""
    return ", ".join(binding.name for binding in host_bindings(host)[0] if binding.merge is not None)


def supported_names(host: str = "comfy") -> str:
    """The catalogue's families that have a binding on ``host`` ("comfy", "neo"), by title (for refusals)."""
    return ", ".join(family.title for family in CATALOGUE if getattr(family, host))


@dataclass(frozen=True)
class ComfyModel:
    """One ComfyUI diffusion model as the catalogue reads it, once: ``model`` (the DiT itself, through torch.compile's
    wrapper), its binding (``entry``) and catalogue family, the depth index of each reported block type's first
    block and its count, the default block range's start, whether mode merge reaches its class, whether this host
    runs its sequence grid last, and why its blocks cannot reach the attention override (None: they can)."""

    model: Any
    entry: ComfyDiT
    family: ModelFamily
    offsets: Dict[str, int]
    counts: Dict[str, int]
    default_start: float
    merges: bool
    grid_last: bool
    unreached: Optional[str]

    @property
    def block_count(self) -> int:
        return sum(self.counts.values())


def comfy_model(diffusion_model: Any) -> Optional[ComfyModel]:
    """What the catalogue knows of ``diffusion_model``, or None where it is no DiT of the catalogue."""
    entry = family_of(diffusion_model)
    if entry is None:
        return None
    offsets, counts = block_offsets(entry, diffusion_model)
    merges = entry.merge is not None and entry.merge.reaches(diffusion_model)
    return ComfyModel(base_model(diffusion_model), entry, family_of_binding(entry), offsets, counts,
                      default_start(entry, counts), merges, grid_last(entry), unreached(entry, diffusion_model))
