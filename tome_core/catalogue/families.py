"""The catalogue of model families: one entry per family, one name, and how each host runs it.

An entry (``ModelFamily``) holds what users call the family, the shape of its token grid, the size it
is made for, and its bindings: the diffusers classes (``DiffusersDiT``: token layout, blocks, timestep
scale, kept tokens) and the ComfyUI classes (``ComfyDiT``: layout, block reports, patch size, kept
tokens) it runs as, each matched by module *and* class name. A host with no binding refuses the model,
naming it. Everything else is derived from here: the adapters' class lookups, the refusals' lists of
what is supported, ``python -m tome_core --help``, the README's supported list (``markdown_list``, checked
by a test), the ComfyUI node's display and the benchmark's family names. Adding a family is one entry
here (plus its tests). The UNet families (SD1.x, SD2.x, SDXL) are found by their module tree instead
(``unets.py``) and need no binding.
"""
from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Dict, Optional, Tuple

from ..engine.config import MERGE_ATTENTIONS, ToMeConfig
from . import token_readers as readers
from .comfy_dits import (DIFFUSIONMODULES, TIME_CONCAT, WAN_APPENDED, WAN_HOST, Appended, ComfyBlocks, ComfyDiT,
                         ComfyMerge)
from .comfy_dits import DOUBLE_SINGLE as COMFY_DOUBLE_SINGLE
from .diffusers_dits import (FLUX_BLOCKS, TRANSFORMERS, BlockList, DiffusersDiT, KeyInputs, MergeInputs, Timestep,
                             rope_image_then_text, rope_over_text_and_image, rope_over_video, rope_over_video_heads)
from .diffusers_dits import DOUBLE_SINGLE as DIFFUSERS_DOUBLE_SINGLE
from .invoke_dits import InvokeDenoise, WindowedDiT
from .neo_dits import NeoDiT
from .wanvideo import WANVIDEO_WRAPPER, WanVideoDiT

# Mode merge on Wan's blocks: their "double_block" replace patches (the blocks report no type), the video's rotary
# table on axis 1, Wan 2.2 ti2v's per-token timestep; VACE's vace_blocks run whole (called without replace patches;
# their hints are added to the full stream after a merged block).
WAN_MERGE = ComfyMerge(pe_axis=1, per_token=("vec",), replace=(("blocks", "double_block"),), lists=("blocks",))
TOMESD_RATIO = 0.5  # tomesd's default, and ToMe's on UNets and where a family has no measured default
UNET_FAMILIES = ("SD1.x", "SD2.x", "SDXL (and SSD-1B, Playground v2, ...)")
NEO = "backend.nn."  # Forge Neo's own model code (backend/nn/*.py)
# What a Neo class's forward_orig must hold for ToMe's patches to reach its blocks: the "dit" block replace patches
# (lllyasviel's Forge has classes of the same module and name without them: refused before sampling).
NEO_REPLACED = ("forward_orig", "blocks_replace")


@dataclass(frozen=True)
class ModelFamily:
    """One transformer (DiT) family.

    name: its one name everywhere (messages, the ComfyUI node, the benchmark); title: what users call it.
    grid_dims: 2 (images) or 3 (frames x height x width): the shape of the token grid mode kv reduces.
    native_px: (width, height) the family is made for, where the benchmark runs it, else None.
    diffusers, comfy: the host classes of the family, as bindings; empty where that host has none.
    wanvideo: the classes of kijai's ComfyUI-WanVideoWrapper (its own loader, sampler and model type), as bindings.
    neo: the classes of Forge Neo (``backend.nn``; ``NeoDiT``: ComfyUI's binding over Neo's ports), as bindings.
    invoke: InvokeAI's denoise invocations that run the family (``InvokeDenoise``; the ToMe node pack offers a variant
        of each), with the binding of InvokeAI's own class where it has one (FLUX.1).
    default_mode: the mode used where none is asked for (the basic ComfyUI node, ``apply_patch`` without
        ``mode``): with ``default_ratio``, the frontier's rule on its deepest run (README, "Each family's default"); "merge"
        only where the family has merge bindings, and only on the classes they reach (the others get kv).
    merge_attention: how mode merge's blocks weigh the merged keys where ``ToMeConfig.merge_attention`` is None
        (``token_merge.key_bias``): the lowest error measured at equal tokens (docs/TRANSFORMERS.md, "How merged
        tokens are used").
    default_ratio: the ratio used with ``default_mode`` where none is asked for (``ratio_for``); with
        ``default_mode``, the frontier's rule on its deepest CPU run (``tome_core.catalogue.quality``: the fastest
        setting at or under tomesd's error on SD1.5; tests/test_quality.py checks the two agree).
    """

    name: str
    title: str
    grid_dims: int = 2
    native_px: Optional[Tuple[int, int]] = None
    diffusers: Tuple[DiffusersDiT, ...] = ()
    comfy: Tuple[ComfyDiT, ...] = ()
    default_mode: str = "kv"
    wanvideo: Tuple[WanVideoDiT, ...] = ()
    merge_attention: str = "plain"
    neo: Tuple[NeoDiT, ...] = ()
    default_ratio: float = TOMESD_RATIO
    invoke: Tuple[InvokeDenoise, ...] = ()

    @property
    def bindings(self) -> tuple:
        """Every host binding of the family (InvokeAI's: the bindings of its own classes)."""
        own = tuple(denoise.own for denoise in self.invoke if denoise.own is not None)
        return self.diffusers + self.comfy + self.wanvideo + self.neo + own

    def mode_for(self, merges: bool) -> str:
        """The mode used where none is asked for, on a class that does (``merges``) or does not take mode merge."""
        return "merge" if self.default_mode == "merge" and merges else "kv"

    def ratio_for(self, mode: str) -> float:
        """The ratio used where none is asked for, in ``mode``: ``default_ratio`` in the family's default mode,
        tomesd's 0.5 in the other (not measured as a default)."""
        return self.default_ratio if mode == self.default_mode else TOMESD_RATIO

    def __post_init__(self) -> None:
        if not 0.0 < self.default_ratio <= 0.75:  # 0.75: the most the default 2x2 cells remove
            raise ValueError(f"ToMe: family {self.name}: default_ratio {self.default_ratio} must be in (0, 0.75].")
        merges = any(b.merge is not None for b in self.bindings)
        if self.default_mode not in ("kv", "merge") or (self.default_mode == "merge" and not merges):
            raise ValueError(f"ToMe: family {self.name}: default_mode {self.default_mode!r} needs merge bindings.")
        if self.merge_attention not in MERGE_ATTENTIONS or (self.merge_attention != "plain" and not merges):
            raise ValueError(f"ToMe: family {self.name}: merge_attention {self.merge_attention!r} must be one of "
                             f"{MERGE_ATTENTIONS}, and not plain only where the family has merge bindings.")

    def attention_for(self, config: ToMeConfig) -> str:
        """The merge attention of a patch: the config's, or this family's default (``merge_attention``)."""
        return config.merge_attention or self.merge_attention


