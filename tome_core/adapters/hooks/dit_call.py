"""The per-model-call set-up both DiT modes share in diffusers: one forward pre-hook on the transformer.

Each model call: forget the last call's plan, read where the image tokens sit (once per distinct set of inputs,
``CallMemo``), read the step only where a step window is set (``call_step``), build the call's plan (mode kv: the
kept keys; mode merge: a ``_Call`` that plans its matching in the first reduced block) and, where the speed check
is on, time the call whole against reduced (``KVPatchState.call_pays``) by repeating it. What differs between the
modes is the state's ``read``, ``placed`` and ``planner``; the plan lives on ``state.current``.
"""
from __future__ import annotations

from typing import Any, Callable, List, Optional

import torch

from ...catalogue.diffusers_dits import family_of
from ...engine.config import ToMeConfig
from ...engine.grid import TokenLayout
from ...engine.kv_state import KVPatchState, call_label
from ...engine.schedule import call_step
from .call_memo import CallMemo
from .call_timing import repeat_call
from .unet import not_compiled

STATE_ATTR = "_tome_dit"  # one attribute for both DiT modes: remove_patch and is_patched treat them alike


class DiTCallState(KVPatchState):
    """What a DiT patch of either mode keeps on its transformer (``_tome_dit``): the family, the hooks, the call in
    progress (``current``) and the memo of the family's reading."""

    def __init__(self, model: torch.nn.Module, config: ToMeConfig) -> None:
        super().__init__(config)
        self.family = family_of(model)
        self.model_name = type(model).__name__
        self.handles: List[Any] = []
        self.current: Any = None
        self.memo = CallMemo()  # the family's reading of the last call (call_memo.py)

    def clear(self) -> None:
        """Forget the call in progress (before each call, and around the speed check's repeats)."""
        self.current = None

    def before_call(self, model: torch.nn.Module) -> None:
        """Checks made at every enabled call (merge: step caches added since apply_patch)."""

    def read(self, model: torch.nn.Module, call: dict) -> Any:
        """The family's reading of a call (``{"args": ..., "kwargs": ...}``), remembered by ``memo``."""
        raise NotImplementedError

    def placed(self, found: Any) -> Optional[TokenLayout]:
        """The layout the call is reduced on, or None (unplaceable, warned; too few tokens) to leave it whole."""
        raise NotImplementedError

    def planner(self, found: Any, layout: TokenLayout, step: Any,
                device: torch.device) -> Optional[Callable[[bool], Any]]:
        """A maker of the call's plan (``first``: the call itself, else a speed-check repeat), or None: leave it
        whole. Built outside any compiled code: what is seeded by the step never reaches a traced graph."""
        raise NotImplementedError


@not_compiled  # host reads (step, Flux's ids) and the seeded picks stay out of torch.compile's graph
def on_model_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> None:
    """The transformer's forward pre-hook: the call's plan on ``state.current`` (None: every block runs whole)."""
    state: DiTCallState = model.__dict__[STATE_ATTR]
    state.clear()
    config = state.config
    if not config.enabled:
        return
    state.before_call(model)
    spec = state.family.timestep
    found = state.memo.read(args, kwargs, (0, "hidden_states", spec.index, spec.name),
                            lambda: state.read(model, {"args": args, "kwargs": kwargs}))
    layout = state.placed(found)
    if layout is None:
        return
    timestep = kwargs.get(spec.name, args[spec.index] if len(args) > spec.index else None)
    on, step = call_step(timestep, config, spec.progress)  # reads the step only for a user-set window
    if not on:
        return
    weight = next(model.parameters())
    device = weight.device
    plan = state.planner(found, layout, step, device)
    if plan is None:
        return
    state.current = plan(True)
    if config.speed_check == "off":
        return
    again = repeat_call(model, args, kwargs)

    def run(reduced: bool) -> None:
        state.clear()
        state.current = plan(False) if reduced else None
        try:
            again()
        finally:
            state.clear()
            state.current = plan(False)

    batch = int((args[0] if args else kwargs["hidden_states"]).shape[0])
    if not state.call_pays((type(model).__name__, layout, batch), call_label(layout.grid, batch),
                           weight.dtype, device, run if again is not None else None):
        state.current = None
