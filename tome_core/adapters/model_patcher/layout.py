"""Where a ComfyUI DiT call's tokens sit, derived from the call itself: its latent, text and keywords, read through
the family's ``comfy_families`` entry (no comfy import).

The APPLY_MODEL wrapper calls these once per model call, with the binding the patch resolved once (``entry``; found
by the model's class where a caller gives none). Tokens whose place the entry cannot give make the call's layout None:
such a call is left whole, never reduced on a guess.
"""
from __future__ import annotations

import math
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...catalogue.comfy_dits import ComfyDiT, attr_path, base_model, grid_last
from ...catalogue.comfy_lookup import family_of
from ...engine.grid import TokenLayout


def token_grid(diffusion_model: Any, latent: torch.Tensor, padded: bool = True,
               entry: Optional[ComfyDiT] = None) -> Optional[Tuple[int, ...]]:
    """Token grid of a latent [B, C, (T,) H, W] after the model's patch embedding: the host pads it to the patch
    (``padded``), else the patch conv drops what does not fill one. A 4-d latent of a video model (a reference
    image) is patched on its last two axes."""
    entry = entry or family_of(diffusion_model)
    model = base_model(diffusion_model)
    if entry is None:
        patch = None
    elif isinstance(entry.patch, tuple):
        patch = [attr_path(model, path) for path in entry.patch]
        patch = None if any(p is None for p in patch) else patch
    else:
        patch = entry.patch if isinstance(entry.patch, int) else attr_path(model, entry.patch)
    if patch is None:
        return None
    if entry.image_frames and latent.ndim == 5:
        if latent.shape[2] != 1:
            return None
        latent = latent[:, :, 0]
    patch = tuple(int(p) for p in patch) if isinstance(patch, (tuple, list)) else (int(patch),) * (latent.ndim - 2)
    patch = patch[len(patch) - (latent.ndim - 2):] if len(patch) > latent.ndim - 2 > 0 else patch
    if len(patch) != latent.ndim - 2:
        return None
    size = math.ceil if padded else math.floor
    return tuple(size(n / p) for n, p in zip(latent.shape[2:], patch))


def _appended(diffusion_model: Any, entry: ComfyDiT, extra: Dict[str, Any],
              frames: bool = False) -> Optional[Tuple[int, int]]:
    """(before, after): the tokens the call's appended latents add before and after the grid, or with ``frames``
    the frames the ``in_time`` ones add to the grid the host reports; None where one of them cannot be patched as
    the table says."""
    model, counts = base_model(diffusion_model), {"before": 0, "after": 0}
    for item in entry.appended:
        latents = extra.get(item.keyword)
        if item.requires and getattr(model, item.requires, None) is None or frames and not item.in_time:
            continue
        for latent in latents if isinstance(latents, (list, tuple)) else (latents,):
            if not isinstance(latent, torch.Tensor):
                continue
            grid = token_grid(diffusion_model, latent, padded=item.padded, entry=entry)
            if grid is None or frames and len(grid) != 3:
                return None
            counts[item.place] += grid[0] if frames else math.prod(grid)
    return counts["before"], counts["after"]


def _leading_frames(diffusion_model: Any, entry: ComfyDiT, extra: Dict[str, Any]) -> Optional[int]:
    """Leading latent frames of the call's own latent that keep every key: the table's reference frames plus those
    the call's ``replaced_frames`` latent writes over; None where that latent cannot be patched."""
    latent = extra.get(entry.replaced_frames) if entry.replaced_frames else None
    if not isinstance(latent, torch.Tensor):
        return entry.reference_frames
    grid = token_grid(diffusion_model, latent, entry=entry)
    return None if grid is None or len(grid) != 3 else entry.reference_frames + grid[0]


def kept_frames(diffusion_model: Any, extra: Optional[Dict[str, Any]] = None,
                entry: Optional[ComfyDiT] = None) -> Optional[Tuple[int, int]]:
    """(lead, trail): the frames at the start and at the end of the grid the host reports (``grid_sizes``: the
    latent the model patched) that keep every key. Lead: reference or replaced frames of the call's latent and
    frames the model concatenates in time before it (SCAIL's references); trail: frames concatenated after it
    (Wan's time_dim_concat). None where one of them cannot be patched."""
    entry, extra = entry or family_of(diffusion_model), extra or {}
    lead = None if entry is None else _leading_frames(diffusion_model, entry, extra)
    appended = None if lead is None else _appended(diffusion_model, entry, extra, frames=True)
    return None if appended is None else (lead + appended[0], appended[1])


def _padding(count: int, multiple: Optional[int]) -> int:
    return (-count) % multiple if multiple else 0


def _unplaceable(entry: Any, extra: Dict[str, Any]) -> List[str]:
    """The call's keywords that add tokens the family's entry cannot place (``unknown_with``)."""
    return [key for key in (entry.unknown_with if entry is not None else ()) if extra.get(key) is not None]


def refuse_unplaceable(diffusion_model: Any, extra: Dict[str, Any], entry: Optional[ComfyDiT] = None) -> None:
    """A call carrying tokens the catalogue cannot place (``unknown_with``, e.g. Z-Image Omni's reference latents and
    SigLIP features) stops the prompt, naming them: left whole, the image would come without ToMe while the node says
    otherwise."""
    keys = _unplaceable(entry or family_of(diffusion_model), extra)
    if keys:
        cls = type(base_model(diffusion_model))
        raise ValueError(f"ToMe: this {cls.__qualname__} call carries {' and '.join(keys)}, whose tokens ToMe cannot "
                         "place yet: remove the ToMe node for this model, or sample without those inputs.")


