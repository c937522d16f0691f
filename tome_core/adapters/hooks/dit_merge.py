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
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...catalogue.diffusers_dits import family_of
from ...engine.config import ToMeConfig
from ...engine.grid import TokenLayout
from ...catalogue.families import family_of_binding
from ...engine.token_merge import GridMatch, TokenMerge, biased_mask, key_bias, match_grid, merge_window
from .dit_call import STATE_ATTR, DiTCallState, on_model_call
from .host_caches import refuse_caches_inside


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
        self.bias: Dict[Tuple[TokenLayout, int], Optional[torch.Tensor]] = {}  # (stream, keys) -> key_bias

    @property
    def merge(self) -> Optional[TokenMerge]:
        """The image stream's merge (None before the first reduced block)."""
        return None if self.match is None else self.merge_on(self.stream)

    def merge_on(self, layout: TokenLayout) -> TokenMerge:
        if layout not in self.merges:
            self.merges[layout] = self.match.on(layout)
        return self.merges[layout]


class DiTMergeState(DiTCallState):
    """Everything a mode-merge patch keeps; lives on the transformer as ``_tome_dit`` (as mode kv's state)."""

    def __init__(self, model: torch.nn.Module, config: ToMeConfig, blocks: List[Tuple[str, torch.nn.Module]]):
        super().__init__(model, config)
        self.blocks = blocks
        self.modules = blocks  # what describe() counts
        self.pending: Dict[int, Tuple[torch.Tensor, torch.Tensor, TokenMerge]] = {}
        self.attention = family_of_binding(self.family).attention_for(config)  # how merged keys are weighed
        self.weighing: Optional[Tuple["_Call", TokenLayout, TokenMerge]] = None  # the merged block running, if biased
        self.biasing: Dict[int, "_WeighedKeys"] = {}  # attention module -> its bias mode, while it runs

    def clear(self) -> None:
        self.current = None
        self.pending.clear()
        self.weighing = None

    def before_call(self, model: torch.nn.Module) -> None:
        refuse_caches(self.blocks)  # a cache added after apply_patch

    def read(self, model: torch.nn.Module, call: dict) -> Any:
        return self.family.read(model, call)

    def placed(self, tokens: Any) -> Optional[TokenLayout]:
        if tokens is None or len(tokens.grid) not in (2, 3) or min(tokens.grid) < 1:
            self.warn_once("layout", f"ToMe: {self.model_name}: could not place the image tokens of this call; "
                           "its blocks run whole.")
            return None
        stream = TokenLayout(tokens.grid, prefix=tokens.before, suffix=tokens.after)
        return stream if stream.grid_tokens >= max(self.config.min_tokens, 4) else None

    def planner(self, tokens: Any, stream: TokenLayout, step: Any,
                device: torch.device) -> Optional[Callable[[bool], "_Call"]]:
        config = self.config

        def new_call(first: bool) -> _Call:
            call = _Call(stream, tokens.text, step, text_last=self.family.text == "last")
            call.reuse_key = (stream.grid, str(device))
            if first and self.reuse.on:  # match_every: an earlier call's matching of this grid (no batch axis)
                call.match = self.reuse.take(call.reuse_key)
            # drawn here, outside any compiled block: the seeded destinations never reach traced code
            call.destinations = self.destinations_for(stream.grid, merge_window(stream.grid, config.sx, config.sy),
                                                      step, device)
            return call

        return new_call


_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _WeighedKeys(TorchFunctionMode):
    """Inside one attention of a merged block: every scaled_dot_product_attention whose keys are the merged stream
    (alone, or with the text the block concatenates inside) gets the bias that weighs its merged keys
    (``token_merge.key_bias``: "balanced" or "proportional"), added to its mask."""

    def __init__(self, call: "_Call", stream: TokenLayout, merge: TokenMerge, how: str, text_first: bool) -> None:
        super().__init__()
        self.call, self.stream, self.merge, self.how, self.text_first = call, stream, merge, how, text_first

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args), **kwargs)
            keys = bound["key"].shape[-2]
            cached = (self.stream, keys)  # one bias per stream and key count in a call
            if cached not in self.call.bias:
                self.call.bias[cached] = key_bias(self.merge, self.stream, keys, self.call.text, self.text_first,
                                                  self.how)
            bias = self.call.bias[cached]
            if bias is not None:
                query = bound["query"]
                bound["attn_mask"] = biased_mask(bound.get("attn_mask"), bias, query.dtype, query.ndim)
                return func(**bound)
        return func(*args, **kwargs)


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
        if state.attention == "proportional" or state.attention == "balanced" and (
                stream.prefix + stream.suffix > 0 or not joint and call.text > 0 and state.family.text != "separate"):
            state.weighing = (call, stream, merge)  # balanced: only where keys carried whole sit beside the grid
        if not torch.compiler.is_compiling():  # a diagnostic count; in traced code an int guard, a recompile
            state.reduced_calls += 1
        return (), named
    return pre_hook


def _leave(state: DiTMergeState, joint: bool):
    def hook(module: torch.nn.Module, args: tuple, kwargs: dict, output: Any) -> Any:
        state.weighing = None
        held = state.pending.pop(id(module), None)
        if held is None or state.current is None or output is None:  # None: the block raised (always_call)
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


def _weigh(state: DiTMergeState):
    """Pre-hook of an attention module inside a merged block: its scaled_dot_product_attention calls get the bias
    (``_WeighedKeys``, entered for this module's forward only, so it sees the attention's few ops, not the block's)."""
    def pre_hook(module: torch.nn.Module, args: tuple) -> None:
        if state.weighing is not None:
            call, stream, merge = state.weighing
            mode = _WeighedKeys(call, stream, merge, state.attention, state.family.text != "last")
            mode.__enter__()
            state.biasing[id(module)] = mode
    return pre_hook


def _unweigh(state: DiTMergeState):
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        mode = state.biasing.pop(id(module), None)
        if mode is not None:
            mode.__exit__(None, None, None)
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
    state.handles.append(model.register_forward_pre_hook(on_model_call, with_kwargs=True))
    joint_lists = state.family.merge.joint
    for name, block in blocks:
        joint = name.split(".", 1)[0] in joint_lists
        state.handles.append(block.register_forward_pre_hook(_enter(state, name, joint), with_kwargs=True))
        state.handles.append(block.register_forward_hook(_leave(state, joint), with_kwargs=True, always_call=True))
        if state.attention == "plain":
            continue
        for attention in (m for m in block.modules() if m is not block and hasattr(m, "processor")):
            state.handles.append(attention.register_forward_pre_hook(_weigh(state)))  # diffusers' attentions
            state.handles.append(attention.register_forward_hook(_unweigh(state), always_call=True))
    model.__dict__[STATE_ATTR] = state
    return state
