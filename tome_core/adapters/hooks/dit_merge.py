"""Mode "merge" on diffusers DiTs: fewer image tokens through whole blocks, through per-block hooks.

A forward pre-hook on the transformer reads each call's layout and step once; a pre-hook on each block of
the block range hands the block the merged image stream (and the rotary table and per-token inputs cut to
it); a forward hook puts the block's update back on the full stream (``TokenMerge.unmerge_update``). The
matching is planned from the first reduced block's input and reused by the call's other blocks. Text and
every token outside the grid pass whole. No block is replaced or copied; removal takes the hooks and the
state attribute (shared with mode kv, so ``remove_patch``/``is_patched`` treat both alike).
"""
from __future__ import annotations

import inspect
from functools import lru_cache
from typing import Any, Dict, List, Optional, Tuple

import torch

from ...catalogue.diffusers_dits import family_of
from ...engine.config import ToMeConfig
from ...engine.grid import TokenLayout
from ...engine.kv_state import KVPatchState, call_label
from ...engine.schedule import call_step
from ...engine.token_merge import GridMatch, TokenMerge, match_grid, merge_window
from .call_memo import CallMemo
from .call_timing import repeat_call
from .host_caches import refuse_caches_inside
from .unet import not_compiled

STATE_ATTR = "_tome_dit"  # one attribute for both DiT modes: remove_patch and is_patched treat them alike


class _Call:
    """One model call's merge: the image stream's layout, the text length, the step, and (once the first reduced
    block has run) the matching, the merge of each stream it is applied to (the image stream; the joint stream of
    Flux.2's single blocks, [text, image], and of Z-Image's layers, [image, caption]) and the cut rotary tables,
    shared by the call's other blocks."""

    def __init__(self, stream: TokenLayout, text: int, step: float, text_last: bool = False) -> None:
        self.stream, self.text, self.step = stream, text, step
        self.joint = (TokenLayout(stream.grid, prefix=stream.prefix, suffix=stream.suffix + text) if text_last else
                      TokenLayout(stream.grid, prefix=text + stream.prefix, suffix=stream.suffix))
        self.match: Optional[GridMatch] = None
        self.reuse_key: Tuple = ()  # (grid, device) under which match_every keeps this call's matching
        self.destinations: Optional[torch.Tensor] = None  # the step's seeded destinations (drawn before the call)
        self.merges: Dict[TokenLayout, TokenMerge] = {}
        self.rope: Dict[str, Any] = {}  # keyword -> the rotary table cut to the kept tokens

    @property
    def merge(self) -> Optional[TokenMerge]:
        """The image stream's merge (None before the first reduced block)."""
        return None if self.match is None else self.merge_on(self.stream)

    def merge_on(self, layout: TokenLayout) -> TokenMerge:
        if layout not in self.merges:
            self.merges[layout] = self.match.on(layout)
        return self.merges[layout]


class DiTMergeState(KVPatchState):
    """Everything a mode-merge patch keeps; lives on the transformer as ``_tome_dit`` (as mode kv's state)."""

    def __init__(self, model: torch.nn.Module, config: ToMeConfig, blocks: List[Tuple[str, torch.nn.Module]]):
        super().__init__(config)
        self.family = family_of(model)
        self.blocks = blocks
        self.modules = blocks  # what describe() counts
        self.handles: List[Any] = []
        self.current: Optional[_Call] = None
        self.pending: Dict[int, Tuple[torch.Tensor, torch.Tensor]] = {}
        self.memo = CallMemo()  # the family's reading of the last call (call_memo.py)


@not_compiled  # host reads (step, Flux's ids) and the seeded picks stay out of torch.compile's graph
def _on_model_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    state: DiTMergeState = model.__dict__[STATE_ATTR]
    state.current = None
    state.pending.clear()
    config = state.config
    if not config.enabled:
        return
    refuse_caches(state.blocks)  # a cache added after apply_patch
    spec = state.family.timestep
    tokens = state.memo.read(args, kwargs, (0, "hidden_states", spec.index, spec.name),
                             lambda: state.family.read(model, {"args": args, "kwargs": kwargs}))
    if tokens is None or len(tokens.grid) not in (2, 3) or min(tokens.grid) < 1:
        state.warn_once("layout", f"ToMe: {type(model).__name__}: could not place the image tokens of this call; "
                        "its blocks run whole.")
        return
    stream = TokenLayout(tokens.grid, prefix=tokens.before, suffix=tokens.after)
    if stream.grid_tokens < max(config.min_tokens, 4):
        return
    timestep = kwargs.get(spec.name, args[spec.index] if len(args) > spec.index else None)
    on, step = call_step(timestep, config, spec.progress)  # reads the step only for a user-set window
    if not on:
        return
    device = next(model.parameters()).device

    def new_call(reuse: bool = False) -> _Call:
        call = _Call(stream, tokens.text, step, text_last=state.family.text == "last")
        call.reuse_key = (stream.grid, str(device))
        if reuse:  # match_every: an earlier call's matching of this grid (GridMatch holds no batch axis)
            call.match = state.reuse.take(call.reuse_key)
        # drawn here, outside any compiled block: the seeded destinations never reach traced code
        call.destinations = state.destinations_for(stream.grid, merge_window(stream.grid, config.sx, config.sy),
                                                   step, device)
        return call

    state.current = new_call(state.reuse.on)
    if config.speed_check != "off":
        again = repeat_call(model, args, kwargs)

        def run(reduced: bool) -> None:
            state.current = new_call() if reduced else None
            state.pending.clear()
            try:
                again()
            finally:
                state.current = new_call()
                state.pending.clear()

        batch = int((args[0] if args else kwargs["hidden_states"]).shape[0])
        if not state.call_pays((type(model).__name__, stream, batch), call_label(stream.grid, batch),
                               next(model.parameters()).dtype, device, run if again is not None else None):
            state.current = None


