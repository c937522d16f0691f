"""The benchmark: ``python -m tome_core bench`` (see ``tome_core.bench.cli``).

Builds real SD1.5/SD2/SDXL UNet architectures with seeded random weights and compares vanilla,
tome_core's modes and tomesd: time, speed-up, output error and peak memory. Needs diffusers
(imported only when the benchmark runs), tqdm and matplotlib.
"""
from .cli import main

__all__ = ["main"]
