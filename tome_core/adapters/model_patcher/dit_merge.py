"""Mode "merge" on ComfyUI's DiTs: fewer image tokens through whole blocks, through its public patch API.

Host mechanisms, all per patched clone: the APPLY_MODEL wrapper (``add_wrapper_with_key``) reads each
model call's layout and sigma once and puts the engine's ``MergeCall`` in that call's ``transformer_options``; a "dit"
block replace patch (``set_model_patch_replace``, the one Flux, Qwen-Image, Wan and LTX call around every
block as ``blocks_replace[("double_block", i)]``) hands the block the merged image tokens and the rotary
table cut to them, and puts the block's update back on every token afterwards. A model that calls its blocks
without replace patches (Lumina 2 / Z-Image's NextDiT) gets the same patch through an object patch
(``add_object_patch``) of each block: a copy sharing the block's weights (``merged_block``). A replace or object
patch another node set on the same block before ToMe is kept and called with the merged tokens (both act). The
matching is planned from the first reduced block's input and shared by the call's other blocks and streams.
"""
from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...catalogue.comfy_dits import ComfyDiT, base_model
from ...catalogue.comfy_lookup import ComfyModel
from ...engine.config import ToMeConfig
from ...engine.grid import TokenLayout
from ...engine.schedule import SigmaWindow
from ...catalogue.families import family_of_binding
from ...engine.call_plan import CallReading, MergeCall
from ...engine.token_merge import TokenMerge, biased_mask, key_bias
from .dit_call import OVERRIDE, DiTCallPatch, call_patch_of
from .mask_probe import compute_dtype, head_width, mask_dropped

CALL_KEY = "tome_merge_call"  # transformer_options key of the running model call's MergeCall
WEIGH_KEY = "tome_weighed_keys"  # a merged block's transformer_options: (stream, merge, text, previous override)


REFERENCE_METHOD = "index_timestep_zero"  # Flux's and Qwen-Image's ref_latents_method that modulates by position


