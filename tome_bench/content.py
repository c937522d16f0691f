"""Image-like content for the benchmark: photographs mapped into each family's latents.

The bench's default latents are white noise (``--content noise``): neighbouring tokens are barely
alike, the worst case for merging. ``--content photo`` replaces the clean part of the latent with a
photograph that scikit-image ships in its wheel (``skimage.data``, no download), carried into the
family's latent channels by the least-squares inverse of the host's latent-to-RGB preview map
(``latent_rgb``), scaled to the standard deviation of the family's real latents (unit), then noised to the bench's step with the same seeded noise the noise content uses:
``x_t = a * x0 + s * noise``. Video families get a slow pan across the photo, one crop per latent
frame. Nothing here is random: the same photo, seed and family give the same latents.

What the proxy can and cannot tell is in docs/CONTENT.md.
"""
from __future__ import annotations

import functools
import importlib
from typing import Tuple

import torch
import torch.nn.functional as F

from .latent_rgb import FAMILY_FORMAT, FORMATS, LATENT_STD

CONTENTS = ("noise", "photo", "both")  # --content: today's noise, photographs, or errors on both
# skimage.data loaders whose images are in the scikit-image wheel itself (others are fetched on first use)
PHOTOS = {"astronaut": "astronaut", "chelsea": "chelsea", "coffee": "coffee", "rocket": "rocket",
          "motorcycle": "stereo_motorcycle"}  # the left view of the stereo pair
UNET_FAMILIES = ("sd15", "sd2", "sdxl")
PAN = 0.2  # video: the crop is (1 - PAN) of the photo's largest crop of the frame's shape; it pans by PAN


def check(content: str, photo: str) -> None:
    """ValueError naming the choices when ``content`` or ``photo`` is unknown."""
    if content not in CONTENTS:
        raise ValueError(f"content must be one of {', '.join(CONTENTS)}, got {content!r}")
    _check_photo(photo)


def _check_photo(photo: str) -> None:
    if photo not in PHOTOS:
        raise ValueError(f"photo must be one of {', '.join(PHOTOS)} (skimage.data), got {photo!r}")


@functools.lru_cache(maxsize=len(PHOTOS))
def photo_rgb(photo: str) -> torch.Tensor:
    """The photograph as ``[3, H, W]`` float64 in [-1, 1] (the preview's range)."""
    _check_photo(photo)
    try:
        data = importlib.import_module("skimage.data")
    except ImportError as e:  # pragma: no cover - depends on the environment
        raise ImportError("--content photo needs scikit-image's bundled photographs: "
                          "pip install scikit-image") from e
    image = getattr(data, PHOTOS[photo])()
    if isinstance(image, tuple):  # stereo_motorcycle: (left, right, disparity)
        image = image[0]
    return torch.from_numpy(image).permute(2, 0, 1).to(torch.float64) / 127.5 - 1.0


def _crop(rgb: torch.Tensor, height: int, width: int, zoom: float, t: float) -> torch.Tensor:
    """The crop of ``rgb`` [3, H, W] with the aspect of ``height`` x ``width``: the largest such crop scaled by
    ``zoom``, centred vertically, at ``t`` (0 = left edge, 1 = right edge) of the room left horizontally."""
    _, ph, pw = rgb.shape
    ch = min(ph, pw * height / width)
    cw = ch * width / height
    ch, cw = max(1, round(ch * zoom)), max(1, round(cw * zoom))
    top, left = (ph - ch) // 2, round(t * (pw - cw))
    return rgb[:, top:top + ch, left:left + cw]


def photo_frames(photo: str, frames: int, height: int, width: int) -> torch.Tensor:
    """RGB ``[3, frames, height, width]`` in [-1, 1] at latent resolution (each cell a VAE cell's pixel
    average, as antialiased resizing gives): one frame is the photo's largest centred crop of that shape;
    more frames pan left to right across the photo, each crop ``1 - PAN`` of it."""
    rgb = photo_rgb(photo)
    if frames == 1:
        crops = [_crop(rgb, height, width, 1.0, 0.5)]
    else:
        crops = [_crop(rgb, height, width, 1.0 - PAN, k / (frames - 1)) for k in range(frames)]
    out = [F.interpolate(c[None], size=(height, width), mode="bilinear", antialias=True, align_corners=False)[0]
           for c in crops]
    return torch.stack(out, dim=1).clamp(-1.0, 1.0)


