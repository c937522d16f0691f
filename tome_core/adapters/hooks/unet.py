"""Installing ToMe on a UNet with PyTorch's own forward hooks (no class swaps, no copied forwards).

The UNet's pre-hook records the latent size and the step; each transformer block's pre-hook makes
the block's ``TokenPlan`` from its input (the metric tomesd uses); pre-/post-hooks on attn1, attn2
and ff merge their input and unmerge their output. Every handle is kept in the ``PatchState`` on
the UNet, so removal mirrors installation exactly.
"""
from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Protocol, Tuple

import torch

from ...engine.config import ToMeConfig
from .fused_kv import add_kv_projection
from .host_caches import Guarded, refuse_caches_inside
from ...catalogue.unets import attention_base_downsample, attention_levels, transformer_blocks
from ...engine.plan import IDENTITY_PLAN, TokenMerger, TokenPlan
from ...engine.schedule import UNET_TIMESTEPS, timestep_value

STATE_ATTR = "_tome_core"
_HIDDEN_NAMES = ("hidden_states", "x")


class Removable(Protocol):
    """A hook handle, or anything else a patch adds that ``remove()`` takes away again."""

    def remove(self) -> None: ...


@dataclass
class PatchState:
    """Everything a patch adds to one UNet; lives at ``unet._tome_core`` until removal."""

    config: ToMeConfig
    merger: TokenMerger
    handles: List[Removable] = field(default_factory=list)
    num_blocks: int = 0
    latent_hw: Optional[Tuple[int, int]] = None
    step_key: float = 0.0
    progress: Optional[float] = None
    active: bool = True  # this model call is inside the step schedule
    tables: Dict[Tuple[int, int], Any] = field(default_factory=dict)  # this call's per-level choices
    guarded: List[Guarded] = field(default_factory=list)  # modules whose tokens ToMe changes (host_caches.py)

    def plan_for(self, hidden: torch.Tensor) -> TokenPlan:
        """The plan of a block whose input is ``hidden``, in the current model call.

        Reads only shapes, a bool and ``tables`` (built by the UNet's pre-hook), never the step's
        float: under torch.compile that would be a constant guarded on, recompiled every step.
        """
        if self.latent_hw is None or not self.active:  # outside the UNet's forward, or off this step
            return IDENTITY_PLAN
        grid = self.merger.grid(hidden, self.latent_hw)
        if grid is None:
            return IDENTITY_PLAN
        if grid in self.tables:
            return self.merger.plan_with(hidden, grid, self.tables[grid])
        return self.merger.plan_at(hidden, grid, self.step_key, self.latent_hw)  # a grid no level formula predicted

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()


def step_of(timestep: Any) -> Tuple[float, Optional[float]]:
    """(step_key, progress) from a UNet's timestep argument; progress 0 = first, noisiest step."""
    key = timestep_value(timestep)
    return (0.0, None) if key is None else (key, UNET_TIMESTEPS.progress(key))


def compute_dtype(unet: torch.nn.Module, sample: torch.Tensor) -> torch.dtype:
    """The dtype the UNet's attention runs in: its own ``dtype`` (diffusers, LDM: inputs are cast to
    it), else the sample's."""
    dtype = getattr(unet, "dtype", None)
    return dtype if isinstance(dtype, torch.dtype) else sample.dtype


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


def _replace_first_input(args: tuple, kwargs: dict, name: Optional[str], value: torch.Tensor):
    if name is None:
        return (value,) + tuple(args[1:]), kwargs
    kwargs[name] = value
    return args, kwargs


def _context_argument(attention: torch.nn.Module) -> str:
    """The keyword that feeds an attention module its keys/values: diffusers vs ldm/sgm naming."""
    parameters = inspect.signature(attention.forward).parameters
    return "encoder_hidden_states" if "encoder_hidden_states" in parameters else "context"


