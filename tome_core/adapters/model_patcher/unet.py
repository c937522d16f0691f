"""ToMe through a ComfyUI-style ``ModelPatcher``: clone it, register attention patches, return the clone.

Host-neutral glue shared by the ComfyUI nodes and WebUI Forge (whose ``UnetPatcher`` has the same
API). Nothing here imports a host: the patcher is duck typed. It must offer ``clone()``,
``set_model_attn1_patch`` and ``set_model_attn1_output_patch`` (plus the attn2 pair when
``merge_crossattn`` is on), and ``.model.diffusion_model`` (or ``get_model_object``).

Patch contract (ComfyUI ``comfy/ldm/modules/attention.py``, unchanged from 2024 to 0.3.x):
    attn1_patch(n, context, value, extra_options) -> (n, context, value)
        n: [B, N, C] = norm1(x); context/value: the self-attention key/value source (n itself
        unless an earlier patch replaced them).
    attn1_output_patch(out, extra_options) -> out, right after self-attention.
    extra_options carries "original_shape" ([B, C, H, W] of the UNet input latent) and "sigmas"
    (the current sigma per batch row).
Mode "merge" merges n, context and value and unmerges the attention output; mode "kv" keeps
every query and pools the keys/values. The plan made in attn1_patch is handed to the output patch
through a cell in the closure made per ``patch_model_patcher`` call, never through a global.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ...engine.config import ToMeConfig, require_all_blocks
from ...engine.levels import Level, level_grids
from ...catalogue.comfy_lookup import supported_names
from ...catalogue.unets import attention_base_downsample, attention_levels
from ...engine.plan import IDENTITY_PLAN, TokenMerger, TokenPlan
from ...engine.schedule import SigmaWindow, sigma_value
from .compiled import APPLY_MODEL, CompileKey, compiled_call
from .step_caches import DIFFUSION_MODEL, repeat_options

log = logging.getLogger("tome_core")

SUPPORTED_MODELS = "SD1.x, SD2.x and SDXL-family UNet models (SSD-1B, Playground v2, ...)"
_REQUIRED_METHODS = ("clone", "set_model_attn1_patch", "set_model_attn1_output_patch")


class UnsupportedModelError(TypeError):
    """The model has no UNet transformer blocks ToMe can merge (e.g. a DiT such as Flux or SD3)."""


def _model_object(patcher: Any, name: str) -> Any:
    """patcher's model attribute ``name``, honouring object patches (e.g. ModelSamplingDiscrete)."""
    getter = getattr(patcher, "get_model_object", None)
    if callable(getter):
        try:
            return getter(name)
        except AttributeError:
            return None
    patched = getattr(patcher, "object_patches", {}) or {}
    if name in patched:
        return patched[name]
    return getattr(getattr(patcher, "model", None), name, None)


def model_type_name(patcher: Any) -> str:
    """Class name of the model inside a patcher (e.g. "BaseModel", "SDXL", "Flux"), for messages."""
    return type(getattr(patcher, "model", patcher)).__name__


def base_downsample_of(patcher: Any) -> int:
    """The latent downsampling of the patcher's first attention level (SD1/2: 1, SDXL: 2).

    Raises UnsupportedModelError naming the model type when there is no UNet with transformer blocks.
    """
    unet = _model_object(patcher, "diffusion_model")
    kind = model_type_name(patcher)
    if not isinstance(unet, torch.nn.Module):
        raise UnsupportedModelError(
            f"ToMe: the {kind} model has no diffusion_model UNet to patch. Supported: {SUPPORTED_MODELS}."
        )
    try:
        return attention_base_downsample(unet)
    except TypeError as error:
        cls = type(getattr(unet, "_orig_mod", unet))
        host, key = ("Forge Neo", "neo") if cls.__module__.startswith("backend.nn.") else ("ComfyUI", "comfy")
        if cls.__module__ == "backend.nn.svdq":  # Forge Neo's Nunchaku classes (SVDQ Flux, Qwen-Image, Z-Image)
            raise UnsupportedModelError(
                f"ToMe cannot patch {cls.__module__}.{cls.__qualname__}: Nunchaku's SVDQ model runs its own "
                "quantized blocks and attention, which no ToMe patch reaches. Load the family's non-quantized "
                f"checkpoint to use ToMe, or turn ToMe off for this model. Transformers it reduces in {host}: "
                f"{supported_names(key)}.") from error
        raise UnsupportedModelError(
            f"ToMe cannot patch a {kind} model ({type(unet).__name__}, {cls.__module__}.{cls.__qualname__}): it has "
            f"no UNet transformer blocks (BasicTransformerBlock in input_blocks/middle_block). Supported: "
            f"{SUPPORTED_MODELS}; and it is not a transformer class of ToMe's catalogue (matched by module and class "
            "name; a quantizing pack's own model class, e.g. Nunchaku's, is not its family's). Transformers it "
            f"reduces in {host}: {supported_names(key)}."
        ) from error


