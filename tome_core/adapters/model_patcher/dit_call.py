"""The per-model-call mechanism both DiT modes share in ComfyUI: one APPLY_MODEL wrapper per patched clone.

Each model call: the wrapper reads the call (``_read_call``: the layout from the latent, the text and the keywords,
the sigma) and hands the reading to the engine's call plan (``CallPlanner.plan``: the speed check's decision, timed
once per call shape by running the call again through this wrapper, forced whole and reduced; then the plan, with
the mode's host additions in ``build``); the plan is installed in the call's ``transformer_options`` for the call
only (``_install``: kv's attention override, merge's call key), then removed. A call ToMe leaves whole runs without
ToMe's per-block patches where the mode has them (``_sit_out``). The first call (which no step cache skips; outside
the schedule, a probe that reduces nothing) must reach the mode's patches, or the prompt stops
(``reach.unreached_error``): a node that runs the model's blocks itself would otherwise drop ToMe silently.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...catalogue.comfy_dits import base_model
from ...catalogue.comfy_lookup import ComfyModel
from ...engine.call_plan import CallPlanner, CallReading
from ...engine.grid import TokenLayout
from ...engine.schedule import SigmaWindow, sigma_value, step_signal
from .compiled import APPLY_MODEL, CompileKey, compiled_call
from .layout import refuse_unplaceable, token_layout
from .reach import unreached_error
from .step_caches import DIFFUSION_MODEL, repeat_options

OVERRIDE = "optimized_attention_override"  # ComfyUI (0.3.6x+) calls it around every optimized_attention


class DiTCallPatch(CallPlanner):
    """A DiT patch's APPLY_MODEL wrapper; the mode supplies ``reducible``, ``build`` (its host additions to the
    engine's plan), ``_install``, ``_probe`` and ``_reached`` (and ``_sit_out`` where it has per-block patches), and
    names itself and what its patches sit on (``MODE``, ``PATCHED``) for the unreached error."""

    MODE = ""
    PATCHED = ""
    reach_checked = False  # whether a model call has shown that it reaches the mode's patches
    window = SigmaWindow()  # the schedule's sigma window (the patch's, from start_percent/end_percent)
    known: Optional[ComfyModel] = None  # the patched model as the catalogue read it once (comfy_lookup.comfy_model)

    @property
    def compile_key(self) -> CompileKey:
        """The keyword that keys a compiled model's graphs to this patch (compiled.py), made at its first use."""
        key = self.__dict__.get("_compile_key")
        if key is None:
            key = self.__dict__["_compile_key"] = CompileKey()
        return key

    def reducible(self, layout: TokenLayout) -> bool:
        """Whether the mode reduces a call of this layout (enough tokens; kv: a window larger than one token)."""
        raise NotImplementedError

    def _read_call(self, base: Any, x: torch.Tensor, t: Any, context: Any, extra: dict,
                   options: dict) -> Optional[CallReading]:
        """The reading of a model call the mode reduces, or None: the call's layout from the latent, the text and the
        keywords (refusing tokens it cannot place), and the sigma, read on the host only where a step window is set
        (else a device signal: the seeded picks are drawn on the sigma's device, no host read)."""
        model, known = base.diffusion_model, self.known
        # the binding resolved at patch time, while the call's model is the one patched (another node may swap it)
        entry, last = (known.entry, known.grid_last) if known is not None and base_model(model) is known.model else \
            (None, None)
        refuse_unplaceable(model, extra, entry)
        layout = token_layout(model, x, context if isinstance(context, torch.Tensor) else None, extra, entry, last)
        if layout is None or not self.reducible(layout):
            return None
        if self.window != SigmaWindow():  # a window: the one host read of a model call
            step = sigma_value(t)
            if not self.window.contains(step):
                return None
        else:
            step = step_signal(t)
        return CallReading(layout, step, int(x.shape[0]), x.dtype, x.device, type(base).__name__,
                           host=(base, x, context, extra, options))

    def _install(self, options: dict, plan: Any) -> Callable[[], None]:
        """Put ``plan`` (or a probe) in the call's transformer_options; returns what takes it out again."""
        raise NotImplementedError

    def _sit_out(self, options: dict) -> Optional[Callable[[], None]]:
        """A call ToMe leaves whole: take the mode's per-block patches out of it (returns what puts them back), so the
        blocks run as unpatched; None where the mode has none."""
        return None

    def _probe(self) -> Any:
        """A plan that reduces nothing and records whether the call reached the patches."""
        raise NotImplementedError

    def _reached(self, plan: Any) -> bool:
        return plan.reached

    def apply_model_wrapper(self, executor: Any, x: torch.Tensor, t: Any, c_concat: Any = None,
                            c_crossattn: Any = None, control: Any = None, transformer_options: Optional[dict] = None,
                            **kwargs: Any) -> Any:
        """APPLY_MODEL wrapper: this call's plan in its transformer_options for the call only."""
        options = transformer_options if transformer_options is not None else {}
        base = executor.class_obj
        enabled = self.config.enabled
        reading = self._read_call(base, x, t, c_crossattn, kwargs, options) \
            if enabled and self.forcing is not False else None

        # the speed check's repeats: EasyCache stepped over, or None: another wrapper would see them (step_caches);
        # inline where no node wraps the diffusion model
        wrappers = options.get("wrappers")
        again = repeat_options(options) if wrappers and wrappers.get(DIFFUSION_MODEL) else options

        def repeat() -> None:  # the speed check's: this call again, through this wrapper as the user gets it
            with torch.no_grad():
                self.apply_model_wrapper(executor, x, t, c_concat, c_crossattn, control, again, **kwargs)

        plan = self.plan(reading, None if again is None else repeat)
        if plan is None and (self.reach_checked or not enabled):
            restore = self._sit_out(options)
            try:
                return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)
            finally:
                if restore is not None:
                    restore()
        probe = plan is None
        if probe:  # the first call, outside the schedule: only check that the patches are reached
            plan = self._probe()
        call_kwargs = kwargs
        if compiled_call(options):  # a graph of its own for each plan (compiled.py)
            call_kwargs = self.compile_key.added(kwargs, base.diffusion_model, "probe" if probe else reading.what)
        remove = self._install(options, plan)
        try:
            out = executor(x, t, c_concat, c_crossattn, control, options, **call_kwargs)
        finally:
            remove()
        if not self.reach_checked:  # the first call only: a step cache may skip later ones whole
            if not self._reached(plan):  # checked again on the next run: the prompt fails until one of the two goes
                raise unreached_error(base.diffusion_model, self.MODE, self.PATCHED)
            self.reach_checked = True
        return out


def call_patch_of(patcher: Any) -> Optional[DiTCallPatch]:
    """The DiT patch (mode kv or merge) of the ToMe patch on ``patcher``: its APPLY_MODEL wrapper's, or in Forge Neo
    its model_function_wrapper's; else None."""
    state = getattr((getattr(patcher, "model_options", None) or {}).get("model_function_wrapper"), "tome_state", None)
    if isinstance(state, DiTCallPatch):
        return state
    for wrappers in (getattr(patcher, "wrappers", None) or {}).get(APPLY_MODEL, {}).values():
        for wrapper in wrappers:
            state = getattr(wrapper, "__self__", None)
            if isinstance(state, DiTCallPatch):
                return state
    return None
