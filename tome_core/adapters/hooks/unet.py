"""Installing ToMe on a UNet with PyTorch's own forward hooks (no class swaps, no copied forwards).

The UNet's pre-hook records the latent size and the step, builds the call's per-level tables and attaches
the block hooks of exactly the levels reduced in this call: a level left whole (speed check, ``min_tokens``),
a call outside the step window and ratio 0 run no ToMe code in any block (on a GPU each hook is launch
time). A reduced block's pre-hook makes its ``TokenPlan`` from its input (the metric tomesd uses); pre-/post-
hooks on attn1, attn2 and ff merge their input and unmerge their output. Every handle is kept in the
``PatchState`` on the UNet, so removal mirrors installation exactly.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from ...engine.config import ToMeConfig
from .fused_kv import add_kv_projection
from .host_caches import Guarded, refuse_caches_inside
from .switched import Removable, SwitchedHooks, compiled_with_fullgraph
from ...catalogue.unets import attention_base_downsample, attention_levels, level_blocks, transformer_blocks
from ...engine.plan import IDENTITY_PLAN, TokenMerger, TokenPlan
from ...engine.schedule import UNET_TIMESTEPS, timestep_value

STATE_ATTR = "_tome_core"
_HIDDEN_NAMES = ("hidden_states", "x")
_HOOK_REGISTRY = "_diffusers_hook"  # where diffusers keeps a module's hooks (host_caches.py)


@dataclass
class PatchState:
    """Everything a patch adds to one UNet; lives at ``unet._tome_core`` until removal."""

    config: ToMeConfig
    merger: TokenMerger
    handles: List[Removable] = field(default_factory=list)
    num_blocks: int = 0
    latent_hw: Optional[Tuple[int, int]] = None
    step_key: Any = 0.0  # the step's value, or its tensor (never read on the host: see engine step_choice)
    progress: Optional[float] = None
    active: bool = True  # this model call is inside the step schedule
    tables: Dict[Tuple[int, int], Any] = field(default_factory=dict)  # this call's per-level choices
    grids: Dict[int, Tuple[int, int]] = field(default_factory=dict)  # tokens -> grid of this call's reduced levels
    guarded: List[Guarded] = field(default_factory=list)  # modules whose tokens ToMe changes (host_caches.py)
    watched: List[torch.nn.Module] = field(default_factory=list)  # the transformer blocks and all inside them
    compiles_seen: set = field(default_factory=set)  # ids of the watched modules' compiled calls already looked at
    levels: Dict[int, SwitchedHooks] = field(default_factory=dict)  # downsample -> its blocks' hooks
    attached: frozenset = frozenset()  # the downsamples whose hooks are registered now
    call: Optional[tuple] = None  # (module, args, kwargs) of the model call being planned, for run_level
    forcing: Optional[tuple] = None  # in a speed-check repeat: the ((grid, downsample),) it reduces, or ()
    weight: Optional[torch.Tensor] = None  # a floating parameter: the dtype a diffusers UNet computes in

    def plan_for(self, hidden: torch.Tensor) -> TokenPlan:
        """The plan of a block whose input is ``hidden``, in the current model call.

        Reads only shapes, a bool and ``tables`` (built by the UNet's pre-hook), never the step's
        float: under torch.compile that would be a constant guarded on, recompiled every step.
        """
        if self.latent_hw is None or not self.active:  # outside the UNet's forward, or off this step
            return IDENTITY_PLAN
        grid = self.grids.get(hidden.shape[1])
        if grid is not None:
            return self.merger.plan_with(hidden, grid, self.tables[grid])
        grid = self.merger.grid(hidden, self.latent_hw)
        if grid is None:
            return IDENTITY_PLAN
        if grid in self.tables:
            return self.merger.plan_with(hidden, grid, self.tables[grid])
        return self.merger.plan_at(hidden, grid, self.step_key, self.latent_hw)  # a grid no level formula predicted

    def attach(self, wanted: frozenset) -> None:
        """Register the hooks of the levels in ``wanted`` and remove the others' (only what changed)."""
        for downsample, hooks in self.levels.items():
            hooks.switch(downsample in wanted)
        self.attached = wanted

    def run_level(self, grid: Tuple[int, int], downsample: int, reduced: bool) -> None:
        """The model call in progress once more, through the patch as the user gets it (its pre-hook builds the
        call's tables), with the level of ``grid`` reduced or with nothing reduced: what the speed check times
        (engine ``TokenMerger.pays``)."""
        module, args, kwargs = self.call
        forcing, call, latent_hw, active = self.forcing, self.call, self.latent_hw, self.active
        self.forcing = ((grid, downsample),) if reduced else ()
        try:
            with torch.no_grad():
                module(*args, **kwargs)
        finally:
            self.forcing, self.call, self.latent_hw, self.active = forcing, call, latent_hw, active

    def remove(self) -> None:
        self.attach(frozenset())
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def step_of(timestep: Any) -> Tuple[float, Optional[float]]:
    """(step_key, progress) from a UNet's timestep argument; progress 0 = first, noisiest step."""
    key = timestep_value(timestep)
    return (0.0, None) if key is None else (key, UNET_TIMESTEPS.progress(key))


def compute_dtype(unet: torch.nn.Module, sample: torch.Tensor, weight: Optional[torch.Tensor]) -> torch.dtype:
    """The dtype the UNet's attention runs in: an LDM/SGM UNet's ``dtype`` attribute (its inputs are cast to it),
    else its floating parameters' (``weight``: what diffusers' ``ModelMixin.dtype`` says, without that property's
    walk over every module, about 1 ms per call on a UNet's 700 modules), else the sample's."""
    dtype = unet.__dict__.get("dtype")
    if isinstance(dtype, torch.dtype):
        return dtype
    return weight.dtype if weight is not None else sample.dtype


def floating_weight(unet: torch.nn.Module) -> Optional[torch.Tensor]:
    """The UNet's first floating parameter (its ``dtype`` follows ``.to()``, which converts it in place)."""
    return next((p for p in unet.parameters() if p.is_floating_point()), None)


def not_compiled(fn):
    """Run ``fn`` eagerly under torch.compile: the once-per-model-call host work (the step read, the
    seeded generator) becomes one graph break before the UNet's compute instead of several inside it."""
    disable = getattr(getattr(torch, "compiler", None), "disable", None)
    return disable(fn) if disable is not None else fn


def _first_input(args: tuple, kwargs: dict) -> Tuple[Optional[str], torch.Tensor]:
    if args:
        return None, args[0]
    for name in _HIDDEN_NAMES:
        if name in kwargs:
            return name, kwargs[name]
    raise TypeError(f"ToMe: cannot find the hidden states among {sorted(kwargs)}.")


def _context_argument(attention: torch.nn.Module) -> str:
    """The keyword that feeds an attention module its keys/values: diffusers vs ldm/sgm naming."""
    parameters = inspect.signature(attention.forward).parameters
    return "encoder_hidden_states" if "encoder_hidden_states" in parameters else "context"


def _hook_block(block: torch.nn.Module, state: PatchState, level: SwitchedHooks) -> None:
    """Add one block's hooks to its level's (registered while the level is reduced; see ``PatchState.attach``)."""
    config = state.config
    current: List[TokenPlan] = [IDENTITY_PLAN]  # the plan of this block's running forward
    grids, merger = state.grids, state.merger

    def make_plan(module, args, kwargs):
        if config.merge_mlp and getattr(module, "_chunk_size", None):
            raise RuntimeError("ToMe: merge_mlp cannot be combined with diffusers' feed-forward chunking; "
                               "call unet.disable_forward_chunking() or use merge_mlp=False.")
        hidden = args[0] if args else _first_input(args, kwargs)[1]
        grid = grids.get(hidden.shape[1])
        current[0] = state.plan_for(hidden) if grid is None else merger.plan_with(hidden, grid, state.tables[grid])
        return None

    def merge_input(module, args, kwargs):
        plan = current[0]
        if not plan.active:
            return None
        if args:
            return (plan.merge(args[0]),) + tuple(args[1:]), kwargs
        name, hidden = _first_input(args, kwargs)
        kwargs[name] = plan.merge(hidden)
        return args, kwargs

    def unmerge_output(module, args, output):
        plan = current[0]
        return plan.unmerge(output) if plan.active else None

    if config.mode == "kv":
        if config.merge_attn:
            _hook_kv(block.attn1, state, level)
        return

    def unmerge_last(module, args, output):
        # The block's last merged module drops the plan, which holds this call's tensors: torch.compile then has
        # nothing made inside its graph to write back into ``current`` (a graph break otherwise), and the block
        # costs no hook of its own after its forward. always_call: dropped also where that module raised (no output).
        plan, current[0] = current[0], IDENTITY_PLAN
        return plan.unmerge(output) if plan.active and output is not None else None

    wanted = ((config.merge_attn, "attn1"), (config.merge_crossattn, "attn2"), (config.merge_mlp, "ff"))
    merged = [getattr(block, name) for enabled, name in wanted if enabled and getattr(block, name, None) is not None]
    if not merged:
        return
    level.add(block, make_plan, "pre")
    for module in merged:
        level.add(module, merge_input, "pre")
        level.add(module, unmerge_output if module is not merged[-1] else unmerge_last,
                  "post" if module is not merged[-1] else "post-always")


def _hook_kv(attention: torch.nn.Module, state: PatchState, level: SwitchedHooks) -> None:
    """kv needs no metric, so attn1's own pre-hook makes and uses the plan: nothing is carried
    between hooks, which keeps the block traceable by torch.compile (no state to reconstruct).
    A diffusers self-attention also gets a ``to_kv`` for its fused processor (see fused_kv.py)."""
    context_name = _context_argument(attention)
    projection = add_kv_projection(attention)
    if projection is not None:
        state.handles.append(projection)
    grids, merger = state.grids, state.merger

    def pool_keys_values(module, args, kwargs):
        # Only plain self-attention: attn1 that already attends to a context (diffusers'
        # only_cross_attention, LDM's disable_self_attn) is left alone.
        if kwargs.get(context_name) is not None or (len(args) > 1 and args[1] is not None):
            return None
        hidden = args[0] if args else _first_input(args, kwargs)[1]
        grid = grids.get(hidden.shape[1])
        plan = state.plan_for(hidden) if grid is None else merger.plan_with(hidden, grid, state.tables[grid])
        if not plan.active:
            return None
        kwargs[context_name] = plan.reduce_kv(hidden)
        return args[:1], kwargs

    level.add(attention, pool_keys_values, "pre")


def guarded_modules(unet: torch.nn.Module, config: ToMeConfig) -> List[Guarded]:
    """The modules whose tokens ToMe changes: merge: what it merges around; kv: attn1's insides."""
    names = {id(module): name for name, module in unet.named_modules()}
    if config.mode == "kv":
        wanted = (("attn1", config.merge_attn, False),)
    else:
        wanted = (("attn1", config.merge_attn, True), ("attn2", config.merge_crossattn, True),
                  ("ff", config.merge_mlp, True))
    guarded = []
    for block in transformer_blocks(unet):
        for attr, enabled, include_self in wanted:
            module = getattr(block, attr, None)
            if enabled and module is not None:
                guarded.append((names.get(id(module), attr), module, include_self))
    return guarded


def check_partners(unet: torch.nn.Module, config: ToMeConfig) -> None:
    """Refuse, before anything is hooked, what ToMe cannot run beside (see host_caches.py)."""
    if config.enabled:
        refuse_caches_inside(guarded_modules(unet, config), config.mode)


def install(unet: torch.nn.Module, config: ToMeConfig) -> PatchState:
    """Hook ``unet`` for ToMe; raises TypeError (and hooks nothing) if it has no transformer block.

    Ratio 0 registers no hook at all. Otherwise the UNet's pre-hook runs once per model call and attaches the
    hooks of the levels reduced in that call (``PatchState.attach``); the blocks of other levels run untouched.
    """
    merger = TokenMerger(config, attention_base_downsample(unet), attention_levels(unet))
    state = PatchState(config=config, merger=merger)
    state.num_blocks = len(transformer_blocks(unet))
    setattr(unet, STATE_ATTR, state)
    if not config.enabled:
        return state
    state.guarded = guarded_modules(unet, config)  # apply_patch checked them (check_partners); each call does again
    # the blocks and all inside them (guarded modules included): looked into at each reduced call
    state.watched = [sub for block in transformer_blocks(unet) for sub in block.modules()]
    for downsample, blocks in level_blocks(unet).items():
        level = state.levels[downsample] = SwitchedHooks()
        for block in blocks:
            _hook_block(block, state, level)
    state.weight = floating_weight(unet)
    state.handles.append(unet.register_forward_pre_hook(_record_step(state), with_kwargs=True))
    return state


def _record_step(state: PatchState) -> Callable:
    """The UNet's forward pre-hook: the call's latent size and step, the levels it reduces (the speed check's verdict
    per level, cached per shape; a speed-check repeat's forced levels) and their tables; only those levels' block
    hooks are registered. A call that reduces nothing (every level left whole, outside the step window) does no
    more than find that out."""
    config, merger = state.config, state.merger
    windowed = config.start_percent > 0 or config.end_percent < 1
    needs_step = merger.needs_step()

    @not_compiled
    def record_step(module, args, kwargs):
        sample = args[0] if args else kwargs.get("sample", kwargs.get("x"))
        timestep = args[1] if len(args) > 1 else next(
            (kwargs[k] for k in ("timestep", "timesteps", "t") if k in kwargs), None)
        state.latent_hw = latent_hw = (int(sample.shape[-2]), int(sample.shape[-1]))
        if windowed:  # the window needs the step's value: the one host read of a model call
            state.step_key, state.progress = step_of(timestep)
            state.active = config.in_schedule(state.progress)
        elif needs_step:  # a random partition per step, drawn on the step's device (engine step_choice)
            state.step_key = 0.0 if timestep is None else timestep
        levels: Tuple = ()  # (grid, downsample) of each level this call reduces
        if state.active:
            device, batch, dtype = sample.device, int(sample.shape[0]), compute_dtype(module, sample, state.weight)
            levels = state.forcing
            if levels is None:
                state.call = (module, args, kwargs)  # what the speed check repeats (run_level)
                try:  # inline, no helper calls: on a fast GPU each Python call here is paid in every step
                    levels = merger.reduced_levels(latent_hw, device, batch, dtype,
                                                   None if getattr(module.__dict__.get(_HOOK_REGISTRY), "hooks", None)
                                                   else state.run_level)  # a step cache on the UNet: not repeated
                finally:
                    state.call = None
        if not levels:  # the call reduces nothing: it runs as if unpatched
            if state.attached:  # the block hooks hold ``grids`` itself: emptied in place
                state.tables = {}
                state.grids.clear()
                state.attach(frozenset())
            return None
        refuse_late_changes(state)  # a cache hook or a compile since apply_patch, before any block of this call
        tables = merger.step_tables(latent_hw, state.step_key, device, batch, dtype, levels=levels,
                                    reuse=state.forcing is None)
        state.tables = tables
        grids = {grid[0] * grid[1]: grid for grid in tables}
        if grids != state.grids:
            state.grids.clear()
            state.grids.update(grids)
        wanted = frozenset(downsample for _, downsample in levels)
        if wanted != state.attached:
            state.attach(wanted)
        return None

    return record_step


def refuse_late_changes(state: PatchState) -> None:
    """Refuse, before any block of the call runs, what was done inside what ToMe reduces since apply_patch: a diffusers
    cache hook (``host_caches``), or in mode merge a block compiled alone with fullgraph=True (``refuse_compiled``).
    One look into each watched module's ``__dict__`` per call; a compiled module is looked into once."""
    merge = state.config.mode == "merge"
    for watched in state.watched:
        held = watched.__dict__
        if _HOOK_REGISTRY in held:
            refuse_caches_inside(state.guarded, state.config.mode)
        compiled = held.get("_compiled_call_impl") if merge else None
        if compiled is not None and id(compiled) not in state.compiles_seen:
            refuse_compiled([watched])
            state.compiles_seen.add(id(compiled))


def refuse_compiled(modules: List[torch.nn.Module]) -> None:
    """Mode merge on a UNet block compiled alone with fullgraph=True (``block.compile(fullgraph=True)``): torch.compile
    traces the block's hooks apart from it, each a graph of its own, and the plan one hook hands the next cannot leave
    a graph (dynamo stops the call: "Reconstruction failure"). Refused naming the block's class and what works."""
    for module in modules:
        if compiled_with_fullgraph(module):
            raise RuntimeError(
                f"ToMe: a {type(module).__name__} of the UNet is compiled alone with fullgraph=True: mode merge's "
                "hooks on a UNet block run outside such a graph and cannot hand it their plan. Compile the whole UNet "
                "instead (torch.compile(unet) or unet.compile(), fullgraph=True allowed), compile the blocks without "
                "fullgraph, or use mode='kv'.")


def uninstall(unet: torch.nn.Module) -> None:
    state = unet.__dict__.pop(STATE_ATTR, None)
    if state is not None:
        state.remove()