def rgb_to_latent(rgb: torch.Tensor, family: str) -> torch.Tensor:
    """The least-squares latent ``[C, ...]`` whose preview is ``rgb`` [3, ...]: pinv(factors^T) (rgb - bias),
    the smallest latent that previews exactly as the photo (only the colour the preview sees)."""
    fmt = FORMATS[FAMILY_FORMAT[family]]
    factors = torch.tensor(fmt.factors, dtype=torch.float64)  # [C, 3]
    bias = torch.tensor(fmt.bias or (0.0, 0.0, 0.0), dtype=torch.float64)
    inverse = torch.linalg.pinv(factors.T)  # [C, 3]
    flat = rgb.to(torch.float64).reshape(3, -1) - bias[:, None]
    return (inverse @ flat).reshape(factors.shape[0], *rgb.shape[1:])


def latent_channels(family: str) -> int:
    """Channels of ``family``'s latent space (its preview map's rows)."""
    return len(FORMATS[FAMILY_FORMAT[family]].factors)


def photo_latent(family: str, frames: int, height: int, width: int, photo: str = "astronaut") -> torch.Tensor:
    """The clean latent x0 ``[C, frames, height, width]`` (float32) of ``photo`` for ``family``: the least-squares
    latent (``rgb_to_latent``) scaled to the standard deviation of the family's real latents (``LATENT_STD``), so the
    photo weighs as much against the noise in every family (its preview is the photo's colours, contrast scaled)."""
    latent = rgb_to_latent(photo_frames(photo, frames, height, width), family)
    return (latent * (LATENT_STD[FAMILY_FORMAT[family]] / latent.std())).float()


@functools.lru_cache(maxsize=None)
def _ddpm_alpha_bar(step: int) -> float:
    # SD1.5/SD2/SDXL's training schedule: "scaled_linear", beta 0.00085 -> 0.012 over 1000 steps
    betas = torch.linspace(0.00085 ** 0.5, 0.012 ** 0.5, 1000, dtype=torch.float64) ** 2
    return torch.cumprod(1.0 - betas, 0)[step].item()


def signal_and_noise(family: str) -> Tuple[float, float]:
    """(a, s) of the bench's step, ``x_t = a * x0 + s * noise``: the UNets' timestep 500 of their DDPM
    schedule (a = sqrt(alpha_bar), s = sqrt(1 - alpha_bar)); the DiTs' flow matching at sigma 0.5 (the bench's
    timestep 500 or 0.5): a = 1 - sigma, s = sigma."""
    if family in UNET_FAMILIES:
        alpha_bar = _ddpm_alpha_bar(500)
        return alpha_bar ** 0.5, (1.0 - alpha_bar) ** 0.5
    return 0.5, 0.5


def noised(x0: torch.Tensor, noise: torch.Tensor, family: str) -> torch.Tensor:
    """``a * x0 + s * noise`` at the bench's step (``x0`` broadcast over ``noise``'s batch)."""
    a, s = signal_and_noise(family)
    return a * x0.to(noise.dtype) + s * noise


def pack(family: str, x0: torch.Tensor) -> torch.Tensor:
    """``x0`` [C, F, H, W] in the layout ``family``'s model takes for one sample: Flux and Qwen-Image pack 2x2
    cells into a token ([(H/2)(W/2), C*4], channel = c*4 + 2*dy + dx, as their pipelines' _pack_latents), LTX-2
    one cell per token ([F*H*W, C]), Wan and Z-Image keep [C, F, H, W], the UNets and SD3 [C, H, W]."""
    c, f, h, w = x0.shape
    if family in ("flux", "qwen_image"):
        return x0[:, 0].reshape(c, h // 2, 2, w // 2, 2).permute(1, 3, 0, 2, 4).reshape((h // 2) * (w // 2), c * 4)
    if family == "ltx2":
        return x0.permute(1, 2, 3, 0).reshape(f * h * w, c)
    if family in ("wan", "z_image"):
        return x0
    return x0[:, 0]


def photo_like(noise: torch.Tensor, family: str, frames: int, height: int, width: int,
               photo: str = "astronaut") -> torch.Tensor:
    """The bench's noise latent ``noise`` (a batch, or one Z-Image sample) with ``photo`` as its clean part.

    frames, height, width: the latent's (``dit_models.latent_shape``; UNets: 1, px // 8). Raises where the
    model's latent channels are not the family's (the tiny LTX-2 is narrower than LTX-2's VAE)."""
    x0 = pack(family, photo_latent(family, frames, height, width, photo))
    shape = noise.shape[1:] if noise.dim() == x0.dim() + 1 else noise.shape
    if tuple(shape) != tuple(x0.shape):
        raise ValueError(f"--content photo: {family}'s latent is {tuple(shape)} here but its VAE's "
                         f"({latent_channels(family)} channels) gives {tuple(x0.shape)}; photo content needs the "
                         "family's real latent channels")
    return noised(x0, noise, family)
