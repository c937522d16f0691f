"""What each diffusers DiT family's reader finds in one model call: the token grid, the text length and the
tokens beside the grid that keep every key (``Tokens``), read from the call's arguments as the host passes them.
One reader per layout; ``families.TABLE`` names which family uses which. No diffusers import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Optional, Sequence, Tuple

import torch


@dataclass(frozen=True)
class Tokens:
    """What a family's reader finds in one model call: the grid, the text length, the tokens right after the
    grid that keep every key (references, padding) and those right before it (Wan Animate's reference frame)."""

    grid: Tuple[int, ...]
    text: int = 0
    after: int = 0
    before: int = 0


def arg(call: dict, index: int, name: str) -> object:
    """The call's argument ``name``, given by keyword or at position ``index``; None where absent."""
    args, kwargs = call["args"], call["kwargs"]
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def squeeze_frames(grid: Sequence[int]) -> Tuple[int, ...]:
    """(1, h, w) -> (h, w): one frame is an image (the same picks as an image model's)."""
    grid = tuple(int(n) for n in grid)
    return grid[1:] if len(grid) == 3 and grid[0] == 1 else grid


def raster(ids: torch.Tensor, h_col: int, w_col: int, zero_cols: Sequence[int]) -> Optional[Tuple[int, int]]:
    """(h, w) when ``ids`` [N, k] are rows/columns of an h x w raster in order with ``zero_cols`` all 0."""
    if ids.shape[0] == 0:
        return None
    h, w = int(ids[:, h_col].max()) + 1, int(ids[:, w_col].max()) + 1
    if h * w != ids.shape[0]:
        return None
    rows = torch.arange(h, dtype=ids.dtype).repeat_interleave(w)
    cols = torch.arange(w, dtype=ids.dtype).repeat(h)
    if not (torch.equal(ids[:, h_col], rows) and torch.equal(ids[:, w_col], cols)
            and all(bool((ids[:, c] == 0).all()) for c in zero_cols)):
        return None
    return h, w


def flux_ids(ids_index: int, image: Tuple[int, str] = (0, "hidden_states"),
             text_at: Tuple[int, str] = (1, "encoder_hidden_states"),
             references: bool = False) -> Callable[[torch.nn.Module, dict], Optional[Tokens]]:
    """Flux.1 / Chroma (``img_ids`` at ``ids_index``; the image tokens and the text at ``image`` and ``text_at``,
    position and name: diffusers' by default, ``img`` and ``txt`` in BFL's code as InvokeAI runs it): the grid from
    ``img_ids`` (first id 0, row, column per token), text first; None unless a plain raster. One small host copy per
    transformer call (not per block). Kontext's reference tokens (first id 1, after the grid, as InvokeAI's
    ``flux_denoise`` appends them) keep every key where ``references`` is set; otherwise such a call is left alone
    rather than mis-placed."""

    def read(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
        hidden, text = arg(call, *image), arg(call, *text_at)
        ids = arg(call, ids_index, "img_ids")
        if hidden is None or text is None or ids is None:
            return None
        ids = (ids[0] if ids.ndim == 3 else ids).detach().to("cpu", torch.float64)
        if ids.shape[0] != hidden.shape[1]:
            return None
        grid_len = int((ids[:, 0] == 0).sum()) if references else ids.shape[0]
        if grid_len < ids.shape[0] and not bool((ids[grid_len:, 0] != 0).all()):
            return None  # not a raster followed by references only
        grid = raster(ids[:grid_len], 1, 2, (0,))
        return None if grid is None else Tokens(grid, text=text.shape[1], after=ids.shape[0] - grid_len)

    return read


def flux2_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Flux.2: ids (t, h, w, l). The grid is the leading raster with t = l = 0; reference images follow it
    with t = 10, 20, ... (diffusers' Flux2Pipeline) and keep every key."""
    hidden, text, ids = arg(call, 0, "hidden_states"), arg(call, 1, "encoder_hidden_states"), \
        arg(call, 3, "img_ids")
    if hidden is None or text is None or ids is None or arg(call, 9, "kv_cache_mode") is not None:
        return None
    ids = (ids[0] if ids.ndim == 3 else ids).detach().to("cpu", torch.float64)
    if ids.shape[0] != hidden.shape[1] or ids.shape[1] != 4:
        return None
    grid_len = int((ids[:, 0] == 0).sum())
    if grid_len == 0 or not bool((ids[:grid_len, 0] == 0).all()) or not bool((ids[grid_len:, 0] != 0).all()):
        return None
    grid = raster(ids[:grid_len], 1, 2, (3,))
    return None if grid is None else Tokens(grid, text=text.shape[1], after=ids.shape[0] - grid_len)


def longcat_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """LongCat-Image: ids (modality, row, column), the image raster starting at the text's length on both axes.
    The grid is the leading run of the first modality (1) as a raster from that start; the edit model's
    reference image follows with modality 2 and keeps every key. Text first."""
    hidden, text, ids = arg(call, 0, "hidden_states"), arg(call, 1, "encoder_hidden_states"), \
        arg(call, 3, "img_ids")
    if hidden is None or text is None or ids is None:
        return None
    ids = (ids[0] if ids.ndim == 3 else ids).detach().to("cpu", torch.float64)
    if ids.shape[0] != hidden.shape[1] or ids.shape[0] == 0:
        return None
    same = ids[:, 0] == ids[0, 0]
    grid_len = int(same.long().cumprod(0).sum())
    if bool(same[grid_len:].any()):
        return None
    grid = raster(ids[:grid_len] - torch.tensor([ids[0, 0], ids[0, 1], ids[0, 2]], dtype=ids.dtype), 1, 2, (0,))
    return None if grid is None else Tokens(grid, text=text.shape[1], after=ids.shape[0] - grid_len)


def krea2_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Krea 2: one sequence [text, image]; ``position_ids`` [text + image, 3]: text rows at the origin, image rows
    (0, row, column) of a plain raster (else left unreduced)."""
    hidden, text, ids = arg(call, 0, "hidden_states"), arg(call, 1, "encoder_hidden_states"), \
        arg(call, 3, "position_ids")
    if hidden is None or text is None or ids is None or ids.ndim != 2 \
            or ids.shape[0] != text.shape[1] + hidden.shape[1]:
        return None
    grid = raster(ids[text.shape[1]:].detach().to("cpu", torch.float64), 1, 2, (0,))
    return None if grid is None else Tokens(grid, text=text.shape[1])


IDEOGRAM4_IMAGE = 2  # diffusers' transformer_ideogram4.OUTPUT_IMAGE_INDICATOR


def ideogram4_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Ideogram 4: packed rows [left padding, text, image] tagged by ``indicator``; the grid is the image block
    (one place in every row, contiguous, a raster in ``position_ids``); everything before it keeps every key."""
    hidden, ids, indicator = arg(call, 0, "hidden_states"), arg(call, 3, "position_ids"), arg(call, 5, "indicator")
    if hidden is None or ids is None or indicator is None or indicator.ndim != 2 or ids.ndim != 3:
        return None
    image = indicator == IDEOGRAM4_IMAGE
    where = image[0].nonzero().flatten().tolist()
    if not where or not bool((image == image[0]).all()) or where[-1] - where[0] + 1 != len(where):
        return None
    start, count = where[0], len(where)
    pos = ids[0, start:start + count].detach().to("cpu", torch.float64)
    grid = raster(pos - pos[0], 1, 2, (0,))
    return None if grid is None else Tokens(grid, text=start, after=hidden.shape[1] - start - count)


def qwen_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Qwen-Image: ``img_shapes`` [(frames, h, w), *references] per sample; [text, image, references]:
    the first shape is the grid, the edit models' reference images after it keep every key."""
    hidden, text, shapes = arg(call, 0, "hidden_states"), arg(call, 1, "encoder_hidden_states"), \
        arg(call, 4, "img_shapes")
    if hidden is None or text is None or not shapes:
        return None
    per_sample = [[tuple(int(n) for n in s) for s in sample] for sample in
                  (shapes if isinstance(shapes[0], (list, tuple)) and isinstance(shapes[0][0], (list, tuple))
                   else [shapes])]
    if any(sample != per_sample[0] for sample in per_sample) or any(len(s) != 3 for s in per_sample[0]):
        return None
    sizes = [math.prod(s) for s in per_sample[0]]
    if sum(sizes) != hidden.shape[1]:
        return None
    return Tokens(squeeze_frames(per_sample[0][0]), text=text.shape[1], after=sum(sizes[1:]))


def sd3_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Latent [B, C, H, W] -> grid (H/p, W/p); SD3's joint attention puts its text last."""
    return _patched_image_with_text(model, arg(call, 0, "hidden_states"), arg(call, 1, "encoder_hidden_states"))


def _patched_image_with_text(model: torch.nn.Module, hidden: Optional[torch.Tensor],
                             text: Optional[torch.Tensor]) -> Optional[Tokens]:
    """An image latent [B, C, H, W] patched by ``config.patch_size`` into a (H/p, W/p) grid, beside text."""
    if hidden is None or text is None or hidden.ndim != 4:
        return None
    p = model.config.patch_size
    return Tokens((hidden.shape[-2] // p, hidden.shape[-1] // p), text=text.shape[1])


def pixart_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """PixArt-α/Σ: latent [B, C, H, W] -> grid (H/p, W/p); its self-attention sees the grid alone."""
    hidden = arg(call, 0, "hidden_states")
    if hidden is None or hidden.ndim != 4:
        return None
    p = model.config.patch_size
    return Tokens((hidden.shape[-2] // p, hidden.shape[-1] // p))


def ernie_image_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """ERNIE-Image: latent [B, C, H, W] -> grid (H/p, W/p); [image, text] with the text padded to the batch's
    longest (padding masked; the mask's key axis is shortened with the keys)."""
    return _patched_image_with_text(model, arg(call, 0, "hidden_states"), arg(call, 2, "text_bth"))


def joyimage_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """JoyImage Edit: latent [B, C, F, H, W], or [B, items, C, F, H, W] with the target (the last item, which the
    model moves first) followed by the reference items as more frames: the target's frames are the grid, the
    references after it keep every key; [image, text]."""
    hidden, text = arg(call, 0, "hidden_states"), arg(call, 2, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim not in (5, 6):
        return None
    pt, ph, pw = model.patch_size
    items = hidden.shape[1] if hidden.ndim == 6 else 1
    if items > 1 and pt != 1:
        return None
    frames, h, w = hidden.shape[-3:]
    grid = (frames // pt, h // ph, w // pw)
    return Tokens(squeeze_frames(grid), text=text.shape[1], after=(items - 1) * math.prod(grid))


def hunyuan_video_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Latent [B, C, F, H, W] -> grid (F/pt, H/p, W/p); text last (its padded tokens are masked; the mask's
    key axis is shortened with the keys)."""
    hidden, text = arg(call, 0, "hidden_states"), arg(call, 2, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim != 5:
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t
    return Tokens((hidden.shape[2] // pt, hidden.shape[3] // p, hidden.shape[4] // p), text=text.shape[1])


def hunyuan_video15_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """HunyuanVideo 1.5: latent [B, C, F, H, W] -> grid (F/pt, H/p, W/p); [video, text] with the text made of the
    image-embedding tokens, the byT5 tokens and the MLLM tokens (all of them, the padding masked), kept whole."""
    hidden = arg(call, 0, "hidden_states")
    texts = [arg(call, 2, "encoder_hidden_states"), arg(call, 5, "encoder_hidden_states_2"),
             arg(call, 7, "image_embeds")]
    if hidden is None or hidden.ndim != 5 or any(t is None or t.ndim != 3 for t in texts):
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t
    grid = (hidden.shape[2] // pt, hidden.shape[3] // p, hidden.shape[4] // p)
    return Tokens(squeeze_frames(grid), text=sum(t.shape[1] for t in texts))


def hunyuan_image_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """HunyuanImage 2.1: latent [B, C, H, W] (or [B, C, F, H, W]) -> its grid over the patch; [image, text] with
    the text made of the MLLM tokens and, where the model has a byT5 projection and gets them, the byT5 tokens."""
    hidden, text, text_2 = arg(call, 0, "hidden_states"), arg(call, 2, "encoder_hidden_states"), \
        arg(call, 5, "encoder_hidden_states_2")
    patch = tuple(model.config.patch_size)
    if hidden is None or text is None or hidden.ndim - 2 != len(patch):
        return None
    grid = tuple(n // p for n, p in zip(hidden.shape[2:], patch))
    second = text_2.shape[1] if text_2 is not None and getattr(model, "context_embedder_2", None) is not None else 0
    return Tokens(squeeze_frames(grid), text=text.shape[1] + second)


def hidream_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """HiDream I1: latent [B, C, H, W] -> grid (H/p, W/p); a non-square latent is padded with masked image
    tokens up to max_seq (kept whole after the grid). [image, text]: the text is T5 + the last Llama layer +
    the block's own Llama layer, one length in every block."""
    hidden, t5, llama = arg(call, 0, "hidden_states"), arg(call, 2, "encoder_hidden_states_t5"), \
        arg(call, 3, "encoder_hidden_states_llama3")
    if hidden is None or hidden.ndim != 4 or t5 is None or llama is None or len(llama) == 0:
        return None
    p = model.config.patch_size
    grid = (hidden.shape[-2] // p, hidden.shape[-1] // p)
    padding = model.max_seq - math.prod(grid) if hidden.shape[-2] != hidden.shape[-1] else 0
    return Tokens(grid, text=t5.shape[1] + 2 * llama[0].shape[-2], after=padding)


def kandinsky5_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Kandinsky 5 (image and video): channels-last latent [B, F, H, W, C] -> grid (F/pt, H/ph, W/pw), flattened
    in raster order; its visual self-attention sees the grid alone. With sparse_params (NABLA attention, a
    block-local "fractal" token order) the call is left unreduced."""
    hidden = arg(call, 0, "hidden_states")
    if hidden is None or hidden.ndim != 5 or arg(call, 7, "sparse_params") is not None:
        return None
    pt, ph, pw = model.config.patch_size
    return Tokens(squeeze_frames((hidden.shape[1] // pt, hidden.shape[2] // ph, hidden.shape[3] // pw)))


def cogvideox_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """CogVideoX: latent [B, F, C, H, W] -> grid (F/pt, H/p, W/p) (1.0: no temporal patch); [text, video]."""
    hidden, text = arg(call, 0, "hidden_states"), arg(call, 1, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim != 5:
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t or 1
    return Tokens(squeeze_frames((hidden.shape[1] // pt, hidden.shape[3] // p, hidden.shape[4] // p)),
                  text=text.shape[1])


def mochi_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Mochi: latent [B, C, F, H, W] -> grid (F, H/p, W/p); each sample attends [video, its valid text tokens]
    (one attention call per sample), so the layout holds only where every sample has one valid text length."""
    hidden, mask = arg(call, 0, "hidden_states"), arg(call, 3, "encoder_attention_mask")
    if hidden is None or mask is None or hidden.ndim != 5:
        return None
    lengths = mask.sum(dim=1).tolist()
    if len(set(lengths)) != 1:
        return None
    p = model.config.patch_size
    return Tokens(squeeze_frames((hidden.shape[2], hidden.shape[3] // p, hidden.shape[4] // p)), text=int(lengths[0]))


def wan_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Latent [B, C, F, H, W] -> grid (F/pt, H/ph, W/pw); attn1 sees video tokens only."""
    hidden = arg(call, 0, "hidden_states")
    if hidden is None or hidden.ndim != 5:
        return None
    pt, ph, pw = model.config.patch_size
    return Tokens((hidden.shape[2] // pt, hidden.shape[3] // ph, hidden.shape[4] // pw))


def wan_animate_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Wan Animate: latent [B, C, 1 + T, H, W]; its first latent frame is the reference (character) image
    (the pose latents are added to the frames after it): that frame keeps every key, the T frames are the grid."""
    tokens = wan_tokens(model, call)
    if tokens is None or tokens.grid[0] < 2 or model.config.patch_size[0] != 1:
        return None
    frames, h, w = tokens.grid
    return Tokens((frames - 1, h, w), before=h * w)


def lumina2_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Lumina 2: [caption, image] per sample, the caption cut to its mask's length; the grid starts at the same
    place in every sample only where all captions have one length (else left unreduced)."""
    hidden, mask = arg(call, 0, "hidden_states"), arg(call, 3, "encoder_attention_mask")
    if hidden is None or mask is None or hidden.ndim != 4:
        return None
    lengths = mask.sum(dim=1).tolist()  # diffusers' own rope embedder reads the same on the host
    if len(set(lengths)) != 1:
        return None
    p = model.config.patch_size
    return Tokens((hidden.shape[-2] // p, hidden.shape[-1] // p), text=int(lengths[0]))


def z_image_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Z-Image (basic mode): per sample [image, image padding, caption, caption padding], each part padded
    to 32 tokens, the samples padded to the longest. Images [C, F, H, W] of one size; the padding and the
    caption after the grid keep every key. Omni mode (nested lists, SigLIP tokens) is left unreduced."""
    images, captions = arg(call, 0, "x"), arg(call, 2, "cap_feats")
    if not isinstance(images, (list, tuple)) or not isinstance(captions, (list, tuple)) or not images \
            or not all(isinstance(x, torch.Tensor) and x.ndim == 4 for x in images) \
            or any(x.shape != images[0].shape for x in images):
        return None
    p, pf = int(arg(call, 7, "patch_size") or 2), int(arg(call, 8, "f_patch_size") or 1)
    _, frames, h, w = images[0].shape
    grid = (frames // pf, h // p, w // p)
    tokens = math.prod(grid)
    multiple = 32  # diffusers' SEQ_MULTI_OF
    padded = tokens + (-tokens) % multiple
    caption = max(len(c) + (-len(c)) % multiple for c in captions)
    return Tokens(squeeze_frames(grid), text=caption, after=padded - tokens)


def ltx_grid(frames_index: int) -> Callable[[torch.nn.Module, dict], Optional[Tokens]]:
    """LTX-Video / LTX-2 (``num_frames, height, width`` from ``frames_index`` on): packed video tokens of that
    latent grid; the hooked self-attention sees them alone. A sequence longer than the grid (conditioning
    tokens appended) is left unreduced."""

    def read(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
        hidden = arg(call, 0, "hidden_states")
        sizes = [arg(call, frames_index + i, name) for i, name in enumerate(("num_frames", "height", "width"))]
        if hidden is None or hidden.ndim != 3 or any(s is None for s in sizes):
            return None
        grid = tuple(int(s) for s in sizes)
        return Tokens(squeeze_frames(grid)) if math.prod(grid) == hidden.shape[1] else None

    return read
