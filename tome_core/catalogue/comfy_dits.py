"""How ComfyUI runs a DiT family: the ``ComfyDiT`` binding of a catalogue entry, and finding one (no comfy import).

Classes are matched by module and class name (``comfy.ldm.aura.mmdit.MMDiT``, AuraFlow, is not SD3's
``comfy.ldm.modules.diffusionmodules.mmdit.MMDiT``). A binding says where the text sits in the joint
attention, its block lists in run order with the block type the model reports for them, which the
default range reduces, where the patch size is, and which tokens besides text keep every key. The
bindings are written in the catalogue's entries (``families.py``) and found by ``comfy_lookup``; this module
knows nothing of the list. The ComfyUI adapter's layout and reports read a call through them. ComfyUI schedules by sigma (its model_sampling maps percent to
sigma), so no timestep scale is needed here.
"""
from __future__ import annotations

import importlib
import inspect
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple, Union

from ..engine.blocks import default_start as block_default_start


@dataclass(frozen=True)
class ComfyBlocks:
    """A block list: its attribute, the ``transformer_options["block_type"]`` the model sets around its
    blocks (where it reports them), and whether the default block range reduces it."""

    attr: str
    reported: str
    default: bool = True


@dataclass(frozen=True)
class Appended:
    """Latent tokens a model adds beside its grid from one keyword of the call (a reference image, frames
    concatenated in time, or a list of reference latents: OmniGen2's); they keep every key.

    place: "before" or "after" the grid in the self-attention's sequence.
    padded: the host pads that latent to the patch size (ceil); otherwise its patch conv drops the rest (floor).
    requires: a model attribute that must be set for the model to read the keyword at all (Wan's ref_conv).
    in_time: the model concatenates the latent to its own along time before the patch embedding (Wan's
        time_dim_concat, SCAIL's reference frames), so its frames are inside the grid the host reports
        (``grid_sizes``); the host reports none of the others.
    """

    keyword: str
    place: str = "after"
    padded: bool = True
    requires: Optional[str] = None
    in_time: bool = False


@dataclass(frozen=True)
class ComfyMerge:
    """How mode "merge" reaches a family's blocks in ComfyUI: its "dit" block replace patches (args "img", "pe",
    "txt", "vec"), keyed ``("<reported>_block", i)`` unless ``replace`` names the key of a reported block type.

    joint: the reported block types whose "img" holds [text, image] (Flux's single blocks); the others hold the image
        stream alone. pe_axis: the token axis of "pe" ([text, image] on axis 2: Flux, Qwen-Image; the video alone on
        axis 1: Wan). per_token: args with one value per stream token on axis 1 where they have one (Wan 2.2 ti2v's
        per-token timestep "vec"). classes: the binding's classes mode merge is tested on (empty: every class).
    object_patch: the model calls its blocks without replace patches (NextDiT): each block is object-patched by a
        copy sharing its weights, whose call goes through the same patch (args "img" [caption, image], "pe", "vec").
    img_item: "img" is a tuple of streams and this one is merged (LTX-2: (video, audio)); pe_keys: the rotary tables
        cut (a tensor, or the tensors of a tuple); whole_with: args that, when given, leave the block whole with a
        warning (token-pair attention masks). lists: the block lists merged (empty: every one; Wan VACE's
        vace_blocks run whole).
    """

    joint: Tuple[str, ...] = ()
    pe_axis: int = 2
    per_token: Tuple[str, ...] = ()
    replace: Tuple[Tuple[str, str], ...] = ()
    classes: Tuple[str, ...] = ()
    object_patch: bool = False
    img_item: Optional[int] = None
    pe_keys: Tuple[str, ...] = ("pe",)
    whole_with: Tuple[str, ...] = ()
    lists: Tuple[str, ...] = ()

    def key(self, reported: str) -> str:
        return dict(self.replace).get(reported, f"{reported}_block")

    def reaches(self, diffusion_model: Any) -> bool:
        cls = type(base_model(diffusion_model))
        return not self.classes or f"{cls.__module__}.{cls.__qualname__}" in self.classes


