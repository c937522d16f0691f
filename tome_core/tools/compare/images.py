"""What ``python -m tome_core compare`` measures and draws: PSNR, SSIM and the labelled image grid.

Images are float arrays ``[H, W, 3]`` in [0, 1] (a diffusers pipeline's ``output_type="np"``).
numpy only for the numbers, Pillow (which diffusers requires) for the grid, imported on use.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np

SSIM_SIGMA = 1.5  # Wang et al. 2004: an 11x11 Gaussian window of sigma 1.5, K1 = 0.01, K2 = 0.03
SSIM_RADIUS = 5
LABEL_LINES = 3
LINE_HEIGHT = 15
MIN_CELL_WIDTH = 256  # room for a label line of about 40 characters


def psnr(image: np.ndarray, reference: np.ndarray) -> float:
    """Peak signal-to-noise ratio in dB for images in [0, 1]; ``math.inf`` when they are identical."""
    mse = float(np.mean((image.astype(np.float64) - reference.astype(np.float64)) ** 2))
    return math.inf if mse == 0.0 else 10.0 * math.log10(1.0 / mse)


def _gaussian_window() -> np.ndarray:
    x = np.arange(-SSIM_RADIUS, SSIM_RADIUS + 1, dtype=np.float64)
    w = np.exp(-0.5 * (x / SSIM_SIGMA) ** 2)
    return w / w.sum()


def _filter_valid(x: np.ndarray, w: np.ndarray) -> np.ndarray:
    """Separable filtering of ``x: [H, W, C]`` over H and W, positions where the window fits only."""
    k = len(w)
    rows = sum(w[i] * x[i:x.shape[0] - k + 1 + i] for i in range(k))
    return sum(w[i] * rows[:, i:x.shape[1] - k + 1 + i] for i in range(k))


def ssim(image: np.ndarray, reference: np.ndarray) -> float:
    """Mean structural similarity of ``[H, W, C]`` images in [0, 1] (1.0 = identical).

    The Gaussian-window SSIM of Wang et al. (2004), each channel on its own, averaged over the
    positions where the 11x11 window fits and over channels: the same number as scikit-image's
    ``structural_similarity(a, b, channel_axis=2, data_range=1, gaussian_weights=True, sigma=1.5,
    use_sample_covariance=False)``.
    """
    if image.shape != reference.shape or image.ndim != 3:
        raise ValueError(f"ssim: two [H, W, C] images of one shape expected, got {image.shape} and {reference.shape}")
    size = 2 * SSIM_RADIUS + 1
    if min(image.shape[:2]) < size:
        raise ValueError(f"ssim: images must be at least {size}x{size} px, got {image.shape[1]}x{image.shape[0]}")
    x, y = image.astype(np.float64), reference.astype(np.float64)
    w = _gaussian_window()
    ux, uy = _filter_valid(x, w), _filter_valid(y, w)
    vx = _filter_valid(x * x, w) - ux * ux
    vy = _filter_valid(y * y, w) - uy * uy
    vxy = _filter_valid(x * y, w) - ux * uy
    c1, c2 = 0.01 ** 2, 0.03 ** 2
    s = ((2 * ux * uy + c1) * (2 * vxy + c2)) / ((ux * ux + uy * uy + c1) * (vx + vy + c2))
    return float(s.mean())


@dataclass(frozen=True)
class Cell:
    """One image of the grid and the lines under it."""

    image: np.ndarray  # [H, W, 3] in [0, 1]
    lines: Sequence[str]


def cell_size(width: int, height: int) -> tuple:
    """(width, height) of one grid cell for images of ``width`` x ``height`` px, label included."""
    return max(width, MIN_CELL_WIDTH), height + LABEL_LINES * LINE_HEIGHT + 6


def _font(size: int = 12):
    from PIL import ImageFont

    try:
        return ImageFont.load_default(size=size)  # a scalable font (Pillow >= 10.1 with FreeType)
    except TypeError:
        return ImageFont.load_default()


def _fit(draw, text: str, font, width: int) -> str:
    """``text``, cut with an ellipsis to fit ``width`` px."""
    if draw.textlength(text, font=font) <= width:
        return text
    while text and draw.textlength(text + "...", font=font) > width:
        text = text[:-1]
    return text + "..."


def grid(rows: Sequence[Sequence[Cell]]):
    """A PIL image: one row per prompt, one column per setting (plain first), each image labelled."""
    from PIL import Image, ImageDraw

    height, width = rows[0][0].image.shape[:2]
    cw, ch = cell_size(width, height)
    canvas = Image.new("RGB", (cw * len(rows[0]), ch * len(rows)), "white")
    draw, font = ImageDraw.Draw(canvas), _font()
    for r, row in enumerate(rows):
        for c, cell in enumerate(row):
            x, y = c * cw, r * ch
            pixels = (np.clip(cell.image, 0.0, 1.0) * 255).round().astype(np.uint8)
            canvas.paste(Image.fromarray(pixels), (x + (cw - width) // 2, y))
            for i, line in enumerate(cell.lines[:LABEL_LINES]):
                draw.text((x + 4, y + height + 3 + i * LINE_HEIGHT), _fit(draw, line, font, cw - 8),
                          fill="black", font=font)
    return canvas


def metric_text(seconds: float, plain_seconds: Optional[float], psnr_db: Optional[float],
                ssim_value: Optional[float]) -> list:
    """The label lines under a setting's image: time per image (and speed-up), then PSNR/SSIM to plain."""
    timing = f"{seconds:.3f} s/image"
    if plain_seconds is not None:
        timing += f" ({plain_seconds / seconds:.2f}x)"
    if psnr_db is None:
        return [timing]
    shown = "inf" if math.isinf(psnr_db) else f"{psnr_db:.2f}"
    return [timing, f"PSNR {shown} dB  SSIM {ssim_value:.4f}"]
