"""How kijai's ComfyUI-WanVideoWrapper runs Wan: the ``WanVideoDiT`` binding of the catalogue's Wan entry.

Read from the wrapper's code at v1.4.7 (kijai 088128b, 2026-05-24); nothing of it is imported. Its loader returns a
ComfyUI ``ModelPatcher`` around ``WanVideoModel``, the transformer at ``patcher.model.diffusion_model``
(``wanvideo/modules/model.py`` ``WanModel``, blocks ``WanAttentionBlock`` / ``BaseWanAttentionBlock`` with VACE). Its
sampler calls the transformer itself with one keyword per feature (``WanModel.forward``), and the transformer calls
each block as ``block(x, x_ip=..., **kwargs)`` with the video stream ``x`` [B, L, C] laid out (f h w) and padded to
``seq_len``, the per-token RoPE ``freqs`` [1, L, 1, D/2, 2, 2] (rope_func "comfy"), the modulation ``e`` ([B, 6, C], or
[B, 6, L, C] for Wan 2.2 5B), ``seq_lens`` [B] and the ``transformer_options`` the patcher carries.

What this file holds is what is known about the wrapper's tokens: where a call's video grid sits in the stream
(``call_layout``), which keyword, model setting or attention mode carries a feature, and whether each mode carries
that feature's tokens correctly (``FEATURES``): where one cannot, the feature is refused by name with its fix, before
any block runs. Below those named refusals, each mode accepts only the block inputs it knows (``BLOCK_INPUTS``): any
other input a block is handed, unless it is at rest, is refused before the first block runs
(``block_input_refusal``), so a feature of a later wrapper that ToMe was not built for stops the prompt instead of
scrambling the video. The adapter (``tome_core/adapters/wanvideo``) reads a call through it.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Any, Dict, FrozenSet, Optional, Tuple

from ..engine.grid import TokenLayout

WRAPPER = "ComfyUI-WanVideoWrapper"
NOT_YET = "ToMe has not been run with it yet"


@dataclass(frozen=True)
class WrapperFeature:
    """A feature of the wrapper and whether each ToMe mode carries it.

    key: where it shows: a ``WanModel.forward`` keyword (active when given and not False/empty), "model.<attr>" (a
        transformer attribute the loader or sampler sets, active when truthy) or "options.<key>" (a
        ``transformer_options`` key). title: what users call it, and the node or input that turns it on.
    merge, kv: None where that mode composes with it; else why it does not (the refusal's reason). fix: the way out.
    """

    key: str
    title: str
    merge: Optional[str]
    kv: Optional[str]
    fix: str

    def refusal(self, mode: str) -> Optional[str]:
        why = self.merge if mode == "merge" else self.kv
        if why is None:
            return None
        return f"ToMe (WanVideoWrapper): {self.title} is not supported with ToMe's mode {mode}: {why}; {self.fix}."


_BY_FRAME = "it reads the video tokens by frame or position inside each block, which merged tokens no longer fill"
_REMOVE = "remove it or the ToMe node"
_KV_OR_REMOVE = "use mode kv (attention_mode sdpa), or remove it or the ToMe node"
_EXTRA = "its extra tokens' place in the stream is not read by ToMe yet"

# Every feature of the wrapper (v1.4.7) that puts tokens in the blocks' stream or reads them by position. Those not
# listed act outside the blocks' tokens (LoRA, block swap, TeaCache/MagCache/EasyCache, SLG, context windows,
# ControlNet/Uni3C/FlashVSR residuals added to the whole stream between blocks, Fun camera, fps embeddings, CFG
# variants, text and CLIP conditioning) and compose with both modes.
FEATURES: Tuple[WrapperFeature, ...] = (
    WrapperFeature("enhance_enabled", "FETA (Enhance-A-Video, feta_args)", _BY_FRAME, None, _KV_OR_REMOVE),
    WrapperFeature("multitalk_audio", "MultiTalk / InfiniteTalk audio (multitalk_embeds)", _BY_FRAME, NOT_YET,
                   _REMOVE),
    WrapperFeature("camera_embed", "ReCamMaster camera (recammaster embeds)", _BY_FRAME, NOT_YET, _REMOVE),
    WrapperFeature("audio_proj", "FantasyTalking audio (fantasytalking_embeds)", _BY_FRAME, NOT_YET, _REMOVE),
    WrapperFeature("fantasy_portrait_input", "FantasyPortrait", _BY_FRAME, NOT_YET, _REMOVE),
    WrapperFeature("inner_t", "EchoShot multi-shot prompts", _BY_FRAME, NOT_YET, _REMOVE),
    WrapperFeature("mtv_motion_tokens", "MTV-Crafter motion", _BY_FRAME, NOT_YET, _REMOVE),
    WrapperFeature("humo_audio", "HuMo audio", _BY_FRAME, NOT_YET, _REMOVE),
    WrapperFeature("standin_input", "Stand-In reference (standin_input)",
                   "its reference tokens join each block's self-attention keys", NOT_YET, _REMOVE),
    WrapperFeature("lynx_embeds", "Lynx face/reference embeddings",
                   "it stores and reads each block's tokens by position", NOT_YET, _REMOVE),
    WrapperFeature("s2v_audio_input", "Wan 2.2 S2V audio", "its zero-timestep segments and audio injector read the "
                   "tokens by position", NOT_YET, _REMOVE),
    WrapperFeature("s2v_ref_latent", "Wan 2.2 S2V reference image", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("s2v_ref_motion", "Wan 2.2 S2V motion frames", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("s2v_pose", "Wan 2.2 S2V pose", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("wananim_pose_latents", "WanAnimate pose", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("wananim_face_pixel_values", "WanAnimate face", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("x_ovi", "Ovi audio stream", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("sdancer_input", "SteadyDancer", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("one_to_all_input", "One-to-All Animation", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("scail_input", "SCAIL pose/reference", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("dual_control_input", "LongVie2 dual control", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("attn_cond", "reference tokens of add_cond_latents (attn_cond)", _EXTRA, NOT_YET, _REMOVE),
    WrapperFeature("unianim_data", "UniAnimate pose", NOT_YET, NOT_YET, _REMOVE),
    WrapperFeature("model.is_longcat", "LongCat-Video", "it views each block's tokens as frames", NOT_YET, _REMOVE),
    WrapperFeature("model.humo_audio", "a HuMo model", "its reference frames sit in the video latent and its "
                   "audio attention reads the tokens by frame", NOT_YET, _REMOVE),
    WrapperFeature("model.motion_encoder", "a WanAnimate model", "its reference frame sits in the video latent",
                   NOT_YET, _REMOVE),
    WrapperFeature("model.video_attention_split_steps", "experimental_args video_attention_split_steps",
                   "it splits the self-attention by frame", "it splits the self-attention by frame, below where "
                   "ToMe shortens keys", "clear video_attention_split_steps, or remove the ToMe node"),
    WrapperFeature("options.ultravico_alpha", "UltraVico (WanVideoUltraVicoSettings)", "it weighs attention by "
                   "frame (frame_tokens)", "its attention kernel is a custom op ToMe does not reach",
                   "use another attention_mode, or remove the ToMe node"),
)

# Attention modes of the wrapper (nodes_model_loading.py attention_modes) and what ToMe can do under each.
# Mode kv shortens the keys handed to torch's scaled_dot_product_attention, where the self-attention ends for "sdpa"
# and for "comfy" with ComfyUI's PyTorch attention (``optimized_attention`` is ``attention_pytorch``; the wrapper calls
# it without transformer_options, so ComfyUI's attention override cannot reach it); the others call a kernel of their
# own (flash-attn, SageAttention).
KV_ATTENTION = ("sdpa", "comfy")
COMFY_SDPA = "attention_pytorch"
# These read the tokens by position (a radial mask built for the whole stream, UltraVico's frame_tokens): merge would
# hand them fewer tokens than they are built for.
POSITIONAL_ATTENTION = ("radial_sage_attention", "sageattn_ultravico")
# RoPE functions that take the per-token table ``freqs``, which merge cuts to the kept tokens; "default" (and MoCha,
# EchoShot) rebuild it inside each block from grid_sizes.
TABLE_ROPE = ("comfy", "comfy_chunked")


def attention_refusal(attention: str, mode: str, where: str, comfy_attention: Optional[str] = None) -> Optional[str]:
    """Why ``mode`` cannot run under the wrapper's attention mode ``attention`` (set by ``where``), else None.
    comfy_attention: the name of the running ComfyUI's ``optimized_attention`` where known (attention_mode "comfy")."""
    if mode == "kv" and attention == "comfy" and comfy_attention not in (None, COMFY_SDPA):
        return (f"ToMe (WanVideoWrapper): mode kv does not reach attention_mode 'comfy' ({where}) here: this ComfyUI's "
                f"attention is {comfy_attention}, not PyTorch's scaled_dot_product_attention, where ToMe shortens the "
                "keys; use attention_mode sdpa, start ComfyUI with --use-pytorch-cross-attention, or use ToMe's mode "
                "merge.")
    if attention in POSITIONAL_ATTENTION:
        return (f"ToMe (WanVideoWrapper): attention_mode {attention!r} ({where}) is not supported with ToMe: it "
                "reads the tokens by position (a radial mask or UltraVico's frame_tokens built for the whole stream); "
                "use sdpa, sageattn, flash_attn or comfy, or remove the ToMe node.")
    if mode == "kv" and attention not in KV_ATTENTION:
        return (f"ToMe (WanVideoWrapper): mode kv does not reach attention_mode {attention!r} ({where}): it calls its "
                "own kernel, below the torch scaled_dot_product_attention call where ToMe shortens the keys; use "
                "attention_mode sdpa (or comfy), or ToMe's mode merge, which runs under every attention mode but "
                "radial and UltraVico.")
    return None


def rope_refusal(rope_func: str, mode: str) -> Optional[str]:
    if mode != "merge" or rope_func in TABLE_ROPE:
        return None
    return (f"ToMe (WanVideoWrapper): mode merge needs the sampler's rope_function 'comfy' (or 'comfy_chunked'), got "
            f"{rope_func!r}: that RoPE is rebuilt inside each block from the grid size, which merged tokens no longer "
            "fill (EchoShot, MoCha and bidirectional sampling force 'default'); set rope_function to comfy, or use "
            "mode kv.")


@dataclass(frozen=True)
class WanVideoMerge:
    """How mode merge cuts a block's per-token inputs to the merged stream: ``freqs`` on ``pe_axis``, a per-token
    modulation ``e`` (4-D, Wan 2.2 5B) on ``per_token_axis``, ``seq_lens`` (flash-attn's key lengths) by the count
    merged away; VACE's ``vace_hints`` are added by the adapter to the whole stream after the block, as the wrapper's
    ``BaseWanAttentionBlock.forward`` adds them after its ``WanAttentionBlock.forward``."""

    pe_axis: int = 1
    per_token_axis: int = 2
    hints: str = "vace_hints"
    hint_scales: str = "vace_context_scale"


@dataclass(frozen=True)
class WanVideoDiT:
    """The wrapper's Wan transformer: its classes (module path *ending*, since ComfyUI names a custom node's modules
    after its folder, e.g. ``ComfyUI-WanVideoWrapper.wanvideo.modules.model``), block list, patcher type and the
    mode merge binding."""

    name: str
    classes: Tuple[str, ...]
    blocks: str = "blocks"
    model_type: str = "WANVIDEOMODEL"
    merge: Optional[WanVideoMerge] = None

    def matches(self, model: Any) -> bool:
        cls = type(getattr(model, "_orig_mod", model))
        module, name = cls.__module__, cls.__qualname__
        for path in self.classes:
            suffix, _, wanted = path.rpartition(".")
            if name == wanted and (module == suffix or module.endswith("." + suffix)):
                return True
        return False


def _active(value: Any) -> bool:
    if value is None or value is False:
        return False
    if isinstance(value, (list, tuple, dict, str)):
        return len(value) > 0
    return True


def feature_refusals(model: Any, kwargs: dict, options: dict, mode: str) -> Optional[str]:
    """The first refusal among ``FEATURES`` that this model call (its keywords, the model's settings, its
    transformer_options) turns on under ``mode``, else None."""
    for feature in FEATURES:
        where, _, name = feature.key.rpartition(".")
        value = getattr(model, name, None) if where == "model" else options.get(name) if where == "options" \
            else kwargs.get(name)
        if _active(value):
            refused = feature.refusal(mode)
            if refused:
                return refused
    return None


# The block inputs each mode carries whatever their value (read from the wrapper's ``WanAttentionBlock.forward`` and
# ``BaseWanAttentionBlock.forward``, wanvideo/modules/model.py, and the block call of ``WanModel.forward``, at kijai
# 0cf30c63, the newest copy read; v1.4.7's block call, as the stand-in mirrors it, passes a subset). Merge cuts or
# shortens x, e, freqs, seq_lens and adds VACE's hints itself; kv changes no input. The rest are the same for every
# token (the step, the text and CLIP conditioning, NAG's context, the attention override), inert without their
# feature's own input (the *_scale strengths, human_num, the split prompts' chunking), or refused by name first
# (rope_function 'default' under merge; several prompts under merge; FETA's enhance_enabled under merge, which kv
# carries: its scores come from the full keys).
_EVERY_MODE = frozenset((
    "x", "e", "seq_lens", "grid_sizes", "freqs", "context", "clip_embed", "current_step", "last_step",
    "num_latent_frames", "frame_tokens", "original_seq_len", "transformer_options", "attention_mode_override",
    "chunked_self_attention", "seq_chunks", "nag_params", "nag_context", "reverse_time", "vace_hints",
    "vace_context_scale", "audio_scale", "ip_scale", "mtv_strength", "humo_audio_scale", "lynx_ip_scale",
    "lynx_ref_scale", "onetoall_ref_scale", "human_num",
))
BLOCK_INPUTS: Dict[str, FrozenSet[str]] = {"merge": _EVERY_MODE, "kv": _EVERY_MODE | {"enhance_enabled"}}
_NO_DEFAULT = object()


def _at_rest(value: Any) -> bool:
    """None, False, 0 or empty: what the wrapper hands a block for a feature that is off."""
    if value is None or value is False:
        return True
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return value == 0
    return isinstance(value, (list, tuple, dict, str)) and len(value) == 0


def declared_default(block: Any, name: str) -> Any:
    """The default the block's own ``forward`` (or a base class's, for a keyword it passes on) declares for ``name``."""
    for cls in type(getattr(block, "_orig_mod", block)).__mro__:
        forward = cls.__dict__.get("forward")
        if forward is None:
            continue
        try:
            parameter = inspect.signature(forward).parameters.get(name)
        except (TypeError, ValueError):
            continue
        if parameter is not None and parameter.default is not inspect.Parameter.empty:
            return parameter.default
    return _NO_DEFAULT


def _shown(value: Any) -> str:
    shape = getattr(value, "shape", None)
    return f"a tensor {list(shape)}" if shape is not None else repr(value)[:60]


def block_input_refusal(block: Any, args: tuple, kwargs: dict, mode: str) -> Optional[str]:
    """Why ``mode`` cannot carry this block call's inputs (one it does not know, and not at rest), else None.

    An input is at rest when None, False, 0 or empty, or a setting equal to the default its block's forward declares;
    only the stream ``x`` may come by position."""
    if len(args) > 1:
        return (f"ToMe (WanVideoWrapper): this wrapper hands its blocks {len(args)} inputs by position, where ToMe "
                "knows the video stream only; update tome (a newer one may know them), or remove the ToMe node.")
    known = BLOCK_INPUTS[mode]
    for name, value in kwargs.items():
        if name in known or _at_rest(value):
            continue
        if isinstance(value, (bool, int, float, str)):  # a setting at its declared default is off as well
            default = declared_default(block, name)
            if type(default) is type(value) and default == value:
                continue
        fix = ("use ToMe's mode kv, which carries it, or remove that feature or the ToMe node"
               if mode == "merge" and name in BLOCK_INPUTS["kv"] else
               "update tome (a newer one may carry it), or remove that feature or the ToMe node, and please report it")
        return (f"ToMe (WanVideoWrapper): this wrapper hands its blocks {name} = {_shown(value)}, an input ToMe's mode "
                f"{mode} does not know (a feature that adds tokens or reads them by position would come back "
                f"scrambled); {fix}.")
    return None


def multiple_prompts(kwargs: dict) -> bool:
    """Whether the call splits its video by frame between several prompts (the wrapper's ``split_attn``: batch 1 with
    more than one text embedding or CLIP embedding; ``split_cross_attn_ffn`` cuts the tokens by frame)."""
    latents, context, clip = kwargs.get("x"), kwargs.get("context"), kwargs.get("clip_fea")
    one = isinstance(latents, (list, tuple)) and len(latents) == 1
    texts = len(context) if isinstance(context, (list, tuple)) else 0
    clips = int(clip.shape[0]) if hasattr(clip, "shape") and len(clip.shape) > 0 else 0
    return one and (texts > 1 or clips > 1)


def call_layout(model: Any, kwargs: dict) -> Optional[TokenLayout]:
    """Where one ``WanModel.forward`` call's video grid sits in the blocks' stream, from its keywords: the latent
    ``x[0]`` [C, F, H, W] patched by ``patch_size`` (t, h, w); Wan 2.1 Fun's reference image (``fun_ref``, with a
    ``ref_conv``: h*w tokens prepended, frame 0 of the RoPE table) before it; Phantom's subject frames
    (``phantom_ref`` [C, Fp, H, W]) and the padding up to ``seq_len`` after it. None where the call holds no latent."""
    latents = kwargs.get("x")
    if not isinstance(latents, (list, tuple)) or not latents or getattr(latents[0], "ndim", 0) != 4:
        return None
    pt, ph, pw = (int(p) for p in model.patch_size)
    _, frames, height, width = (int(n) for n in latents[0].shape)
    grid = (frames // pt, height // ph, width // pw)
    if min(grid) < 1:
        return None
    prefix = 0
    fun_ref = kwargs.get("fun_ref")
    if fun_ref is not None and getattr(model, "ref_conv", None) is not None:
        prefix = (int(fun_ref.shape[-2]) // ph) * (int(fun_ref.shape[-1]) // pw)
    after = 0
    phantom = kwargs.get("phantom_ref")
    if phantom is not None:
        after = (int(phantom.shape[-3]) // pt) * (int(phantom.shape[-2]) // ph) * (int(phantom.shape[-1]) // pw)
    seq_len = int(kwargs.get("seq_len") or 0)
    padding = max(seq_len - grid[0] * grid[1] * grid[2], 0)
    return TokenLayout(grid, prefix=prefix, suffix=after + padding)


WANVIDEO_WRAPPER = WanVideoDiT("wanvideo", ("wanvideo.modules.model.WanModel",), merge=WanVideoMerge())
