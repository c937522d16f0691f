"""The per-model-call set-up both DiT modes share in diffusers: one forward pre-hook on the transformer.

Each model call: forget the last call's plan, read where the image tokens sit (once per distinct set of inputs,
``CallMemo``), read the step only where a step window is set (``call_step``), and hand the engine's call plan the
reading (``CallPlanner.plan``: the speed check's decision, asked before anything is planned and timed once per call
shape by repeating the call through this hook, then the plan). The blocks' hooks are registered only while calls
are reduced, so a call ToMe leaves whole runs as if unpatched. What differs between the modes is the state's
``read`` and ``reading``; the plan lives on ``state.current``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional, Tuple

import torch

from ...catalogue.diffusers_lookup import family_of
from ...engine.call_plan import CallPlanner, CallReading
from ...engine.config import ToMeConfig
from ...engine.schedule import call_step
from .call_memo import CallMemo
from .context_parallel import refuse as refuse_split
from .host_caches import cache_dit_probes, caches_stepped_over, is_cache_hook, probed_by
from .switched import SwitchedHooks
from .unet import not_compiled

CONTEXT_PARALLEL_HOOKS = ("cp_input---", "cp_output---")  # diffusers.hooks.context_parallel's hook names
PROBE = "_tome_probe"  # on each module of a block a step cache decides from (``DiTCallState.mark_probes``)
STATE_ATTR = "_tome_dit"  # one attribute for both DiT modes: remove_patch and is_patched treat them alike


class DiTCallState(CallPlanner):
    """What a DiT patch of either mode keeps on its transformer (``_tome_dit``): the family, the hooks, the call in
    progress (``current``) and the memo of the family's reading."""

    def __init__(self, model: torch.nn.Module, config: ToMeConfig) -> None:
        super().__init__(config)
        self.family = family_of(model)
        self.model_name = type(model).__name__
        self.handles: List[Any] = []
        self.current: Any = None
        self.memo = CallMemo()  # the family's reading of the last call (call_memo.py)
        self.hooks = SwitchedHooks()  # the blocks' hooks, registered while calls are reduced (switched.py)
        self.split_noted: set = set()  # the context-parallel settings describe() has a note of (``note_split``)
        self.weight = next(model.parameters())  # its dtype and device follow .to(), which converts it in place
        # the blocks ToMe changes (set by each mode), and those of them a step cache probes (``before_call``): left
        # whole, so the cache decides on the block's exact output and computes the steps it computes alone
        self.changed_blocks: List[Tuple[str, torch.nn.Module]] = []
        self.probes: frozenset = frozenset()

    def clear(self) -> None:
        """Forget the call in progress (before each call, and around the speed check's repeats)."""
        self.current = None

    def before_call(self, model: torch.nn.Module) -> None:
        """Before a reduced call's blocks run: the blocks a step cache probes (``probes``, read again at each reduced
        call: a cache may come or go between calls); mode merge adds its refusal of caches inside merged blocks."""
        by_cache_dit = cache_dit_probes(model)
        found = {}
        for name, block in self.changed_blocks:  # a loop, and probed_by only on a block diffusers hooks: no Python
            technique = by_cache_dit.get(name)   # call per block in a call without a cache
            if technique is None and "_diffusers_hook" in block.__dict__:
                technique = probed_by(block)
            if technique is not None:
                found[name] = technique
        probes = frozenset(found)
        if probes == self.probes:
            return
        self.probes = probes
        self.mark_probes()
        for name in sorted(probes):
            note = (f"{name} runs whole: {found[name]} decides from its output whether a step is computed, which "
                    "ToMe would change")
            if note not in self.notes:
                self.notes.append(note)

    def mark_probes(self) -> None:
        """Mark each module of a probe block (``PROBE``, cleared elsewhere): the hooks read the mark on the module they
        run on, the same code for every block (a block's name read in a hook would be a guard of dynamo's, one graph
        per block instance under regional compilation)."""
        for name, block in self.changed_blocks:
            for module in block.modules():
                if name in self.probes:
                    module.__dict__.setdefault(PROBE, True)
                else:
                    module.__dict__.pop(PROBE, None)

    def note_split(self, slices: Any, how: Callable[[], str]) -> None:
        """Say once per parallel setting, in describe(), how each process of a context-parallel split reduces its
        chunk (``how()``: built only then, not at every call)."""
        if slices.setting not in self.split_noted:
            self.split_noted.add(slices.setting)
            self.notes.append(f"under {slices.setting}: {how()}")

    def read(self, model: torch.nn.Module, call: dict) -> Any:
        """The family's reading of a call (``{"args": ..., "kwargs": ...}``), remembered by ``memo``."""
        raise NotImplementedError

    def reading(self, found: Any, step: Any, batch: int, slices: Any = None) -> Optional[CallReading]:
        """What the engine plans the call from, or None (unplaceable, warned; too few tokens) to leave it whole;
        ``slices``: the call's sequence split across processes (``engine.slices``), None on one."""
        raise NotImplementedError


@not_compiled  # host reads (step, Flux's ids) and the seeded picks stay out of torch.compile's graph
def on_model_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The transformer's forward pre-hook: the call's plan on ``state.current`` (None: every block runs whole, its
    block hooks unregistered: a call ToMe leaves whole runs as if unpatched)."""
    state: DiTCallState = model.__dict__[STATE_ATTR]
    state.clear()
    state.current = plan = _plan(state, model, args, kwargs)
    state.hooks.switch(plan is not None)


def _plan(state: DiTCallState, model: torch.nn.Module, args: tuple, kwargs: dict) -> Any:
    """The call's plan, or None: the reading (remembered while the inputs stay the same) and the step, then the
    engine's call plan (the speed check's decision first: a call shape left whole costs nothing more)."""
    config = state.config
    if not config.enabled or state.forcing is False:
        return None
    family = state.family
    spec = family.timestep
    found = state.memo.read(args, kwargs, (0, family.latents, spec.index, spec.name),
                            lambda: state.read(model, {"args": args, "kwargs": kwargs}))
    timestep = kwargs.get(spec.name, args[spec.index] if len(args) > spec.index else None)
    # context parallelism (diffusers sets the instance's _parallel_config): the split, or a refusal naming it
    slices = None if model.__dict__.get("_parallel_config") is None else refuse_split(model, config, found)
    on, step = call_step(timestep, config, spec.progress)  # reads the step only for a user-set window
    if not on:
        return None
    reading = state.reading(found, step, family.batch(args, kwargs), slices)
    # the speed check repeats the call through this hook, diffusers' step caches stepped over (``_again``); not where
    # another diffusers hook on the model itself may keep state (context parallelism's split and gather keep none)
    hooks = getattr(model.__dict__.get("_diffusers_hook"), "hooks", None)
    repeat = None if hooks and any(not name.startswith(CONTEXT_PARALLEL_HOOKS) and not is_cache_hook(name)
                                   for name in hooks) else (lambda: _again(model, args, kwargs))
    plan = state.plan(reading, repeat)
    if plan is not None:
        state.before_call(model)
    return plan


def _again(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The model call in progress once more, as the user gets it on a step no cache serves (the speed check forces it
    whole or reduced): diffusers' step caches are stepped over, so none takes a repeat for a step, serves it, or has
    its state changed by it."""
    with torch.no_grad(), caches_stepped_over(model):
        model(*args, **kwargs)
