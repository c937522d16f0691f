"""Mode "kv" on diffusers DiTs (the catalogue's diffusers bindings) through per-module hooks; no diffusers import.

Where to act: these models apply RoPE and concatenate text with image tokens *inside* their
attention processors, so the only point that sees the final (rotated, concatenated) keys is the
attention call itself. Around each patched attention module's forward (in its marked ``forward``:
``switched.py``, kind "around", which torch.compile traces with the block), ToMe enters a
``TorchFunctionMode`` that lives only for that forward and shortens the keys/values handed to
``torch.nn.functional.scaled_dot_product_attention`` (diffusers' native backend and SD3's processor
both end there), and leaves it after, also where the forward raised. No processor is replaced or
copied and no global is touched; removal takes the hooks and the state attribute away.
"""
from __future__ import annotations

from typing import Any, List, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...engine.blocks import chosen_blocks
from ...engine.config import ToMeConfig, require_dit_config
from ...catalogue.diffusers_dits import KeyInputs
from ...catalogue.invoke_dits import WindowedDiT
from ...catalogue.diffusers_lookup import family_of, find_dit, merging_families, supported_classes, unsupported_dit
from ...engine.grid import TokenLayout
from ...engine.kv import dit_window
from ...engine.call_plan import CallPlanner, CallReading
from . import dit_merge
from .dit_call import PROBE, STATE_ATTR, DiTCallState, on_model_call
from ...engine.passthrough import PYTHON_METHODS
from .switched import enter_for, exit_for
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def check_config(model: torch.nn.Module, config: ToMeConfig) -> None:
    """Refuse what would give users a different image than they asked for, naming the model and the fix."""
    family = family_of(model)
    name = type(model).__name__
    if isinstance(family, WindowedDiT):  # a host's own class: named with its module (InvokeAI's Flux, not diffusers')
        name = f"{name} ({type(model).__module__}.{name})"
    require_dit_config(config, name, merges=family is not None and family.merge is not None,
                       merge_families=merging_families())


class _KVMode(TorchFunctionMode):
    """Shortens the keys/values of the scaled_dot_product_attention calls made inside one module's forward."""

    def __init__(self, state: "DiTState", layout: TokenLayout, keep: torch.Tensor, module: torch.nn.Module) -> None:
        super().__init__()
        # the attention itself, not its name: a string made per attention would be a guard of dynamo's under regional
        # compilation (one graph per block instance); the name is looked up only for a message
        self.state, self.layout, self.keep, self.module = state, layout, keep, module
        self.sdpa_calls = 0
        self.projections = 0  # F.linear calls: nonzero where the attention computed its q/k/v itself
        self.kept_before = 0  # the key count where the keys' inputs were already cut to the kept tokens

    @property
    def where(self) -> str:
        return next((name for name, module, _ in self.state.modules if module is self.module), "an attention")

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func is F.linear:
            self.projections += 1
        elif func is F.scaled_dot_product_attention:
            bound = dict(zip(_SDPA_ARGS, args), **kwargs)
            self.sdpa_calls += 1
            key, value, mask = bound["key"], bound["value"], bound.get("attn_mask")
            if key.shape[-2] == self.layout.length and value.shape[-2] == self.layout.length \
                    and not bound.get("is_causal", False):
                keep = self.keep.to(key.device) if self.keep.device != key.device else self.keep
                bound["key"], bound["value"] = key.index_select(-2, keep), value.index_select(-2, keep)
                if isinstance(mask, torch.Tensor) and mask.shape[-1] == self.layout.length:
                    bound["attn_mask"] = mask.index_select(-1, keep)
                if not torch.compiler.is_compiling():  # a diagnostic count; in traced code an int guard, a recompile
                    self.state.reduced_calls += 1
            elif self.kept_before and key.shape[-2] == self.kept_before == value.shape[-2]:
                if not torch.compiler.is_compiling():
                    self.state.reduced_calls += 1
            else:
                self.state.warn_once(f"skip:{self.where}", f"ToMe: {self.where}: keys of length {key.shape[-2]} "
                                     f"do not match the token layout {self.layout}; left unreduced.")
            return func(**bound)
        if PYTHON_METHODS.get(getattr(func, "__name__", None)) is func and args and type(args[0]) is torch.Tensor:
            return getattr(args[0], func.__name__)(*args[1:], **kwargs)  # passthrough.py
        return func(*args, **kwargs)


