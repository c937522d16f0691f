"""Mode "kv" on ComfyUI's DiTs (the catalogue's ComfyUI bindings) through its public patch API; no comfy import.

Two host mechanisms, both per patched clone: an APPLY_MODEL wrapper (``add_wrapper_with_key``,
chained by ComfyUI itself) reads the latent and text shapes and the sigma of each model call, and
for the duration of that call sets ``transformer_options["optimized_attention_override"]``, which
ComfyUI (0.3.6x+, ``comfy/ldm/modules/attention.py: wrap_attn``) calls around every
``optimized_attention``. The override shortens the image tokens' keys/values and then calls the
override that was there before (set by another node, earlier or later in the graph) or the
attention function itself. Installing per call is what lets it survive an override set after ours.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ...engine.call_plan import CallReading, KVCall
from ...engine.config import ToMeConfig, require_dit_config
from ...engine.blocks import chosen_blocks
from ...engine.schedule import SigmaWindow
from ...catalogue.comfy_dits import ComfyDiT, base_model
from ...catalogue.comfy_lookup import ComfyModel, comfy_model, family_of, merging_names, supported_names
from .layout import ambiguous_lengths
from .dit_call import OVERRIDE, DiTCallPatch
from .reports import ReportBasis, agrees, host_report, report_basis, reported_layout
from ...catalogue.families import ModelFamily
from ...engine.grid import TokenLayout
from ...engine.kv import dit_window
from ...catalogue.neo_dits import NeoDiT
from . import dit_merge, neo
from .compiled import APPLY_MODEL

WRAPPER_KEY = "tome_dit_kv"
NEO_METHODS = ("clone", "set_model_unet_function_wrapper", "set_model_patch_replace", "add_object_patch",
               "get_model_object")

def _diffusion_model(patcher: Any) -> Any:
    model = getattr(patcher, "model", None)
    return getattr(model, "diffusion_model", None)


def resolve_dit(patcher: Any) -> Optional[ComfyModel]:
    """What the catalogue knows of the patcher's DiT (``comfy_lookup.comfy_model``: binding, family, blocks, default
    range), read once per patch; None where it is no DiT of the catalogue. TorchCompileModel's wrapper is seen
    through."""
    return comfy_model(_diffusion_model(patcher))


def dit_family(patcher: Any) -> Optional[ModelFamily]:
    """The catalogue entry of the patcher's model ("flux", "sd3", "wan", "ltx2", ...), or None."""
    known = resolve_dit(patcher)
    return known.family if known else None


def _host_has_override() -> bool:
    attention = sys.modules.get("comfy.ldm.modules.attention")
    return attention is None or hasattr(attention, "wrap_attn")  # wrap_attn is what calls the override


def has_image_only_attention(diffusion_model: Any, entry: Optional[ComfyDiT] = None) -> bool:
    """Whether an MMDiT runs SD3.5's image-only ``x_block`` self-attention in some joint block (MMDiT-X)."""
    model = base_model(diffusion_model)
    entry = entry or family_of(diffusion_model)
    return entry is not None and entry.name == "sd3" and any(
        bool(getattr(getattr(block, "x_block", None), "x_block_self_attn", False))
        for block in getattr(model, "joint_blocks", None) or ())


class CallPlan(KVCall):
    """What one model call's attention override needs, read once by the APPLY_MODEL wrapper (no host reads later):
    the engine's ``KVCall`` (the layout derived from the call and its kept indices, built before the model runs:
    under torch.compile nothing seeded by the step is built in traced code; ``image_keep``: SD3.5's x_block picks),
    and ComfyUI's additions: ``ambiguous``, the key lengths of the call's other attentions (``ambiguous_lengths``);
    ``reports``, the basis for the layout the model reports inside its forward, None where the family reads none."""

    def __init__(self, layout: TokenLayout, keep: torch.Tensor, step: Any, image_keep: Optional[torch.Tensor] = None,
                 ambiguous: Tuple[int, ...] = (), reports: Optional[ReportBasis] = None) -> None:
        super().__init__(layout, keep, step, image_keep)
        self.ambiguous, self.reports = ambiguous, reports