def sigma_window(patcher: Any, config: ToMeConfig) -> SigmaWindow:
    """Convert config.start/end_percent to sigmas with the model's ``model_sampling``."""
    if config.start_percent <= 0.0 and config.end_percent >= 1.0:
        return SigmaWindow()
    # ComfyUI and reForge: model.model_sampling; Forge (backend/, 2024-08 on): model.predictor.
    sampling = _model_object(patcher, "model_sampling") or _model_object(patcher, "predictor")
    to_sigma = getattr(sampling, "percent_to_sigma", None)
    if not callable(to_sigma):
        raise UnsupportedModelError(
            f"ToMe: start_percent/end_percent need the model's model_sampling.percent_to_sigma, which the "
            f"{model_type_name(patcher)} model lacks; use start_percent=0 and end_percent=1."
        )
    return SigmaWindow.from_percents(config.start_percent, config.end_percent, to_sigma)


class StepSigma:
    """``schedule.sigma_value`` read at most once per model call.

    ComfyUI passes the same ``sigmas`` tensor object (transformer_options["sigmas"], set once in
    ``BaseModel._apply_model``) to every block of one model call, so the float is memoised on that
    object's identity: one host sync per model call instead of one per block. The reference held
    keeps the id from being reused by a new tensor.
    """

    def __init__(self) -> None:
        self._sigmas: Any = None
        self._value: Optional[float] = None

    def __call__(self, extra_options: dict) -> Optional[float]:
        sigmas = extra_options.get("sigmas")
        if sigmas is not self._sigmas or sigmas is None:
            self._sigmas, self._value = sigmas, sigma_value(sigmas)
        return self._value


def _latent_hw(extra_options: dict) -> Optional[Tuple[int, int]]:
    shape = extra_options.get("original_shape")
    if shape is None or len(shape) < 4:
        return None
    return int(shape[-2]), int(shape[-1])


def _same_tokens(a: Optional[torch.Tensor], n: torch.Tensor) -> bool:
    return isinstance(a, torch.Tensor) and a.dim() == 3 and a.shape[:2] == n.shape[:2]


def _reduced_once(reduce: Callable, n: torch.Tensor, context: Any, value: Any,
                  reduced_n: Optional[torch.Tensor]) -> Tuple[Any, Any]:
    """(context, value) reduced like the queries' tokens ``n``, each tensor once: ComfyUI hands the
    block's attn1 patches ``n`` itself as context and value, so one reduction serves all three."""
    def one(tensor: Any) -> Any:
        nonlocal reduced_n
        if tensor is n:
            reduced_n = reduce(n) if reduced_n is None else reduced_n
            return reduced_n
        return reduce(tensor) if _same_tokens(tensor, n) else tensor

    reduced_context = one(context)
    return reduced_context, (reduced_context if value is context else one(value))


# Core ComfyUI nodes whose attn1_patch regroups the self-attention queries (by the module and name of
# their patch function; duck typed, nothing imported). ComfyUI runs attn1 patches, and then attn1 output
# patches, in registration order (not nested), so two such patches on one block see each other's tokens.
REGROUPING_PARTNERS = {("nodes_hypertile", "hypertile_in"): "HyperTile", ("nodes_tomesd", "tomesd_m"): "TomePatchModel"}


def partner_of(patch: Any) -> Optional[str]:
    """The core node that registered ``patch`` if it regroups self-attention tokens, else None."""
    # The module is "comfy_extras.nodes_hypertile", "nodes_hypertile" (2024) or, ComfyUI 0.3.x's loader,
    # the file's path with "." spelled "_x_" (".../comfy_extras/nodes_hypertile_x_py").
    module = getattr(patch, "__module__", "") or ""
    module = re.split(r"[./\\]", module[:-len("_x_py")] if module.endswith("_x_py") else module)[-1]
    return REGROUPING_PARTNERS.get((module, getattr(patch, "__name__", "")))


