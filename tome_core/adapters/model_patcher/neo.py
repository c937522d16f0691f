"""Forge Neo's DiTs (``NeoDiT`` bindings): ToMe's ComfyUI DiT patch through the patch points Neo's patcher has.

Neo's ``backend/patcher/base.py`` is ComfyUI's ModelPatcher ported without model wrappers or an attention override.
What stands in for each, per patched clone:

- The APPLY_MODEL wrapper: the clone's ``model_function_wrapper``, which ``sampling_function.calc_cond_uncond_batch``
  calls as ``wrapper(model.apply_model, {"input", "timestep", "c", "cond_or_uncond"})``. It runs the same per-call
  planner as ComfyUI (``DiTCallPatch.apply_model_wrapper``) through an executor over ``KModel.apply_model``. A wrapper
  already in the slot (MultiDiffusion, Radial Attention) is called in turn, with an ``apply_model`` that ToMe plans
  for each call it makes: both act.
- The attention override: Neo's blocks call a module global chosen at start-up (``NeoDiT.attention``). For the
  duration of a model call that carries ToMe's plan, that global holds a shim running
  ``transformer_options["optimized_attention_override"]`` around the function it found (ComfyUI's ``wrap_attn``
  contract), and gets that function back in a ``finally``: nothing outlives the call, and a call ToMe leaves whole
  runs Neo's function itself. Qwen-Image hands its attention no ``transformer_options``: the shim reads those of the
  running block (ToMe's block patch carries them) or of the call.
- The partner check: the slot holds one wrapper, so an extension that sets it after ToMe drops ToMe's. ToMe's first
  block patch (in mode kv a pass-through on the model's first block) then sees a model call its wrapper never marked
  and stops the generation, naming the order that works.
- Mode merge's block patches are ComfyUI's: ``set_model_patch_replace``, or ``add_object_patch`` of NextDiT's layers
  (Neo applies a clone's object patches when it loads the clone and undoes them at the next load).
"""
from __future__ import annotations

import importlib
import sys
from typing import Any, Callable, List, Optional, Tuple

from ...catalogue.comfy_lookup import ComfyModel
from ...catalogue.neo_dits import NeoDiT
from .dit_call import OVERRIDE, DiTCallPatch
from .dit_merge import CALL_KEY, DiTMergePatch, merged_block

MARK = "tome_neo_call"  # transformer_options key: this model call went through ToMe's model_function_wrapper


class NeoAttention:
    """The attention globals of one patched clone's family, replaced for one model call at a time; ``ambient``: the
    transformer_options of the running call (and block) for attention calls that carry none (Qwen-Image)."""

    def __init__(self, paths: Tuple[str, ...]) -> None:
        self.paths = paths
        self.ambient: List[dict] = []

    def run(self, call: Callable[[], Any], options: dict, swap: bool) -> Any:
        """``call()`` with ``options`` ambient and, ``swap``, the shims in place; everything put back after it."""
        swapped = []
        self.ambient.append(options)
        try:
            for path in self.paths if swap else ():
                module_name, _, name = path.rpartition(".")
                module = importlib.import_module(module_name)
                found = getattr(module, name)
                setattr(module, name, self._shim(getattr(found, "tome_original", found)))  # never a shim over a shim
                swapped.append((module, name, found))
            return call()
        finally:
            for module, name, found in reversed(swapped):
                setattr(module, name, found)
            self.ambient.pop()

    def _shim(self, original: Callable) -> Callable:
        ambient = self.ambient

        def tome_attention(*args: Any, **kwargs: Any) -> Any:
            options = kwargs.get("transformer_options")
            if not isinstance(options, dict):
                options = kwargs["transformer_options"] = ambient[-1]  # Neo's functions take it into **kwargs
            override = options.get(OVERRIDE)
            return original(*args, **kwargs) if override is None else override(original, *args, **kwargs)

        tome_attention.tome_original = original
        return tome_attention

    def carrying(self, original_block: Callable) -> Callable:
        """A block's ``original_block`` whose attention sees the options the block was handed (Qwen-Image: its
        attention takes none; a merged block's carry the weighing override)."""
        ambient = self.ambient

        def run(args: dict) -> Any:
            ambient.append(args.get("transformer_options") or ambient[-1])
            try:
                return original_block(args)
            finally:
                ambient.pop()

        return run


class _Executor:
    """``KModel.apply_model`` called as ComfyUI's APPLY_MODEL executor; the attention shims in place for a call
    that carries ToMe's plan (its override, or mode merge's call)."""

    __slots__ = ("apply_model", "class_obj", "attention")

    def __init__(self, apply_model: Callable, attention: NeoAttention) -> None:
        self.apply_model, self.attention = apply_model, attention
        self.class_obj = getattr(apply_model, "__self__", None)  # the KModel

    def __call__(self, x: Any, t: Any, c_concat: Any, c_crossattn: Any, control: Any, options: dict,
                 **kwargs: Any) -> Any:
        def call() -> Any:
            return self.apply_model(x, t, c_concat=c_concat, c_crossattn=c_crossattn, control=control,
                                    transformer_options=options, **kwargs)

        return self.attention.run(call, options, OVERRIDE in options or CALL_KEY in options)


def _process_references(entry: NeoDiT) -> Optional[list]:
    """The reference latents Neo hands the model through its process global (``backend.args.dynamic_args``: Qwen-Image
    Edit's and Flux Kontext's images, read by the model where the call passes none), where the family places them
    (``appended`` "ref_latents"); None where there are none."""
    if not any(item.keyword == "ref_latents" for item in entry.appended):
        return None
    refs = getattr(getattr(sys.modules.get("backend.args"), "dynamic_args", None), "ref_latents", None)
    return list(refs) if refs else None


