"""The diffusers DiTs mode "kv" reaches, as data: one ``Family`` entry per model family.

Each entry says which diffusers classes it is (matched by module *and* class name, so two classes
with one name are never confused), where the text sits in the joint attention, which tokens after
the grid keep every key (reference images, padding), the block lists in run order with the
attentions to hook and whether the default block range reduces them, how the token grid follows
from the call's inputs, and how the timestep maps to sampling progress. ``diffusers_dit`` only
routes through this table; adding a family is one entry (plus its tests). No diffusers import.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from .grid import TokenLayout

TEXT_PLACES = ("first", "last", "separate", "none")
_TRANSFORMERS = "diffusers.models.transformers."


@dataclass(frozen=True)
class BlockList:
    """One ``nn.ModuleList`` of blocks: its attribute, the attentions of each block to hook with their
    kind ("joint": the call's whole layout, with its text where the text shares the sequence and its kept
    reference tokens; "image": a self-attention over the grid alone), and whether the default block range
    (no block_start given) reduces it."""

    attr: str
    attentions: Tuple[Tuple[str, str], ...]
    default: bool = True


@dataclass(frozen=True)
class Tokens:
    """What a family's reader finds in one model call: the grid, the text length, the tokens right after the
    grid that keep every key (references, padding) and those right before it (Wan Animate's reference frame)."""

    grid: Tuple[int, ...]
    text: int = 0
    after: int = 0
    before: int = 0


@dataclass(frozen=True)
class Timestep:
    """Where the timestep argument is, and its value at the first step (``scale``); ``rising``: it grows
    from 0 to ``scale`` over sampling (Lumina 2 / Z-Image) instead of falling to 0."""

    index: int
    name: str
    scale: float
    rising: bool = False

    def progress(self, value: float) -> float:
        share = value / self.scale
        return min(max(share if self.rising else 1.0 - share, 0.0), 1.0)


@dataclass(frozen=True)
class Family:
    """One DiT family in diffusers.

    classes: "module.Class" names of the host's model classes.
    text: where the text sits in the joint attention ("first", "last"; "separate": a cross-attention,
        never reduced, the hooked self-attention sees the grid only).
    blocks: block lists in the order they run (the block range's depth order).
    read: the call's grid, text and kept tokens, or None where they cannot be placed (left unreduced).
    """

    name: str
    classes: Tuple[str, ...]
    text: str
    blocks: Tuple[BlockList, ...]
    read: Callable[[torch.nn.Module, dict], Optional[Tokens]]
    timestep: Timestep

    def __post_init__(self) -> None:
        if self.text not in TEXT_PLACES:
            raise ValueError(f"ToMe: family {self.name}: text must be one of {TEXT_PLACES}, got {self.text!r}.")

    def attentions(self, model: torch.nn.Module) -> List[Tuple[str, torch.nn.Module, str]]:
        """(name, attention module, kind) of every attention to hook, in run order."""
        found = []
        for blocks in self.blocks:
            for i, block in enumerate(getattr(model, blocks.attr, None) or ()):
                for attr, kind in blocks.attentions:
                    module = block
                    for part in attr.split("."):  # "block.attn1": HiDream wraps each block
                        module = getattr(module, part, None)
                    if module is not None:  # SD3.5's attn2 exists only in its dual-attention blocks
                        found.append((f"{blocks.attr}.{i}.{attr}", module, kind))
        return found

    def default_start(self, model: torch.nn.Module) -> float:
        """block_start when none is given: the share of the depth before the first default-reduced list."""
        counts = [len(getattr(model, blocks.attr, None) or ()) for blocks in self.blocks]
        total, before = sum(counts), 0
        for blocks, count in zip(self.blocks, counts):
            if blocks.default and count:
                return before / total if 0 < before < total else 0.0
            before += count
        return 0.0

    def layout(self, model: torch.nn.Module, call: dict) -> Optional[TokenLayout]:
        tokens = self.read(model, call)
        if tokens is None or len(tokens.grid) not in (2, 3) or min(tokens.grid) < 1:
            return None
        if self.text == "first":
            return TokenLayout(tokens.grid, prefix=tokens.text + tokens.before, suffix=tokens.after)
        if self.text == "last":
            return TokenLayout(tokens.grid, prefix=tokens.before, suffix=tokens.after + tokens.text)
        return TokenLayout(tokens.grid, prefix=tokens.before, suffix=tokens.after)


def _arg(call: dict, index: int, name: str):
    args, kwargs = call["args"], call["kwargs"]
    return kwargs[name] if name in kwargs else (args[index] if len(args) > index else None)


def _squeeze_frames(grid: Sequence[int]) -> Tuple[int, ...]:
    """(1, h, w) -> (h, w): one frame is an image (the same picks as an image model's)."""
    grid = tuple(int(n) for n in grid)
    return grid[1:] if len(grid) == 3 and grid[0] == 1 else grid


def _raster(ids: torch.Tensor, h_col: int, w_col: int, zero_cols: Sequence[int]) -> Optional[Tuple[int, int]]:
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


def _flux_ids(ids_index: int) -> Callable[[torch.nn.Module, dict], Optional[Tokens]]:
    """Flux.1 / Chroma (``img_ids`` at ``ids_index``): the grid from ``img_ids`` (first id 0, row, column per
    token), text first; None unless a plain raster. One small host copy per transformer call (not per
    block). Kontext's reference tokens (first id 1) are not told from the grid here: such a call is left
    alone rather than mis-placed."""

    def read(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
        hidden, text = _arg(call, 0, "hidden_states"), _arg(call, 1, "encoder_hidden_states")
        ids = _arg(call, ids_index, "img_ids")
        if hidden is None or text is None or ids is None:
            return None
        ids = (ids[0] if ids.ndim == 3 else ids).detach().to("cpu", torch.float64)
        if ids.shape[0] != hidden.shape[1]:
            return None
        grid = _raster(ids, 1, 2, (0,))
        return None if grid is None else Tokens(grid, text=text.shape[1])

    return read


def _flux2_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Flux.2: ids (t, h, w, l). The grid is the leading raster with t = l = 0; reference images follow it
    with t = 10, 20, ... (diffusers' Flux2Pipeline) and keep every key."""
    hidden, text, ids = _arg(call, 0, "hidden_states"), _arg(call, 1, "encoder_hidden_states"), \
        _arg(call, 3, "img_ids")
    if hidden is None or text is None or ids is None or _arg(call, 9, "kv_cache_mode") is not None:
        return None
    ids = (ids[0] if ids.ndim == 3 else ids).detach().to("cpu", torch.float64)
    if ids.shape[0] != hidden.shape[1] or ids.shape[1] != 4:
        return None
    grid_len = int((ids[:, 0] == 0).sum())
    if grid_len == 0 or not bool((ids[:grid_len, 0] == 0).all()) or not bool((ids[grid_len:, 0] != 0).all()):
        return None
    grid = _raster(ids[:grid_len], 1, 2, (3,))
    return None if grid is None else Tokens(grid, text=text.shape[1], after=ids.shape[0] - grid_len)


def _longcat_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """LongCat-Image: ids (modality, row, column), the image raster starting at the text's length on both axes.
    The grid is the leading run of the first modality (1) as a raster from that start; the edit model's
    reference image follows with modality 2 and keeps every key. Text first."""
    hidden, text, ids = _arg(call, 0, "hidden_states"), _arg(call, 1, "encoder_hidden_states"), \
        _arg(call, 3, "img_ids")
    if hidden is None or text is None or ids is None:
        return None
    ids = (ids[0] if ids.ndim == 3 else ids).detach().to("cpu", torch.float64)
    if ids.shape[0] != hidden.shape[1] or ids.shape[0] == 0:
        return None
    same = ids[:, 0] == ids[0, 0]
    grid_len = int(same.long().cumprod(0).sum())
    if bool(same[grid_len:].any()):
        return None
    grid = _raster(ids[:grid_len] - torch.tensor([ids[0, 0], ids[0, 1], ids[0, 2]], dtype=ids.dtype), 1, 2, (0,))
    return None if grid is None else Tokens(grid, text=text.shape[1], after=ids.shape[0] - grid_len)


def _krea2_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Krea 2: one sequence [text, image]; ``position_ids`` [text + image, 3]: text rows at the origin, image rows
    (0, row, column) of a plain raster (else left unreduced)."""
    hidden, text, ids = _arg(call, 0, "hidden_states"), _arg(call, 1, "encoder_hidden_states"), \
        _arg(call, 3, "position_ids")
    if hidden is None or text is None or ids is None or ids.ndim != 2 or ids.shape[0] != text.shape[1] + hidden.shape[1]:
        return None
    grid = _raster(ids[text.shape[1]:].detach().to("cpu", torch.float64), 1, 2, (0,))
    return None if grid is None else Tokens(grid, text=text.shape[1])


_IDEOGRAM4_IMAGE = 2  # diffusers' transformer_ideogram4.OUTPUT_IMAGE_INDICATOR


def _ideogram4_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Ideogram 4: packed rows [left padding, text, image] tagged by ``indicator``; the grid is the image block
    (one place in every row, contiguous, a raster in ``position_ids``); everything before it keeps every key."""
    hidden, ids, indicator = _arg(call, 0, "hidden_states"), _arg(call, 3, "position_ids"), _arg(call, 5, "indicator")
    if hidden is None or ids is None or indicator is None or indicator.ndim != 2 or ids.ndim != 3:
        return None
    image = indicator == _IDEOGRAM4_IMAGE
    where = image[0].nonzero().flatten().tolist()
    if not where or not bool((image == image[0]).all()) or where[-1] - where[0] + 1 != len(where):
        return None
    start, count = where[0], len(where)
    pos = ids[0, start:start + count].detach().to("cpu", torch.float64)
    grid = _raster(pos - pos[0], 1, 2, (0,))
    return None if grid is None else Tokens(grid, text=start, after=hidden.shape[1] - start - count)


def _qwen_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Qwen-Image: ``img_shapes`` [(frames, h, w), *references] per sample; [text, image, references]:
    the first shape is the grid, the edit models' reference images after it keep every key."""
    hidden, text, shapes = _arg(call, 0, "hidden_states"), _arg(call, 1, "encoder_hidden_states"), \
        _arg(call, 4, "img_shapes")
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
    return Tokens(_squeeze_frames(per_sample[0][0]), text=text.shape[1], after=sum(sizes[1:]))


def _sd3_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Latent [B, C, H, W] -> grid (H/p, W/p); SD3's joint attention puts its text last."""
    hidden, text = _arg(call, 0, "hidden_states"), _arg(call, 1, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim != 4:
        return None
    p = model.config.patch_size
    return Tokens((hidden.shape[-2] // p, hidden.shape[-1] // p), text=text.shape[1])


def _ernie_image_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """ERNIE-Image: latent [B, C, H, W] -> grid (H/p, W/p); [image, text] with the text padded to the batch's
    longest (padding masked; the mask's key axis is shortened with the keys)."""
    hidden, text = _arg(call, 0, "hidden_states"), _arg(call, 2, "text_bth")
    if hidden is None or text is None or hidden.ndim != 4:
        return None
    p = model.config.patch_size
    return Tokens((hidden.shape[-2] // p, hidden.shape[-1] // p), text=text.shape[1])


def _joyimage_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """JoyImage Edit: latent [B, C, F, H, W], or [B, items, C, F, H, W] with the target (the last item, which the
    model moves first) followed by the reference items as more frames: the target's frames are the grid, the
    references after it keep every key; [image, text]."""
    hidden, text = _arg(call, 0, "hidden_states"), _arg(call, 2, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim not in (5, 6):
        return None
    pt, ph, pw = model.patch_size
    items = hidden.shape[1] if hidden.ndim == 6 else 1
    if items > 1 and pt != 1:
        return None
    frames, h, w = hidden.shape[-3:]
    grid = (frames // pt, h // ph, w // pw)
    return Tokens(_squeeze_frames(grid), text=text.shape[1], after=(items - 1) * math.prod(grid))


def _hunyuan_video_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Latent [B, C, F, H, W] -> grid (F/pt, H/p, W/p); text last (its padded tokens are masked; the mask's
    key axis is shortened with the keys)."""
    hidden, text = _arg(call, 0, "hidden_states"), _arg(call, 2, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim != 5:
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t
    return Tokens((hidden.shape[2] // pt, hidden.shape[3] // p, hidden.shape[4] // p), text=text.shape[1])


def _hunyuan_video15_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """HunyuanVideo 1.5: latent [B, C, F, H, W] -> grid (F/pt, H/p, W/p); [video, text] with the text made of the
    image-embedding tokens, the byT5 tokens and the MLLM tokens (all of them, the padding masked), kept whole."""
    hidden = _arg(call, 0, "hidden_states")
    texts = [_arg(call, 2, "encoder_hidden_states"), _arg(call, 5, "encoder_hidden_states_2"),
             _arg(call, 7, "image_embeds")]
    if hidden is None or hidden.ndim != 5 or any(t is None or t.ndim != 3 for t in texts):
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t
    grid = (hidden.shape[2] // pt, hidden.shape[3] // p, hidden.shape[4] // p)
    return Tokens(_squeeze_frames(grid), text=sum(t.shape[1] for t in texts))


def _hunyuan_image_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """HunyuanImage 2.1: latent [B, C, H, W] (or [B, C, F, H, W]) -> its grid over the patch; [image, text] with
    the text made of the MLLM tokens and, where the model has a byT5 projection and gets them, the byT5 tokens."""
    hidden, text, text_2 = _arg(call, 0, "hidden_states"), _arg(call, 2, "encoder_hidden_states"), \
        _arg(call, 5, "encoder_hidden_states_2")
    patch = tuple(model.config.patch_size)
    if hidden is None or text is None or hidden.ndim - 2 != len(patch):
        return None
    grid = tuple(n // p for n, p in zip(hidden.shape[2:], patch))
    second = text_2.shape[1] if text_2 is not None and getattr(model, "context_embedder_2", None) is not None else 0
    return Tokens(_squeeze_frames(grid), text=text.shape[1] + second)


def _hidream_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """HiDream I1: latent [B, C, H, W] -> grid (H/p, W/p); a non-square latent is padded with masked image
    tokens up to max_seq (kept whole after the grid). [image, text]: the text is T5 + the last Llama layer +
    the block's own Llama layer, one length in every block."""
    hidden, t5, llama = _arg(call, 0, "hidden_states"), _arg(call, 2, "encoder_hidden_states_t5"), \
        _arg(call, 3, "encoder_hidden_states_llama3")
    if hidden is None or hidden.ndim != 4 or t5 is None or llama is None or len(llama) == 0:
        return None
    p = model.config.patch_size
    grid = (hidden.shape[-2] // p, hidden.shape[-1] // p)
    padding = model.max_seq - math.prod(grid) if hidden.shape[-2] != hidden.shape[-1] else 0
    return Tokens(grid, text=t5.shape[1] + 2 * llama[0].shape[-2], after=padding)


def _kandinsky5_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Kandinsky 5 (image and video): channels-last latent [B, F, H, W, C] -> grid (F/pt, H/ph, W/pw), flattened
    in raster order; its visual self-attention sees the grid alone. With sparse_params (NABLA attention, a
    block-local "fractal" token order) the call is left unreduced."""
    hidden = _arg(call, 0, "hidden_states")
    if hidden is None or hidden.ndim != 5 or _arg(call, 7, "sparse_params") is not None:
        return None
    pt, ph, pw = model.config.patch_size
    return Tokens(_squeeze_frames((hidden.shape[1] // pt, hidden.shape[2] // ph, hidden.shape[3] // pw)))


def _cogvideox_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """CogVideoX: latent [B, F, C, H, W] -> grid (F/pt, H/p, W/p) (1.0: no temporal patch); [text, video]."""
    hidden, text = _arg(call, 0, "hidden_states"), _arg(call, 1, "encoder_hidden_states")
    if hidden is None or text is None or hidden.ndim != 5:
        return None
    p, pt = model.config.patch_size, model.config.patch_size_t or 1
    return Tokens(_squeeze_frames((hidden.shape[1] // pt, hidden.shape[3] // p, hidden.shape[4] // p)),
                  text=text.shape[1])


def _mochi_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Mochi: latent [B, C, F, H, W] -> grid (F, H/p, W/p); each sample attends [video, its valid text tokens]
    (one attention call per sample), so the layout holds only where every sample has one valid text length."""
    hidden, mask = _arg(call, 0, "hidden_states"), _arg(call, 3, "encoder_attention_mask")
    if hidden is None or mask is None or hidden.ndim != 5:
        return None
    lengths = mask.sum(dim=1).tolist()
    if len(set(lengths)) != 1:
        return None
    p = model.config.patch_size
    return Tokens(_squeeze_frames((hidden.shape[2], hidden.shape[3] // p, hidden.shape[4] // p)), text=int(lengths[0]))


def _wan_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Latent [B, C, F, H, W] -> grid (F/pt, H/ph, W/pw); attn1 sees video tokens only."""
    hidden = _arg(call, 0, "hidden_states")
    if hidden is None or hidden.ndim != 5:
        return None
    pt, ph, pw = model.config.patch_size
    return Tokens((hidden.shape[2] // pt, hidden.shape[3] // ph, hidden.shape[4] // pw))


def _wan_animate_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Wan Animate: latent [B, C, 1 + T, H, W]; its first latent frame is the reference (character) image
    (the pose latents are added to the frames after it): that frame keeps every key, the T frames are the grid."""
    tokens = _wan_tokens(model, call)
    if tokens is None or tokens.grid[0] < 2 or model.config.patch_size[0] != 1:
        return None
    frames, h, w = tokens.grid
    return Tokens((frames - 1, h, w), before=h * w)


def _lumina2_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Lumina 2: [caption, image] per sample, the caption cut to its mask's length; the grid starts at the same
    place in every sample only where all captions have one length (else left unreduced)."""
    hidden, mask = _arg(call, 0, "hidden_states"), _arg(call, 3, "encoder_attention_mask")
    if hidden is None or mask is None or hidden.ndim != 4:
        return None
    lengths = mask.sum(dim=1).tolist()  # diffusers' own rope embedder reads the same on the host
    if len(set(lengths)) != 1:
        return None
    p = model.config.patch_size
    return Tokens((hidden.shape[-2] // p, hidden.shape[-1] // p), text=int(lengths[0]))


def _z_image_tokens(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
    """Z-Image (basic mode): per sample [image, image padding, caption, caption padding], each part padded
    to 32 tokens, the samples padded to the longest. Images [C, F, H, W] of one size; the padding and the
    caption after the grid keep every key. Omni mode (nested lists, SigLIP tokens) is left unreduced."""
    images, captions = _arg(call, 0, "x"), _arg(call, 2, "cap_feats")
    if not isinstance(images, (list, tuple)) or not isinstance(captions, (list, tuple)) or not images \
            or not all(isinstance(x, torch.Tensor) and x.ndim == 4 for x in images) \
            or any(x.shape != images[0].shape for x in images):
        return None
    p, pf = int(_arg(call, 7, "patch_size") or 2), int(_arg(call, 8, "f_patch_size") or 1)
    _, frames, h, w = images[0].shape
    grid = (frames // pf, h // p, w // p)
    tokens = math.prod(grid)
    multiple = 32  # diffusers' SEQ_MULTI_OF
    padded = tokens + (-tokens) % multiple
    caption = max(len(c) + (-len(c)) % multiple for c in captions)
    return Tokens(_squeeze_frames(grid), text=caption, after=padded - tokens)


def _ltx_grid(frames_index: int) -> Callable[[torch.nn.Module, dict], Optional[Tokens]]:
    """LTX-Video / LTX-2 (``num_frames, height, width`` from ``frames_index`` on): packed video tokens of that
    latent grid; the hooked self-attention sees them alone. A sequence longer than the grid (conditioning
    tokens appended) is left unreduced."""

    def read(model: torch.nn.Module, call: dict) -> Optional[Tokens]:
        hidden = _arg(call, 0, "hidden_states")
        sizes = [_arg(call, frames_index + i, name) for i, name in enumerate(("num_frames", "height", "width"))]
        if hidden is None or hidden.ndim != 3 or any(s is None for s in sizes):
            return None
        grid = tuple(int(s) for s in sizes)
        return Tokens(_squeeze_frames(grid)) if math.prod(grid) == hidden.shape[1] else None

    return read


_DOUBLE_SINGLE = (BlockList("transformer_blocks", (("attn", "joint"),)),
                  BlockList("single_transformer_blocks", (("attn", "joint"),)))
# Flux.1: nearly all of kv's error comes from the double blocks (python -m tome_core.bench.dit_blocks;
# README "Which blocks"): the default range is its single blocks, the lowest error per unit of speed-up.
_FLUX_BLOCKS = (BlockList("transformer_blocks", (("attn", "joint"),), default=False),
                BlockList("single_transformer_blocks", (("attn", "joint"),)))

TABLE: Tuple[Family, ...] = (
    Family("flux", (_TRANSFORMERS + "transformer_flux.FluxTransformer2DModel",), "first", _FLUX_BLOCKS,
           _flux_ids(4), Timestep(3, "timestep", 1.0)),
    Family("chroma", (_TRANSFORMERS + "transformer_chroma.ChromaTransformer2DModel",), "first", _DOUBLE_SINGLE,
           _flux_ids(3), Timestep(2, "timestep", 1.0)),
    Family("flux2", (_TRANSFORMERS + "transformer_flux2.Flux2Transformer2DModel",), "first", _DOUBLE_SINGLE,
           _flux2_tokens, Timestep(2, "timestep", 1.0)),
    # LongCat-Image (and its edit model): Flux-like double/single blocks, [text, image, reference]; its
    # transformer multiplies the timestep by 1000 itself.
    Family("longcat_image", (_TRANSFORMERS + "transformer_longcat_image.LongCatImageTransformer2DModel",), "first",
           _DOUBLE_SINGLE, _longcat_tokens, Timestep(2, "timestep", 1.0)),
    Family("ernie_image", (_TRANSFORMERS + "transformer_ernie_image.ErnieImageTransformer2DModel",), "last",
           (BlockList("layers", (("self_attention", "joint"),)),), _ernie_image_tokens, Timestep(1, "timestep", 1000.0)),
    # Ideogram 4: its model time rises 0 (noise) -> 1 (clean).
    Family("ideogram4", (_TRANSFORMERS + "transformer_ideogram4.Ideogram4Transformer2DModel",), "first",
           (BlockList("layers", (("attention", "joint"),)),), _ideogram4_tokens,
           Timestep(1, "timestep", 1.0, rising=True)),
    Family("joyimage", (_TRANSFORMERS + "transformer_joyimage.JoyImageEditTransformer3DModel",), "last",
           (BlockList("double_blocks", (("attn", "joint"),)),), _joyimage_tokens, Timestep(1, "timestep", 1000.0)),
    # Krea 2: single-stream [text, image] blocks after a text-fusion stack that sees the text alone (not hooked).
    Family("krea2", (_TRANSFORMERS + "transformer_krea2.Krea2Transformer2DModel",), "first",
           (BlockList("transformer_blocks", (("attn", "joint"),)),), _krea2_tokens, Timestep(2, "timestep", 1.0)),
    Family("qwen_image", (_TRANSFORMERS + "transformer_qwenimage.QwenImageTransformer2DModel",), "first",
           (BlockList("transformer_blocks", (("attn", "joint"),)),), _qwen_tokens, Timestep(3, "timestep", 1.0)),
    Family("sd3", (_TRANSFORMERS + "transformer_sd3.SD3Transformer2DModel",), "last",
           (BlockList("transformer_blocks", (("attn", "joint"), ("attn2", "image"))),),  # attn2: SD3.5, image only
           _sd3_tokens, Timestep(3, "timestep", 1000.0)),
    Family("wan", (_TRANSFORMERS + "transformer_wan.WanTransformer3DModel",), "separate",
           (BlockList("blocks", (("attn1", "image"),)),), _wan_tokens, Timestep(1, "timestep", 1000.0)),
    # VACE runs all its vace_blocks (the control video over the same grid) before the main blocks.
    Family("wan_vace", (_TRANSFORMERS + "transformer_wan_vace.WanVACETransformer3DModel",), "separate",
           (BlockList("vace_blocks", (("attn1", "image"),)), BlockList("blocks", (("attn1", "image"),))),
           _wan_tokens, Timestep(1, "timestep", 1000.0)),
    Family("wan_animate", (_TRANSFORMERS + "transformer_wan_animate.WanAnimateTransformer3DModel",), "separate",
           (BlockList("blocks", (("attn1", "joint"),)),), _wan_animate_tokens,  # joint: [reference frame, grid]
           Timestep(1, "timestep", 1000.0)),
    Family("hunyuan_video", (_TRANSFORMERS + "transformer_hunyuan_video.HunyuanVideoTransformer3DModel",), "last",
           _DOUBLE_SINGLE, _hunyuan_video_tokens, Timestep(1, "timestep", 1000.0)),
    Family("hunyuan_video15", (_TRANSFORMERS + "transformer_hunyuan_video15.HunyuanVideo15Transformer3DModel",),
           "last", (BlockList("transformer_blocks", (("attn", "joint"),)),), _hunyuan_video15_tokens,
           Timestep(1, "timestep", 1000.0)),
    Family("hunyuan_image", (_TRANSFORMERS + "transformer_hunyuanimage.HunyuanImageTransformer2DModel",), "last",
           _DOUBLE_SINGLE, _hunyuan_image_tokens, Timestep(1, "timestep", 1000.0)),
    # HiDream I1 (Full/Dev/Fast): each block is wrapped (HiDreamBlock.block); [image, text] in both lists.
    Family("hidream", (_TRANSFORMERS + "transformer_hidream_image.HiDreamImageTransformer2DModel",), "last",
           (BlockList("double_stream_blocks", (("block.attn1", "joint"),)),
            BlockList("single_stream_blocks", (("block.attn1", "joint"),))), _hidream_tokens,
           Timestep(1, "timesteps", 1000.0)),
    # Kandinsky 5: its text blocks see the text alone (never hooked); the visual blocks' self-attention the grid.
    Family("kandinsky5", (_TRANSFORMERS + "transformer_kandinsky.Kandinsky5Transformer3DModel",), "separate",
           (BlockList("visual_transformer_blocks", (("self_attention", "image"),)),), _kandinsky5_tokens,
           Timestep(2, "timestep", 1000.0)),
    Family("cogvideox", (_TRANSFORMERS + "cogvideox_transformer_3d.CogVideoXTransformer3DModel",), "first",
           (BlockList("transformer_blocks", (("attn1", "joint"),)),), _cogvideox_tokens, Timestep(2, "timestep", 1000.0)),
    # Mochi's pipeline passes reversed timesteps (rising 0 -> 1000 over sampling).
    Family("mochi", (_TRANSFORMERS + "transformer_mochi.MochiTransformer3DModel",), "last",
           (BlockList("transformer_blocks", (("attn1", "joint"),)),), _mochi_tokens,
           Timestep(2, "timestep", 1000.0, rising=True)),
    # Lumina 2 and Z-Image: the refiners see the caption or the image alone; the main layers the joint sequence.
    Family("lumina2", (_TRANSFORMERS + "transformer_lumina2.Lumina2Transformer2DModel",), "first",
           (BlockList("layers", (("attn", "joint"),)),), _lumina2_tokens, Timestep(1, "timestep", 1.0, rising=True)),
    Family("z_image", (_TRANSFORMERS + "transformer_z_image.ZImageTransformer2DModel",), "last",
           (BlockList("layers", (("attention", "joint"),)),), _z_image_tokens, Timestep(1, "t", 1.0, rising=True)),
    Family("ltx_video", (_TRANSFORMERS + "transformer_ltx.LTXVideoTransformer3DModel",), "separate",
           (BlockList("transformer_blocks", (("attn1", "image"),)),), _ltx_grid(4), Timestep(2, "timestep", 1000.0)),
    # LTX-2: the video self-attention only; the audio self-attention and the audio-video cross-attentions
    # keep every key (not hooked).
    Family("ltx2", (_TRANSFORMERS + "transformer_ltx2.LTX2VideoTransformer3DModel",), "separate",
           (BlockList("transformer_blocks", (("attn1", "image"),)),), _ltx_grid(10), Timestep(4, "timestep", 1000.0)),
)

FAMILIES: Dict[str, Family] = {family.name: family for family in TABLE}
_BY_CLASS: Dict[str, Family] = {cls: family for family in TABLE for cls in family.classes}


def class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def family_of(model: object) -> Optional[Family]:
    """The table entry of ``model``'s class (module and class name), else None."""
    return _BY_CLASS.get(class_path(model))


def supported_classes() -> List[str]:
    return [cls.rsplit(".", 1)[1] for family in TABLE for cls in family.classes]


def find_dit(model: object) -> Optional[torch.nn.Module]:
    """The supported DiT in ``model`` (itself or a pipeline's ``.transformer``), else None."""
    for candidate in (model, getattr(model, "transformer", None)):
        if isinstance(candidate, torch.nn.Module) and family_of(candidate) is not None:
            return candidate
    return None


def unsupported_dit(model: object) -> Optional[str]:
    """Class name of a transformer-only model that mode "kv" cannot reach (e.g. PixArt, AuraFlow), else None."""
    for candidate in (model, getattr(model, "transformer", None)):
        name = type(candidate).__name__
        if isinstance(candidate, torch.nn.Module) and family_of(candidate) is None and (
                "Transformer" in name and not name.startswith("UNet")
                or hasattr(candidate, "transformer_blocks") and not hasattr(candidate, "down_blocks")):
            return name
    return None
