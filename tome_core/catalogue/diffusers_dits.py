"""The diffusers DiTs mode "kv" reaches, as data: one ``Family`` entry per model family.

Each entry says which diffusers classes it is (matched by module *and* class name, so two classes
with one name are never confused), where the text sits in the joint attention, which tokens after
the grid keep every key (reference images, padding), the block lists in run order with the
attentions to hook and whether the default block range reduces them, how the token grid follows
from the call's inputs, and how the timestep maps to sampling progress. ``diffusers_dit`` only
routes through this table; adding a family is one entry (plus its tests). No diffusers import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Dict, List, Optional, Tuple

import torch

from ..engine.blocks import default_start
from ..engine.schedule import TimestepScale
from . import token_readers as readers
from ..engine.grid import TokenLayout
from .token_readers import Tokens

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
class Timestep:
    """Where the timestep argument is, and its value at the first step (``scale``); ``rising``: it grows
    from 0 to ``scale`` over sampling (Lumina 2 / Z-Image) instead of falling to 0."""

    index: int
    name: str
    scale: float
    rising: bool = False

    def progress(self, value: float) -> float:
        return TimestepScale(self.scale, self.rising).progress(value)


@dataclass(frozen=True)
class KeyInputs:
    """Keyword inputs through which a hooked self-attention takes its keys apart from its queries (LTX-2's
    ``LTX2Attention``: ``encoder_hidden_states`` and ``key_rotary_emb``). Handing it only the kept tokens there
    gives it the same keys, while its key/value projections, key norm and key RoPE run on those tokens alone.

    source: the keys' hidden states; rope / query_rope: the keys' and the queries' rotary embeddings (cos, sin),
    the kept tokens' taken from the queries'; allowed: the keywords such a call may carry (any other, e.g. a
    perturbed-attention mask, leaves the call to the reduction at the attention itself).
    """

    source: str
    rope: str
    query_rope: str
    allowed: Tuple[str, ...]


@dataclass(frozen=True)
class Family:
    """One DiT family in diffusers.

    classes: "module.Class" names of the host's model classes.
    text: where the text sits in the joint attention ("first", "last"; "separate": a cross-attention,
        never reduced, the hooked self-attention sees the grid only).
    blocks: block lists in the order they run (the block range's depth order).
    read: the call's grid, text and kept tokens, or None where they cannot be placed (left unreduced).
    key_inputs: where the self-attention takes its keys' inputs apart (``KeyInputs``), else None.
    """

    name: str
    classes: Tuple[str, ...]
    text: str
    blocks: Tuple[BlockList, ...]
    read: Callable[[torch.nn.Module, dict], Optional[Tokens]]
    timestep: Timestep
    key_inputs: Optional[KeyInputs] = None

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
        """block_start when none is given (``blocks.default_start`` over this model's block lists)."""
        return default_start([len(getattr(model, blocks.attr, None) or ()) for blocks in self.blocks],
                             [blocks.default for blocks in self.blocks])

    def layout(self, model: torch.nn.Module, call: dict) -> Optional[TokenLayout]:
        tokens = self.read(model, call)
        if tokens is None or len(tokens.grid) not in (2, 3) or min(tokens.grid) < 1:
            return None
        if self.text == "first":
            return TokenLayout(tokens.grid, prefix=tokens.text + tokens.before, suffix=tokens.after)
        if self.text == "last":
            return TokenLayout(tokens.grid, prefix=tokens.before, suffix=tokens.after + tokens.text)
        return TokenLayout(tokens.grid, prefix=tokens.before, suffix=tokens.after)


_DOUBLE_SINGLE = (BlockList("transformer_blocks", (("attn", "joint"),)),
                  BlockList("single_transformer_blocks", (("attn", "joint"),)))
# Flux.1: nearly all of kv's error comes from the double blocks (python -m tome_bench.dit_blocks;
# README "Which blocks"): the default range is its single blocks, the lowest error per unit of speed-up.
_FLUX_BLOCKS = (BlockList("transformer_blocks", (("attn", "joint"),), default=False),
                BlockList("single_transformer_blocks", (("attn", "joint"),)))

TABLE: Tuple[Family, ...] = (
    Family("flux", (_TRANSFORMERS + "transformer_flux.FluxTransformer2DModel",), "first", _FLUX_BLOCKS,
           readers.flux_ids(4), Timestep(3, "timestep", 1.0)),
    Family("chroma", (_TRANSFORMERS + "transformer_chroma.ChromaTransformer2DModel",), "first", _DOUBLE_SINGLE,
           readers.flux_ids(3), Timestep(2, "timestep", 1.0)),
    Family("flux2", (_TRANSFORMERS + "transformer_flux2.Flux2Transformer2DModel",), "first", _DOUBLE_SINGLE,
           readers.flux2_tokens, Timestep(2, "timestep", 1.0)),
    # LongCat-Image (and its edit model): Flux-like double/single blocks, [text, image, reference]; its
    # transformer multiplies the timestep by 1000 itself.
    Family("longcat_image", (_TRANSFORMERS + "transformer_longcat_image.LongCatImageTransformer2DModel",), "first",
           _DOUBLE_SINGLE, readers.longcat_tokens, Timestep(2, "timestep", 1.0)),
    Family("ernie_image", (_TRANSFORMERS + "transformer_ernie_image.ErnieImageTransformer2DModel",), "last",
           (BlockList("layers", (("self_attention", "joint"),)),), readers.ernie_image_tokens,
           Timestep(1, "timestep", 1000.0)),
    # Ideogram 4: its model time rises 0 (noise) -> 1 (clean).
    Family("ideogram4", (_TRANSFORMERS + "transformer_ideogram4.Ideogram4Transformer2DModel",), "first",
           (BlockList("layers", (("attention", "joint"),)),), readers.ideogram4_tokens,
           Timestep(1, "timestep", 1.0, rising=True)),
    Family("joyimage", (_TRANSFORMERS + "transformer_joyimage.JoyImageEditTransformer3DModel",), "last",
           (BlockList("double_blocks", (("attn", "joint"),)),), readers.joyimage_tokens,
           Timestep(1, "timestep", 1000.0)),
    # Krea 2: single-stream [text, image] blocks after a text-fusion stack that sees the text alone (not hooked).
    Family("krea2", (_TRANSFORMERS + "transformer_krea2.Krea2Transformer2DModel",), "first",
           (BlockList("transformer_blocks", (("attn", "joint"),)),), readers.krea2_tokens,
           Timestep(2, "timestep", 1.0)),
    Family("qwen_image", (_TRANSFORMERS + "transformer_qwenimage.QwenImageTransformer2DModel",), "first",
           (BlockList("transformer_blocks", (("attn", "joint"),)),), readers.qwen_tokens, Timestep(3, "timestep", 1.0)),
    Family("sd3", (_TRANSFORMERS + "transformer_sd3.SD3Transformer2DModel",), "last",
           (BlockList("transformer_blocks", (("attn", "joint"), ("attn2", "image"))),),  # attn2: SD3.5, image only
           readers.sd3_tokens, Timestep(3, "timestep", 1000.0)),
    Family("wan", (_TRANSFORMERS + "transformer_wan.WanTransformer3DModel",), "separate",
           (BlockList("blocks", (("attn1", "image"),)),), readers.wan_tokens, Timestep(1, "timestep", 1000.0)),
    # VACE runs all its vace_blocks (the control video over the same grid) before the main blocks.
    Family("wan_vace", (_TRANSFORMERS + "transformer_wan_vace.WanVACETransformer3DModel",), "separate",
           (BlockList("vace_blocks", (("attn1", "image"),)), BlockList("blocks", (("attn1", "image"),))),
           readers.wan_tokens, Timestep(1, "timestep", 1000.0)),
    Family("wan_animate", (_TRANSFORMERS + "transformer_wan_animate.WanAnimateTransformer3DModel",), "separate",
           (BlockList("blocks", (("attn1", "joint"),)),), readers.wan_animate_tokens,  # joint: [reference frame, grid]
           Timestep(1, "timestep", 1000.0)),
    Family("hunyuan_video", (_TRANSFORMERS + "transformer_hunyuan_video.HunyuanVideoTransformer3DModel",), "last",
           _DOUBLE_SINGLE, readers.hunyuan_video_tokens, Timestep(1, "timestep", 1000.0)),
    Family("hunyuan_video15", (_TRANSFORMERS + "transformer_hunyuan_video15.HunyuanVideo15Transformer3DModel",),
           "last", (BlockList("transformer_blocks", (("attn", "joint"),)),), readers.hunyuan_video15_tokens,
           Timestep(1, "timestep", 1000.0)),
    Family("hunyuan_image", (_TRANSFORMERS + "transformer_hunyuanimage.HunyuanImageTransformer2DModel",), "last",
           _DOUBLE_SINGLE, readers.hunyuan_image_tokens, Timestep(1, "timestep", 1000.0)),
    # HiDream I1 (Full/Dev/Fast): each block is wrapped (HiDreamBlock.block); [image, text] in both lists.
    Family("hidream", (_TRANSFORMERS + "transformer_hidream_image.HiDreamImageTransformer2DModel",), "last",
           (BlockList("double_stream_blocks", (("block.attn1", "joint"),)),
            BlockList("single_stream_blocks", (("block.attn1", "joint"),))), readers.hidream_tokens,
           Timestep(1, "timesteps", 1000.0)),
    # Kandinsky 5: its text blocks see the text alone (never hooked); the visual blocks' self-attention the grid.
    Family("kandinsky5", (_TRANSFORMERS + "transformer_kandinsky.Kandinsky5Transformer3DModel",), "separate",
           (BlockList("visual_transformer_blocks", (("self_attention", "image"),)),), readers.kandinsky5_tokens,
           Timestep(2, "timestep", 1000.0)),
    Family("cogvideox", (_TRANSFORMERS + "cogvideox_transformer_3d.CogVideoXTransformer3DModel",), "first",
           (BlockList("transformer_blocks", (("attn1", "joint"),)),), readers.cogvideox_tokens,
           Timestep(2, "timestep", 1000.0)),
    # Mochi's pipeline passes reversed timesteps (rising 0 -> 1000 over sampling).
    Family("mochi", (_TRANSFORMERS + "transformer_mochi.MochiTransformer3DModel",), "last",
           (BlockList("transformer_blocks", (("attn1", "joint"),)),), readers.mochi_tokens,
           Timestep(2, "timestep", 1000.0, rising=True)),
    # Lumina 2 and Z-Image: the refiners see the caption or the image alone; the main layers the joint sequence.
    Family("lumina2", (_TRANSFORMERS + "transformer_lumina2.Lumina2Transformer2DModel",), "first",
           (BlockList("layers", (("attn", "joint"),)),), readers.lumina2_tokens,
           Timestep(1, "timestep", 1.0, rising=True)),
    Family("z_image", (_TRANSFORMERS + "transformer_z_image.ZImageTransformer2DModel",), "last",
           (BlockList("layers", (("attention", "joint"),)),), readers.z_image_tokens,
           Timestep(1, "t", 1.0, rising=True)),
    Family("ltx_video", (_TRANSFORMERS + "transformer_ltx.LTXVideoTransformer3DModel",), "separate",
           (BlockList("transformer_blocks", (("attn1", "image"),)),), readers.ltx_grid(4),
           Timestep(2, "timestep", 1000.0)),
    # LTX-2: the video self-attention only; the audio self-attention and the audio-video cross-attentions
    # keep every key (not hooked). Its attention takes the keys' source and RoPE apart from the queries': the
    # kept tokens are projected alone.
    Family("ltx2", (_TRANSFORMERS + "transformer_ltx2.LTX2VideoTransformer3DModel",), "separate",
           (BlockList("transformer_blocks", (("attn1", "image"),)),), readers.ltx_grid(10),
           Timestep(4, "timestep", 1000.0),
           KeyInputs("encoder_hidden_states", "key_rotary_emb", "query_rotary_emb",
                     ("hidden_states", "encoder_hidden_states", "query_rotary_emb", "key_rotary_emb",
                      "attention_mask"))),
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