class _CallKeys:
    """Which keys each self-attention of one model call keeps (``DiTKVPatch.override``); built per call.

    The layout: where the family reads a report the model sets for the attention
    (``transformer_options["grid_sizes"]``/``["img_slice"]``) and the derived layout does not hold under it, the
    report's (``reports``); else the derived one. Kept indices are built once per layout and key length in the
    call, never per block.
    """

    def __init__(self, patch: "DiTKVPatch", plan: CallPlan) -> None:
        self.patch, self.plan = patch, plan
        self.seen = 0  # self-attentions over the layout so far in this model call (counted families)
        self.derived = (plan.layout, plan.keep, {})  # layout, its kept indices, kept indices per longer key length
        self.reported: Dict[Any, Optional[Tuple[TokenLayout, torch.Tensor, Dict[int, torch.Tensor]]]] = {}

    def kept_index(self, options: dict, n: int, m: int) -> Optional[torch.Tensor]:
        """Kept key indices of an attention with m queries over n keys, None where ToMe leaves it whole."""
        patch, family = self.patch, self.patch.family
        if n <= 0 or not (m == n or family.partial_queries and 0 < m < n):
            return None
        found = self.layout_of(options)
        index = self.block_of(options, found[0], n, m == n) if found is not None else None
        blocks_on = patch.blocks_on
        if index is None or not (blocks_on is None or (index < len(blocks_on) and blocks_on[index])):
            return None
        return self.kept_for(*found, n)

    def layout_of(self, options: dict) -> Optional[Tuple[TokenLayout, torch.Tensor, Dict[int, torch.Tensor]]]:
        patch, plan, family = self.patch, self.plan, self.patch.family
        basis = plan.reports
        report = host_report(family, options, basis.stale) if basis is not None else None
        if report is None or agrees(basis, report):
            return self.derived
        if report not in self.reported:  # once per distinct report in this call
            layout = reported_layout(basis, report)
            if layout is None:
                patch.warn_once(f"report {report[0]}", f"ToMe: {family.name}: the model reports {report[0]}="
                                f"{list(report[1])}, which does not hold this call's tokens that keep every key; "
                                "such calls are left unreduced.")
            reducible = layout is not None and patch.reducible(layout)
            self.reported[report] = (layout, patch.keep_for(layout, plan.step, plan.keep.device), {}) \
                if reducible else None
        return self.reported[report]

    def block_of(self, options: dict, layout: TokenLayout, n: int, full: bool) -> Optional[int]:
        """Depth index of the block making this self-attention over n keys, None where ToMe leaves it.

        Where the model reports it (Flux, HunyuanVideo set ``block_type``/``block_index`` in transformer_options
        around each block), from that; elsewhere (MMDiT, Wan, LTX) the self-attentions over the layout come one
        per block in depth order, so their count in this call is the block index (skipping the blocks the model
        reports it does not compute, LTX's STG). A key length in ``plan.ambiguous`` (text, another stream) is never
        taken for self-attention. With ``plan.image_keep`` (SD3.5's MMDiT-X), a self-attention over the grid alone
        is the image-only ``x_block`` attention that ``_block_mixing`` runs right after its block's joint one, so it
        belongs to the last counted block.
        """
        plan, family, offsets = self.plan, self.patch.family, self.patch.block_offsets
        kind = options.get("block_type")
        if n in plan.ambiguous:  # a cross-attention's text (or another stream) of this length looks alike
            return None
        if family.reports_blocks and kind in offsets:
            return offsets[kind] + int(options.get("block_index", 0)) if n >= layout.length else None
        if plan.image_keep is not None and n == layout.grid_tokens and self.seen > 0:
            return self.seen - 1  # SD3.5's x_block self-attention, after its block's joint attention
        if not full or family.text == "last" and not family.text_tokens or n != layout.length:
            # No block report: [image, text] cannot be told from the text refiner's self-attention unless the
            # table gives the whole text's length (HiDream).
            return None
        index, self.seen = self.seen, self.seen + 1
        skipped = options.get(family.skipped_blocks) if family.skipped_blocks else None
        for block in sorted(set(skipped or ())):  # the index-th block whose self-attention runs
            if block > index:
                break
            index += 1
        return index

    def kept_for(self, layout: TokenLayout, keep: torch.Tensor, longer: Dict[int, torch.Tensor], n: int) -> torch.Tensor:
        """Kept key indices of a self-attention over n keys; tokens past the layout (or, grid last, before the
        grid) keep every key. Built once per layout and n in this call."""
        plan, grid_last = self.plan, self.patch.grid_last
        if n == layout.length and not grid_last:
            return keep
        if plan.image_keep is not None and n == layout.grid_tokens and not grid_last:
            return plan.image_keep
        kept = longer.get(n)
        if kept is None:
            if grid_last:  # every token before the grid (text, references), however many, keeps its key
                before = n - layout.grid_tokens
                kept = torch.cat([torch.arange(before, device=keep.device), keep + before])
            else:
                kept = torch.cat([keep, torch.arange(layout.length, n, device=keep.device)])
            longer[n] = kept
        return kept