def attn1_patches_of(patcher_or_options: Any) -> list:
    """The attn1_patch list of a ModelPatcher, or of a transformer_options dict (as samplers pass it)."""
    options = patcher_or_options
    if not isinstance(options, dict):
        options = (getattr(patcher_or_options, "model_options", None) or {}).get("transformer_options", {})
    return list((options.get("patches") or {}).get("attn1_patch") or [])


def refuse_partner_before(patcher: Any, config: ToMeConfig) -> None:
    """Refuse, when the node runs, a regrouping partner already on the model that ToMe cannot act beside.

    HyperTile before ToMe in mode merge: HyperTile moves the queries into the batch (tiles), merged
    tokens cannot be copied back through its tiles, so ToMe would merge nothing HyperTile tiled.
    (TomePatchModel before ToMe works: it merges the queries, ToMe the keys/values.)
    """
    if config.mode != "merge" or not config.enabled:
        return
    if "HyperTile" in {partner_of(patch) for patch in attn1_patches_of(patcher)}:
        raise ValueError(
            "ToMe: HyperTile is applied before ToMe (mode merge) on this model; both regroup the same "
            "self-attention tokens, so ToMe would merge nothing HyperTile tiles. Use ToMe (advanced) in mode "
            "kv, which acts beside HyperTile in either order, or one of the two nodes.")


def refuse_partner_after(patches: list, own_patch: Callable, config: ToMeConfig) -> None:
    """Refuse, at sampling before any attention, a regrouping partner registered after ToMe in mode merge:
    it would see ToMe's merged tokens and silently do nothing (or tile them wrongly)."""
    if config.mode != "merge" or own_patch not in patches:
        return
    after = [partner_of(patch) for patch in patches[patches.index(own_patch) + 1:]]
    if "HyperTile" in after:
        raise RuntimeError(
            "ToMe: HyperTile is applied after ToMe (mode merge) on this model, and would tile nothing: ToMe "
            "merges the self-attention tokens first. Use ToMe (advanced) in mode kv, which acts beside "
            "HyperTile in either order, or one of the two nodes.")
    if "TomePatchModel" in after:
        raise RuntimeError(
            "ToMe: ComfyUI's TomePatchModel is applied after ToMe (mode merge) on this model, and would merge "
            "nothing: ToMe merges the same tokens first. Put TomePatchModel before ToMe (Load Checkpoint -> "
            "TomePatchModel -> ToMe: it merges the queries, ToMe the keys/values), use mode kv, or one node.")


_OFF = object()  # a call's tables entry when ToMe is off at its step


@dataclass
class ComfyPatches:
    """The patch callables for one patched model; attn2/attn2_output are None unless merge_crossattn.

    apply_model_wrapper, for hosts with model wrappers (ComfyUI 0.3.x ``add_wrapper_with_key``),
    reads the step once per model call outside the diffusion model and hands the blocks this
    call's per-level tables through ``transformer_options[tables_key]``: the patches then never
    read a float or seed a generator, so ComfyUI's TorchCompileModel traces them without a graph
    break or a per-step recompile. Hosts without them (the 2024 ComfyUI, Forge) get the same work
    from ``model_function_wrapper`` in their one ``model_options["model_function_wrapper"]`` slot,
    chained to a wrapper already there (``with_previous``). Where a node set after ToMe replaced it,
    the patches read the step themselves, once per model call (``StepSigma``), and match per block.
    """

    attn1: Callable
    attn1_output: Callable
    apply_model_wrapper: Callable
    model_function_wrapper: Callable[[Optional[Callable]], Callable]
    tables_key: str
    merger: TokenMerger
    state: "UNetPatchState"
    partner_check: Optional[Callable] = None
    attn2: Optional[Callable] = None
    attn2_output: Optional[Callable] = None


def levels_of(patcher: Any) -> Dict[int, Level]:
    """The attention levels of the patcher's UNet (for the speed check); {} where it has none."""
    unet = _model_object(patcher, "diffusion_model")
    return attention_levels(unet) if isinstance(unet, torch.nn.Module) else {}


