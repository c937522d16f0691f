"""Plan, describe, attach: ToMe on a WanVideoWrapper model patcher (``WANVIDEOMODEL``), refused before any clone.

``plan_wanvideo`` runs every refusal that the patcher already shows (the model class, the loader's attention mode and
torch.compile settings, an attention override set before ToMe, model types ToMe cannot carry, the block range) and
describes the patch; ``patch_wanvideo`` returns the clone with ToMe's state under its key in
``model_options["transformer_options"]`` and the hooks installed. What only the sampler decides (its inputs: Phantom,
MultiTalk, FETA, ..., its RoPE function, an attention override set after ToMe) is refused at the first model call,
before any block runs (``state.call_refusal``).
"""
from __future__ import annotations

from typing import Any, Dict, Optional, Tuple

from ...catalogue.defaults import ModelDefaults
from ...catalogue.families import BY_NAME, short_title
from ...catalogue.wanvideo import WANVIDEO_WRAPPER, WRAPPER, feature_refusals
from ...engine.blocks import chosen_blocks
from ...engine.config import ToMeConfig
from ...engine.kv import window_for_dims
from .hooks import OPTIONS_KEY, install, patch_in
from .state import WanVideoPatch, attention_refusals

FAMILY = BY_NAME["wan"]
DEFAULTS = ModelDefaults(FAMILY, merges=True)  # the wrapper runs Wan only, in both modes: its defaults are the catalogue's
# The merge variants other hosts may take (ToMeConfig fields where this tome_core has them) and the one run here.
MERGE_VARIANTS = {"merge_attention": "plain", "merge_assign": "hard", "merge_destinations": "random"}


def _transformer(patcher: Any) -> Any:
    return getattr(getattr(patcher, "model", None), "diffusion_model", None)


def _pipeline(patcher: Any, key: str) -> Any:
    """A value the wrapper's loader keeps on its ``WanVideoModel`` (``model["compile_args"]``), None where absent."""
    try:
        return patcher.model[key]
    except (KeyError, TypeError, AttributeError, IndexError):
        return None


def check_wanvideo(patcher: Any, config: ToMeConfig) -> Optional[Tuple[bool, ...]]:
    """Every refusal the patcher shows before sampling; returns the blocks reduced (None: all)."""
    model = _transformer(patcher)
    if model is None or not WANVIDEO_WRAPPER.matches(model):
        cls = type(getattr(model, "_orig_mod", model))
        raise TypeError(f"ToMe (WanVideoWrapper): expected a {WRAPPER} model (its WanModel, "
                        f"wanvideo.modules.model.WanModel, at model.diffusion_model), got {cls.__module__}."
                        f"{cls.__qualname__}; for ComfyUI's own MODEL use the ToMe node (TomeCoreToMe).")
    if config.kv_downsample != "nearest":
        raise ValueError("ToMe (WanVideoWrapper): kv_downsample 'avg' would average RoPE-rotated keys; use 'nearest'.")
    variants = {name: getattr(config, name, plain) for name, plain in MERGE_VARIANTS.items()}
    if any(value not in (None, MERGE_VARIANTS[name]) for name, value in variants.items()):
        raise ValueError(f"ToMe (WanVideoWrapper): mode merge runs its plain form here (merge_attention 'plain', hard "
                         f"assignment, seeded destinations), got {variants}; leave those settings at their defaults.")
    options = getattr(patcher, "model_options", {}).get("transformer_options") or {}
    refused = feature_refusals(model, {}, options, config.mode) or attention_refusals(model, options, config.mode)
    compile_args = _pipeline(patcher, "compile_args")
    if not refused and isinstance(compile_args, dict) and not compile_args.get("compile_transformer_blocks_only", True):
        refused = ("ToMe (WanVideoWrapper): WanVideoTorchCompileSettings with compile_transformer_blocks_only off "
                   "compiles the whole transformer, ToMe's per-call planning included; set "
                   "compile_transformer_blocks_only on (ToMe's hooks then run around each compiled block), or remove "
                   "the ToMe node.")
    if not refused and str(getattr(model, "model_type", "")) == "s2v":
        refused = "ToMe (WanVideoWrapper): Wan 2.2 S2V models are not supported with ToMe yet; remove the ToMe node."
    if refused:
        raise ValueError(refused)
    blocks = getattr(model, WANVIDEO_WRAPPER.blocks)
    return chosen_blocks(config, len(blocks), 0.0, type(getattr(model, "_orig_mod", model)).__name__)