def _cut_keys(args: list, kwargs: dict, seq: int, n: int, kept: torch.Tensor) -> None:
    """Keep only ``kept`` of the n keys and values (and of a key mask) of one attention call, in place.

    ComfyUI's attention functions take (q, k, v, heads, mask=None, ...): Qwen-Image, Lumina 2 and Ideogram 4 pass
    the mask by position, the others by keyword.
    """
    k, v = (args[1], args[2]) if len(args) >= 3 else (kwargs["k"], kwargs["v"])
    k, v = k.index_select(seq, kept), v.index_select(seq, kept)
    if len(args) >= 3:
        args[1], args[2] = k, v
    else:
        kwargs["k"], kwargs["v"] = k, v
    positional = len(args) >= 5
    mask = args[4] if positional else kwargs.get("mask")
    if isinstance(mask, torch.Tensor) and mask.shape[-1] == n:
        if positional:
            args[4] = mask.index_select(-1, kept)
        else:
            kwargs["mask"] = mask.index_select(-1, kept)


def _probe(plan: KVCall, previous: Optional[Callable]) -> Callable:
    """An attention override that only records that ComfyUI's attention reached it (a call ToMe leaves whole)."""
    def tome_reach_probe(func: Callable, *args: Any, **kwargs: Any) -> Any:
        plan.reached = True
        return previous(func, *args, **kwargs) if previous is not None else func(*args, **kwargs)
    return tome_reach_probe