class DiTMergePatch(DiTCallPatch):
    """The state of one clone patched in mode merge: config, sigma window, family and the blocks it covers.

    Its APPLY_MODEL wrapper (``DiTCallPatch.apply_model_wrapper``) puts each call's ``MergeCall`` in that call's
    transformer_options; a first call (which no step cache skips; outside the schedule a probe) that no block patch
    reached stops the prompt (a node that replaced the model's forward would otherwise drop ToMe silently)."""

    MODE, PATCHED = "merge", "block"

    def __init__(self, config: ToMeConfig, window: SigmaWindow, family: ComfyDiT,
                 blocks: List[Tuple[str, int]], known: Optional[ComfyModel] = None) -> None:
        super().__init__(config)
        self.window, self.family, self.blocks, self.known = window, family, blocks, known
        owner = known.family if known is not None else family_of_binding(family)
        self.attention = owner.attention_for(config)  # how merged keys are weighed
        # (another node's attention override or None, device) -> whether the attention there takes the mask, probed once
        self.takes_mask: Dict[Tuple[Any, torch.device], bool] = {}
        self.last_call: Optional[MergeCall] = None  # the latest reduced model call (for tests and diagnostics)

    def _install(self, options: dict, call: MergeCall) -> Callable[[], None]:
        options[CALL_KEY] = self.last_call = call
        return lambda: options.pop(CALL_KEY, None)

    def _sit_out(self, options: dict) -> Optional[Callable[[], None]]:
        """A call ToMe leaves whole gets the dit replace patches without ToMe's (another node's it chained stand in its
        place), so no block runs ToMe code: each patch that only passes the block on is launch time in every block.
        The object-patched blocks (NextDiT) keep their copy, which passes the block on."""
        replace = options.get("patches_replace")
        blocks = replace.get("dit") if isinstance(replace, dict) else None
        if not blocks:
            return None
        whole = {}
        for key, patch in blocks.items():  # a loop, not a comprehension: each of those is a Python call (3.11)
            if getattr(patch, "tome_owner", None) is not self:
                whole[key] = patch
            elif patch.tome_previous is not None:
                whole[key] = patch.tome_previous
        options["patches_replace"] = dict(replace, dit=whole)
        return lambda: options.__setitem__("patches_replace", replace)

    def _probe(self) -> MergeCall:
        return MergeCall(None, probe=True)

    def reducible(self, layout: TokenLayout) -> bool:
        return layout.grid_tokens >= max(self.config.min_tokens, 4)

    def build(self, reading: CallReading, first: bool) -> MergeCall:
        """The engine's merge plan (ComfyUI's layout holds the text where the model's joint blocks do: the stream),
        with ComfyUI's additions: whether reference tokens are modulated by position (``zero_refs``), and whether the
        merged keys can be weighed (``weigh``: the attention the blocks run takes the mask, probed once per override
        and device)."""
        base, x, _, extra, options = reading.host
        if first and self.reuse.on:  # match_every: a sampling run never starts on the last run's matching
            # ComfyUI's sample_sigmas; Forge Neo's sampling_sigmas (sd_samplers_kdiffusion writes them per run)
            self.reuse.restart_on(options.get("sample_sigmas", options.get("sampling_sigmas")))
        call = super().build(reading, first)
        model = base_model(base.diffusion_model)
        params = getattr(model, "params", None)  # Flux keeps it in its params, Qwen-Image on the model
        method = extra.get("ref_latents_method", getattr(model, "default_ref_method",
                                                         getattr(params, "default_ref_method", None)))
        call.zero_refs = method == REFERENCE_METHOD
        if self.attention != "plain":  # one look-up per call; the probe once per override and device
            where = (options.get(OVERRIDE), x.device)
            weigh = self.takes_mask.get(where)
            call.weigh = self._probe_mask(where, base, x, options) if weigh is None else weigh
        return call

    def _probe_mask(self, where: Tuple[Any, torch.device], base: Any, x: torch.Tensor, options: dict) -> bool:
        """Whether the attention of the merged blocks (``where``: another node's override over ComfyUI's function,
        on this device) takes a mask (``mask_probe``); if not, they run plain attention, said once in the log and
        to the node."""
        override, device = where
        dropped = mask_dropped(override, options, device, compute_dtype(base, x.dtype), head_width(base))
        self.takes_mask[where] = not dropped
        if dropped:
            note = f"{self.attention} attention needs a mask; {dropped}: plain"
            self.warn_once(f"mask:{note}", f"ToMe: {self.family.name}: {note}.")
            if note not in self.notes:
                self.notes.append(note)
                self.verdict_changed()  # the listeners (the node) get the notes with the verdicts
        return not dropped

    def _references(self) -> ValueError:
        return ValueError(f"ToMe: mode merge does not reduce {self.family.name} calls whose reference images take the "
                          "zero timestep by position (ref_latents_method 'index_timestep_zero', e.g. Qwen-Image Edit "
                          "2511) yet: use mode kv for them, or the 'index' reference method.")

    def block_patch(self, kind: str, previous: Optional[Callable]) -> Callable:
        """The replace patch of one block of reported type ``kind``; calls ``previous`` (another node's) inside."""
        joint = kind in self.family.merge.joint

        def tome_merge_block(args: dict, extra: dict) -> dict:
            # where the host passes it; a forward copied from an older ComfyUI (a step cache's) may pass it in extra
            options = args.get("transformer_options") or extra.get("transformer_options") or {}
            call: Optional[MergeCall] = options.get(CALL_KEY)
            run = (lambda a: previous(a, extra)) if previous is not None else extra["original_block"]
            if call is None:
                return run(args)
            call.reached = True
            merged_args = None if call.probe else self._merged(call, args, joint)
            if merged_args is None:
                return run(args)
            img, merged, merge = merged_args.pop("_tome")
            out = dict(run(merged_args))
            item = self.family.merge.img_item
            if item is None:
                out["img"] = merge.unmerge_update(img, merged, out["img"])
            else:  # LTX-2: ("img": (video, audio)); the audio stream comes back as the block made it
                streams = list(out["img"])
                streams[item] = merge.unmerge_update(img, merged, streams[item])
                out["img"] = tuple(streams)
            return out

        return tome_merge_block

    def _merged(self, call: MergeCall, args: dict, joint: bool) -> Optional[dict]:
        """The block's args with the merged image tokens and the cut rotary table, or None to run it whole.

        The tokens after the grid (reference latents, which the model appends inside its forward) pass whole; where
        the model modulates them by position (``zero_refs``) a shorter grid would shift them: refused."""
        spec, layout = self.family.merge, call.stream
        streams = args.get("img")
        img = streams[spec.img_item] if spec.img_item is not None and isinstance(streams, tuple) else streams
        separate = joint or self.family.text == "separate"  # the text is not in "img" (a cross-attention's)
        text = 0 if separate else (args["txt"].shape[1] if isinstance(args.get("txt"), torch.Tensor) else -1)
        prefix = layout.prefix - text
        after = img.shape[1] - prefix - layout.grid_tokens if isinstance(img, torch.Tensor) and img.ndim == 3 else -1
        masked = [key for key in ("attn_mask",) + spec.whole_with if args.get(key) is not None]
        if text < 0 or prefix < 0 or after < 0 or masked:
            self.warn_once(f"whole:{joint}", f"ToMe: a {self.family.name} block's tokens do not match the call's "
                           f"layout {layout} (or it has an attention mask: {', '.join(masked) or 'none'}); such "
                           "blocks run whole.")
            return None
        if after > 0 and call.zero_refs:
            raise self._references()
        stream = TokenLayout(layout.grid, prefix=prefix, suffix=after)
        merge = call.matched(img, stream, self.config, self.reuse)
        merged = merge.merge(img)
        # ComfyUI's Flux and LTX-2 blocks add to their input in place (x += ...): the update is taken against a copy
        out = dict(args, _tome=(img, merged.clone(), merge))
        if spec.img_item is None:
            out["img"] = merged
        else:
            out["img"] = tuple(merged if i == spec.img_item else s for i, s in enumerate(streams))
        joint_layout = TokenLayout(layout.grid, prefix=text + prefix, suffix=after)
        for key in spec.pe_keys:  # over [text, image] (Flux, Qwen-Image), or the video alone (Wan, LTX-2)
            pe = args.get(key)
            if pe is None:
                continue
            # one cut per input and stream per call: the model builds its rotary table once per call and hands every
            # block the same one (keyed by name, not by the table's id: under torch.compile an id is a guard that
            # fails at every call, a recompile per step)
            cut = (key, joint_layout.grid, joint_layout.prefix, joint_layout.suffix)  # plain values (MergeCall.merges)
            if cut not in call.cuts:
                call.cuts[cut] = (pe, _cut_table(pe, call.merge_on(joint_layout), spec.pe_axis))
            out[key] = call.cuts[cut][1]
        for key in spec.per_token:  # Wan 2.2 ti2v: a timestep per token; LTX-2's per-token (or per-frame) timesteps
            value = args.get(key)
            if value is None:
                continue
            cut = (key, merge.length)  # one cut per input and stream per call (by name, as the rotary table)
            if cut not in call.cuts:
                call.cuts[cut] = (value, _cut_per_token(value, merge))
            out[key] = call.cuts[cut][1]
        if call.weigh:
            self._weigh_keys(call, out, stream, merge, text)
        if not torch.compiler.is_compiling():
            self.reduced_calls += 1
        return out

    def _weigh_keys(self, call: MergeCall, args: dict, stream: TokenLayout, merge: TokenMerge, text: int) -> None:
        """The merged keys weighed inside this block (``token_merge.key_bias``): its transformer_options (a copy) get
        ``weighed_attention`` as the attention override, chaining the override there before, and what it needs under
        ``WEIGH_KEY``."""
        options = args.get("transformer_options")
        if not isinstance(options, dict):
            self.warn_once("weigh", f"ToMe: a {self.family.name} block was called without transformer_options; its "
                           f"merged keys are attended to as one token each ({self.attention} attention needs them).")
            return
        args["transformer_options"] = dict(options, **{OVERRIDE: self.weighed_attention,
                                                       WEIGH_KEY: (stream, merge, text, options.get(OVERRIDE))})

    def weighed_attention(self, func: Callable, *args: Any, **kwargs: Any) -> Any:
        """The attention override of a merged block: ``key_bias`` added to the mask of an attention whose keys are the
        merged stream (with the text before it where the block's attention prepends it). One bound method for every
        block and call, reading the block's merge from its transformer_options, so torch.compile guards on no
        per-call object (a closure per block would recompile at every call)."""
        options = kwargs.get("transformer_options") or {}
        stream, merge, text, previous = options[WEIGH_KEY]
        call: MergeCall = options[CALL_KEY]
        args = list(args)
        q, k = (args[0], args[1]) if len(args) >= 3 else (kwargs.get("q"), kwargs.get("k"))
        keys = k.shape[2 if kwargs.get("skip_reshape", False) else 1] if isinstance(k, torch.Tensor) else -1
        cached = (stream.grid, stream.prefix, stream.suffix, keys)  # one bias per stream and key count in a call
        if cached not in call.bias:
            call.bias[cached] = key_bias(merge, stream, keys, text, how=self.attention)
        bias = call.bias[cached]
        if bias is not None:
            positional = len(args) >= 5
            mask = biased_mask(args[4] if positional else kwargs.get("mask"), bias, q.dtype, 2)
            if positional:
                args[4] = mask
            else:
                kwargs["mask"] = mask
        return previous(func, *args, **kwargs) if previous is not None else func(*args, **kwargs)


