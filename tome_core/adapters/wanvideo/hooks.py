"""The forward hooks ToMe puts on the wrapper's transformer and its blocks.

They are installed once per transformer and shared by every clone of the model (the clones share the module), so
each one first looks for ToMe's key in the call's ``transformer_options`` and does nothing without it: a clone that
ToMe did not patch runs exactly as before. The transformer's hooks plan (and end) each model call; each block's pre-
and post-hooks carry the plan into the block, the first block of a planned call checking its inputs first. The
wrapper's sampler may ``torch.compile`` each block at sampling time, putting a compiled wrapper (``OptimizedModule``) in
``blocks``: the model's pre-hook then moves the block hooks onto that wrapper, where they run eagerly around the
compiled block (never traced: no per-step guard, no recompile).

What ToMe leaves on the wrapper's modules is one attribute of the transformer, ``_tome_wanvideo`` (``ATTRIBUTE``): the
``WanVideoHooks`` record of those hooks' handles, so they are installed once and can be moved. It holds no patch state
(that is each clone's, under its key in ``transformer_options``); nothing is written on the blocks.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import partial
from typing import Any, Dict, Optional, Tuple

import torch

from ...catalogue.wanvideo import block_input_refusal
from .state import WanVideoPatch

OPTIONS_KEY = "tome_wanvideo"
ATTRIBUTE = "_tome_wanvideo"  # on the transformer: its WanVideoHooks


@dataclass
class WanVideoHooks:
    """ToMe's hooks on one transformer: the name of its block list, the handles of the two model-call hooks, and per
    block index the module hooked there (the block, or the torch.compile wrapper that replaced it) with its handles."""

    blocks: str
    model: Tuple[Any, Any]
    hooked: Dict[int, Tuple[torch.nn.Module, Tuple[Any, Any]]] = field(default_factory=dict)


def patch_in(kwargs: dict) -> Optional[WanVideoPatch]:
    """ToMe's state in a call's transformer_options, None where the call's clone is not patched. Duck typed
    (``WanVideoPatch.TOME_STATE``): a second copy of tome_core in the process (a pip install beside the ComfyUI pack)
    finds the hooks the first one installed, and they run its state."""
    options = kwargs.get("transformer_options")
    found = options.get(OPTIONS_KEY) if isinstance(options, dict) else None
    return found if getattr(found, "TOME_STATE", None) == OPTIONS_KEY else None


def install(model: torch.nn.Module, blocks: str) -> None:
    """Put the model-call hooks on the transformer (once), and the block hooks on its blocks."""
    if ATTRIBUTE not in model.__dict__:
        model.__dict__[ATTRIBUTE] = WanVideoHooks(blocks, (
            model.register_forward_pre_hook(_before_model_call, with_kwargs=True),
            model.register_forward_hook(_after_model_call, with_kwargs=True)))
    hook_blocks(model)


def hook_blocks(model: torch.nn.Module) -> None:
    """Block hooks on whatever ``model.blocks`` holds now: each block, or its torch.compile wrapper (and then no longer
    on the block inside it, where torch.compile would trace them)."""
    record = model.__dict__[ATTRIBUTE]
    for index, block in enumerate(getattr(model, record.blocks)):
        found = record.hooked.get(index)
        if found is not None and found[0] is block:
            continue
        if found is not None:
            for handle in found[1]:
                handle.remove()
        record.hooked[index] = (block, (
            block.register_forward_pre_hook(partial(_before_block, index), with_kwargs=True),
            block.register_forward_hook(partial(_after_block, index), with_kwargs=True, always_call=True)))


def _before_model_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    patch = patch_in(kwargs)
    if patch is None:
        return None
    hook_blocks(model)
    patch.begin(model, args, kwargs)
    return None


def _after_model_call(model: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
    patch = patch_in(kwargs)
    if patch is not None:
        patch.end(model)
    return None


def _before_block(index: int, block: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[tuple]:
    patch = patch_in(kwargs)
    if patch is None:
        return None
    call = patch.current
    if call is not None and not getattr(call, "inputs_checked", True):  # the first block of a call ToMe acts on
        call.inputs_checked = True
        refused = block_input_refusal(block, args, kwargs, patch.config.mode)
        if refused:
            raise ValueError(refused)
    return patch.before_block(index, block, args, kwargs)


def _after_block(index: int, block: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
    patch = patch_in(kwargs)
    return None if patch is None else patch.after_block(index, block, output)
