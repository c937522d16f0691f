"""Mode "merge" on diffusers DiTs: fewer image tokens through whole blocks, through per-block hooks.

A forward pre-hook on the transformer reads each call's layout and step once; around each block of the block range
(in its marked ``forward``: ``switched.py``, kind "around", traced by torch.compile with the block, so hooks on the
block see its whole tokens) ToMe hands the block the merged image stream (and the rotary table and per-token inputs
cut to it) and puts the block's update back on the full stream after (``TokenMerge.unmerge_update``). The
matching is planned from the first reduced block's input and reused by the call's other blocks. Text and
every token outside the grid pass whole. No block is replaced or copied; removal takes the hooks and the
state attribute (shared with mode kv, so ``remove_patch``/``is_patched`` treat both alike).
"""
from __future__ import annotations

import inspect
import sys
from typing import Any, Dict, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...catalogue.diffusers_lookup import family_of
from ...engine.config import ToMeConfig
from ...engine.grid import TokenLayout
from ...catalogue.families import family_of_binding
from ...engine.call_plan import CallReading, MergeCall
from ...engine.token_merge import TokenMerge, biased_mask, key_bias
from .dit_call import PROBE, STATE_ATTR, DiTCallState, on_model_call
from .host_caches import refuse_caches_inside
from ...engine.passthrough import PYTHON_METHODS
from .switched import enter_for, exit_for


class DiTMergeState(DiTCallState):
    """Everything a mode-merge patch keeps; lives on the transformer as ``_tome_dit`` (as mode kv's state)."""

    def __init__(self, model: torch.nn.Module, config: ToMeConfig, blocks: List[Tuple[str, torch.nn.Module]]):
        super().__init__(model, config)
        self.blocks = blocks
        self.modules = blocks  # what describe() counts
        # the running merged block's (input, merged input, merge); a stack, as ``enter_for``'s (blocks never nest)
        self.pending: List[Tuple[torch.Tensor, torch.Tensor, TokenMerge]] = []
        self.attention = family_of_binding(self.family).attention_for(config)  # how merged keys are weighed
        self.weighing: Optional[Tuple[MergeCall, TokenLayout, TokenMerge]] = None  # the merged block running, if biased
        self.biasing: List["_WeighedKeys"] = []  # the running attention's bias mode (``enter_for``)
        # whether the bias reaches an attention's result, learnt at its first merged call (``_FirstWeighing``) and kept
        # on the attention module itself (``TAKES_MASK``: read by attribute, the same code for every block under
        # regional compilation); forgotten when diffusers' active attention backend changes
        self.weighed: List[torch.nn.Module] = []
        self.sdpa_masks: Dict[Tuple, bool] = {}  # (device, dtype, SDPA kernels allowed) -> whether a mask drops there
        dispatch = sys.modules.get("diffusers.models.attention_dispatch")
        self.backends = getattr(dispatch, "_AttentionBackendRegistry", None)
        self.active_backend = getattr(self.backends, "_active_backend", None)
        self.last_read: Tuple[Any, Optional[TokenLayout]] = (None, None)  # a call's reading and its image stream

    def clear(self) -> None:
        self.current = None
        self.pending.clear()
        self.weighing = None

    def before_call(self, model: torch.nn.Module) -> None:
        refuse_caches(self.blocks)  # a cache added after apply_patch
        super().before_call(model)

    @property
    def takes_mask(self) -> Dict[str, bool]:
        """The verdicts learnt so far, by attention (for tests and diagnostics)."""
        return {str(id(m)): m.__dict__[TAKES_MASK] for m in self.weighed if TAKES_MASK in m.__dict__}

    def forget_masks(self) -> None:
        """Ask each attention again whether it takes the bias (at apply, removal and a change of backend)."""
        for attention in self.weighed:
            attention.__dict__.pop(TAKES_MASK, None)

    def read(self, model: torch.nn.Module, call: dict) -> Any:
        return self.family.read(model, call)

    def reading(self, tokens: Any, step: Any, batch: int, slices: Any = None) -> Optional[CallReading]:
        if tokens is None or len(tokens.grid) not in (2, 3) or min(tokens.grid) < 1:
            self.warn_once("layout", f"ToMe: {self.model_name}: could not place the image tokens of this call; "
                           "its blocks run whole.")
            return None
        if tokens is not self.last_read[0]:  # the memo hands the same reading while the inputs stay the same
            self.last_read = (tokens, TokenLayout(tokens.grid, prefix=tokens.before, suffix=tokens.after))
        stream = self.last_read[1]
        if stream.grid_tokens < max(self.config.min_tokens, 4):
            return None
        active = getattr(self.backends, "_active_backend", None)
        if active is not self.active_backend:  # another backend runs now: each attention is asked again
            self.forget_masks()
            self.active_backend = active
        weight = self.weight
        text = tokens.text
        if slices is not None:  # this process's text: split beside the grid, Wan's (cross-attended apart) whole
            text = text // slices.world if self.family.text != "separate" else text
            self.note_split(slices, lambda: f"each of the {slices.world} processes merges its own band of the grid "
                                            "(its chunk of rows or frames), as many tokens on each")
        return CallReading(stream, step, batch, weight.dtype, weight.device, self.model_name, text=text,
                           text_last=self.family.text == "last", slices=slices)