def settle_wanvideo(asked: Dict[str, Any]) -> Tuple[Dict[str, Any], Dict[str, Any]]:
    """What a host asked, with mode and ratio left to the model settled to Wan's (``catalogue.defaults``): the values
    to build the config from, and what the description adds (which settings were the model's, its default ratio)."""
    settled = DEFAULTS.settle(asked)
    return settled.values, settled.describe()


def plan_wanvideo(patcher: Any, config: ToMeConfig) -> Dict[str, Any]:
    """Validate ``config`` on the patcher and describe the patch (what the node shows), before anything is cloned."""
    chosen = check_wanvideo(patcher, config)
    count = len(getattr(_transformer(patcher), WANVIDEO_WRAPPER.blocks))
    kv_window = list(window_for_dims(config.ratio, FAMILY.grid_dims, config.sx, config.sy)) \
        if config.mode == "kv" else []
    reduced = count if chosen is None else sum(chosen)
    return dict(config.as_dict(), kind="dit", base_downsample=1, model_type=f"{WRAPPER} WanModel",
                family=FAMILY.name, title=FAMILY.title, name=short_title(FAMILY), kv_window=kv_window, blocks=[reduced, count],
                text=describe_lines(config, reduced, count, kv_window))


def patch_wanvideo(patcher: Any, config: ToMeConfig) -> Any:
    """A clone of ``patcher`` that ToMe reduces (the input is never changed); refuses as ``check_wanvideo``."""
    chosen = check_wanvideo(patcher, config)
    model = _transformer(patcher)
    blocks = getattr(model, WANVIDEO_WRAPPER.blocks)
    state = WanVideoPatch(config, WANVIDEO_WRAPPER, chosen, len(blocks))
    clone = patcher.clone()
    options = clone.model_options.setdefault("transformer_options", {})
    options[OPTIONS_KEY] = state  # re-patching a patched clone replaces ToMe's state, never stacks it
    install(getattr(model, "_orig_mod", model), WANVIDEO_WRAPPER.blocks)
    return clone


def patch_of(patcher: Any) -> Optional[WanVideoPatch]:
    """ToMe's state on a patched clone, else None."""
    return patch_in({"transformer_options": getattr(patcher, "model_options", {}).get("transformer_options")})


def describe_lines(config: ToMeConfig, reduced: int, count: int, kv_window: list) -> list:
    """What the patch does, in words (the node's text and the log)."""
    blocks = f"{reduced} of {count} blocks" if reduced != count else f"all {count} blocks"
    if not config.enabled:
        what = "ratio 0: nothing is reduced"
    elif config.mode == "merge":
        what = (f"{config.ratio:.0%} of the video tokens merged into a similar neighbour through {blocks}; text, "
                "reference and padding tokens whole")
    else:
        kept = 1
        for side in kv_window:
            kept *= side
        what = (f"keys/values of the self-attention in {blocks}: 1 of {kept} per {'x'.join(map(str, kv_window))} "
                "window; every query kept")
    head = f"ToMe {config.mode} r={config.ratio:g} on {short_title(FAMILY)} ({WRAPPER}): {what}"
    if not config.enabled:
        return [head]
    if config.speed_check == "off":
        return [head, "speed check off: every call is reduced"]
    return [head, f"speed check {config.speed_check}: each call shape is timed once per device (the model call "
                  "whole against reduced) and left whole where reducing it measured slower"
                  + (" (auto: on a GPU)" if config.speed_check == "auto" else "") + "; the verdicts are shown on "
                  "this node and in the log"]


def describe_patch(patcher: Any) -> str:
    """What ToMe does to this patched clone, with the speed check's verdicts so far."""
    state = patch_of(patcher)
    if state is None:
        return "ToMe is not applied to this model."
    reduced = state.block_count if state.blocks_on is None else sum(state.blocks_on)
    kv_window = list(window_for_dims(state.config.ratio, FAMILY.grid_dims, state.config.sx, state.config.sy)) \
        if state.config.mode == "kv" else []
    lines = describe_lines(state.config, reduced, state.block_count, kv_window)
    return "\n".join(lines + state.describe_verdicts())