def token_layout(diffusion_model: Any, x: torch.Tensor, context: Optional[torch.Tensor],
                 extra: Optional[Dict[str, Any]] = None, entry: Optional[ComfyDiT] = None,
                 last: Optional[bool] = None) -> Optional[TokenLayout]:
    """Token layout of one model call from the latent x, the text, the patch size and the call's keywords.

    Tokens after the grid that the model adds itself (HunyuanVideo's text, Flux Kontext's and Qwen-Image-Edit's
    reference images) are not part of the layout: the override keeps them whole, whatever their number.
    HunyuanVideo puts reference-latent tokens (``ref_latent``) before its grid: they become the prefix.
    last: whether this host runs the sequence grid last (``grid_last``, read once per patch; None: read now).
    """
    entry, extra = entry or family_of(diffusion_model), extra or {}
    if _unplaceable(entry, extra):
        return None
    if entry is not None and entry.streams:
        shapes = extra.get(entry.streams)
        if shapes:  # x is the packed streams [B, 1, N]: the grid comes from the first stream's shape
            x = torch.empty(tuple(shapes[0]), device="meta")
    grid = None if entry is None else token_grid(diffusion_model, x, entry=entry)
    if grid is None:
        return None
    model = base_model(diffusion_model)
    if entry.text == "separate":
        return _separate_layout(diffusion_model, entry, grid, extra)
    if entry.text_tokens:
        inputs = dict(extra, c_crossattn=context)
        if any(not isinstance(inputs.get(key), torch.Tensor) or inputs[key].ndim <= axis
               for key, axis, _ in entry.text_tokens):
            return None
        text = sum(inputs[key].shape[axis] * times for key, axis, times in entry.text_tokens)
        return TokenLayout(grid, suffix=text) if entry.text == "last" else TokenLayout(grid, prefix=text)
    if entry.text == "last":
        reference = extra.get("ref_latent")
        if not isinstance(reference, torch.Tensor) or (grid_last(entry) if last is None else last):
            return TokenLayout(grid)  # grid last: the rest is before it
        ref_grid = token_grid(diffusion_model, reference, entry=entry)
        return None if ref_grid is None else TokenLayout(grid, prefix=math.prod(ref_grid))
    if context is None:
        return TokenLayout(grid) if entry.text_optional else None
    appended = _appended(diffusion_model, entry, extra)
    if appended is None:
        return None
    multiple = int(getattr(model, entry.pad_multiple, 0) or 0) if entry.pad_multiple else 0
    text = context.shape[1] + _padding(context.shape[1], multiple)
    prefix = text + int(getattr(model, "register_length", 0) or 0) + appended[0]
    return TokenLayout(grid, prefix=prefix, suffix=_padding(math.prod(grid), multiple) + appended[1])


def _separate_layout(diffusion_model: Any, entry: ComfyDiT, grid: Tuple[int, ...],
                     extra: Dict[str, Any]) -> Optional[TokenLayout]:
    """Layout of a self-attention over image/video tokens alone (text "separate"): the grid less its leading kept
    frames, the appended latents' tokens before and after it, or LTXV's guide frames after the video."""
    guide = extra.get(entry.conditioning) if entry.conditioning else None
    if isinstance(guide, torch.Tensor):
        frame = math.prod(grid[1:])  # guide frames follow the video's frames in the latent: whole frames
        kept = int(guide.shape[2])
        if len(grid) != 3 or kept % frame or kept // frame >= grid[0]:
            return None
        return TokenLayout((grid[0] - kept // frame,) + grid[1:], suffix=kept)
    appended = _appended(diffusion_model, entry, extra)
    frames = _leading_frames(diffusion_model, entry, extra)
    if appended is None or frames is None or frames and (len(grid) != 3 or grid[0] <= frames):
        return None
    before = appended[0] + frames * math.prod(grid[1:])
    return TokenLayout((grid[0] - frames,) + grid[1:] if frames else grid, prefix=before, suffix=appended[1])


def ambiguous_lengths(diffusion_model: Any, context: Optional[torch.Tensor],
                      extra: Optional[Dict[str, Any]] = None, entry: Optional[ComfyDiT] = None) -> Tuple[int, ...]:
    """Key lengths of the call's other attentions whose queries could be the grid's: a cross-attention's text
    (text "separate") or other keys (``cross_keys``: Wan i2v's CLIP image tokens), and the other packed streams
    (``streams``). A self-attention of one of these lengths cannot be told from them, so it is left whole."""
    entry, extra = entry or family_of(diffusion_model), extra or {}
    if entry is None:
        return ()
    lengths = []
    if entry.text == "separate" and isinstance(context, torch.Tensor):
        lengths.append(int(context.shape[1]))
    for key in entry.cross_keys:
        tokens = extra.get(key)
        if isinstance(tokens, torch.Tensor) and tokens.ndim >= 2:
            lengths.append(int(tokens.shape[-2]))
    shapes = extra.get(entry.streams) if entry.streams else None
    prefix = extra.get(entry.stream_prefix) if entry.stream_prefix else None
    prefix = prefix.get("tokens") if isinstance(prefix, dict) else None
    for shape in list(shapes or ())[1:]:
        if len(shape) >= 3:
            lengths.append(int(shape[2]))
            if isinstance(prefix, torch.Tensor) and prefix.ndim >= 2:
                lengths.append(int(shape[2]) + int(prefix.shape[1]))
    return tuple(lengths)