class DiTKVPatch(DiTCallPatch):
    """The state of one patched clone: config, sigma window, block choice and the per-step kept indices.

    Its APPLY_MODEL wrapper (``DiTCallPatch.apply_model_wrapper``) sets our attention override for each call only and
    restores what was there afterwards. The first model call (which no step cache skips) checks that ComfyUI's
    attention reaches the override at all, reducing or not (a call outside the schedule gets a pass-through probe):
    where none does, a node runs the model's blocks itself and the prompt stops (``reach.unreached_error``), on every
    run until one goes."""

    MODE, PATCHED = "kv", "attention"

    def __init__(self, config: ToMeConfig, window: SigmaWindow, family: ComfyDiT,
                 blocks: Optional[Tuple[bool, ...]] = None, block_offsets: Optional[Dict[str, int]] = None,
                 image_only_attention: bool = False, grid_last: bool = False,
                 known: Optional[ComfyModel] = None) -> None:
        super().__init__(config)
        self.known = known
        self.window = window
        self.family = family
        self.blocks_on = blocks
        self.block_offsets = block_offsets or {}
        self.image_only_attention = image_only_attention  # SD3.5's MMDiT-X x_block self-attention
        self.grid_last = grid_last  # [text, references, grid] (HunyuanVideo on ComfyUI 0.13+): the rest precedes it

    def reducible(self, layout: TokenLayout) -> bool:
        """Whether the config reduces a grid of this layout (enough tokens, a window larger than one token)."""
        config = self.config
        return layout.grid_tokens >= max(config.min_tokens, 2) and \
            max(dit_window(config.ratio, layout.grid, config.sx, config.sy)) > 1

    def override(self, plan: CallPlan, previous: Optional[Callable]) -> Callable:
        """The optimized_attention_override for one model call; chains ``previous``. Which keys each
        self-attention keeps is ``_CallKeys``'s; a block outside ``blocks_on`` is left alone."""
        keys = _CallKeys(self, plan)

        def tome_kv_override(func: Callable, *args: Any, **kwargs: Any) -> Any:
            plan.reached = True
            args = list(args)
            q, k, v = args[:3] if len(args) >= 3 else (kwargs.get("q"), kwargs.get("k"), kwargs.get("v"))
            seq = 2 if kwargs.get("skip_reshape", False) else 1
            n = k.shape[seq] if k is not None and v is not None and v.shape[seq] == k.shape[seq] else -1
            m = q.shape[seq] if q is not None else -1
            options = kwargs.get("transformer_options")
            kept = keys.kept_index(options if isinstance(options, dict) else {}, n, m)
            if kept is not None:
                _cut_keys(args, kwargs, seq, n, kept)
                if not torch.compiler.is_compiling():  # a diagnostic count; in traced code an int guard, a recompile
                    self.reduced_calls += 1
            if previous is not None:
                return previous(func, *args, **kwargs)
            return func(*args, **kwargs)

        return tome_kv_override

    def _install(self, options: dict, plan: Any) -> Callable[[], None]:
        """For this call only: our override (or, probing, a pass-through that records the reach) chaining the one
        there before; the returned function puts back what was there."""
        had, previous = OVERRIDE in options, options.get(OVERRIDE)
        options[OVERRIDE] = _probe(plan, previous) if plan.probe else self.override(plan, previous)

        def remove() -> None:
            if had:
                options[OVERRIDE] = previous
            else:
                options.pop(OVERRIDE, None)
        return remove

    def _probe(self) -> KVCall:
        return KVCall(None, None, probe=True)

    def build(self, reading: CallReading, first: bool) -> CallPlan:
        base, x, context, extra, options = reading.host
        layout, step = reading.layout, reading.step
        diffusion_model = base.diffusion_model
        context = context if isinstance(context, torch.Tensor) else None
        ambiguous = ambiguous_lengths(diffusion_model, context, extra, self.family)
        if layout.length in ambiguous:
            self.warn_once("ambiguous", f"ToMe: {layout.grid_tokens} video tokens equal the length of the text or of "
                           "another stream (audio); this size is left unreduced (self- and cross-attention cannot "
                           "be told apart).")
        keep_image = None
        if self.image_only_attention and layout.prefix > 0:  # the same picks on the grid alone (same seed)
            keep_image = self.keep_for(layout.image_only(), step, x.device)
        return CallPlan(layout, self.keep_for(layout, step, x.device), step, keep_image, ambiguous,
                        report_basis(diffusion_model, layout, extra, options, self.family, self.grid_last))