class DiTState(DiTCallState):
    """Everything a mode-kv patch keeps; lives on the transformer as ``_tome_dit`` (never in a global)."""

    def __init__(self, model: torch.nn.Module, config: ToMeConfig, modules: List[Tuple[str, torch.nn.Module, str]]):
        super().__init__(model, config)
        self.modules = modules
        self.modes: List[_KVMode] = []  # the running attention's (``enter_for``)
        self.image_keys = any(kind == "image" for _, _, kind in modules)  # an image-only self-attention is hooked

    def read(self, model: torch.nn.Module, call: dict) -> Optional[TokenLayout]:
        return self.family.layout(model, call)

    def reading(self, found: Optional[TokenLayout], step: Any, batch: int,
                slices: Any = None) -> Optional[CallReading]:
        if found is None:
            self.warn_once("layout", f"ToMe: {self.model_name}: could not place the image tokens of this call "
                           "(e.g. reference-image tokens); attention left unreduced.")
            return None
        config = self.config
        if found.grid_tokens < max(config.min_tokens, 2) or \
                max(dit_window(config.ratio, found.grid, config.sx, config.sy)) == 1:
            return None  # too few tokens, or a window of one token: nothing to reduce
        weight = self.weight
        if slices is not None:
            self.note_split(slices, lambda: f"each of the {slices.world} processes keeps the keys one process "
                                            "would, found where Ulysses gathers them")
        return CallReading(found, step, batch, weight.dtype, weight.device, self.model_name,
                           image_keys=self.image_keys, slices=slices)