@lru_cache(maxsize=None)
def _signature(cls: type) -> inspect.Signature:
    return inspect.signature(cls.forward)


def _keywords(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[dict]:
    """The block call as keywords (gradient checkpointing calls blocks positionally), None if it does not bind."""
    if not args:
        return dict(kwargs)
    try:
        bound = _signature(type(module)).bind(module, *args, **kwargs)
    except TypeError:
        return None
    named = dict(bound.arguments)
    named.pop(next(iter(named)))  # self
    for name, parameter in _signature(type(module)).parameters.items():
        if parameter.kind is inspect.Parameter.VAR_KEYWORD:
            named.update(named.pop(name, {}))
    return named


def _enter(state: DiTMergeState, name: str, joint: bool):
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        call = state.current
        if call is None:
            return None
        inputs = state.family.merge
        named = _keywords(module, args, kwargs)
        hidden = None if named is None else named.get(inputs.hidden)
        stream = call.joint if joint else call.stream  # Flux.2's single blocks take [text, image]
        if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or hidden.shape[1] != stream.length:
            state.warn_once(f"skip:{name}", f"ToMe: {name}: its image stream does not match the call's layout "
                            f"{stream}; this block runs whole.")
            return None
        masked = [key for key in inputs.whole_with if named.get(key) is not None]
        if masked:
            state.warn_once(f"mask:{name}", f"ToMe: {name}: called with {', '.join(masked)} (one entry per token "
                            "pair, which merged tokens have no counterpart for); this block runs whole.")
            return None
        if call.match is None:
            config = state.config
            window = merge_window(stream.grid, config.sx, config.sy)
            destinations = call.destinations
            if destinations.device != hidden.device:
                destinations = destinations.to(hidden.device)
            tokens = hidden[:, stream.prefix:stream.prefix + stream.grid_tokens]
            call.match = match_grid(tokens, stream.grid, config.ratio, destinations, window)
            state.reuse.keep(call.reuse_key, call.match)
        merge = call.merge_on(stream)
        merged = merge.merge(hidden)
        named[inputs.hidden] = merged
        for key in inputs.rope_keys:
            rope = named.get(key)
            if rope is not None and inputs.rope is not None:
                # one cut per call and keyword: the model computes its rotary table once per call and hands every
                # block the same one (keyed by name, not by the table's id: under torch.compile an id is a guard
                # that fails at every call, a recompile per step)
                if key not in call.rope:
                    call.rope[key] = inputs.rope(rope, call.merge, call.text)
                named[key] = call.rope[key]
        for key in inputs.per_token:
            value = named.get(key)
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == merge.length:
                named[key] = merge.take(value, 1)
        state.pending[id(module)] = (hidden, merged, merge)
        if not torch.compiler.is_compiling():  # a diagnostic count; in traced code an int guard, a recompile
            state.reduced_calls += 1
        return (), named
    return pre_hook


def _leave(state: DiTMergeState, joint: bool):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        held = state.pending.pop(id(module), None)
        if held is None or state.current is None:
            return None
        hidden, merged, merge = held
        inputs = state.family.merge
        at = inputs.joint_output if joint else inputs.output
        if at is None:
            return merge.unmerge_update(hidden, merged, output)
        out = list(output)
        out[at] = merge.unmerge_update(hidden, merged, out[at])
        return tuple(out)
    return hook


def refuse_caches(blocks: List[Tuple[str, torch.nn.Module]]) -> None:
    """A diffusers step cache on a merged block (FirstBlockCache, MagCache) or inside one (PyramidAttentionBroadcast,
    TaylorSeer) would return merged tokens of another step's matching: refused, naming it and what works."""
    refuse_caches_inside([(name, block, True) for name, block in blocks], "merge",
                         fix="use mode='kv' on this transformer (its blocks then see every token, so a cached "
                             "block or attention output stays valid)")


def block_names(model: torch.nn.Module, modules: List[Tuple[str, torch.nn.Module, str]]) -> List[str]:
    """The blocks (the attention names without their last part) holding ``modules``, in run order."""
    return list(dict.fromkeys(name.rsplit(".", 1)[0] for name, _, _ in modules))


def install(model: torch.nn.Module, config: ToMeConfig,
            modules: List[Tuple[str, torch.nn.Module, str]]) -> DiTMergeState:
    """Hook the blocks holding ``modules`` (the block range's attentions) of ``model``."""
    lists = family_of(model).merge.lists
    blocks = [(name, model.get_submodule(name)) for name in block_names(model, modules)
              if not lists or name.split(".", 1)[0] in lists]
    if config.enabled:
        refuse_caches(blocks)
    state = DiTMergeState(model, config, blocks)
    state.handles.append(model.register_forward_pre_hook(_on_model_call, with_kwargs=True))
    joint_lists = state.family.merge.joint
    for name, block in blocks:
        joint = name.split(".", 1)[0] in joint_lists
        state.handles.append(block.register_forward_pre_hook(_enter(state, name, joint), with_kwargs=True))
        state.handles.append(block.register_forward_hook(_leave(state, joint), with_kwargs=True))
    model.__dict__[STATE_ATTR] = state
    return state
