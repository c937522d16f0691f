"""The ComfyUI DiTs mode "kv" reaches, as data: one ``ComfyFamily`` entry per model family (no comfy import).

Classes are matched by module and class name (``comfy.ldm.aura.mmdit.MMDiT``, AuraFlow, is not SD3's
``comfy.ldm.modules.diffusionmodules.mmdit.MMDiT``). Each entry says where the text sits in the joint
attention, its block lists in run order with the block type the model reports for them, which the
default range reduces, where the patch size is, and which tokens besides text keep every key.
``comfy_layout`` reads a call's layout through it, ``comfy_reports`` the layout the host reports, and
``comfy_dit`` only routes through them. ComfyUI schedules by sigma (its model_sampling maps
percent to sigma), so no timestep scale is needed here.
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
class ComfyFamily:
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
    blocks_reached_by: Optional[Tuple[str, str]] = None

    def __post_init__(self) -> None:
        unknown = set(self.host_reports) - {"grid_sizes", "img_slice"}
        if unknown:
            raise ValueError(f"ToMe: {self.name}: host_reports are 'grid_sizes' or 'img_slice', got {sorted(unknown)}.")
        if self.partial_queries and (not self.reports_blocks or self.text == "separate"):
            raise ValueError(f"ToMe: {self.name}: partial_queries needs block reports and joint attention (text "
                             f"'first' or 'last'), got reports_blocks={self.reports_blocks}, text={self.text!r}.")


_DIFFUSIONMODULES = "comfy.ldm.modules.diffusionmodules."
_DOUBLE_SINGLE = (ComfyBlocks("double_blocks", "double"), ComfyBlocks("single_blocks", "single"))
_TIME_CONCAT = Appended("time_dim_concat", in_time=True)
_WAN_APPENDED = (_TIME_CONCAT, Appended("reference_latent", place="before", padded=False, requires="ref_conv"))
# Every Wan class: its i2v cross-attention's CLIP image tokens; 2026-08 classes that patch one latent report its grid.
_WAN_HOST: Dict[str, Any] = dict(cross_keys=("clip_fea",), host_reports=("grid_sizes",))

TABLE: Tuple[ComfyFamily, ...] = (
    # Flux.1, Flux.2 (same class, other parameters) and Kontext; measured: the single blocks by default.
    ComfyFamily("flux", ("comfy.ldm.flux.model.Flux",), "first",
                (ComfyBlocks("double_blocks", "double", default=False), ComfyBlocks("single_blocks", "single")),
                reports_blocks=True, host_reports=("img_slice",)),
    # Chroma and Chroma Radiance (pixel space, its patch embedding a conv): Flux's double/single blocks,
    # [text, image], blocks reported; every block by default (not measured apart, as in diffusers' Chroma).
    ComfyFamily("chroma", ("comfy.ldm.chroma.model.Chroma", "comfy.ldm.chroma_radiance.model.ChromaRadiance"),
                "first", _DOUBLE_SINGLE, reports_blocks=True, host_reports=("img_slice",)),
    # Krea 2 (2026-08 ComfyUIs): single-stream [text, image, references] blocks, reported; the text-fusion stack
    # sees the text alone. Its Wan 2.1-format latent [B, C, 1, H, W] is one image.
    ComfyFamily("krea2", ("comfy.ldm.krea2.model.SingleStreamDiT",), "first", (ComfyBlocks("blocks", "single"),),
                reports_blocks=True, patch="patch", image_frames=True, host_reports=("img_slice",)),
    # JoyImage (Edit) (2026-08 ComfyUIs): [video/image, reference latents, text], blocks reported.
    ComfyFamily("joyimage", ("comfy.ldm.joyimage.model.JoyImageTransformer3DModel",), "last",
                (ComfyBlocks("double_blocks", "double"),), reports_blocks=True),
    # Mage-Flow (2026-08 ComfyUIs): Qwen-Image's blocks, [text, image, references], patch 1, blocks reported.
    ComfyFamily("mage_flow", ("comfy.ldm.mage_flow.model.MageFlowTransformer2DModel",), "first",
                (ComfyBlocks("transformer_blocks", "double"),), reports_blocks=True),
    ComfyFamily("qwen_image", ("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",), "first",
                (ComfyBlocks("transformer_blocks", "double"),), reports_blocks=True, image_frames=True),
    ComfyFamily("sd3", (_DIFFUSIONMODULES + "mmdit.OpenAISignatureMMDITWrapper", _DIFFUSIONMODULES + "mmdit.MMDiT"),
                "first", (ComfyBlocks("joint_blocks", "joint"),)),  # _block_mixing concatenates [context, x]
    # Wan: VACE runs its vace_blocks between the main ones (reporting the main block's index), so its depth order is
    # the order of the calls: counted. time_dim_concat (Phantom's subject images) adds whole frames after the video; a
    # model with a ref_conv (Wan 2.2 Fun) puts its reference image's tokens before it. WanDancer (2026-08): WanModel's
    # layout; its music encoder's and music injector's attentions are called without transformer_options.
    ComfyFamily("wan", ("comfy.ldm.wan.model.WanModel", "comfy.ldm.wan.model.VaceWanModel",
                        "comfy.ldm.wan.model.CameraWanModel", "comfy.ldm.wan.model_wandancer.WanDancerModel"),
                "separate", (ComfyBlocks("blocks", "blocks"), ComfyBlocks("vace_blocks", "vace")),
                appended=_WAN_APPENDED, **_WAN_HOST),
    # HuMo: its reference latent's frames follow the video in the sequence; the audio cross-attention keeps all.
    ComfyFamily("wan_humo", ("comfy.ldm.wan.model.HumoWanModel",), "separate", (ComfyBlocks("blocks", "blocks"),),
                appended=(_TIME_CONCAT, Appended("reference_latent", padded=False)), **_WAN_HOST),
    # Wan 2.2 Animate: the latent's first frame is the reference (character) image; the face adapter's
    # attention is not reduced.
    ComfyFamily("wan_animate", ("comfy.ldm.wan.model_animate.AnimateWanModel",), "separate",
                (ComfyBlocks("blocks", "blocks"),), appended=_WAN_APPENDED, reference_frames=1, **_WAN_HOST),
    # Wan 2.2 S2V (2026-08: its blocks get transformer_options and report themselves): the video grid, then its
    # reference image's and packed motion frames' tokens, kept whole whatever their number; its audio injector's
    # attention is called without transformer_options.
    ComfyFamily("wan_s2v", ("comfy.ldm.wan.model.WanModel_S2V",), "separate", (ComfyBlocks("blocks", "double"),),
                reports_blocks=True, appended=(_TIME_CONCAT,), **_WAN_HOST,
                blocks_reached_by=("forward_orig", "transformer_options=transformer_options")),
    # SCAIL / SCAIL-2 (2026-08): reference frames concatenated before the video in time (inside the reported grid),
    # pose tokens after the grid (kept whole); blocks reported.
    ComfyFamily("wan_scail", ("comfy.ldm.wan.model.SCAILWanModel", "comfy.ldm.wan.model.SCAIL2WanModel"), "separate",
                (ComfyBlocks("blocks", "double"),), reports_blocks=True,
                appended=(_TIME_CONCAT, Appended("reference_latent", place="before", in_time=True)), **_WAN_HOST),
    # HunyuanVideo (and 1.5, HunyuanImage 2.1: same class): [image, text]; its text grows inside the model
    # (byT5, vision tokens), so the tokens after the grid are kept whole, whatever their number. ComfyUI 0.13+
    # dropped DoubleStreamBlock's flipped_img_txt and runs [text, reference, image]: the grid ends the sequence.
    ComfyFamily("hunyuan_video", ("comfy.ldm.hunyuan_video.model.HunyuanVideo",), "last", _DOUBLE_SINGLE,
                reports_blocks=True, grid_last_without=("comfy.ldm.flux.layers.DoubleStreamBlock", "flipped_img_txt"),
                host_reports=("img_slice",)),
    # Ideogram 4 (2026-08 ComfyUIs): one stream [text, image], or the image alone in a call without text; its
    # 128-channel latent is already packed 2x2, so a latent cell is a token. No block reports: counted.
    ComfyFamily("ideogram4", ("comfy.ldm.ideogram4.model.Ideogram4Transformer2DModel",), "first",
                (ComfyBlocks("layers", "layers"),), patch=1, text_optional=True),
    # Lens (2026-08 ComfyUIs): [image, text] joint attention, blocks reported; its latent comes packed (Flux.2's
    # 128 channels): one latent cell is one token. The text (and its mask) after the grid keeps every key.
    ComfyFamily("lens", ("comfy.ldm.lens.model.LensTransformer2DModel",), "last",
                (ComfyBlocks("transformer_blocks", "double"),), reports_blocks=True, patch=1),
    # Anima (2026-08 ComfyUIs; Cosmos Predict 2's MiniTrainDIT with an LLM adapter for its text): self-attention over
    # the (t, h, w) grid alone, cross-attention to the text; its latent is padded to the patch. Cosmos Predict 2
    # itself (video-to-world conditioning frames inside the grid) is not in the table.
    ComfyFamily("anima", ("comfy.ldm.anima.model.Anima",), "separate", (ComfyBlocks("blocks", "blocks"),),
                patch=("patch_temporal", "patch_spatial", "patch_spatial")),
    # OmniGen2: refiners over the text, the reference latents and the image alone (other lengths: never reduced),
    # then main layers over [text, reference latents (each padded to the patch), image]; no block reports: counted.
    ComfyFamily("omnigen2", ("comfy.ldm.omnigen.omnigen2.OmniGen2Transformer2DModel",), "first",
                (ComfyBlocks("layers", "layers"),), appended=(Appended("ref_latents", place="before"),)),
    # Lumina 2 and Z-Image: [caption (+ padding), image (+ padding)] in the main layers; the refiners see
    # the caption or the image alone (other lengths: never reduced).
    ComfyFamily("lumina2", ("comfy.ldm.lumina.model.NextDiT",), "first", (ComfyBlocks("layers", "layers"),),
                pad_multiple="pad_tokens_multiple", unknown_with=("ref_latents", "siglip_feats")),
    # HiDream I1: [image, text] in double and single blocks, no block reports in 0.3.75 nor 2026-08: the joint
    # attentions are counted by their length. E1's image_cond widens every token row (concatenated along the
    # width): its sequence is longer than this layout, so such a call is never reduced.
    ComfyFamily("hidream", ("comfy.ldm.hidream.model.HiDreamImageTransformer2DModel",), "last",
                (ComfyBlocks("double_stream_blocks", "double"), ComfyBlocks("single_stream_blocks", "single")),
                text_tokens=(("c_crossattn", 1, 1), ("encoder_hidden_states_llama3", 2, 2))),
    # HiDream O1 (2026-08): a Qwen3-VL decoder over [text (input_ids, reference-image ViT tokens spliced in), image
    # (32 x 32 pixel patches), reference-image patches], layers reported. Its causal text runs outside ComfyUI's
    # attention; the generation queries (from the last text token on) attend every key, and with its key/value cache
    # only the fresh queries run: fewer queries than keys.
    ComfyFamily("hidream_o1", ("comfy.ldm.hidream_o1.model.HiDreamO1Transformer",), "first",
                (ComfyBlocks("language_model.layers", "double"),), reports_blocks=True,
                text_tokens=(("input_ids", 1, 1),), partial_queries=True),
    # Kandinsky 5 (2026-08 ComfyUIs): text blocks over the text alone, then visual blocks (self-attention over
    # the grid, counted; cross-attention to the text).
    ComfyFamily("kandinsky5", ("comfy.ldm.kandinsky5.model.Kandinsky5",), "separate",
                (ComfyBlocks("visual_transformer_blocks", "visual"),), replaced_frames="time_dim_replace"),
    ComfyFamily("ltxv", ("comfy.ldm.lightricks.model.LTXVModel",), "separate",
                (ComfyBlocks("transformer_blocks", "transformer"),), patch="patchifier.patch_size",
                conditioning="keyframe_idxs"),
    # LTX-2 (2026 ComfyUIs): LTXV's video blocks with an audio stream beside them. Only the video self-attention
    # (queries and keys over the video) is reduced; the audio self-attention, the text cross-attentions and the
    # audio<->video cross-attentions (queries of one stream, keys of the other) keep every key.
    ComfyFamily("ltxav", ("comfy.ldm.lightricks.av_model.LTXAVModel",), "separate",
                (ComfyBlocks("transformer_blocks", "transformer"),), patch="patchifier.patch_size",
                conditioning="keyframe_idxs", streams="latent_shapes", stream_prefix="ref_audio",
                skipped_blocks="stg_self_attn_blocks"),
)

FAMILIES: Dict[str, ComfyFamily] = {family.name: family for family in TABLE}
_BY_CLASS: Dict[str, ComfyFamily] = {cls: family for family in TABLE for cls in family.classes}


def base_model(diffusion_model: Any) -> Any:
    """The diffusion model itself, seen through torch.compile's OptimizedModule."""
    return getattr(diffusion_model, "_orig_mod", diffusion_model)


