"""The diffusers DiTs mode "kv" reaches, as data: the ``DiffusersDiT`` binding type of a catalogue entry.

Each entry says which diffusers classes it is (matched by module *and* class name, so two classes
with one name are never confused), where the text sits in the joint attention, which tokens after
the grid keep every key (reference images, padding), the block lists in run order with the
attentions to hook and whether the default block range reduces them, how the token grid follows
from the call's inputs, and how the timestep maps to sampling progress. The entries are written in the catalogue
(``families.py``) and found by ``diffusers_lookup``; this module knows nothing of the list. No diffusers import.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional, Tuple

import torch

from ..engine.blocks import default_start
from ..engine.schedule import TimestepScale
from ..engine.grid import TokenLayout
from ..engine.token_merge import TokenMerge
from .token_readers import Tokens

TEXT_PLACES = ("first", "last", "separate", "none")
TRANSFORMERS = "diffusers.models.transformers."


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


def rope_over_text_and_image(rope: Any, merge: TokenMerge, text: int) -> Any:
    """Flux.1's ``image_rotary_emb``: (cos, sin), each [text + image tokens, D]."""
    return tuple(merge.take(table, 0, offset=text, before=text) for table in rope)


def rope_image_then_text(rope: Any, merge: TokenMerge, text: int) -> Any:
    """Qwen-Image's ``image_rotary_emb``: (image frequencies [image tokens, D/2], text frequencies)."""
    return (merge.take(rope[0], 0), rope[1])


def rope_over_video(rope: Any, merge: TokenMerge, text: int) -> Any:
    """Wan's ``rotary_emb``: (cos, sin), each [1, video tokens, 1, D]."""
    return tuple(merge.take(table, 1) for table in rope)


def rope_over_video_heads(rope: Any, merge: TokenMerge, text: int) -> Any:
    """LTX-2's video tables: (cos, sin), each [B, video tokens, D] ("interleaved") or [B, heads, video tokens, D/2]
    ("split")."""
    return tuple(merge.take(table, 1 if table.ndim == 3 else 2) for table in rope)


@dataclass(frozen=True)
class MergeInputs:
    """How mode "merge" carries fewer image tokens through a family's blocks in diffusers.

    Every block of the block range takes the image stream ([before, grid, after]; the text apart) as its ``hidden``
    input and returns that stream (``output`` None) or a tuple whose ``output``-th item it is; ``rope`` cuts the
    block's rotary table (``image_rotary_emb``, Wan's ``rotary_emb``) to the merged stream (given the text length);
    ``per_token`` names inputs holding one value per stream token on axis 1 where they have one (Qwen-Image Edit's
    ``modulate_index``, Wan 2.2 ti2v's per-token ``temb``, Z-Image's per-sample ``freqs_cis`` and ``attn_mask``),
    cut alike. ``joint``: block lists whose hidden input is the joint sequence instead, the text where the family's
    ``text`` puts it (Flux.2's single blocks: [text, image]; Z-Image's layers: [image, caption]), returning
    ``joint_output`` (None: the tensor itself). ``rope_keys``: the inputs ``rope`` cuts (LTX-2: its video self- and
    cross-attention tables). ``whole_with``: inputs that, when given, leave the block whole with a warning (LTX-2's
    token-by-token attention masks, which have no merged counterpart). ``lists``: the block lists merged (empty: every
    one of the range; Wan VACE's vace_blocks, which take the control video apart, run whole).
    """

    rope: Optional[Callable[[Any, TokenMerge, int], Any]]
    per_token: Tuple[str, ...] = ()
    output: Optional[int] = 1
    joint: Tuple[str, ...] = ()
    joint_output: Optional[int] = None
    hidden: str = "hidden_states"
    rope_keys: Tuple[str, ...] = ("image_rotary_emb", "rotary_emb")
    whole_with: Tuple[str, ...] = ()
    lists: Tuple[str, ...] = ()


@dataclass(frozen=True)
class DiffusersDiT:
    """How diffusers runs one DiT class family (a binding of a catalogue entry).

    classes: "module.Class" names of the host's model classes.
    text: where the text sits in the joint attention ("first", "last"; "separate": a cross-attention,
        never reduced, the hooked self-attention sees the grid only).
    blocks: block lists in the order they run (the block range's depth order).
    read: the call's grid, text and kept tokens, or None where they cannot be placed (left unreduced).
    key_inputs: where the self-attention takes its keys' inputs apart (``KeyInputs``), else None.
    merge: how mode "merge" reaches its blocks (``MergeInputs``); None: the family takes mode "kv" only.
    latents: the forward's first argument's name: the latents, a tensor [B, ...] or a list of one per sample
        (Z-Image's ``x``); the batch and the call memo read it.
    context_parallel: diffusers' context parallelism (``_cp_plan``) splits the class's text and image tokens into
        contiguous chunks, joint attention ``[text_r, image_r]`` per process (or the image alone), as
        ``engine.slices`` reads them: mode kv reduces it under Ulysses attention, mode merge under Ulysses and Ring
        (each process merges its own band; its blocks hooked as ``_cp_plan`` splits their inputs).
    """

    name: str
    classes: Tuple[str, ...]
    text: str
    blocks: Tuple[BlockList, ...]
    read: Callable[[torch.nn.Module, dict], Optional[Tokens]]
    timestep: Timestep
    key_inputs: Optional[KeyInputs] = None
    merge: Optional[MergeInputs] = None
    latents: str = "hidden_states"
    context_parallel: bool = False

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

    def batch(self, args: tuple, kwargs: dict) -> int:
        """The call's batch, from its latents (``latents``: a tensor's first axis, or one list entry per sample)."""
        latents = args[0] if args else kwargs[self.latents]
        return len(latents) if isinstance(latents, (list, tuple)) else int(latents.shape[0])

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


DOUBLE_SINGLE = (BlockList("transformer_blocks", (("attn", "joint"),)),
                  BlockList("single_transformer_blocks", (("attn", "joint"),)))
# Flux.1: nearly all of kv's error comes from the double blocks (python -m tome_bench.dit_blocks;
# docs/TRANSFORMERS.md "Which blocks"): the default range is its single blocks, the lowest error per unit of speed-up.
FLUX_BLOCKS = (BlockList("transformer_blocks", (("attn", "joint"),), default=False),
                BlockList("single_transformer_blocks", (("attn", "joint"),)))

def class_path(obj: object) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"