@dataclass(frozen=True)
class ComfyDiT:
    """How one family of ComfyUI DiT classes lays out its attention sequence and orders its blocks.

    classes: "module.Class" of the diffusion models (``comfy.ldm...``).
    text: "first" ([text, image]: Flux, MMDiT, Qwen-Image, Lumina 2), "last" ([image, text]: HunyuanVideo),
        "separate" (a cross-attention; the self-attention sees only image/video tokens: Wan, LTXV).
    blocks: the block lists in the order they run (the block range's depth order).
    reports_blocks: the model sets transformer_options["block_type"/"block_index"] around each block,
        so a call's block is read, not counted; tokens after the grid (references) then keep every key.
    patch: attribute path of the patch size on the diffusion model, one such path per latent axis (Anima: temporal,
        spatial, spatial), or the size itself (Ideogram 4's latent comes packed: one latent cell is one token).
    text_optional: a call without text runs the grid alone (Ideogram 4's unconditional pass), not an unknown layout.
    pad_multiple: attribute holding the multiple the caption and the image are each padded to (Z-Image);
        the caption padding joins the prefix, the image padding is kept after the grid.
    image_frames: the latent may carry a frame axis of size 1 ([B, C, 1, H, W]: Qwen-Image's Wan 2.1-format
        latent), patched on its last two axes only.
    conditioning: keyword of the model call whose tokens follow the grid as whole frames (LTXV's
        keyframe_idxs: guide frames appended to the latent), kept whole.
    appended: latents of the call's keywords that the model patches and puts beside the grid, kept whole.
    reference_frames: leading latent frames that are a reference image, not video (Wan Animate), kept whole.
    replaced_frames: keyword of the call whose latent the model writes over the grid's leading frames
        (Kandinsky 5's time_dim_replace: image-to-video's first frame): those frames are kept whole.
    text_tokens: (keyword, token axis, times) of the call's inputs that make the whole text ("c_crossattn": the
        context): after the grid for text "last" without block reports, so the joint attention is told apart by its
        length (HiDream I1: T5 + twice the Llama tokens); before it for "first" where the context is a stand-in
        (HiDream O1: its ``input_ids``, reference-image tokens spliced in).
    grid_last_without: ("module.Class", "__init__ parameter") of the host that the "last" layout holds on: a host
        whose class lacks the parameter (HunyuanVideo on ComfyUI 0.13+) puts everything else (text, byT5, vision
        and reference-latent tokens) before the grid, which then ends the sequence; those keep every key.
    unknown_with: keywords of a model call that add tokens this entry cannot place (Z-Image Omni's
        reference latents on 2026 ComfyUIs): such a call is left whole, never mis-reduced.
    streams: keyword of the call holding the shapes of the latents the host packs into one tensor (LTX-2's
        [video, audio] in ``latent_shapes``). The first is the grid's latent. Each other stream has one token
        per step of its third axis (LTX-2's audio patchifier), plus the tokens of ``stream_prefix``, and runs
        its own attentions: a call whose grid is as long as one of them is ambiguous and left whole.
    stream_prefix: keyword of the call whose ``"tokens"`` [B, L, C] the model puts before the other streams'
        tokens (LTX-2's reference audio, ``ref_audio``).
    skipped_blocks: key of ``transformer_options`` listing the blocks whose self-attention the model does not
        compute in this call (LTX's spatio-temporal guidance, ``stg_self_attn_blocks``): the counted
        self-attentions skip those block indices.
    host_reports: keys of ``transformer_options`` that the model sets inside its forward (so the attention override
        sees them) and that describe where its tokens sit: "grid_sizes" (the post-patch (t, h, w) of the latent
        the model patched, ``in_time`` frames included: Wan) and "img_slice" ([text tokens, joint sequence length]
        of the single-stream blocks: Flux, Chroma, HunyuanVideo, Krea 2). Where set, they win over the layout
        derived from the call (``comfy_reports``).
    partial_queries: the self-attention may run part of its queries against every key (HiDream O1's generation pass
        after its causal text, and its key/value-cache pass). Only with block reports and joint attention (no
        cross-attention whose keys could span the layout): a reported call whose keys span the layout is its block's
        self-attention, whatever its query count.
    cross_keys: keywords of the call whose token count (axis -2) is the key length of a cross-attention beside the
        text (Wan i2v's clip_fea: 257 image tokens): a self-attention of that length cannot be told from it.
    merge: how mode "merge" reaches the family's blocks (``ComfyMerge``); None: mode "kv" only.
    blocks_reached_by: (method, source text) the model class's own method must hold for its blocks to receive
        ``transformer_options`` (Wan S2V: ComfyUI 0.3.x's ``forward_orig`` calls them without it, so no override can
        reach them): a host whose code lacks it is refused before sampling, never accepted and left unreduced.
    """

    name: str
    classes: Tuple[str, ...]
    text: str
    blocks: Tuple[ComfyBlocks, ...]
    reports_blocks: bool = False
    patch: Union[str, Tuple[str, ...], int] = "patch_size"
    text_optional: bool = False
    pad_multiple: Optional[str] = None
    image_frames: bool = False
    conditioning: Optional[str] = None
    appended: Tuple[Appended, ...] = ()
    reference_frames: int = 0
    replaced_frames: Optional[str] = None
    text_tokens: Tuple[Tuple[str, int, int], ...] = ()
    grid_last_without: Optional[Tuple[str, str]] = None
    unknown_with: Tuple[str, ...] = ()
    streams: Optional[str] = None
    stream_prefix: Optional[str] = None
    skipped_blocks: Optional[str] = None
    host_reports: Tuple[str, ...] = ()
    partial_queries: bool = False
    cross_keys: Tuple[str, ...] = ()
    merge: Optional["ComfyMerge"] = None
    blocks_reached_by: Optional[Tuple[str, str]] = None

    def __post_init__(self) -> None:
        unknown = set(self.host_reports) - {"grid_sizes", "img_slice"}
        if unknown:
            raise ValueError(f"ToMe: {self.name}: host_reports are 'grid_sizes' or 'img_slice', got {sorted(unknown)}.")
        if self.partial_queries and (not self.reports_blocks or self.text == "separate"):
            raise ValueError(f"ToMe: {self.name}: partial_queries needs block reports and joint attention (text "
                             f"'first' or 'last'), got reports_blocks={self.reports_blocks}, text={self.text!r}.")