class UNetPatchState:
    """What one patched model's patch functions share (held by their closures, never deep-copied): the
    merger, the sigma window and the model call in progress.

    One ``TokenMerger`` serves every block, so blocks of a level and cond/uncond chunks evaluated at the
    same sigma share one random partition (the sigma is the merger's step key).
    """

    def __init__(self, config: ToMeConfig, base_downsample: int, window: SigmaWindow,
                 levels: Optional[Dict[int, Level]]) -> None:
        self.config = config
        self.merger = TokenMerger(config, base_downsample, levels)
        self.window = window
        self.windowed = window != SigmaWindow()
        self.step_sigma = StepSigma()
        self.tables_key = f"tome_tables_{id(self.merger):x}"  # one per patched model: two ToMe nodes never share it
        self.call_step: Any = 0.0  # the step key (a float or the sigma tensor) of the call in progress
        self.own_patch: Optional[Callable] = None  # this model's attn1 patch, for the partner checks
        self.own_patches: Tuple[Callable, ...] = ()  # all of this model's patch functions
        # patches only for calls no wrapper of ToMe's prepared: set where ToMe holds the model_function_wrapper slot,
        # which a node set after ToMe can take
        self.fallback_patches: Tuple[Callable, ...] = ()
        self.warned_unwrapped = False
        self.needs_step = self.merger.needs_step()  # the config is frozen
        self.checked_attn1: Tuple[Callable, ...] = ()  # the attn1 patches last checked for a partner after ToMe
        self.forcing: Optional[Tuple] = None  # in a speed-check repeat: the ((grid, downsample),) it reduces, or ()
        self.compile_key = CompileKey()  # the keyword that keys a compiled model's graphs to this patch (compiled.py)

    def prepare_call(self, model: Any, x: torch.Tensor, t: Any, options: dict,
                     rerun: Optional[Callable[[], Any]] = None) -> Optional[dict]:
        """Before a model call: refuse a partner registered after ToMe, and hand the blocks this call's per-level
        tables through ``options`` (only tables reach traced code: a float there would be guarded on, a recompile
        per step). The step is read on the host only where a window needs it; a random partition is drawn from
        the sigma tensor on its device (engine ``step_choice``). rerun(): the model call once more through ToMe's
        wrapper, which the speed check times whole and with each level reduced (once per shape; ``forcing``).

        Where the call reduces nothing (outside its window, or every level left whole) ToMe's patches sit it out:
        ``options["patches"]`` becomes lists without them, and the lists it had are returned: the wrapper puts
        them back after the call and drops the call's tables (``options.pop(tables_key)``).
        Written for a fast GPU, where every Python call here is launch time: a handful per model call."""
        attn1 = tuple((options.get("patches") or {}).get("attn1_patch") or ())
        if attn1 != self.checked_attn1 and self.config.mode == "merge":  # the same patches in every call of a run
            refuse_partner_after(list(attn1), self.own_patch, self.config)
            self.checked_attn1 = attn1
        step: Any = 0.0
        if self.windowed:
            sigma = sigma_value(t)  # the one host read of this model call
            step = 0.0 if sigma is None else sigma
            if sigma is not None and not self.window.contains(sigma):
                options[self.tables_key] = _OFF
                return self._hand_patches(options, self.own_patches)
        elif self.needs_step and t is not None:
            step = t
        self.call_step = step
        forcing = self.forcing
        if self.merger.reuse.on and forcing is None:  # match_every: a sampling run never starts on the last run's
            self.merger.reuse.restart_on(options.get("sample_sigmas"))
        hw, batch = (int(x.shape[-2]), int(x.shape[-1])), int(x.shape[0])
        dtype = getattr(model, "manual_cast_dtype", None)  # what ComfyUI's BaseModel computes in
        if not isinstance(dtype, torch.dtype):
            get_dtype = getattr(model, "get_dtype", None)
            dtype = get_dtype() if callable(get_dtype) else None
            dtype = dtype if isinstance(dtype, torch.dtype) else x.dtype
        levels = forcing
        if levels is None:
            run_level = None if rerun is None else (
                lambda grid, downsample, reduced: self.repeat_forced(((grid, downsample),) if reduced else (), rerun))
            levels = self.merger.reduced_levels(hw, x.device, batch, dtype, run_level)
        if not levels:  # the call reduces nothing: ToMe's patches sit it out
            options[self.tables_key] = _OFF
            return self._hand_patches(options, self.own_patches)
        tables = self.merger.step_tables(hw, step, x.device, batch, dtype, levels=levels, reuse=forcing is None)
        grids = {grid[0] * grid[1]: grid for grid in tables}  # token count -> grid of each level this call reduces
        # token counts of every other level: a block of one this call leaves is left alone
        options[self.tables_key] = (tables, grids, level_grids(*hw).keys() - grids.keys())
        return self._hand_patches(options, self.fallback_patches) if self.fallback_patches else None

    def repeat_forced(self, levels: Tuple, rerun: Callable[[], Any]) -> None:
        """The model call once more, through ToMe's wrapper as the user gets it, reducing exactly ``levels`` (the
        speed check's two sides: one level, or none)."""
        previous, self.forcing = self.forcing, levels
        try:
            with torch.no_grad():
                rerun()
        finally:
            self.forcing = previous

    @staticmethod
    def _hand_patches(options: dict, drop: Tuple[Callable, ...]) -> Optional[dict]:
        """Give this call patch lists without ``drop``; returns the lists it had (None where nothing changed)."""
        patches = options.get("patches")
        if not isinstance(patches, dict):
            return None
        handed = {}
        for kind, fns in patches.items():  # loops, not comprehensions: each of those is a Python call (3.11)
            if isinstance(fns, list):
                kept = []
                for fn in fns:
                    if fn not in drop:
                        kept.append(fn)
                fns = kept
            handed[kind] = fns
        options["patches"] = handed
        return patches

    def plan_for(self, n: torch.Tensor, extra_options: dict) -> TokenPlan:
        """The plan of the block whose attention gets ``n``. Shapes first: blocks ToMe leaves alone never look at
        the sigma (a host sync for a tensor), and the sigma is read only when the window or a random partition
        depends on it (hosts without model wrappers; with them, ``prepare_call`` did the step's work)."""
        merger, prepared = self.merger, extra_options.get(self.tables_key)
        if prepared is not None:
            if prepared is _OFF or n.dim() != 3:
                return IDENTITY_PLAN
            tables, grids, left_alone = prepared
            tokens = n.shape[1]
            grid = grids.get(tokens)
            if grid is not None and n.shape[0] == extra_options["original_shape"][0]:
                return merger.plan_with(n, grid, tables[grid])
            if grid is not None or not grids or tokens in left_alone:
                return IDENTITY_PLAN  # regrouped tokens (HyperTile), nothing reduced, or a level this call leaves
        shape, hw = extra_options.get("original_shape"), _latent_hw(extra_options)
        if hw is None or n.dim() != 3 or n.shape[0] != shape[0]:
            return IDENTITY_PLAN  # no latent size, or an earlier patch regrouped the tokens (HyperTile)
        grid = merger.grid(n, hw)
        if grid is None:
            return IDENTITY_PLAN
        if prepared is not None:
            tables = prepared[0]
            if grid in tables:
                return merger.plan_with(n, grid, tables[grid])
            return merger.plan_at(n, grid, step_key=self.call_step, latent_hw=hw)  # a grid no formula predicted
        sigma = self.step_sigma(extra_options) if self.windowed else None
        if self.windowed and sigma is not None and not self.window.contains(sigma):
            return IDENTITY_PLAN
        step = sigma if sigma is not None else (extra_options.get("sigmas") if merger.needs_step() else None)
        return merger.plan_at(n, grid, step_key=0.0 if step is None else step, latent_hw=hw)

    def reduce_keys_values(self, n: torch.Tensor, context: Any, value: Any, extra_options: dict, claim: str) -> tuple:
        """Keys/values only, when an earlier patch regrouped the queries but left the keys/values on the
        latent grid: TomePatchModel (queries merged, same batch) in both modes, HyperTile (queries tiled
        into the batch) in mode kv, where the reduced keys still split evenly over its tiles (attention
        reshapes the keys of each batch row into one contiguous run per tile)."""
        if context is n or not (isinstance(context, torch.Tensor) and context.dim() == 3 and n.dim() == 3
                                and _same_tokens(value, context) and n.shape[0] % context.shape[0] == 0):
            return n, context, value
        tiles = n.shape[0] // context.shape[0]
        if tiles > 1 and self.config.mode != "kv":
            return n, context, value
        plan = self.plan_for(context, extra_options)
        if not plan.active:
            return n, context, value
        reduce = plan.reduce_kv if self.config.mode == "kv" else plan.merge
        context_r = reduce(context)
        if tiles > 1 and context_r.shape[1] % tiles:
            return n, context, value
        extra_options[claim] = True
        return n, context_r, context_r if value is context else reduce(value)