def function_wrapper(state: DiTCallPatch, attention: NeoAttention, previous: Optional[Callable],
                     entry: NeoDiT) -> Callable:
    """The clone's ``model_function_wrapper``: each model call through ``state.apply_model_wrapper``; ``previous``
    (a wrapper set before ToMe) called in turn with an ``apply_model`` that ToMe plans per call. Neo's process-global
    references are handed to the call as its ``ref_latents`` (what the model reads anyway), so the layout has them."""
    def prepared(apply_model: Callable, args: dict) -> Any:
        c = dict(args.get("c") or {})
        options: Optional[dict] = c.pop("transformer_options", None)
        if not isinstance(options, dict):
            return apply_model(args["input"], args["timestep"], **c)
        options[MARK] = True
        if not c.get("ref_latents"):
            refs = _process_references(entry)
            if refs is not None:
                c["ref_latents"] = refs
        return state.apply_model_wrapper(_Executor(apply_model, attention), args["input"], args["timestep"],
                                         c.pop("c_concat", None), c.pop("c_crossattn", None), c.pop("control", None),
                                         options, **c)

    prepared.tome_state = state
    if previous is None:
        return prepared

    def model_function_wrapper(apply_model: Callable, args: dict) -> Any:
        def each_call(x: Any, t: Any, **c: Any) -> Any:
            return prepared(apply_model, {"input": x, "timestep": t, "c": c})

        each_call.__self__ = getattr(apply_model, "__self__", None)  # as the bound method it stands for
        return previous(each_call, args)

    model_function_wrapper.tome_state, model_function_wrapper.tome_previous = state, previous
    return model_function_wrapper


def state_of(patcher: Any) -> Optional[DiTCallPatch]:
    """The DiT patch state of the ToMe wrapper in ``patcher``'s model_function_wrapper slot, else None."""
    wrapper = (getattr(patcher, "model_options", None) or {}).get("model_function_wrapper")
    return getattr(wrapper, "tome_state", None)


def partner_error(model_name: str) -> RuntimeError:
    return RuntimeError(
        f"ToMe: a model call reached {model_name}'s blocks without ToMe's model_function_wrapper: an extension that "
        "ran after ToMe (e.g. MultiDiffusion, Radial Attention) took Forge Neo's one wrapper slot, so the image would "
        "come back without ToMe. Run that extension before ToMe (ToMe calls a wrapper set before it, and both act), "
        "or use one of the two.")


def _guarded(patch: Callable, attention: NeoAttention, entry: NeoDiT, first: bool, model_name: str) -> Callable:
    """``patch`` as Neo calls it: with the call's options where the host hands none (carried to the block's
    attention), and on the first block, the partner check."""
    def tome_neo_block(args: dict, extra: dict) -> Any:
        if not entry.replace_options and "transformer_options" not in args:
            options = attention.ambient[-1] if attention.ambient else {}
            args = dict(args, transformer_options=options)
            extra = dict(extra, original_block=attention.carrying(extra["original_block"]))
        else:
            options = args.get("transformer_options") or {}
        if first and MARK not in options:
            raise partner_error(model_name)
        return patch(args, extra)

    return tome_neo_block


def _pass_through(previous: Optional[Callable]) -> Callable:
    def tome_pass(args: dict, extra: dict) -> Any:
        return previous(args, extra) if previous is not None else extra["original_block"](args)
    return tome_pass


def attach(patcher: Any, state: DiTCallPatch, known: ComfyModel) -> Any:
    """A clone of ``patcher`` with ``state``'s wrapper and block patches (module docstring); re-patching replaces
    ToMe's wrapper and patches, keeping another extension's."""
    entry: NeoDiT = known.entry  # type: ignore[assignment]
    clone = patcher.clone()
    attention = NeoAttention(entry.attention)
    previous = clone.model_options.get("model_function_wrapper")
    if getattr(previous, "tome_state", None) is not None:
        previous = getattr(previous, "tome_previous", None)
    clone.set_model_unet_function_wrapper(function_wrapper(state, attention, previous, entry))
    merging = isinstance(state, DiTMergePatch)
    first_list = entry.blocks[0]
    targets = state.blocks if merging else [(first_list.reported, 0)]
    if not merging or targets[0] != (first_list.reported, 0):  # the partner check's block runs first
        targets = [(first_list.reported, 0)] + [t for t in targets if t != (first_list.reported, 0)]
    reduced = set(state.blocks) if merging else set()
    replaced = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    name = type(known.model).__name__
    object_patch = entry.merge is not None and entry.merge.object_patch
    for n, (kind, index) in enumerate(targets):
        if object_patch:
            attr = {blocks.reported: blocks.attr for blocks in entry.blocks}[kind]
            key = f"diffusion_model.{attr}.{index}"
            patch = state.block_patch(kind, None) if (kind, index) in reduced else _pass_through(None)
            clone.add_object_patch(key, merged_block(clone.get_model_object(key),
                                                     _guarded(patch, attention, entry, n == 0, name)))
            continue
        key = entry.merge.key(kind) if entry.merge is not None else f"{kind}_block"
        before = replaced.get((key, index))
        before = before.tome_previous if getattr(before, "tome_owner", None) is not None else before
        patch = state.block_patch(kind, before) if (kind, index) in reduced else _pass_through(before)
        guarded = _guarded(patch, attention, entry, n == 0, name)
        guarded.tome_previous, guarded.tome_owner = before, state  # another extension's patch it chains; whose
        clone.set_model_patch_replace(guarded, "dit", key, index)
    return clone