def _cut_table(pe: Any, merge: TokenMerge, axis: int) -> Any:
    """A rotary table cut to the merged stream: a tensor, or the tensors of a tuple (LTX-2's (matrix, split flag)) that
    have the stream's length on ``axis``."""
    if isinstance(pe, torch.Tensor):
        return merge.take(pe, axis)
    if isinstance(pe, tuple):
        return tuple(merge.take(t, axis) if isinstance(t, torch.Tensor) and t.ndim > axis
                     and t.shape[axis] == merge.length else t for t in pe)
    return pe


def _cut_per_token(value: Any, merge: TokenMerge) -> Any:
    """A per-token input cut to the merged stream where it has one row per token (axis 1); others (one row per sample)
    pass. LTX-2's ``CompressedTimestep`` (one row per frame, ``patches_per_frame`` tokens each) becomes the kept tokens'
    frame rows, uncompressed (the merged stream has no fixed number of tokens per frame)."""
    if isinstance(value, torch.Tensor):
        return merge.take(value, 1) if value.ndim >= 2 and value.shape[1] == merge.length else value
    data, per_frame = getattr(value, "data", None), getattr(value, "patches_per_frame", None)
    if isinstance(data, torch.Tensor) and isinstance(per_frame, int) and data.shape[1] * per_frame == merge.length:
        rows = data.index_select(1, torch.div(merge.kept, per_frame, rounding_mode="floor"))
        return type(value)(rows, None)
    return value