def family_of(diffusion_model: Any) -> Optional[ComfyFamily]:
    """The table entry of a diffusion model's class (module and class name), else None."""
    cls = type(base_model(diffusion_model))
    return _BY_CLASS.get(f"{cls.__module__}.{cls.__qualname__}")


def grid_last(diffusion_model: Any) -> bool:
    """Whether this host runs the family's sequence as [everything else, grid] (``grid_last_without``): the host
    class lacks the parameter the "last" layout depends on."""
    entry = family_of(diffusion_model)
    if entry is None or entry.grid_last_without is None:
        return False
    path, parameter = entry.grid_last_without
    module_name, _, class_name = path.rpartition(".")
    try:
        host_class = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError):
        return False
    return parameter not in inspect.signature(host_class.__init__).parameters


def unreached(diffusion_model: Any) -> Optional[str]:
    """Why this host's class cannot reach the attention override (``blocks_reached_by``), else None. Read from the
    class's own source: a method whose source cannot be read counts as not reaching (never guessed)."""
    entry = family_of(diffusion_model)
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
    return (f"this ComfyUI's {cls.__module__}.{cls.__qualname__}.{method} calls its blocks without "
            "transformer_options, so no attention override reaches them; update ComfyUI (2026 ComfyUIs pass them)")