CATALOGUE: Tuple[ModelFamily, ...] = (
    ModelFamily(
        'flux', 'Flux (Flux.1 with Kontext and Krea, Flux.2, LongCat-Image)', grid_dims=2, native_px=(1024, 1024),
        # InvokeAI: FLUX.1 on its own BFL-derived class (mode kv: its attention sits between the blocks' parts, no block
        # is hooked whole), FLUX.2 (Klein) on diffusers' Flux2Transformer2DModel.
        invoke=(InvokeDenoise("flux_denoise", "FLUX.1", merges=False, own=WindowedDiT(
                    "invoke_flux", ("invokeai.backend.flux.model.Flux",), "first",
                    (BlockList("double_blocks", (("img_attn.norm", "joint"),), default=False),
                     BlockList("single_blocks", (("norm", "joint"),))),
                    readers.flux_ids(1, image=(0, "img"), text_at=(2, "txt"), references=True),
                    Timestep(4, "timesteps", 1.0),
                    latents="img", closes=(("double_blocks", "img_attn.proj"), ("single_blocks", "linear2")))),
                InvokeDenoise("flux2_denoise", "FLUX.2", merges=True)),
        # default merge 0.2 (its single blocks) by the frontier's rule (docs/results/frontier_deep_cpu.json, 4+8
        # blocks): the fastest setting at or under tomesd's error that saves work (0.189 / 0.124 noise / photo, 1.10x
        # less work); merge 0.3 passes it (0.237), kv saves under 3 % of the work at any ratio. Was kv 0.5.
        default_mode="merge", default_ratio=0.2,
        diffusers=(
            DiffusersDiT("flux", (TRANSFORMERS + "transformer_flux.FluxTransformer2DModel",), "first", FLUX_BLOCKS,
                         readers.flux_ids(4), Timestep(3, "timestep", 1.0),
                         merge=MergeInputs(rope_over_text_and_image), context_parallel=True),
            DiffusersDiT("flux2", (TRANSFORMERS + "transformer_flux2.Flux2Transformer2DModel",), "first",
                         DIFFUSERS_DOUBLE_SINGLE,
                         readers.flux2_tokens, Timestep(2, "timestep", 1.0),
                         merge=MergeInputs(rope_over_text_and_image, joint=("single_transformer_blocks",)),
                         context_parallel=True),
            # LongCat-Image (and its edit model): Flux-like double/single blocks, [text, image, reference]; its
            # transformer multiplies the timestep by 1000 itself.
            DiffusersDiT("longcat_image",
                         (TRANSFORMERS + "transformer_longcat_image.LongCatImageTransformer2DModel",), "first",
                         DIFFUSERS_DOUBLE_SINGLE, readers.longcat_tokens, Timestep(2, "timestep", 1.0)),
        ),
        comfy=(
            # Flux.1, Flux.2 (same class, other parameters) and Kontext; measured: the single blocks by default.
            ComfyDiT("flux", ("comfy.ldm.flux.model.Flux",), "first",
                     (ComfyBlocks("double_blocks", "double", default=False), ComfyBlocks("single_blocks", "single")),
                     reports_blocks=True, host_reports=("img_slice",), merge=ComfyMerge(joint=("single",))),
        ),
        neo=(
            # Flux.1 (Kontext, Krea) and Flux.2 Klein in Forge Neo: ComfyUI's Flux blocks, reports and replace patches,
            # no img_slice report (reference latents come from Neo's dynamic_args, after the grid: kept whole).
            NeoDiT("flux", (NEO + "flux.IntegratedFluxTransformer2DModel",), "first",
                   (ComfyBlocks("double_blocks", "double", default=False), ComfyBlocks("single_blocks", "single")),
                   reports_blocks=True, merge=ComfyMerge(joint=("single",)),
                   attention=(NEO + "flux.attention_function",), blocks_reached_by=NEO_REPLACED),
        ),
    ),
    ModelFamily(
        'chroma', 'Chroma / Chroma Radiance', grid_dims=2, native_px=(1024, 1024),
        diffusers=(
            DiffusersDiT("chroma", (TRANSFORMERS + "transformer_chroma.ChromaTransformer2DModel",), "first",
                         DIFFUSERS_DOUBLE_SINGLE,
                         readers.flux_ids(3), Timestep(2, "timestep", 1.0)),
        ),
        comfy=(
            # Chroma and Chroma Radiance (pixel space, its patch embedding a conv): Flux's double/single blocks,
            # [text, image], blocks reported; every block by default (not measured apart, as in diffusers' Chroma).
            ComfyDiT("chroma", ("comfy.ldm.chroma.model.Chroma", "comfy.ldm.chroma_radiance.model.ChromaRadiance"),
                     "first", COMFY_DOUBLE_SINGLE, reports_blocks=True, host_reports=("img_slice",)),
        ),
        neo=(
            # Chroma in Forge Neo: Flux's blocks (and so Flux's attention global), reported; no Radiance class.
            NeoDiT("chroma", (NEO + "chroma.IntegratedChromaTransformer2DModel",), "first", COMFY_DOUBLE_SINGLE,
                   reports_blocks=True, attention=(NEO + "flux.attention_function",), blocks_reached_by=NEO_REPLACED),
        ),
    ),
    # Qwen-Image: default merge 0.025 by the frontier's rule (docs/results/frontier_deep_cpu.json, 8 blocks): no
    # setting holds tomesd's error and saves work (merge 0.05: 0.296 noise; kv 0.5: 0.495), so the one closest under
    # it. Earlier: at ratio 0.5 on the CPU 2.01x at cfg err peaked 0.364 against kv's 1.16x at 0.140 (2 blocks).
    ModelFamily(
        'qwen_image', 'Qwen-Image (2512, Edit 2509/2511)', grid_dims=2, native_px=(1328, 1328), default_mode="merge",
        invoke=(InvokeDenoise("qwen_image_denoise", "Qwen Image", merges=True),),
        merge_attention="balanced", default_ratio=0.025,
        diffusers=(
            DiffusersDiT("qwen_image", (TRANSFORMERS + "transformer_qwenimage.QwenImageTransformer2DModel",), "first",
                         (BlockList("transformer_blocks", (("attn", "joint"),)),), readers.qwen_tokens, Timestep(3,
                         "timestep", 1.0), merge=MergeInputs(rope_image_then_text, per_token=("modulate_index",)),
                         context_parallel=True),
        ),
        comfy=(
            ComfyDiT("qwen_image", ("comfy.ldm.qwen_image.model.QwenImageTransformer2DModel",), "first",
                     (ComfyBlocks("transformer_blocks", "double"),), reports_blocks=True, image_frames=True,
                     merge=ComfyMerge()),
        ),
        neo=(
            # Qwen-Image in Forge Neo: no block reports (counted), no transformer_options in the replace args nor in
            # the attention call (positional mask), the rotary table's token axis 1; Edit's reference images (Neo's
            # dynamic_args, handed to the call by the binding) after the image, kept whole.
            NeoDiT("qwen_image", (NEO + "qwen.QwenImageTransformer2DModel",), "first",
                   (ComfyBlocks("transformer_blocks", "double"),), image_frames=True, merge=ComfyMerge(pe_axis=1),
                   appended=(Appended("ref_latents"),),
                   attention=(NEO + "qwen.attention_function",), replace_options=False,
                   blocks_reached_by=("forward", "blocks_replace")),
        ),
    ),
    ModelFamily(
        'mage_flow', 'Mage-Flow', grid_dims=2,
        comfy=(
            # Mage-Flow (2026-08 ComfyUIs): Qwen-Image's blocks, [text, image, references], patch 1, blocks reported.
            ComfyDiT("mage_flow", ("comfy.ldm.mage_flow.model.MageFlowTransformer2DModel",), "first",
                     (ComfyBlocks("transformer_blocks", "double"),), reports_blocks=True),
        ),
    ),
    ModelFamily(
        'sd3', 'SD3 / SD3.5', grid_dims=2, native_px=(1024, 1024),
        invoke=(InvokeDenoise("sd3_denoise", "SD3", merges=False),),
        diffusers=(
            DiffusersDiT("sd3", (TRANSFORMERS + "transformer_sd3.SD3Transformer2DModel",), "last",
                         (BlockList("transformer_blocks", (("attn", "joint"), ("attn2", "image"))),),
                          # attn2: SD3.5, image only
                         readers.sd3_tokens, Timestep(3, "timestep", 1000.0)),
        ),
        comfy=(
            ComfyDiT("sd3", (DIFFUSIONMODULES + "mmdit.OpenAISignatureMMDITWrapper",
                     DIFFUSIONMODULES + "mmdit.MMDiT"),
                     "first", (ComfyBlocks("joint_blocks", "joint"),)),  # _block_mixing concatenates [context, x]
        ),
    ),
    ModelFamily(
        'z_image', 'Z-Image / Lumina 2', grid_dims=2, native_px=(1024, 1024), default_mode="merge",
        invoke=(InvokeDenoise("z_image_denoise", "Z-Image", merges=True),),
        # default merge 0.025 by the frontier's rule (docs/results/frontier_deep_cpu.json, 8 blocks): no setting holds
        # tomesd's error and saves work (merge 0.05: 0.240 noise; kv 0.5: 0.400), so the one closest under it.
        default_ratio=0.025,
        # earlier: at r=0.5 on the CPU (Z-Image 1024², bf16, --blocks 2) 2.36x at cfg err peaked 0.63
        # against kv's 1.06x at 0.30 (0.46 against 5.1 per unit of speed-up)
        diffusers=(
            # Lumina 2 and Z-Image: the refiners see the caption or the image alone; the main layers the joint
            # sequence.
            # Mode merge: the main layers take the joint sequence, its rotary table and mask per sample (token axis 1).
            DiffusersDiT("lumina2", (TRANSFORMERS + "transformer_lumina2.Lumina2Transformer2DModel",), "first",
                         (BlockList("layers", (("attn", "joint"),)),), readers.lumina2_tokens,
                         Timestep(1, "timestep", 1.0, rising=True),
                         merge=MergeInputs(None, per_token=("image_rotary_emb", "attention_mask"), joint=("layers",))),
            DiffusersDiT("z_image", (TRANSFORMERS + "transformer_z_image.ZImageTransformer2DModel",), "last",
                         (BlockList("layers", (("attention", "joint"),)),), readers.z_image_tokens,
                         Timestep(1, "t", 1.0, rising=True),
                         merge=MergeInputs(None, per_token=("freqs_cis", "attn_mask"), joint=("layers",), hidden="x"),
                         latents="x"),
        ),
        comfy=(
            # Lumina 2 and Z-Image: [caption (+ padding), image (+ padding)] in the main layers; the refiners see
            # the caption or the image alone (other lengths: never reduced).
            # Mode merge: its main layers, object-patched (NextDiT calls them without replace patches).
            ComfyDiT("lumina2", ("comfy.ldm.lumina.model.NextDiT",), "first", (ComfyBlocks("layers", "layers"),),
                     pad_multiple="pad_tokens_multiple", unknown_with=("ref_latents", "siglip_feats"),
                     merge=ComfyMerge(joint=("layers",), pe_axis=1, object_patch=True)),
        ),
        neo=(
            # Z-Image and Lumina 2 in Forge Neo: ComfyUI's NextDiT without its Omni inputs; layers object-patched.
            NeoDiT("lumina2", (NEO + "lumina.NextDiT",), "first", (ComfyBlocks("layers", "layers"),),
                   pad_multiple="pad_tokens_multiple",
                   merge=ComfyMerge(joint=("layers",), pe_axis=1, object_patch=True),
                   attention=(NEO + "lumina.attention_function",),
                   blocks_reached_by=("forward", "layer(x, mask, freqs_cis, adaln_input, transformer_options=")),
        ),
    ),
    ModelFamily(
        'wan', 'Wan 2.x (t2v, i2v, flf2v, ti2v, Fun, Phantom, VACE, Animate, HuMo, S2V, SCAIL, WanDancer)',
        invoke=(InvokeDenoise("wan_denoise", "Wan 2.2", merges=True),
                InvokeDenoise("wan_video_denoise", "Wan 2.2 video", merges=True)),
        # default merge 0.625 where its classes take it (all but ComfyUI's HumoWanModel; those get kv 0.5), by the
        # frontier's rule (docs/results/frontier_deep_cpu.json, 8 blocks): the fastest setting measured at or under
        # tomesd's error (0.095 / 0.101 noise / photo, 2.80x less work). Earlier: merge r=0.5 2.01x at 0.059.
        grid_dims=3, native_px=(832, 480), default_mode="merge", default_ratio=0.625,
        diffusers=(
            DiffusersDiT("wan", (TRANSFORMERS + "transformer_wan.WanTransformer3DModel",), "separate",
                         (BlockList("blocks", (("attn1", "image"),)),), readers.wan_tokens, Timestep(1, "timestep",
                         1000.0), merge=MergeInputs(rope_over_video, per_token=("temb",), output=None),
                         context_parallel=True),
            # VACE runs all its vace_blocks (the control video over the same grid) before the main blocks.
            DiffusersDiT("wan_vace", (TRANSFORMERS + "transformer_wan_vace.WanVACETransformer3DModel",), "separate",
                         (BlockList("vace_blocks", (("attn1", "image"),)), BlockList("blocks", (("attn1",
                         "image"),))),
                         readers.wan_tokens, Timestep(1, "timestep", 1000.0),
                         merge=MergeInputs(rope_over_video, per_token=("temb",), output=None, lists=("blocks",))),
            DiffusersDiT("wan_animate", (TRANSFORMERS + "transformer_wan_animate.WanAnimateTransformer3DModel",),
                         "separate",
                         (BlockList("blocks", (("attn1", "joint"),)),), readers.wan_animate_tokens,
                          # joint: [reference frame, grid]
                         Timestep(1, "timestep", 1000.0),
                         merge=MergeInputs(rope_over_video, per_token=("temb",), output=None)),
        ),
        comfy=(
            # Wan: VACE runs its vace_blocks between the main ones (reporting the main block's index), so its depth
            # order is the order of the calls: counted. time_dim_concat (Phantom's subject images) adds whole frames
            # after the video; a model with a ref_conv (Wan 2.2 Fun) puts its reference image's tokens before it.
            # WanDancer (2026-08): WanModel's layout; its music encoder's and music injector's attentions are called
            # without transformer_options.
            ComfyDiT("wan", ("comfy.ldm.wan.model.WanModel", "comfy.ldm.wan.model.VaceWanModel",
                                "comfy.ldm.wan.model.CameraWanModel", "comfy.ldm.wan.model_wandancer.WanDancerModel"),
                     "separate", (ComfyBlocks("blocks", "blocks"), ComfyBlocks("vace_blocks", "vace")),
                     appended=WAN_APPENDED, **WAN_HOST, merge=WAN_MERGE),
            # HuMo: its reference latent's frames follow the video in the sequence; the audio cross-attention keeps
            # all. No mode merge: that audio attention, inside each block, reshapes the video tokens by frame.
            ComfyDiT("wan_humo", ("comfy.ldm.wan.model.HumoWanModel",), "separate", (ComfyBlocks("blocks",
                     "blocks"),),
                     appended=(TIME_CONCAT, Appended("reference_latent", padded=False)), **WAN_HOST),
            # Wan 2.2 Animate: the latent's first frame is the reference (character) image; the face adapter's
            # attention is not reduced.
            ComfyDiT("wan_animate", ("comfy.ldm.wan.model_animate.AnimateWanModel",), "separate",
                     (ComfyBlocks("blocks", "blocks"),), appended=WAN_APPENDED, reference_frames=1, **WAN_HOST,
                     merge=WAN_MERGE),
            # Wan 2.2 S2V (2026-08: its blocks get transformer_options and report themselves): the video grid, then
            # its reference image's and packed motion frames' tokens, kept whole whatever their number; its audio
            # injector's attention is called without transformer_options.
            ComfyDiT("wan_s2v", ("comfy.ldm.wan.model.WanModel_S2V",), "separate", (ComfyBlocks("blocks", "double"),),
                     reports_blocks=True, appended=(TIME_CONCAT,), **WAN_HOST,
                     blocks_reached_by=("forward_orig", "transformer_options=transformer_options"),
                     merge=ComfyMerge(pe_axis=1, per_token=("vec",))),
            # SCAIL / SCAIL-2 (2026-08): reference frames concatenated before the video in time (inside the reported
            # grid), pose tokens after the grid (kept whole); blocks reported.
            ComfyDiT("wan_scail", ("comfy.ldm.wan.model.SCAILWanModel", "comfy.ldm.wan.model.SCAIL2WanModel"),
                     "separate",
                     (ComfyBlocks("blocks", "double"),), reports_blocks=True,
                     appended=(TIME_CONCAT, Appended("reference_latent", place="before", in_time=True)), **WAN_HOST,
                     merge=ComfyMerge(pe_axis=1, per_token=("vec",))),
        ),
        neo=(
            # Wan 2.1/2.2 t2v and i2v in Forge Neo: ComfyUI's WanModel blocks and replace patches; the self-attention
            # calls the module function backend.nn.wan.attention (Radial Attention's slot), the cross-attention not.
            NeoDiT("wan", (NEO + "wan.WanModel",), "separate", (ComfyBlocks("blocks", "blocks"),),
                   cross_keys=("clip_fea",), merge=WAN_MERGE, attention=(NEO + "wan.attention",),
                   blocks_reached_by=NEO_REPLACED),
        ),
        # kijai's ComfyUI-WanVideoWrapper (v1.4.7): its own WanModel, loader and sampler (WANVIDEOMODEL); mode merge
        # and kv through hooks on its blocks, its features placed or refused by name (wanvideo.py).
        wanvideo=(WANVIDEO_WRAPPER,),
    ),
    ModelFamily(
        'hunyuan_video', 'HunyuanVideo (1.0, 1.5, HunyuanImage 2.1)', grid_dims=3,
        diffusers=(
            DiffusersDiT("hunyuan_video",
                         (TRANSFORMERS + "transformer_hunyuan_video.HunyuanVideoTransformer3DModel",), "last",
                         DIFFUSERS_DOUBLE_SINGLE, readers.hunyuan_video_tokens, Timestep(1, "timestep", 1000.0)),
            DiffusersDiT("hunyuan_video15",
                         (TRANSFORMERS + "transformer_hunyuan_video15.HunyuanVideo15Transformer3DModel",),
                         "last", (BlockList("transformer_blocks", (("attn", "joint"),)),),
                         readers.hunyuan_video15_tokens,
                         Timestep(1, "timestep", 1000.0)),
            DiffusersDiT("hunyuan_image",
                         (TRANSFORMERS + "transformer_hunyuanimage.HunyuanImageTransformer2DModel",), "last",
                         DIFFUSERS_DOUBLE_SINGLE, readers.hunyuan_image_tokens, Timestep(1, "timestep", 1000.0)),
        ),
        comfy=(
            # HunyuanVideo (and 1.5, HunyuanImage 2.1: same class): [image, text]; its text grows inside the model
            # (byT5, vision tokens), so the tokens after the grid are kept whole, whatever their number. ComfyUI 0.13+
            # dropped DoubleStreamBlock's flipped_img_txt and runs [text, reference, image]: the grid ends the
            # sequence.
            ComfyDiT("hunyuan_video", ("comfy.ldm.hunyuan_video.model.HunyuanVideo",), "last", COMFY_DOUBLE_SINGLE,
                     reports_blocks=True, grid_last_without=("comfy.ldm.flux.layers.DoubleStreamBlock",
                     "flipped_img_txt"),
                     host_reports=("img_slice",)),
        ),
    ),
    ModelFamily(
        'ltx_video', 'LTX-Video (0.9)', grid_dims=3,
        diffusers=(
            DiffusersDiT("ltx_video", (TRANSFORMERS + "transformer_ltx.LTXVideoTransformer3DModel",), "separate",
                         (BlockList("transformer_blocks", (("attn1", "image"),)),), readers.ltx_grid(4),
                         Timestep(2, "timestep", 1000.0)),
        ),
        comfy=(
            ComfyDiT("ltx_video", ("comfy.ldm.lightricks.model.LTXVModel",), "separate",
                     (ComfyBlocks("transformer_blocks", "transformer"),), patch="patchifier.patch_size",
                     conditioning="keyframe_idxs"),
        ),
    ),
    ModelFamily(
        'ltx2', 'LTX-2', grid_dims=3, native_px=(768, 512), default_mode="merge", default_ratio=0.625,
        # default merge 0.625 by the frontier's rule (docs/results/frontier_deep_cpu.json, 8 blocks): the fastest
        # setting measured at or under tomesd's error (0.233 / 0.169 noise / photo, 2.32x less work). Earlier: at
        # r=0.5 on the CPU (768x512x33, bf16, --blocks 2) 2.01x at cfg err peaked 0.200 against kv's 1.20x at 0.102
        diffusers=(
            # LTX-2: the video self-attention only; the audio self-attention and the audio-video cross-attentions
            # keep every key (not hooked). Its attention takes the keys' source and RoPE apart from the queries': the
            # kept tokens are projected alone.
            DiffusersDiT("ltx2", (TRANSFORMERS + "transformer_ltx2.LTX2VideoTransformer3DModel",), "separate",
                         (BlockList("transformer_blocks", (("attn1", "image"),)),), readers.ltx_grid(10),
                         Timestep(4, "timestep", 1000.0),
                         KeyInputs("encoder_hidden_states", "key_rotary_emb", "query_rotary_emb",
                             ("hidden_states", "encoder_hidden_states", "query_rotary_emb", "key_rotary_emb",
                              "attention_mask")),
                         # Mode merge: the video stream through whole blocks (returned first, the audio second);
                         # the audio stream, its attentions and the text pass whole; the audio<->video
                         # cross-attentions see the merged video tokens (their rotary rows cut alike).
                         merge=MergeInputs(rope_over_video_heads, output=0,
                                           rope_keys=("video_rotary_emb", "ca_video_rotary_emb"),
                                           per_token=("temb", "temb_ca_scale_shift", "temb_ca_gate",
                                                      "perturbation_mask"),
                                           whole_with=("self_attention_mask", "a2v_cross_attention_mask",
                                                       "v2a_cross_attention_mask"))),
        ),
        comfy=(
            # LTX-2 (2026 ComfyUIs): LTXV's video blocks with an audio stream beside them. Only the video
            # self-attention (queries and keys over the video) is reduced; the audio self-attention, the text
            # cross-attentions and the audio<->video cross-attentions (queries of one stream, keys of the other) keep
            # every key.
            ComfyDiT("ltx2", ("comfy.ldm.lightricks.av_model.LTXAVModel",), "separate",
                     (ComfyBlocks("transformer_blocks", "transformer"),), patch="patchifier.patch_size",
                     conditioning="keyframe_idxs", streams="latent_shapes", stream_prefix="ref_audio",
                     skipped_blocks="stg_self_attn_blocks",
                     # Mode merge: "img" is (video, audio); the video through whole blocks, its self- and
                     # cross-attention rotary tables and per-token (or per-frame) timesteps cut; audio whole.
                     merge=ComfyMerge(pe_axis=1, img_item=0, pe_keys=("v_pe", "v_cross_pe"),
                                      per_token=("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep"),
                                      replace=(("transformer", "double_block"),), whole_with=("self_attention_mask",))),
        ),
    ),
    ModelFamily(
        'hidream', 'HiDream (I1, E1, O1)', grid_dims=2,
        diffusers=(
            # HiDream I1 (Full/Dev/Fast): each block is wrapped (HiDreamBlock.block); [image, text] in both lists.
            DiffusersDiT("hidream", (TRANSFORMERS + "transformer_hidream_image.HiDreamImageTransformer2DModel",),
                         "last",
                         (BlockList("double_stream_blocks", (("block.attn1", "joint"),)),
                    BlockList("single_stream_blocks", (("block.attn1", "joint"),))), readers.hidream_tokens,
                         Timestep(1, "timesteps", 1000.0)),
        ),
        comfy=(
            # HiDream I1: [image, text] in double and single blocks, no block reports in 0.3.75 nor 2026-08: the joint
            # attentions are counted by their length. E1's image_cond widens every token row (concatenated along the
            # width): its sequence is longer than this layout, so such a call is never reduced.
            ComfyDiT("hidream", ("comfy.ldm.hidream.model.HiDreamImageTransformer2DModel",), "last",
                     (ComfyBlocks("double_stream_blocks", "double"), ComfyBlocks("single_stream_blocks", "single")),
                     text_tokens=(("c_crossattn", 1, 1), ("encoder_hidden_states_llama3", 2, 2))),
            # HiDream O1 (2026-08): a Qwen3-VL decoder over [text (input_ids, reference-image ViT tokens spliced in),
            # image (32 x 32 pixel patches), reference-image patches], layers reported. Its causal text runs outside
            # ComfyUI's attention; the generation queries (from the last text token on) attend every key, and with its
            # key/value cache only the fresh queries run: fewer queries than keys.
            ComfyDiT("hidream_o1", ("comfy.ldm.hidream_o1.model.HiDreamO1Transformer",), "first",
                     (ComfyBlocks("language_model.layers", "double"),), reports_blocks=True,
                     text_tokens=(("input_ids", 1, 1),), partial_queries=True),
        ),
    ),
    ModelFamily(
        'kandinsky5', 'Kandinsky 5 (image, video)', grid_dims=3,
        diffusers=(
            # Kandinsky 5: its text blocks see the text alone (never hooked); the visual blocks' self-attention the
            # grid.
            DiffusersDiT("kandinsky5", (TRANSFORMERS + "transformer_kandinsky.Kandinsky5Transformer3DModel",),
                         "separate",
                         (BlockList("visual_transformer_blocks", (("self_attention", "image"),)),),
                         readers.kandinsky5_tokens,
                         Timestep(2, "timestep", 1000.0)),
        ),
        comfy=(
            # Kandinsky 5 (2026-08 ComfyUIs): text blocks over the text alone, then visual blocks (self-attention over
            # the grid, counted; cross-attention to the text).
            ComfyDiT("kandinsky5", ("comfy.ldm.kandinsky5.model.Kandinsky5",), "separate",
                     (ComfyBlocks("visual_transformer_blocks", "visual"),), replaced_frames="time_dim_replace"),
        ),
    ),
    ModelFamily(
        'krea2', 'Krea 2', grid_dims=2,
        invoke=(InvokeDenoise("krea2_denoise", "Krea-2", merges=False),),
        diffusers=(
            # Krea 2: single-stream [text, image] blocks after a text-fusion stack that sees the text alone (not
            # hooked).
            DiffusersDiT("krea2", (TRANSFORMERS + "transformer_krea2.Krea2Transformer2DModel",), "first",
                         (BlockList("transformer_blocks", (("attn", "joint"),)),), readers.krea2_tokens,
                         Timestep(2, "timestep", 1.0)),
        ),
        comfy=(
            # Krea 2 (2026-08 ComfyUIs): single-stream [text, image, references] blocks, reported; the text-fusion
            # stack sees the text alone. Its Wan 2.1-format latent [B, C, 1, H, W] is one image.
            ComfyDiT("krea2", ("comfy.ldm.krea2.model.SingleStreamDiT",), "first", (ComfyBlocks("blocks", "single"),),
                     reports_blocks=True, patch="patch", image_frames=True, host_reports=("img_slice",)),
        ),
    ),
    ModelFamily(
        'ideogram4', 'Ideogram 4', grid_dims=2,
        diffusers=(
            # Ideogram 4: its model time rises 0 (noise) -> 1 (clean).
            DiffusersDiT("ideogram4", (TRANSFORMERS + "transformer_ideogram4.Ideogram4Transformer2DModel",), "first",
                         (BlockList("layers", (("attention", "joint"),)),), readers.ideogram4_tokens,
                         Timestep(1, "timestep", 1.0, rising=True)),
        ),
        comfy=(
            # Ideogram 4 (2026-08 ComfyUIs): one stream [text, image], or the image alone in a call without text; its
            # 128-channel latent is already packed 2x2, so a latent cell is a token. No block reports: counted.
            ComfyDiT("ideogram4", ("comfy.ldm.ideogram4.model.Ideogram4Transformer2DModel",), "first",
                     (ComfyBlocks("layers", "layers"),), patch=1, text_optional=True),
        ),
    ),
    ModelFamily(
        'ernie_image', 'ERNIE-Image', grid_dims=2,
        diffusers=(
            DiffusersDiT("ernie_image", (TRANSFORMERS + "transformer_ernie_image.ErnieImageTransformer2DModel",),
                         "last",
                         (BlockList("layers", (("self_attention", "joint"),)),), readers.ernie_image_tokens,
                         Timestep(1, "timestep", 1000.0)),
        ),
    ),
    ModelFamily(
        'joyimage', 'JoyImage Edit', grid_dims=2,
        diffusers=(
            DiffusersDiT("joyimage", (TRANSFORMERS + "transformer_joyimage.JoyImageEditTransformer3DModel",), "last",
                         (BlockList("double_blocks", (("attn", "joint"),)),), readers.joyimage_tokens,
                         Timestep(1, "timestep", 1000.0)),
        ),
        comfy=(
            # JoyImage (Edit) (2026-08 ComfyUIs): [video/image, reference latents, text], blocks reported.
            ComfyDiT("joyimage", ("comfy.ldm.joyimage.model.JoyImageTransformer3DModel",), "last",
                     (ComfyBlocks("double_blocks", "double"),), reports_blocks=True),
        ),
    ),
    ModelFamily(
        'lens', 'Lens', grid_dims=2,
        comfy=(
            # Lens (2026-08 ComfyUIs): [image, text] joint attention, blocks reported; its latent comes packed
            # (Flux.2's 128 channels): one latent cell is one token. The text (and its mask) after the grid keeps
            # every key.
            ComfyDiT("lens", ("comfy.ldm.lens.model.LensTransformer2DModel",), "last",
                     (ComfyBlocks("transformer_blocks", "double"),), reports_blocks=True, patch=1),
        ),
    ),
    ModelFamily(
        'anima', 'Anima', grid_dims=3,
        comfy=(
            # Anima (2026-08 ComfyUIs; Cosmos Predict 2's MiniTrainDIT with an LLM adapter for its text):
            # self-attention over the (t, h, w) grid alone, cross-attention to the text; its latent is padded to the
            # patch. Cosmos Predict 2 itself (video-to-world conditioning frames inside the grid) is not in the table.
            ComfyDiT("anima", ("comfy.ldm.anima.model.Anima",), "separate", (ComfyBlocks("blocks", "blocks"),),
                     patch=("patch_temporal", "patch_spatial", "patch_spatial")),
        ),
    ),
    ModelFamily(
        'omnigen2', 'OmniGen2', grid_dims=2,
        comfy=(
            # OmniGen2: refiners over the text, the reference latents and the image alone (other lengths: never
            # reduced), then main layers over [text, reference latents (each padded to the patch), image]; no block
            # reports: counted.
            ComfyDiT("omnigen2", ("comfy.ldm.omnigen.omnigen2.OmniGen2Transformer2DModel",), "first",
                     (ComfyBlocks("layers", "layers"),), appended=(Appended("ref_latents", place="before"),)),
        ),
    ),
    ModelFamily(
        'pixart', 'PixArt-α / PixArt-Σ', grid_dims=2, native_px=(1024, 1024),
        diffusers=(
            # PixArt-α/Σ: BasicTransformerBlocks whose attn1 sees the image tokens alone (absolute position
            # embeddings, no RoPE) and whose attn2 attends to the T5 text.
            DiffusersDiT("pixart", (TRANSFORMERS + "pixart_transformer_2d.PixArtTransformer2DModel",), "separate",
                         (BlockList("transformer_blocks", (("attn1", "image"),)),), readers.pixart_tokens,
                         Timestep(2, "timestep", 1000.0)),
        ),
    ),
    ModelFamily(
        'cogvideox', 'CogVideoX', grid_dims=3,
        diffusers=(
            DiffusersDiT("cogvideox", (TRANSFORMERS + "cogvideox_transformer_3d.CogVideoXTransformer3DModel",),
                         "first",
                         (BlockList("transformer_blocks", (("attn1", "joint"),)),), readers.cogvideox_tokens,
                         Timestep(2, "timestep", 1000.0)),
        ),
    ),
    ModelFamily(
        'mochi', 'Mochi', grid_dims=3,
        diffusers=(
            # Mochi's pipeline passes reversed timesteps (rising 0 -> 1000 over sampling).
            DiffusersDiT("mochi", (TRANSFORMERS + "transformer_mochi.MochiTransformer3DModel",), "last",
                         (BlockList("transformer_blocks", (("attn1", "joint"),)),), readers.mochi_tokens,
                         Timestep(2, "timestep", 1000.0, rising=True)),
        ),
    ),
)