TAKES_MASK = "_tome_takes_mask"  # on an attention module of a merged block: whether the keys' bias reaches its result
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


class _WeighedKeys(TorchFunctionMode):
    """Inside one attention of a merged block: every scaled_dot_product_attention whose keys are the merged stream
    (alone, or with the text the block concatenates inside) gets the bias that weighs its merged keys
    (``token_merge.key_bias``: "balanced" or "proportional"), added to its mask."""

    LEARNS = False  # whether the attention's exit keeps what this mode saw (``_FirstWeighing``)

    def __init__(self, call: MergeCall, stream: TokenLayout, merge: TokenMerge, how: str, text_first: bool) -> None:
        super().__init__()
        self.call, self.stream, self.merge, self.how, self.text_first = call, stream, merge, how, text_first

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args), **kwargs)
            keys = bound["key"].shape[-2]
            stream = self.stream
            cached = (stream.grid, stream.prefix, stream.suffix, keys)  # one bias per stream and key count, per call
            if cached not in self.call.bias:
                self.call.bias[cached] = self._bias(keys)
            bias = self.call.bias[cached]
            if bias is not None:
                query = bound["query"]
                bound["attn_mask"] = biased_mask(bound.get("attn_mask"), bias, query.dtype, query.ndim)
                return func(**bound)
        if PYTHON_METHODS.get(getattr(func, "__name__", None)) is func and args and type(args[0]) is torch.Tensor:
            return getattr(args[0], func.__name__)(*args[1:], **kwargs)  # passthrough.py
        return func(*args, **kwargs)

    def _bias(self, keys: int) -> Optional[torch.Tensor]:
        """``key_bias`` of ``keys`` keys; under Ulysses context parallelism the keys are the Ulysses group's processes'
        own ([text_0, band_0, text_1, band_1, ...]), each laid out as this one's, so the bias is this process's
        repeated."""
        merge, text, own = self.merge, self.call.text, keys
        if self.call.slices is not None and keys not in (merge.slots, merge.slots + text):
            own = next((local for local in (merge.slots + text, merge.slots) if keys % local == 0), keys)
        bias = key_bias(merge, self.stream, own, text, self.text_first, self.how)
        return bias.repeat(keys // own) if bias is not None and own != keys else bias


class _FirstWeighing(_WeighedKeys):
    """``_WeighedKeys`` for an attention's first merged call (outside torch.compile): also learns whether the bias can
    reach its result. The bias goes into torch's scaled_dot_product_attention, so an attention whose projections ran
    but no SDPA (a diffusers backend such as flash-attn, sage, xformers or flex, or a processor calling such a kernel
    itself) cannot take it; nor can an SDPA whose kernel choice takes no mask (diffusers' "_native_flash" backend
    enters ``sdpa_kernel(FLASH_ATTENTION)``: on CUDA that kernel has no mask, ``sdpa_drops_mask``)."""

    LEARNS = True

    def __init__(self, kernels: Dict[Tuple, bool], *args: Any) -> None:
        super().__init__(*args)
        self.kernels = kernels  # the state's ``sdpa_masks``: each kernel choice probed once
        self.projections = self.sdpa_calls = 0
        self.dropped = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        if func is F.linear:
            self.projections += 1
        elif func is F.scaled_dot_product_attention:
            self.sdpa_calls += 1
            if self.sdpa_calls == 1:
                query = dict(zip(_SDPA_ARGS, args), **(kwargs or {}))["query"]
                cuda = torch.backends.cuda  # the kernels sdpa_kernel() allows (on the CPU too)
                where = (query.device, query.dtype, query.shape[-1], cuda.flash_sdp_enabled(),
                         cuda.mem_efficient_sdp_enabled(), cuda.math_sdp_enabled(), cuda.cudnn_sdp_enabled())
                if where not in self.kernels:
                    self.kernels[where] = sdpa_drops_mask(query)
                self.dropped = self.kernels[where]
            if self.dropped:  # (this mode runs outside torch.compile only: no passthrough.py)
                return func(*args, **(kwargs or {}))
        return super().__torch_function__(func, types, args, kwargs)

    def verdict(self) -> Optional[bool]:
        """Whether the bias reached the attention's result; None where it computed nothing (a cache's stored
        output), to be asked again at its next call."""
        if self.sdpa_calls:
            return not self.dropped
        return False if self.projections else None


PROBE_TOKENS, KEPT_KEY = 16, 5


def sdpa_drops_mask(query: torch.Tensor) -> bool:
    """Whether torch's scaled_dot_product_attention, in the kernel choice in force (``sdpa_kernel``) on ``query``'s
    device and dtype, drops a mask or cannot run one: a tiny call with a mask of -inf on every key but one, whose
    output must then be that key's value. Syncs once: set-up work at an attention's first merged call. The ``meta``
    device computes nothing to compare: there the kernel is taken to honour the mask."""
    if query.device.type == "meta":
        return False
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 1, PROBE_TOKENS, query.shape[-1], generator=generator).to(query.device, query.dtype)
               for _ in range(3))
    mask = torch.full((1, PROBE_TOKENS), -float("inf")).index_fill_(1, torch.tensor([KEPT_KEY]), 0.0)  # one key
    try:
        with torch.no_grad():
            masked = F.scaled_dot_product_attention(q, k, v, attn_mask=mask.to(query.device, query.dtype)).float()
            plain = F.scaled_dot_product_attention(q, k, v).float()
    except RuntimeError:  # e.g. "No available kernel": the kernel allowed here takes no mask
        return True
    expected = v[:, :, KEPT_KEY:KEPT_KEY + 1].float().expand_as(masked)
    return bool((masked - expected).norm() >= (masked - plain).norm())


