"""The UNet families (SD1.x, SD2.x, SDXL): where their attention blocks and levels sit in the module tree.

diffusers (``down_blocks``/``mid_block``/``up_blocks``), LDM/SGM (the WebUI) and ComfyUI
(``input_blocks``/``middle_block``/``output_blocks``) name these the same way, and all three call the
block that holds attn1/attn2/ff ``BasicTransformerBlock``: found by those names, without importing any host.

Depth rule: ``max_downsample`` counts from the first UNet level that has attention. SD1.x/SD2.x
have attention at full latent resolution, so their first attention level is 1x (tomesd's
meaning exactly); SDXL's first attention level is 2x downsampled, so at the defaults ToMe merges
there instead of doing nothing as tomesd does.
"""
from __future__ import annotations

from typing import Dict, Iterable, Tuple

import torch

from ..engine.levels import Level

TRANSFORMER_BLOCK = "BasicTransformerBlock"
# The names users know for a UNet, by the prefix of the host's model-config class (ComfyUI's supported_models: SD15,
# SD20, SD21UnclipL, SDXLRefiner, SDXL, SSD1B, Segmind_Vega, KOALA_700M, ...); longest prefix first.
UNET_TITLES = (("SDXLRefiner", "SDXL Refiner"), ("SDXL", "SDXL"), ("SSD1B", "SSD-1B"), ("Segmind_Vega", "Segmind Vega"),
               ("KOALA", "KOALA"), ("SD15", "SD1.5"), ("SD20", "SD2.x"), ("SD21", "SD2.x"))


def unet_title(config_name: str, base_downsample: int) -> str:
    """The UNet's name as users know it (SD1.5, SDXL, ...) from its model-config class name; an unknown config by its
    first attention level (1x: an SD1.x/SD2.x-class UNet, 2x: SDXL-class)."""
    for prefix, title in UNET_TITLES:
        if config_name.startswith(prefix):
            return title
    return "SDXL-class UNet" if base_downsample == 2 else "SD1.x/SD2.x-class UNet"


def is_transformer_block(module: torch.nn.Module) -> bool:
    """diffusers, ldm, sgm and ComfyUI all name the block that holds attn1/attn2/ff this way."""
    return type(module).__name__ == TRANSFORMER_BLOCK


def transformer_blocks(module: torch.nn.Module) -> list:
    return [m for m in module.modules() if is_transformer_block(m)]


def _has_downsampler(module: torch.nn.Module) -> bool:
    return any("Downsample" in type(m).__name__ for m in module.modules())


def _has_upsampler(module: torch.nn.Module) -> bool:
    return any("Upsample" in type(m).__name__ for m in module.modules())


def _width_and_heads(block: torch.nn.Module) -> Tuple[int, int]:
    attention = getattr(block, "attn1", None)
    to_q = getattr(attention, "to_q", None)
    channels = getattr(to_q, "in_features", None)
    if channels is None:
        shape = getattr(getattr(block, "norm1", None), "normalized_shape", None) or (0,)
        channels = shape[0]
    return int(channels), int(getattr(attention, "heads", 1) or 1)


def level_blocks(unet: torch.nn.Module) -> Dict[int, list]:
    """The transformer blocks of each attention level of a UNet, by latent downsampling, in execution order.

    Walks the stages in execution order (down path, middle, up path): a stage's blocks sit at the
    resolution it receives; a stage with a downsampler halves it after them, one with an
    upsampler doubles it after them (diffusers, LDM/SGM and ComfyUI UNets alike).
    """
    if hasattr(unet, "down_blocks"):
        stages = list(unet.down_blocks) + [unet.mid_block] + list(getattr(unet, "up_blocks", []))
    else:
        stages = list(_levels_in_order(unet)) + list(getattr(unet, "output_blocks", []))
    found: Dict[int, list] = {}
    downsample = 1
    for stage in stages:
        if stage is None:
            continue
        for block in transformer_blocks(stage):
            found.setdefault(downsample, []).append(block)
        if _has_downsampler(stage):
            downsample *= 2
        elif _has_upsampler(stage):
            downsample = max(1, downsample // 2)
    return dict(sorted(found.items()))


def attention_levels(unet: torch.nn.Module) -> Dict[int, Level]:
    """Each attention level of a UNet by its latent downsampling (``level_blocks``): its blocks, width, heads."""
    return {ds: Level(ds, len(blocks), *_width_and_heads(blocks[0])) for ds, blocks in level_blocks(unet).items()}


def _levels_in_order(unet: torch.nn.Module) -> Iterable[torch.nn.Module]:
    if hasattr(unet, "down_blocks"):  # diffusers UNet2DConditionModel / ControlNetModel
        return list(unet.down_blocks) + [unet.mid_block]
    if hasattr(unet, "input_blocks"):  # ldm / sgm / ComfyUI openaimodel
        return list(unet.input_blocks) + [unet.middle_block]
    raise TypeError(
        f"ToMe: {type(unet).__name__} is not a UNet (expected diffusers down_blocks or LDM input_blocks); "
        "ToMe supports SD1.x, SD2.x and SDXL UNets and their ControlNets."
    )


def attention_base_downsample(unet: torch.nn.Module) -> int:
    """Latent downsampling of the first UNet level with a transformer block (SD1/2: 1, SDXL: 2)."""
    downsample = 1
    for block in _levels_in_order(unet):
        if block is None:
            continue
        if transformer_blocks(block):
            return downsample
        if _has_downsampler(block):
            downsample *= 2
    raise TypeError(
        f"ToMe: {type(unet).__name__} has no transformer blocks ({TRANSFORMER_BLOCK}) in its down path or "
        "middle: there is no attention to merge. Supported: SD1.x, SD2.x and SDXL UNets and their ControlNets."
    )