BY_NAME: Dict[str, ModelFamily] = {family.name: family for family in CATALOGUE}


@lru_cache(maxsize=None)
def host_bindings(host: str) -> Tuple[tuple, Dict[str, object], Dict[str, object]]:
    """Every binding of one host ("diffusers", "comfy") in the catalogue, by name and by "module.Class" (the
    lookups' tables, built on first use)."""
    table = tuple(binding for family in CATALOGUE for binding in getattr(family, host))
    return table, {b.name: b for b in table}, {cls: b for b in table for cls in b.classes}


def family_of_binding(binding: object) -> Optional[ModelFamily]:
    """The catalogue entry a host binding belongs to."""
    return next((family for family in CATALOGUE if binding in family.bindings), None)


def titles(host: str) -> str:
    """The titles of the families ``host`` ("diffusers", "comfy" or "neo") runs, for help text and refusals."""
    return ", ".join(family.title for family in CATALOGUE if getattr(family, host))


def markdown_list() -> str:
    """The README's supported list: the UNet families, then each transformer family and where it runs."""
    lines = [f"- UNets (modes merge and kv): {', '.join(UNET_FAMILIES)}"]
    for family in CATALOGUE:
        held = [(label, getattr(family, host)) for label, host in HOSTS if getattr(family, host)]
        hosts = [label for label, _ in held]
        merging = [label for label, bindings in held if any(binding.merge is not None for binding in bindings)]
        only = "" if merging == hosts else f" in {_joined(merging)}"
        weighed = "" if family.merge_attention == "plain" else f" with {family.merge_attention} attention"
        ratio = f" {family.default_ratio:g}"
        modes = (f"modes kv and merge{only}, default {family.default_mode}{ratio}{weighed}" if merging
                 else "mode kv" + ("" if family.default_ratio == TOMESD_RATIO else f", default ratio{ratio}"))
        lines.append(f"- {family.title} (`{family.name}`, {modes}): {_joined(hosts)}")
    return "\n".join(lines) + "\n"


