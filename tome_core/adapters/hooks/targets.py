"""Finding the UNets inside what a user hands to ``apply_patch``, by duck typing (no host imports)."""
from __future__ import annotations

from typing import List

import torch

from ...catalogue.unets import is_transformer_block

SUPPORTED = (
    "a diffusers pipeline, UNet2DConditionModel or ControlNetModel (SD1.x, SD2.x, SDXL), an LDM/SGM model "
    "with .model.diffusion_model (the WebUI's sd_model), or an LDM UNet (input_blocks/middle_block)"
)


def _is_unet_shaped(module: torch.nn.Module) -> bool:
    return (hasattr(module, "down_blocks") and hasattr(module, "mid_block")) or (
        hasattr(module, "input_blocks") and hasattr(module, "middle_block")
    )


def _has_transformer_blocks(module: torch.nn.Module) -> bool:
    return any(is_transformer_block(m) for m in module.modules())


def _roots(model: object) -> List[torch.nn.Module]:
    components = getattr(model, "components", None)
    if isinstance(components, dict) and not isinstance(model, torch.nn.Module):  # a DiffusionPipeline
        return [c for c in components.values() if isinstance(c, torch.nn.Module)]
    inner = getattr(getattr(model, "model", None), "diffusion_model", None)
    if isinstance(inner, torch.nn.Module):  # LDM / SGM wrapper (the WebUI's sd_model)
        return [inner]
    if isinstance(model, torch.nn.Module):
        return [model]
    raise TypeError(f"ToMe: cannot patch a {type(model).__name__}; expected {SUPPORTED}.")


def _collect_unets(module: torch.nn.Module, found: List[torch.nn.Module]) -> None:
    if _is_unet_shaped(module) and _has_transformer_blocks(module):
        found.append(module)  # a UNet's own sub-blocks are handled with it, never on their own
        return
    for child in module.children():
        _collect_unets(child, found)


def find_unets(model: object) -> List[torch.nn.Module]:
    """Every UNet-shaped module with transformer blocks in ``model`` (a UNet and its ControlNets).

    Raises TypeError, naming the model's class, when there is none (e.g. a DiT outside the catalogue).
    """
    found: List[torch.nn.Module] = []
    for root in _roots(model):
        _collect_unets(root, found)
    if not found:
        raise TypeError(
            f"ToMe: {type(model).__name__} has no UNet with transformer blocks to merge. Supported: {SUPPORTED}. "
            "Transformer-only models that the catalogue does not hold (e.g. HunyuanDiT, AuraFlow) are not supported."
        )
    return found


def patched_modules(model: object, attr: str) -> List[torch.nn.Module]:
    """Modules below ``model`` that carry patch state ``attr`` (lenient: unknown models give [])."""
    try:
        roots = _roots(model)
    except TypeError:
        return []
    return [m for root in roots for m in root.modules() if attr in m.__dict__]