def merge_blocks(family: ComfyDiT, diffusion_model: Any, offsets: Dict[str, int],
                 chosen: Optional[Tuple[bool, ...]]) -> List[Tuple[str, int]]:
    """(reported block type, index) of every block the block range holds, in depth order."""
    model = base_model(diffusion_model)
    found = []
    for blocks in family.blocks:
        if family.merge.lists and blocks.attr not in family.merge.lists:
            continue  # VACE's vace_blocks: called without replace patches (and over the control video)
        for i in range(len(getattr(model, blocks.attr, None) or ())):
            depth = offsets.get(blocks.reported, 0) + i
            if chosen is None or (depth < len(chosen) and chosen[depth]):
                found.append((blocks.reported, i))
    return found


def _merged_forward(self: torch.nn.Module, x: torch.Tensor, x_mask: Any, freqs_cis: Any, adaln_input: Any = None,
                    *args: Any, transformer_options: Optional[dict] = None, **kwargs: Any) -> torch.Tensor:
    """NextDiT's block call (x, x_mask, freqs_cis, adaln_input, ..., transformer_options) as a "dit" replace patch's
    args: the block it stands for runs on whatever the patch hands it."""
    previous: torch.nn.Module = self.__dict__["_tome_previous"]
    options = transformer_options if transformer_options is not None else {}
    if args or kwargs.get("timestep_zero_index") is not None:  # Z-Image Omni's per-position modulation: whole
        return previous(x, x_mask, freqs_cis, adaln_input, *args, transformer_options=options, **kwargs)

    def original(a: dict) -> dict:
        return {"img": previous(a["img"], a["attn_mask"], a["pe"], a["vec"],
                                transformer_options=a.get("transformer_options", options), **kwargs)}

    args_in = {"img": x, "attn_mask": x_mask, "pe": freqs_cis, "vec": adaln_input, "transformer_options": options}
    return self.__dict__["_tome_patch"](args_in, {"original_block": original, "transformer_options": options})["img"]