def check_dit_model_patcher(patcher: Any, config: ToMeConfig,
                            known: Optional[ComfyModel] = None) -> Optional[Tuple[bool, ...]]:
    """Every refusal of ``patch_dit_model_patcher``, without cloning or patching anything; returns the
    block choice (per block in depth order, whether the block range holds it; None: every block).

    Raises TypeError naming the model for diffusion models the override cannot reach (PixArt,
    HunyuanDiT, UNets...), ValueError for settings that do not apply (mode "merge" where the family has no merge
    binding, avg, a block range holding no block), and RuntimeError on a ComfyUI without ``optimized_attention_override``.
    known: the patcher's model as resolved once (``resolve_dit``); read now where not given.
    """
    known = known or resolve_dit(patcher)
    if known is None:
        diffusion_model = base_model(_diffusion_model(patcher))
        name, module = type(diffusion_model).__name__, type(diffusion_model).__module__
        raise TypeError(f"ToMe: {name} is not a DiT that ToMe's kv mode can reach in ComfyUI ({module}.{name}); "
                        f"supported: "
                        f"{supported_names()}. UNet models (SD1.x/SD2.x/SDXL) use the UNet patch.")
    name = type(known.model).__name__
    if known.unreached:
        raise TypeError(f"ToMe: {name} cannot be reduced here: {known.unreached}.")
    in_neo = isinstance(known.entry, NeoDiT)
    require_dit_config(config, name, merges=known.merges, merge_families=merging_names("neo" if in_neo else "comfy"))
    chosen = chosen_blocks(config, known.block_count, known.default_start, name)
    if in_neo:  # Forge Neo: its patcher's model_function_wrapper, replace and object patches (neo.py)
        missing = [method for method in NEO_METHODS if not callable(getattr(patcher, method, None))]
        if missing:
            raise TypeError(f"ToMe: {name} runs in Forge Neo, but its {type(patcher).__name__} lacks "
                            f"{', '.join(missing)}: this Forge Neo's patcher is not the one ToMe knows "
                            "(backend/patcher/base.py of Neo 2.x).")
        return chosen
    if not hasattr(patcher, "add_wrapper_with_key") or not _host_has_override():
        raise RuntimeError("ToMe: this ComfyUI has no transformer_options['optimized_attention_override'] "
                           "(added in ComfyUI 0.3.6x); update ComfyUI to use ToMe on DiT models.")
    return chosen


def patch_dit_model_patcher(patcher: Any, config: ToMeConfig, known: Optional[ComfyModel] = None,
                            checked: Any = None) -> Any:
    """A clone of ``patcher`` with mode "kv" (or "merge", ``dit_merge``) on its DiT; the input patcher is never
    changed.

    Refuses (see ``check_dit_model_patcher``) before cloning: nothing is patched then. known, checked: the model as
    resolved once and the block choice ``check_dit_model_patcher`` returned for it (``plan.plan_patch``: the node's
    path reads the model once); found now where not given.
    """
    known = known or resolve_dit(patcher)
    chosen = check_dit_model_patcher(patcher, config, known) if checked is None else checked[0]
    in_neo = isinstance(known.entry, NeoDiT)
    # ComfyUI's model_sampling; Forge Neo's KModel holds its predictor
    sampling = patcher.get_model_object("predictor" if in_neo else "model_sampling")
    window = SigmaWindow.from_percents(config.start_percent, config.end_percent, sampling.percent_to_sigma)
    if config.mode == "merge":  # whole blocks through "dit" block replace patches (dit_merge.py)
        blocks = dit_merge.merge_blocks(known.entry, known.model, known.offsets, chosen)
        state = dit_merge.DiTMergePatch(config, window, known.entry, blocks, known)
        if in_neo:
            return neo.attach(patcher, state, known)
        return dit_merge.attach(patcher.clone(), state, WRAPPER_KEY, APPLY_MODEL)
    state = DiTKVPatch(config, window=window, family=known.entry, blocks=chosen, block_offsets=known.offsets,
                       image_only_attention=has_image_only_attention(known.model, known.entry),
                       grid_last=known.grid_last, known=known)
    if in_neo:
        return neo.attach(patcher, state, known)
    clone = patcher.clone()
    clone.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)  # re-patching replaces, never stacks
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, state.apply_model_wrapper)
    return clone