def supported_names() -> str:
    return ("Flux.1/Flux.2/Kontext/LongCat-Image, Chroma/Chroma Radiance, Qwen-Image (+ Edit), SD3/SD3.5 (MMDiT), "
            "Wan 2.x (WanModel, VACE, Camera, HuMo, Animate, S2V, SCAIL/SCAIL-2, WanDancer), HiDream I1/O1, "
            "Kandinsky 5, Krea 2, JoyImage, Mage-Flow, "
            "HunyuanVideo/1.5/HunyuanImage 2.1, Lumina 2/Z-Image (NextDiT), LTX-Video (LTXV), LTX-2 (LTXAV), "
            "Ideogram 4, Lens, Anima, OmniGen2")


def attr_path(obj: Any, path: str) -> Any:
    """The attribute at a dotted path ("patchifier.patch_size", "language_model.layers"), None where one is missing."""
    for part in path.split("."):
        obj = getattr(obj, part, None)
    return obj


def block_offsets(diffusion_model: Any) -> Tuple[Dict[str, int], Dict[str, int]]:
    """Per reported block type: the depth index of its first block, and its count."""
    model, entry = base_model(diffusion_model), family_of(diffusion_model)
    offsets: Dict[str, int] = {}
    counts: Dict[str, int] = {}
    for blocks in entry.blocks if entry else ():
        offsets[blocks.reported], counts[blocks.reported] = sum(counts.values()), \
            len(attr_path(model, blocks.attr) or ())
    return offsets, counts


def default_start(diffusion_model: Any) -> float:
    """block_start when none is given (``blocks.default_start`` over this model's block lists)."""
    entry = family_of(diffusion_model)
    counts = block_offsets(diffusion_model)[1]
    lists = entry.blocks if entry else ()
    return block_default_start([counts[blocks.reported] for blocks in lists], [blocks.default for blocks in lists])