def _apply_model_wrapper(state: UNetPatchState) -> Callable:
    """The APPLY_MODEL wrapper (ComfyUI 0.3.x): ``state.prepare_call`` before each model call, undone after it."""
    def apply_model_wrapper(executor: Any, x: torch.Tensor, t: Any, c_concat: Any = None, c_crossattn: Any = None,
                            control: Any = None, transformer_options: Optional[dict] = None, **kwargs: Any) -> Any:
        # The signature of comfy.model_base.BaseModel.apply_model, whose executor we wrap.
        options = transformer_options
        args = (c_concat, c_crossattn, control, transformer_options)
        if not isinstance(options, dict) or x.dim() != 4:
            return executor(x, t, *args, **kwargs)
        model = getattr(executor, "class_obj", None)
        # the speed check's repeats: EasyCache stepped over, or None (step_caches); inline where no node wraps the
        # diffusion model (the steady call makes no Python call it does not need)
        wrappers = options.get("wrappers")
        again = repeat_options(options) if wrappers and wrappers.get(DIFFUSION_MODEL) else options
        patches = state.prepare_call(model, x, t, options, None if again is None else (
            lambda: apply_model_wrapper(executor, x, t, c_concat, c_crossattn, control, again, **kwargs)))
        prepared, call_kwargs = options.get(state.tables_key), kwargs
        if prepared is not _OFF and prepared is not None and compiled_call(options):  # its own graph (compiled.py)
            call_kwargs = state.compile_key.added(kwargs, model.diffusion_model, (tuple(x.shape), tuple(prepared[1])))
        try:
            return executor(x, t, *args, **call_kwargs)
        finally:  # inline, not a method: one Python call fewer per model call
            options.pop(state.tables_key, None)
            if patches is not None:
                options["patches"] = patches

    return apply_model_wrapper