def attention_named(module: torch.nn.Module, backends: Any) -> str:
    """An attention as users set it up: its processor class, and the diffusers attention backend it dispatches to
    (``set_attention_backend``, else the active one) where that is not the native one."""
    processor = getattr(module, "processor", None)
    cls = type(processor)
    name = cls.__qualname__ if cls.__module__.startswith("diffusers.") else f"{cls.__module__}.{cls.__qualname__}"
    if not hasattr(processor, "_attention_backend"):
        return name
    backend = processor._attention_backend or getattr(backends, "_active_backend", None)
    backend = getattr(backend, "value", backend)
    return name if backend in (None, "native") else f"{name} on diffusers' {backend!r} attention backend"


def positional_names(cls: type) -> Tuple[str, ...]:
    """The names ``cls.forward`` takes positionally after ``self`` (read at install: inspect is no code to trace)."""
    names = []
    for parameter in list(inspect.signature(cls.forward).parameters.values())[1:]:
        if parameter.kind not in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD):
            break
        names.append(parameter.name)
    return tuple(names)


def block_keywords(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[dict]:
    """A block call as keywords (``_keywords`` with the block class's positional names; for code outside the hot path:
    it reads the signature)."""
    return _keywords(positional_names(type(module)), args, kwargs)


def _keywords(names: Tuple[str, ...], args: tuple, kwargs: dict) -> Optional[dict]:
    """The block call as keywords (gradient checkpointing and Wan call blocks positionally; ``names``:
    ``positional_names`` of the block's class), None where it does not bind."""
    if not args:
        return dict(kwargs)
    if len(args) > len(names):
        return None
    for name in names[:len(args)]:  # a loop, not any(...): a generator is a Python call per item
        if name in kwargs:
            return None
    named = dict(zip(names, args))
    named.update(kwargs)
    return named


def _enter(state: DiTMergeState, name: str, joint: bool, names: Tuple[str, ...]):
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        call = state.current
        if call is None or PROBE in module.__dict__:  # a block a step cache probes runs whole
            return None
        inputs = state.family.merge
        named = _keywords(names, args, kwargs)
        hidden = None if named is None else named.get(inputs.hidden)
        stream = call.joint if joint else call.stream  # Flux.2's single blocks take [text, image]
        # context parallelism: a block whose input the host splits inside its own call (diffusers' _cp_plan on
        # Qwen-Image's and Wan's first block) sees every process's tokens here: it merges its own and hands the
        # block them at its place in an input as long, which the host's split hands back
        slices = call.slices
        carried = slices is not None and isinstance(hidden, torch.Tensor) and hidden.ndim == 3 and \
            hidden.shape[1] == slices.world * stream.length
        if carried:
            hidden = slices.own(hidden, 1)
        if not isinstance(hidden, torch.Tensor) or hidden.ndim != 3 or hidden.shape[1] != stream.length:
            state.warn_once(f"skip:{name}", f"ToMe: {name}: its image stream does not match the call's layout "
                            f"{stream}; this block runs whole.")
            return None
        masked = [key for key in inputs.whole_with if named.get(key) is not None]
        if masked:
            state.warn_once(f"mask:{name}", f"ToMe: {name}: called with {', '.join(masked)} (one entry per token "
                            "pair, which merged tokens have no counterpart for); this block runs whole.")
            return None
        merge = call.matched(hidden, stream, state.config, state.reuse)
        merged = merge.merge(hidden)
        named[inputs.hidden] = slices.carrier(merged, 1) if carried else merged
        for key in inputs.rope_keys:
            rope = named.get(key)
            if rope is not None and inputs.rope is not None:
                # one cut per call and keyword: the model computes its rotary table once per call and hands every
                # block the same one (keyed by name, not by the table's id: under torch.compile an id is a guard
                # that fails at every call, a recompile per step)
                if key not in call.cuts:
                    call.cuts[key] = inputs.rope(rope, call.merge, call.text)
                named[key] = call.cuts[key]
        for key in inputs.per_token:
            value = named.get(key)
            if isinstance(value, torch.Tensor) and value.ndim >= 2 and value.shape[1] == merge.length:
                named[key] = merge.take(value, 1)
            elif slices is not None and isinstance(value, torch.Tensor) and value.ndim >= 2 and \
                    value.shape[1] == slices.world * merge.length:  # split by the host inside the call (Qwen's)
                named[key] = slices.carrier(merge.take(slices.own(value, 1), 1), 1)
        state.pending.append((hidden, merged, merge))
        if state.attention == "proportional" or state.attention == "balanced" and (
                stream.prefix + stream.suffix > 0 or not joint and call.text > 0 and state.family.text != "separate"):
            state.weighing = (call, stream, merge)  # balanced: only where keys carried whole sit beside the grid
        if not torch.compiler.is_compiling():  # a diagnostic count; in traced code an int guard, a recompile
            state.reduced_calls += 1
        return (), named
    return pre_hook


def _leave(state: DiTMergeState, joint: bool):
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> Any:
        state.weighing = None
        if not state.pending or state.current is None:
            return None
        held = state.pending.pop()
        if output is None:  # the block raised (always_call)
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
    (``_WeighedKeys``, entered for this module's forward only, so it sees the attention's few ops, not the block's);
    at its first call ``_FirstWeighing`` learns whether the bias reaches the result, and where it does not the
    attention runs plain from then on (no mode, no bias)."""
    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        if state.weighing is not None:
            known = module.__dict__.get(TAKES_MASK)
            if known is False:
                return
            call, stream, merge = state.weighing
            how = (call, stream, merge, state.attention, state.family.text != "last")
            mode = _FirstWeighing(state.sdpa_masks, *how) if known is None and not torch.compiler.is_compiling() \
                else _WeighedKeys(*how)
            enter_for(state.biasing, mode)
    return pre_hook


def _unweigh(state: DiTMergeState):
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        if state.biasing:  # inline: an attention run plain returns here, no further Python call
            mode = exit_for(state.biasing)
            if mode.LEARNS:
                _learn(state, module, mode)
    return hook


def _learn(state: DiTMergeState, module: torch.nn.Module, mode: _FirstWeighing) -> None:
    """Keep what an attention's first merged call showed; where the bias does not reach its result, say once, in
    the log and in describe(), that it runs plain attention."""
    verdict = mode.verdict()
    if verdict is None:
        return
    module.__dict__[TAKES_MASK] = verdict
    if verdict:
        return
    why = ("the kernel its scaled_dot_product_attention runs takes no mask" if mode.sdpa_calls else
           "it does not run torch's scaled_dot_product_attention, where ToMe adds the mask")
    note = f"{state.attention} attention needs a mask; {attention_named(module, state.backends)} ignores masks: plain"
    if note not in state.notes:
        state.notes.append(note)
    state.warn_once(f"mask:{note}", f"ToMe: {state.model_name}: {note} ({why}).")


def refuse_caches(blocks: List[Tuple[str, torch.nn.Module]]) -> None:
    """A diffusers step cache inside a merged block (PyramidAttentionBroadcast, TaylorSeer and FasterCache on its
    attention) would return merged tokens of another step's matching: refused, naming it and what works. One on the
    block itself (FirstBlockCache, MagCache, SeaCache) composes: ToMe's merge runs under its hook
    (``host_caches.cache_slot``), so it keeps the block's whole tokens."""
    refuse_caches_inside([(name, block, False) for name, block in blocks], "merge",
                         fix="use mode='kv' on this transformer (its blocks then see every token, so a cached "
                             "attention output stays valid), or a cache on whole blocks (FirstBlockCache, MagCache, "
                             "SeaCache), which composes with mode 'merge'")


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
    state.changed_blocks = blocks
    state.handles.append(model.register_forward_pre_hook(on_model_call, with_kwargs=True))
    joint_lists = state.family.merge.joint
    for name, block in blocks:  # registered while calls are reduced (``on_model_call``)
        joint = name.split(".", 1)[0] in joint_lists
        state.hooks.add(block, (_enter(state, name, joint, positional_names(type(block))), _leave(state, joint)),
                        "around")
        if state.attention == "plain":
            continue
        for attention in (m for m in block.modules() if m is not block and hasattr(m, "processor")):
            state.weighed.append(attention)
            state.hooks.add(attention, (_weigh(state), _unweigh(state)), "around")  # diffusers' attentions
    state.forget_masks()  # an earlier patch's verdicts
    model.__dict__[STATE_ATTR] = state
    return state
