"""One patched clone of a WanVideoWrapper model: its settings, and each model call's plan.

The state lives in the clone's ``model_options["transformer_options"]`` (ToMe's key), so it travels with the clone,
and is that clone's alone; the wrapper's sampler deep-copies those options at every run, and a copy of the state is
the state itself (``__deepcopy__``), as ComfyUI's patches are shared by the clones made from a patched model. Each
model call ``begin``s a plan (refusals first, then the layout, the step window, the seeded picks and the speed check)
that the block hooks read, and ``end``s it.
"""
from __future__ import annotations

import sys
from typing import Any, Optional, Tuple

import torch

from ...catalogue.wanvideo import (WanVideoDiT, attention_refusal, call_layout, feature_refusals, multiple_prompts,
                                   rope_refusal)
from ...engine.config import ToMeConfig
from ...engine.grid import TokenLayout
from ...engine.kv import dit_window
from ...engine.call_plan import CallPlanner, CallReading, KVCall, MergeCall, PlannedCall
from ...engine.schedule import step_signal
from .blocks import KVMode, merged_block_args, unmerged_output

CLIP_TOKENS = 257  # Wan i2v's CLIP image tokens: a cross-attention of that key length looks like a self-attention


class WanVideoPatch(CallPlanner):
    """The state of one clone: config, binding, the blocks reduced; ``current`` is the running call's plan."""

    TOME_STATE = "tome_wanvideo"  # what the hooks look for (hooks.patch_in), the key it is kept under

    def __init__(self, config: ToMeConfig, binding: WanVideoDiT, blocks_on: Optional[Tuple[bool, ...]],
                 block_count: int) -> None:
        super().__init__(config)
        self.binding, self.blocks_on, self.block_count = binding, blocks_on, block_count
        self.current: Optional[PlannedCall] = None
        self.reach_checked = False

    def __deepcopy__(self, memo: dict) -> "WanVideoPatch":
        return self

    def __copy__(self) -> "WanVideoPatch":
        return self

    def reduces(self, index: int) -> bool:
        return self.blocks_on is None or (index < len(self.blocks_on) and self.blocks_on[index])

    # --- one model call -------------------------------------------------------------------------------------------
    def begin(self, model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """Plan this model call: refuse what ToMe cannot carry (before any block runs), else set ``current``."""
        self.current = None
        options = kwargs.get("transformer_options") or {}
        refused = call_refusal(model, kwargs, options, self.config.mode)
        if refused:
            raise ValueError(refused)
        config = self.config
        if not config.enabled or self.forcing is False:
            return
        latents = kwargs.get("x", args[0] if args else None)
        layout = call_layout(model, dict(kwargs, x=latents))
        if layout is None or layout.grid_tokens < max(config.min_tokens, 4) or not self._window_reduces(layout):
            return
        device = latents[0].device
        progress = kwargs.get("current_step_percentage")
        if not config.in_schedule(None if progress is None else float(progress)):
            if not self.reach_checked:  # the first call, outside the window: check the hooks reach
                self.current = MergeCall(layout, probe=True) if config.mode == "merge" else KVCall(layout, None,
                                                                                                    probe=True)
            return
        if config.mode == "kv" and layout.length in (int(getattr(model, "text_len", 512)), CLIP_TOKENS):
            self.warn_once("ambiguous", f"ToMe: {layout.length} video tokens equal the text's or the CLIP image's "
                           "token count; kv leaves this size unreduced (self- and cross-attention look alike).")
            return
        step = step_signal(kwargs.get("t", args[1] if len(args) > 1 else None))
        reading = CallReading(layout, step, len(latents), getattr(model, "base_dtype", torch.float32), device,
                              f"WanVideoWrapper {type(model).__name__}")
        repeat = None if _unrepeatable(model) else (lambda: self._again(model, args, kwargs))
        self.current = self.plan(reading, repeat)

    def end(self, model: torch.nn.Module) -> None:
        """After a model call: the first planned call must have reached ToMe's block hooks (else nothing would be
        reduced while the node says otherwise)."""
        call, self.current = self.current, None
        if call is None or self.reach_checked:
            return
        if not call.reached:
            raise RuntimeError(unreached(self.config.mode, model))
        self.reach_checked = True

    def _window_reduces(self, layout: TokenLayout) -> bool:
        if self.config.mode == "merge":
            return True
        return max(dit_window(self.config.ratio, layout.grid, self.config.sx, self.config.sy)) > 1

    @staticmethod
    def _again(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        """The speed check's repeat of this model call, through ToMe's hooks as the user gets it (``forcing`` says
        whole or reduced; its output dropped)."""
        with torch.no_grad():
            model(*args, **kwargs)

    # --- one block call -------------------------------------------------------------------------------------------
    def before_block(self, index: int, block: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
        call = self.current
        if call is None:
            return None
        if call.probe or not self.reduces(index):
            if self.config.mode == "merge":
                call.reached = True  # a block hook ran: merge would have reached it
            elif call.probe:
                call.pending[index] = _entered(KVMode(call.layout, None, probe=True))
            return None
        if self.config.mode == "kv":
            call.pending[index] = _entered(KVMode(call.layout, call.keep))
            return None
        call.reached = True
        x = args[0] if args else kwargs["x"]
        _check_stream(call.layout, x, kwargs)
        call.matched(x, call.layout, self.config, self.reuse)
        if not args:
            args = (kwargs.pop("x"),)
        new_args, new_kwargs, pending = merged_block_args(self.binding.merge, call.merge, x, args, kwargs, call.cuts)
        call.pending[index] = pending
        if not torch.compiler.is_compiling():
            self.reduced_calls += 1
        return new_args, new_kwargs

    def after_block(self, index: int, block: torch.nn.Module, output: Any) -> Any:
        call = self.current
        pending = call.pending.pop(index, None) if call is not None else None
        if isinstance(pending, KVMode):
            pending.__exit__(None, None, None)
            if pending.reached:
                call.reached = True
                if not pending.probe and not torch.compiler.is_compiling():
                    self.reduced_calls += 1
            return None
        if pending is None or output is None:  # output None: the block raised
            return None
        return unmerged_output(pending, block, output)


def _entered(mode: KVMode) -> KVMode:
    mode.__enter__()
    return mode


def _check_stream(layout: TokenLayout, x: torch.Tensor, kwargs: dict) -> None:
    """The block's stream must be the one the call's keywords describe; a feature that changed it is not one ToMe
    knows, and merging it would scramble the video: stop, naming what was found."""
    video = kwargs.get("original_seq_len")
    if x.ndim != 3 or x.shape[1] != layout.length or (isinstance(video, int) and video != layout.grid_tokens):
        raise RuntimeError(
            f"ToMe (WanVideoWrapper): a block got {tuple(x.shape)} tokens (video tokens {video}), not the layout this "
            f"model call's inputs describe ({layout}): a feature of the wrapper that ToMe does not know added or moved "
            "tokens. Remove that feature or the ToMe node, and please report it.")


def _unrepeatable(model: torch.nn.Module) -> bool:
    """Whether repeating a model call for the speed check would disturb the wrapper's step caches."""
    return any(bool(getattr(model, name, False)) for name in ("enable_teacache", "enable_magcache", "enable_easycache"))


def call_refusal(model: Any, kwargs: dict, options: dict, mode: str) -> Optional[str]:
    """Why ToMe cannot carry this model call in ``mode`` (a feature, the attention mode, the RoPE), else None."""
    refused = feature_refusals(model, kwargs, options, mode)
    if refused:
        return refused
    refused = attention_refusals(model, options, mode)
    refused = refused or rope_refusal(str(getattr(model, "rope_func", "comfy")), mode)
    if not refused and mode == "merge" and multiple_prompts(kwargs):
        refused = ("ToMe (WanVideoWrapper): several prompts (or CLIP embeddings) over one video are not supported "
                   "with ToMe's mode merge: the wrapper splits the video tokens by frame between them; use mode kv, "
                   "or one prompt.")
    return refused


def comfy_attention() -> Optional[str]:
    """The name of the running ComfyUI's ``optimized_attention`` (what the wrapper's attention_mode "comfy" calls), read
    from the module ComfyUI has loaded (never imported here); None outside ComfyUI."""
    attention = sys.modules.get("comfy.ldm.modules.attention")
    function = getattr(attention, "optimized_attention", None)
    return getattr(function, "__name__", None) if function is not None else None


def attention_refusals(model: Any, options: dict, mode: str) -> Optional[str]:
    """Why ``mode`` cannot run under the attention the model's blocks use: an override another node set (it wins where
    it applies), else the loader's attention_mode."""
    override = options.get("attention_mode_override")
    found = None
    if isinstance(override, dict) and override.get("mode"):
        found = attention_refusal(str(override["mode"]), mode, "WanVideoSetAttentionModeOverride", comfy_attention())
    return found or attention_refusal(str(getattr(model, "attention_mode", "sdpa")), mode,
                                      "the model loader's attention_mode", comfy_attention())


def unreached(mode: str, model: Any) -> str:
    what = "block" if mode == "merge" else "self-attention (torch's scaled_dot_product_attention)"
    why = ("its blocks were called without ToMe's hooks (the transformer compiled whole, or a node that runs the "
           "blocks itself)" if mode == "merge" else
           "its attention ran in a kernel of its own (attention_mode 'comfy' with a ComfyUI attention other than "
           "PyTorch's, or a node that runs the blocks itself)")
    return (f"ToMe (WanVideoWrapper): mode {mode} reached no {what} of {type(model).__name__}'s first model call: "
            f"{why}, so the video would come back without ToMe. Use attention_mode sdpa"
            + (" or ToMe's mode merge" if mode == "kv" else "") + ", or remove the ToMe node.")