def _model_function_wrapper(state: UNetPatchState) -> Callable[[Optional[Callable]], Callable]:
    """``with_previous(previous)``: the ``model_function_wrapper`` for hosts without model wrappers (the 2024
    ComfyUI's ``samplers.calc_cond_batch`` and Forge's ``sampling_function.calc_cond_uncond_batch`` call it as
    ``wrapper(model.apply_model, {"input", "timestep", "c", "cond_or_uncond"})``): ``state.prepare_call`` before
    each model call, undone after it. The slot holds one function, so ``previous`` (a wrapper a node applied
    before ToMe) is called in turn and both act: it gets an ``apply_model`` that ToMe prepares for each call it
    makes, so a wrapper that calls the model on other latents (Forge's MultiDiffusion, on tiles) gets tables for
    those latents, not for the one the sampler passed."""
    def prepared(apply_model: Callable, args: dict) -> Any:
        x, c, t = args.get("input"), args.get("c"), args.get("timestep")
        options = c.get("transformer_options") if isinstance(c, dict) else None
        if not isinstance(options, dict) or not isinstance(x, torch.Tensor) or x.dim() != 4:
            return apply_model(x, t, **c)
        patches = state.prepare_call(getattr(apply_model, "__self__", None), x, t, options,
                                     lambda: prepared(apply_model, args))
        try:
            return apply_model(x, t, **c)
        finally:
            options.pop(state.tables_key, None)
            if patches is not None:
                options["patches"] = patches

    def with_previous(previous: Optional[Callable]) -> Callable:
        if previous is None:
            return prepared  # the sampler's call itself: the fewest Python calls per model call

        def model_function_wrapper(apply_model: Callable, args: dict) -> Any:
            def each_call(x: torch.Tensor, t: Any, **c: Any) -> Any:
                return prepared(apply_model, {"input": x, "timestep": t, "c": c})

            each_call.__self__ = getattr(apply_model, "__self__", None)  # as the bound method it stands for
            return previous(each_call, args)

        model_function_wrapper.tome_previous = previous
        return model_function_wrapper

    return with_previous