HOSTS = (("diffusers", "diffusers"), ("ComfyUI", "comfy"), ("ComfyUI-WanVideoWrapper", "wanvideo"),
         ("Forge Neo", "neo"), ("InvokeAI", "invoke"))


def _joined(labels: list) -> str:
    return " and ".join(labels) if len(labels) < 3 else ", ".join(labels[:-1]) + " and " + labels[-1]


def short_title(family: ModelFamily) -> str:
    """The family's title without its parenthesised list of versions, for one-line texts ("Wan 2.x")."""
    return family.title.split(" (")[0]


def modes_of(family: ModelFamily, host: Optional[str] = None) -> Tuple[str, ...]:
    """The modes ``family`` takes on ``host`` ("diffusers", "comfy", "wanvideo" or "neo"; None: on any): ("kv",) or
    ("kv", "merge")."""
    bindings = family.bindings if host is None else getattr(family, host)
    return ("kv", "merge") if any(binding.merge is not None for binding in bindings) else ("kv",)


def merging(default: Optional[str] = None) -> Tuple[ModelFamily, ...]:
    """The families that take mode merge on some host; ``default``: only those whose default mode it is."""
    return tuple(family for family in CATALOGUE if "merge" in modes_of(family)
                 and (default is None or family.default_mode == default))


def _names(families: Tuple[ModelFamily, ...]) -> str:
    titles_ = [short_title(family) for family in families]
    return " and ".join(titles_) if len(titles_) < 3 else ", ".join(titles_[:-1]) + " and " + titles_[-1]


def default_modes() -> str:
    """The transformer families' default modes, short: "merge on Qwen-Image, ... and LTX-2, kv on the others"."""
    return f"merge on {_names(merging('merge'))}, kv on the others"


def mode_summary() -> str:
    """One sentence on the transformer families' modes and defaults, for help texts and node tooltips."""
    names = _names
    also = merging("kv")
    others = f"{names(also)} {'takes' if len(also) == 1 else 'take'} merge too, default kv; " if also else ""
    return (f"mode merge (fewer image tokens through whole blocks) is the default on {names(merging('merge'))}; "
            f"{others}the other transformers take mode kv (fewer keys/values) only")