def _hook_block(block: torch.nn.Module, state: PatchState) -> None:
    config = state.config
    current: List[TokenPlan] = [IDENTITY_PLAN]  # the plan of this block's running forward

    def make_plan(module, args, kwargs):
        if config.merge_mlp and getattr(module, "_chunk_size", None):
            raise RuntimeError("ToMe: merge_mlp cannot be combined with diffusers' feed-forward chunking; "
                               "call unet.disable_forward_chunking() or use merge_mlp=False.")
        _, hidden = _first_input(args, kwargs)
        current[0] = state.plan_for(hidden)
        return None

    def merge_input(module, args, kwargs):
        plan = current[0]
        if not plan.active:
            return None
        name, hidden = _first_input(args, kwargs)
        return _replace_first_input(args, kwargs, name, plan.merge(hidden))

    def unmerge_output(module, args, output):
        plan = current[0]
        return plan.unmerge(output) if plan.active else None

    if config.mode == "kv":
        if config.merge_attn:
            _hook_kv(block.attn1, state)
        return
    def forget_plan(module, args, output):
        # The plan holds this call's tensors; dropping it after the block also leaves torch.compile
        # nothing made inside the graph to write back into ``current`` (a graph break otherwise).
        current[0] = IDENTITY_PLAN

    state.handles.append(block.register_forward_pre_hook(make_plan, with_kwargs=True))
    state.handles.append(block.register_forward_hook(forget_plan, always_call=True))
    for enabled, name in ((config.merge_attn, "attn1"), (config.merge_crossattn, "attn2"), (config.merge_mlp, "ff")):
        module = getattr(block, name, None)
        if enabled and module is not None:
            state.handles.append(module.register_forward_pre_hook(merge_input, with_kwargs=True))
            state.handles.append(module.register_forward_hook(unmerge_output))


def _hook_kv(attention: torch.nn.Module, state: PatchState) -> None:
    """kv needs no metric, so attn1's own pre-hook makes and uses the plan: nothing is carried
    between hooks, which keeps the block traceable by torch.compile (no state to reconstruct).
    A diffusers self-attention also gets a ``to_kv`` for its fused processor (see fused_kv.py)."""
    context_name = _context_argument(attention)
    projection = add_kv_projection(attention)
    if projection is not None:
        state.handles.append(projection)

    def pool_keys_values(module, args, kwargs):
        # Only plain self-attention: attn1 that already attends to a context (diffusers'
        # only_cross_attention, LDM's disable_self_attn) is left alone.
        if kwargs.get(context_name) is not None or (len(args) > 1 and args[1] is not None):
            return None
        _, hidden = _first_input(args, kwargs)
        plan = state.plan_for(hidden)
        if not plan.active:
            return None
        kwargs[context_name] = plan.reduce_kv(hidden)
        return args[:1], kwargs

    state.handles.append(attention.register_forward_pre_hook(pool_keys_values, with_kwargs=True))


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
    """Hook every transformer block of ``unet``; raises TypeError (and hooks nothing) if it has none."""
    state = PatchState(config=config, merger=TokenMerger(config, attention_base_downsample(unet), attention_levels(unet)))
    blocks = transformer_blocks(unet)
    if config.enabled:  # apply_patch checked them (check_partners); each model call checks again
        state.guarded = guarded_modules(unet, config)

    @not_compiled
    def record_step(module, args, kwargs):
        # A cache hook added after apply_patch is refused here, before any block of this call runs.
        refuse_caches_inside(state.guarded, state.config.mode)
        sample = args[0] if args else kwargs.get("sample", kwargs.get("x"))
        timestep = args[1] if len(args) > 1 else next(
            (kwargs[k] for k in ("timestep", "timesteps", "t") if k in kwargs), None)
        state.latent_hw = (int(sample.shape[-2]), int(sample.shape[-1]))
        # step_of reads the timestep (one host sync per UNet call): only when the plans depend on it.
        if state.merger.needs_step() or state.config.start_percent > 0 or state.config.end_percent < 1:
            state.step_key, state.progress = step_of(timestep)
        state.active = state.config.in_schedule(state.progress)
        state.tables = state.merger.step_tables(state.latent_hw, state.step_key, sample.device, int(sample.shape[0]),
                                                compute_dtype(module, sample)) if state.active else {}
        return None

    state.handles.append(unet.register_forward_pre_hook(record_step, with_kwargs=True))
    for block in blocks:
        _hook_block(block, state)
    state.num_blocks = len(blocks)
    setattr(unet, STATE_ATTR, state)
    return state


def uninstall(unet: torch.nn.Module) -> None:
    state = unet.__dict__.pop(STATE_ATTR, None)
    if state is not None:
        state.remove()
