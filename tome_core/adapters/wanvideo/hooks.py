"""The forward hooks ToMe puts on the wrapper's transformer and its blocks.

They are installed once per transformer and shared by every clone of the model (the clones share the module), so
each one first looks for ToMe's key in the call's ``transformer_options`` and does nothing without it: a clone that
ToMe did not patch runs exactly as before. The transformer's hooks plan (and end) each model call; each block's pre-
and post-hooks carry the plan into the block. The wrapper's sampler may ``torch.compile`` each block at sampling time,
putting a compiled wrapper (``OptimizedModule``) in ``blocks``: the model's pre-hook then moves the block hooks onto
that wrapper, where they run eagerly around the compiled block (never traced: no per-step guard, no recompile).
"""
from __future__ import annotations

from functools import partial
from typing import Any, Optional

import torch

from .state import WanVideoPatch

OPTIONS_KEY = "tome_wanvideo"
MODEL_HOOKS = "_tome_wanvideo_hooks"  # on the transformer: its two hook handles
BLOCK_HOOKS = "_tome_wanvideo_block_hooks"  # on each block (or its compiled wrapper): its two hook handles


def patch_in(kwargs: dict) -> Optional[WanVideoPatch]:
    """ToMe's state in a call's transformer_options, None where the call's clone is not patched. Duck typed
    (``WanVideoPatch.TOME_STATE``): a second copy of tome_core in the process (a pip install beside the ComfyUI pack)
    finds the hooks the first one installed, and they run its state."""
    options = kwargs.get("transformer_options")
    found = options.get(OPTIONS_KEY) if isinstance(options, dict) else None
    return found if getattr(found, "TOME_STATE", None) == OPTIONS_KEY else None


def install(model: torch.nn.Module, blocks: str) -> None:
    """Put the model-call hooks on the transformer (once), and the block hooks on its blocks."""
    if MODEL_HOOKS not in model.__dict__:
        model.__dict__[MODEL_HOOKS] = (
            model.register_forward_pre_hook(_before_model_call, with_kwargs=True),
            model.register_forward_hook(_after_model_call, with_kwargs=True))
        model.__dict__["_tome_wanvideo_blocks"] = blocks
    hook_blocks(model)


def hook_blocks(model: torch.nn.Module) -> None:
    """Block hooks on whatever ``model.blocks`` holds now: each block, or its torch.compile wrapper (and then not on
    the block inside it, where torch.compile would trace them)."""
    for index, block in enumerate(getattr(model, model.__dict__["_tome_wanvideo_blocks"])):
        if BLOCK_HOOKS in block.__dict__:
            continue
        inner = block.__dict__.get("_modules", {}).get("_orig_mod")
        if inner is not None and BLOCK_HOOKS in inner.__dict__:
            for handle in inner.__dict__.pop(BLOCK_HOOKS):
                handle.remove()
        block.__dict__[BLOCK_HOOKS] = (
            block.register_forward_pre_hook(partial(_before_block, index), with_kwargs=True),
            block.register_forward_hook(partial(_after_block, index), with_kwargs=True, always_call=True))


def _before_model_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    patch = patch_in(kwargs)
    if patch is None or patch.busy:
        return None
    hook_blocks(model)
    patch.begin(model, args, kwargs)
    return None


def _after_model_call(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    patch = patch_in(kwargs)
    if patch is not None and not patch.busy:
        patch.end(model)
    return None


def _before_block(index: int, block: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    patch = patch_in(kwargs)
    return None if patch is None else patch.before_block(index, block, args, kwargs)


def _after_block(index: int, block: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    patch = patch_in(kwargs)
    return None if patch is None else patch.after_block(index, block, output)