@lru_cache(maxsize=None)
def _merged_class(cls: type) -> type:
    return type(f"ToMeMerged{cls.__name__}", (cls,), {"forward": _merged_forward, "__module__": cls.__module__})


def merged_block(block: torch.nn.Module, patch: Callable) -> torch.nn.Module:
    """``block`` as an object patch that runs through ``patch``: a shallow copy, so it shares the block's parameter,
    buffer and submodule dicts (weight patches, LoRA keys, offloading and casts see the very same tensors under the
    same names), with a subclass whose forward calls the block itself through the patch."""
    previous = block.__dict__.get("_tome_previous", block)  # re-patching replaces ToMe's copy, keeps another node's
    merged = copy.copy(previous)
    for name, hooks in list(vars(merged).items()):  # the block's own hooks fire once, when the copy calls it
        if name.startswith(("_forward_", "_backward_")) and isinstance(hooks, dict):
            setattr(merged, name, type(hooks)())
    merged.__class__ = _merged_class(type(previous))
    merged.__dict__["_tome_previous"], merged.__dict__["_tome_patch"] = previous, patch
    return merged


def _object_patch(clone: Any, state: DiTMergePatch, kind: str, index: int) -> None:
    attr = {blocks.reported: blocks.attr for blocks in state.family.blocks}[kind]
    diffusion_model = clone.get_model_object("diffusion_model")
    at = "diffusion_model._orig_mod" if hasattr(diffusion_model, "_orig_mod") else "diffusion_model"
    key = f"{at}.{attr}.{index}"
    clone.add_object_patch(key, merged_block(clone.get_model_object(key), state.block_patch(kind, None)))


def merge_patch_of(patcher: Any) -> Optional[DiTMergePatch]:
    """The ``DiTMergePatch`` of the ToMe patch on ``patcher`` (``call_patch_of`` in mode merge), else None."""
    state = call_patch_of(patcher)
    return state if isinstance(state, DiTMergePatch) else None


def attach(clone: Any, state: DiTMergePatch, wrapper_key: str, apply_model: str) -> Any:
    """Register the wrapper and one replace (or object) patch per block on ``clone``, chaining patches set before."""
    replaced = clone.model_options.get("transformer_options", {}).get("patches_replace", {}).get("dit", {})
    clone.remove_wrappers_with_key(apply_model, wrapper_key)  # re-patching replaces, never stacks
    clone.add_wrapper_with_key(apply_model, wrapper_key, state.apply_model_wrapper)
    for kind, index in state.blocks:
        if state.family.merge.object_patch:
            _object_patch(clone, state, kind, index)
            continue
        key = state.family.merge.key(kind)
        previous = replaced.get((key, index))
        previous = previous.tome_previous if getattr(previous, "tome_owner", None) is not None else previous
        patch = state.block_patch(kind, previous)
        patch.tome_previous, patch.tome_owner = previous, state  # another node's patch it chains; whose it is
        clone.set_model_patch_replace(patch, "dit", key, index)
    return clone