DIFFUSIONMODULES = "comfy.ldm.modules.diffusionmodules."
DOUBLE_SINGLE = (ComfyBlocks("double_blocks", "double"), ComfyBlocks("single_blocks", "single"))
TIME_CONCAT = Appended("time_dim_concat", in_time=True)
WAN_APPENDED = (TIME_CONCAT, Appended("reference_latent", place="before", padded=False, requires="ref_conv"))
# Every Wan class: its i2v cross-attention's CLIP image tokens; 2026-08 classes that patch one latent report its grid.
WAN_HOST: Dict[str, Any] = dict(cross_keys=("clip_fea",), host_reports=("grid_sizes",))

def base_model(diffusion_model: Any) -> Any:
    """The diffusion model itself, seen through torch.compile's OptimizedModule."""
    return getattr(diffusion_model, "_orig_mod", diffusion_model)


def grid_last(entry: Optional["ComfyDiT"]) -> bool:
    """Whether this host runs the family's sequence as [everything else, grid] (``grid_last_without``): the host
    class lacks the parameter the "last" layout depends on."""
    if entry is None or entry.grid_last_without is None:
        return False
    path, parameter = entry.grid_last_without
    module_name, _, class_name = path.rpartition(".")
    try:
        host_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return False
    return parameter not in inspect.signature(host_class.__init__).parameters


def unreached(entry: Optional["ComfyDiT"], diffusion_model: Any) -> Optional[str]:
    """Why this host's class cannot reach the attention override (``blocks_reached_by``), else None. Read from the
    class's own source: a method whose source cannot be read counts as not reaching (never guessed)."""
    if entry is None or entry.blocks_reached_by is None:
        return None
    method, text = entry.blocks_reached_by
    cls = type(base_model(diffusion_model))
    try:
        source = inspect.getsource(getattr(cls, method))
    except (AttributeError, OSError, TypeError):
        source = ""
    if text in source:
        return None
    if cls.__module__.startswith("backend.nn."):  # Forge's model code: Forge Neo's classes honour replace patches
        return (f"this WebUI's {cls.__module__}.{cls.__qualname__}.{method} has no {text!r}, so ToMe's block "
                "patches cannot reach its blocks; ToMe reduces this family in Forge Neo (2.x), ComfyUI and diffusers")
    return (f"this ComfyUI's {cls.__module__}.{cls.__qualname__}.{method} calls its blocks without "
            "transformer_options, so no attention override reaches them; update ComfyUI (2026 ComfyUIs pass them)")


def attr_path(obj: Any, path: str) -> Any:
    """The attribute at a dotted path ("patchifier.patch_size", "language_model.layers"), None where one is missing."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def block_offsets(entry: Optional["ComfyDiT"], diffusion_model: Any) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Per reported block type: the depth index of its first block, and its count."""
    model = base_model(diffusion_model)
    offsets: Dict[str, int] = {}
    counts: Dict[str, int] = {}
    for blocks in entry.blocks if entry else ():
        offsets[blocks.reported], counts[blocks.reported] = sum(counts.values()), \
            len(attr_path(model, blocks.attr) or ())
    return offsets, counts


def default_start(entry: Optional["ComfyDiT"], counts: Dict[str, int]) -> float:
    """block_start when none is given (``blocks.default_start`` over this model's block lists; ``counts``: their
    lengths, from ``block_offsets``)."""
    lists = entry.blocks if entry else ()
    return block_default_start([counts[blocks.reported] for blocks in lists], [blocks.default for blocks in lists])