def _kept_key_inputs(keys: KeyInputs, layout: TokenLayout, keep: torch.Tensor, args: tuple,
                     kwargs: dict) -> Optional[dict]:
    """The call's keywords with the keys' inputs cut to the kept tokens (``KeyInputs``), or None where this call
    is not a plain self-attention over the layout (its keys are then reduced at the attention itself)."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    rope = kwargs.get(keys.query_rope)
    if (set(kwargs) - set(keys.allowed) or kwargs.get(keys.source) is not None or kwargs.get(keys.rope) is not None
            or kwargs.get("attention_mask") is not None or not isinstance(hidden, torch.Tensor)
            or hidden.ndim != 3 or hidden.shape[1] != layout.length
            or not (isinstance(rope, (tuple, list)) and len(rope) == 2
                    and all(isinstance(part, torch.Tensor) for part in rope))):
        return None
    seq = 2 if rope[0].ndim == 4 else 1  # (B, heads, T, r) for split RoPE, (B, T, C) interleaved
    if any(part.ndim < 2 or part.shape[seq] != layout.length for part in rope):
        return None
    keep = keep.to(hidden.device) if keep.device != hidden.device else keep
    kwargs = dict(kwargs)
    kwargs[keys.source] = hidden.index_select(1, keep)
    kwargs[keys.rope] = tuple(part.index_select(seq, keep) for part in rope)
    return kwargs


def _enter(state: DiTState, name: str, kind: str):
    joint = kind == "joint"  # the call's whole layout; else a self-attention over the grid alone

    def pre_hook(module: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[Tuple[tuple, dict]]:
        call = state.current
        # registered only while calls are reduced (a speed-check repeat may still clear it); a block a step cache
        # probes keeps every key (``PROBE``)
        if call is None or PROBE in module.__dict__:
            return None
        layout, keep = (call.layout, call.keep) if joint else (call.image, call.image_keep)
        mode = _KVMode(state, layout, keep, module)
        keys = state.family.key_inputs
        kept = _kept_key_inputs(keys, layout, keep, args, kwargs) if keys is not None else None
        if kept is not None:
            mode.kept_before = keep.numel()
        enter_for(state.modes, mode)
        return None if kept is None else (args, kept)
    return pre_hook


def _leave(state: DiTState):
    def hook(module: torch.nn.Module, args: tuple, output: Any) -> None:
        mode = exit_for(state.modes)
        # Projections but no SDPA: a global diffusers attention backend (flash-attn, sage, xformers) computed it.
        # Neither: a cache (TaylorSeer, Pyramid Attention Broadcast, FasterCache) returned its stored output for this
        # step; nothing was computed, so there is nothing to reduce and no error.
        if mode is not None and mode.sdpa_calls == 0 and mode.projections > 0:
            raise RuntimeError(
                    f"ToMe: {mode.where} computed attention without torch's scaled_dot_product_attention, so "
                    "mode 'kv' could not reduce it (a non-native diffusers attention backend?); use the native "
                    "backend (model.set_attention_backend('native')) or remove_patch().")
    return hook


# diffusers attention backends that end in torch.nn.functional.scaled_dot_product_attention
_SDPA_BACKENDS = {None, "native", "_native_flash", "_native_efficient", "_native_cudnn", "_native_math"}


def _check_backends(model: torch.nn.Module, modules: List[Tuple[str, torch.nn.Module, str]]) -> None:
    for name, module, _ in modules:
        backend = getattr(getattr(module, "processor", None), "_attention_backend", None)
        backend = getattr(backend, "value", backend)  # AttentionBackendName is a str enum
        if backend not in _SDPA_BACKENDS:
            raise ValueError(
                f"ToMe: {type(model).__name__}'s attention {name} uses the diffusers attention backend "
                f"{backend!r}; mode 'kv' reaches only backends that call torch's scaled_dot_product_attention "
                "(native, _native_flash, _native_efficient, _native_cudnn, _native_math): call "
                "model.set_attention_backend('native') (or reset_attention_backend()) before apply_patch.")


def attention_names(model: torch.nn.Module) -> List[str]:
    """Names of the attentions mode "kv" can patch in ``model``, in block order (e.g. for ``blocks``)."""
    return [name for name, _, _ in family_of(model).attentions(model)]


def in_block_range(model: torch.nn.Module, modules: List[Tuple[str, torch.nn.Module, str]],
                   config: ToMeConfig) -> List[Tuple[str, torch.nn.Module, str]]:
    """The attentions whose block (the name without its last part, in depth order) is in config's range
    (the model's default range where block_start is None: see ``families.Family.default_start``).

    Raises ValueError naming the model when the range holds none of its blocks.
    """
    order = list(dict.fromkeys(name.rsplit(".", 1)[0] for name, _, _ in modules))
    on = chosen_blocks(config, len(order), family_of(model).default_start(model), type(model).__name__)
    if on is None:
        return modules
    chosen = {block for block, held in zip(order, on) if held}
    return [entry for entry in modules if entry[0].rsplit(".", 1)[0] in chosen]


def install(model: torch.nn.Module, config: ToMeConfig, blocks: Optional[List[str]] = None) -> CallPlanner:
    """Hook the attentions (mode kv) or the blocks (mode merge: ``dit_merge``) of ``model`` (a supported DiT; see
    ``find_dit``). Raises before patching anything.

    blocks: names from ``attention_names`` to patch (None: all); used to measure which blocks
    tolerate reduction.
    """
    check_config(model, config)
    family = family_of(model)
    modules = in_block_range(model, family.attentions(model), config)
    if blocks is not None:
        unknown = sorted(set(blocks) - {name for name, _, _ in modules})
        if unknown:
            raise ValueError(f"ToMe: {type(model).__name__} has no attention {unknown[:3]}; see attention_names().")
        modules = [entry for entry in modules if entry[0] in set(blocks)]
    if config.mode == "merge":  # whole blocks: any attention backend
        return dit_merge.install(model, config, modules)
    _check_backends(model, modules)
    state = DiTState(model, config, modules)
    state.changed_blocks = [(name, model.get_submodule(name))
                            for name in dict.fromkeys(name.rsplit(".", 1)[0] for name, _, _ in modules)]
    state.handles.append(model.register_forward_pre_hook(on_model_call, with_kwargs=True))
    if isinstance(family, WindowedDiT):  # the attention runs between two parts of each block (invoke_dits.py)
        _hook_windows(model, state, family, modules)
    else:
        for name, module, kind in modules:  # registered while calls are reduced (``on_model_call``)
            state.hooks.add(module, (_enter(state, name, kind), _leave(state)), "around")
    model.__dict__[STATE_ATTR] = state
    return state


def _nothing(*_: Any) -> None:
    return None


def _hook_windows(model: torch.nn.Module, state: DiTState, family: WindowedDiT,
                  modules: List[Tuple[str, torch.nn.Module, str]]) -> None:
    """Each attention's window: the mode entered before the part that opens it runs, left before the part that
    closes it runs (``WindowedDiT``); a model call that raised in between leaves none entered (an always-called hook
    on the model)."""
    for name, module, kind in modules:
        block = model.get_submodule(".".join(name.split(".")[:2]))  # "double_blocks.3"
        state.hooks.add(module, (_enter(state, name, kind), _nothing), "around")
        state.hooks.add(block.get_submodule(family.close_of(name)), (_leave(state), _nothing), "around")

    def leave_all(*_: Any) -> None:
        while state.modes:
            exit_for(state.modes)
    state.handles.append(model.register_forward_hook(leave_all, always_call=True))


def uninstall(model: torch.nn.Module) -> None:
    state = model.__dict__.pop(STATE_ATTR, None)
    if state is not None:
        state.hooks.remove()
        for handle in state.handles:
            handle.remove()
        if isinstance(state, dit_merge.DiTMergeState):
            state.forget_masks()
        state.probes = frozenset()
        state.mark_probes()


__all__ = ["STATE_ATTR", "check_config", "find_dit", "install", "supported_classes", "uninstall",
           "unsupported_dit", "DiTState"]