def _partner_check(state: UNetPatchState) -> Callable:
    """An input_block_patch, for calls no wrapper of ToMe's prepared (the 2024 ComfyUI and Forge, where a node set
    after ToMe took the one model_function_wrapper slot): it sees the sampler's transformer_options, patch lists
    included, after input block 0 and before any attention. The wrapper leaves it out of the calls it prepares."""
    def partner_check(h: torch.Tensor, transformer_options: dict) -> torch.Tensor:
        # a call ToMe's wrapper prepared (its tables are in the options: the speed check's repeats too) was checked
        if transformer_options.get("block") == ("input", 0) and state.tables_key not in transformer_options:
            refuse_partner_after(attn1_patches_of(transformer_options), state.own_patch, state.config)
            if state.fallback_patches and not state.warned_unwrapped:
                state.warned_unwrapped = True
                log.warning("ToMe: a node or extension applied after ToMe replaced its model_function_wrapper (this "
                            "host keeps one), so ToMe matches per block and its speed check times self-attention "
                            "alone. Apply ToMe after that node and both act as set.")
        return h

    return partner_check


def _slot_patches(state: UNetPatchState, kind: str) -> Tuple[Callable, Callable]:
    """The (patch, output patch) pair of ``kind`` ("attn1" or "attn2"): merge (or reduce) before the attention,
    unmerge after. The plan of the block being evaluated and the [B, N'] its output must have are handed from
    ``before`` to ``after`` (called back to back by the same block)."""
    pending: list = [IDENTITY_PLAN, None]
    claim, mode = f"tome_{kind}_merged", state.config.mode

    def before(n, context, value, extra_options: dict):
        # extra_options is made afresh for each block call and shared by its patches: an earlier
        # ToMe patch (a second ToMe node upstream) marks the block so that only the first one acts.
        plan = IDENTITY_PLAN if extra_options.get(claim) else state.plan_for(n, extra_options)
        pending[:] = [plan, None]
        if not plan.active:  # checks inline: on a fast GPU each Python call here is paid in every block
            if kind == "attn1" and context is not n and not extra_options.get(claim):
                return state.reduce_keys_values(n, context, value, extra_options, claim)
            return n, context, value
        extra_options[claim] = True
        if kind == "attn1" and mode == "kv":
            return (n, *_reduced_once(plan.reduce_kv, n, context, value, None))
        merged = plan.merge(n)  # attn2: only the queries are image tokens
        if kind == "attn1":
            context, value = _reduced_once(plan.merge, n, context, value, merged)
        pending[1] = tuple(merged.shape[:2])
        return merged, context, value

    def after(out, extra_options):
        (plan, expected), pending[:] = pending, [IDENTITY_PLAN, None]
        if expected is None:  # nothing merged before this attention (kv leaves the queries whole)
            return out
        if tuple(out.shape[:2]) != expected:
            raise RuntimeError(
                f"ToMe: the {kind} output has shape {tuple(out.shape)} but ToMe merged the tokens to "
                f"{expected}: an attention patch registered after ToMe regroups tokens (e.g. HyperTile). "
                "Apply ToMe after that node, or not on the same UNet level."
            )
        return plan.unmerge(out)

    before.__name__, after.__name__ = f"tome_{kind}_patch", f"tome_{kind}_output_patch"
    return before, after


def make_patches(config: ToMeConfig, base_downsample: int, window: SigmaWindow = SigmaWindow(),
                 levels: Optional[Dict[int, Level]] = None) -> ComfyPatches:
    """Build the attention patches for one model: plain functions (ComfyUI deep-copies model_options on
    clone(), keeping functions as they are) whose closures share one ``UNetPatchState``.

    levels: the UNet's attention levels, for the speed check (``levels_of``).
    """
    state = UNetPatchState(config, base_downsample, window, levels)
    attn1, attn1_output = _slot_patches(state, "attn1")
    state.own_patch = attn1
    attn1.tome_merger = state.merger  # found again on any clone of the patcher (merger_of)
    patches = ComfyPatches(attn1=attn1, attn1_output=attn1_output, apply_model_wrapper=_apply_model_wrapper(state),
                           model_function_wrapper=_model_function_wrapper(state), tables_key=state.tables_key,
                           merger=state.merger, state=state, partner_check=_partner_check(state))
    if config.merge_crossattn and config.mode == "merge":
        patches.attn2, patches.attn2_output = _slot_patches(state, "attn2")
    state.own_patches = tuple(p for p in (attn1, attn1_output, patches.attn2, patches.attn2_output,
                                          patches.partner_check) if p is not None)
    return patches


