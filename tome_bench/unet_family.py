"""UNet families (SD1.5, SD2, SDXL) in the benchmark: every method, compiled rows, profiling."""
from __future__ import annotations

from typing import Any

import torch

from . import measure
from .family import Case
from .methods import DEFAULT_METHODS
from .models import FAMILIES, build_unet, make_inputs, peaked_attention


class UNetFamily:
    """The benchmark's UNets: real diffusers architectures, seeded random weights (``models``)."""

    kind = "UNet"
    names = FAMILIES
    methods = DEFAULT_METHODS
    skipped: dict[str, str] = {}
    compiles = True
    defaults_in_config = True  # the same sizes and batch for every UNet: written into the config

    def check(self, cfg: Any, method_names: tuple[str, ...]) -> None:
        """Every method and option applies to UNets."""

    def default_sizes(self, name: str) -> tuple[tuple[int, int], ...]:
        return ((512, 512), (768, 768))

    def default_batch(self, name: str) -> int:
        return 2  # [uncond; cond]

    def build(self, name: str, cfg: Any) -> torch.nn.Module:
        return build_unet(name, cfg.scale, cfg.seed, measure.DTYPES[cfg.dtype]).to(cfg.device)

    def inputs(self, unet: torch.nn.Module, name: str, size: tuple[int, int], cfg: Any,
               content: str | None = None) -> measure.Inputs:
        """The case's inputs; ``content`` "noise" or "photo" (default: what the run times)."""
        width, height = size
        inputs = make_inputs(unet, name, cfg.batch_for(name), height, width, cfg.seed,
                             measure.DTYPES[cfg.dtype], content or cfg.inputs_content, cfg.photo)
        return measure.Inputs(*inputs).to(torch.device(cfg.device))

    def case(self, unet: torch.nn.Module, name: str, size: tuple[int, int], cfg: Any) -> Case:
        photo = self.inputs(unet, name, size, cfg, "photo") if cfg.content == "both" else None
        return Case(self.inputs(unet, name, size, cfg), measure.forward, peaked_attention,
                    photo_inputs=photo)


UNET = UNetFamily()
