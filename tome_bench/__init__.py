"""The benchmark, a package of its own beside the engine, which never imports it: ``python -m tome_core bench``,
``python -m tome_bench`` or ``tome-bench`` (see ``tome_bench.cli``).

Builds real UNet (SD1.5/SD2/SDXL) and DiT (Flux, SD3, Wan) architectures with seeded random
weights and compares vanilla, tome_core's modes and tomesd: time, speed-up, output error and peak
memory. Needs diffusers (imported only when the benchmark runs) and tqdm; matplotlib draws the
chart (without it the run ends with one line saying so).
"""
from .cli import main

__all__ = ["main"]