def merger_of(patcher: Any) -> Optional[TokenMerger]:
    """The ``TokenMerger`` of the ToMe patch on ``patcher`` or on a clone of it, else None."""
    for patch in attn1_patches_of(patcher):
        merger = getattr(patch, "tome_merger", None)
        if isinstance(merger, TokenMerger):
            return merger
    return None


def describe_patcher(patcher: Any) -> list:
    """The speed check's verdict lines of the ToMe patch on ``patcher`` (``TokenMerger.describe_levels``)."""
    merger = merger_of(patcher)
    return merger.describe_levels() if merger is not None else []


def check_model_patcher(patcher: Any, config: ToMeConfig) -> Tuple[int, SigmaWindow]:
    """Every refusal of ``patch_model_patcher``, without cloning or patching anything.

    Returns (base_downsample, sigma window). config.merge_mlp has no patch point in ComfyUI's
    transformer block and is refused; so are non-UNet models (UnsupportedModelError, a TypeError,
    naming the model type) and a schedule window on a model without ``percent_to_sigma``.
    """
    missing = [name for name in _REQUIRED_METHODS if not callable(getattr(patcher, name, None))]
    if missing:
        raise TypeError(
            f"ToMe: expected a ComfyUI/Forge ModelPatcher with {', '.join(_REQUIRED_METHODS)}; "
            f"a {type(patcher).__name__} lacks {', '.join(missing)}."
        )
    if config.merge_mlp:
        raise ValueError("ToMe: merge_mlp is not available through ModelPatcher (no patch point around the "
                         "feed-forward); set merge_mlp=False.")
    base = base_downsample_of(patcher)  # refuses non-UNets, naming the model, before the block range
    require_all_blocks(config, model_type_name(patcher))
    if config.match_every > 1 and not callable(getattr(patcher, "add_wrapper_with_key", None)):
        raise ValueError(f"ToMe: match_every={config.match_every} keeps a matching across model calls, which needs "
                         "ComfyUI 0.3's model wrappers and the sampling run's sigmas (so a run never starts on the "
                         "last run's matching); this host (Forge, or a ComfyUI from before them) has neither: set "
                         "match_every=1 (in ComfyUI, or update it to 0.3 or later).")
    refuse_partner_before(patcher, config)
    return base, sigma_window(patcher, config)


def patch_model_patcher(patcher: Any, config: ToMeConfig, checked: Optional[Tuple[int, SigmaWindow]] = None) -> Any:
    """Return a clone of ``patcher`` with ToMe registered; ``patcher`` itself is never changed.

    Refuses (see ``check_model_patcher``) before cloning. checked: what ``check_model_patcher`` returned for this
    patcher and config (a host that checked first, as the ComfyUI node's plan does, reads the model once).
    """
    base, window = checked if checked is not None else check_model_patcher(patcher, config)
    clone = patcher.clone()
    if not config.enabled:
        return clone
    patches = make_patches(config, base, window, levels_of(patcher))
    if callable(getattr(clone, "add_wrapper_with_key", None)):
        clone.add_wrapper_with_key(APPLY_MODEL, patches.tables_key, patches.apply_model_wrapper)
    else:
        if callable(getattr(clone, "set_model_unet_function_wrapper", None)):
            previous = (getattr(clone, "model_options", None) or {}).get("model_function_wrapper")
            clone.set_model_unet_function_wrapper(patches.model_function_wrapper(previous))
            patches.state.fallback_patches = (patches.partner_check,)
        if callable(getattr(clone, "set_model_input_block_patch", None)):
            clone.set_model_input_block_patch(patches.partner_check)
    if config.merge_attn or config.mode == "kv":
        clone.set_model_attn1_patch(patches.attn1)
        clone.set_model_attn1_output_patch(patches.attn1_output)
    if patches.attn2 is not None:
        clone.set_model_attn2_patch(patches.attn2)
        clone.set_model_attn2_output_patch(patches.attn2_output)
    return clone
