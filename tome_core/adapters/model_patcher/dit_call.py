"""The per-model-call mechanism both DiT modes share in ComfyUI: one APPLY_MODEL wrapper per patched clone.

Each model call: the mode plans the call from the latent, the text and the sigma (``_plan``: mode kv's kept keys,
mode merge's ``_MergeCall``), the speed check times the call whole against reduced where it is on
(``KVPatchState.call_pays``), and the plan is installed in the call's ``transformer_options`` for the call only
(``_install``: kv's attention override, merge's call key), then removed. The first call (which no step cache
skips; outside the schedule, a probe that reduces nothing) must reach the mode's patches, or the prompt stops
(``reach.unreached_error``): a node that runs the model's blocks itself would otherwise drop ToMe silently.
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

from ...engine.grid import TokenLayout
from ...engine.kv_state import KVPatchState, call_label
from ...engine.schedule import SigmaWindow, sigma_value, step_signal
from .layout import refuse_unplaceable, token_layout
from .reach import unreached_error

OVERRIDE = "optimized_attention_override"  # ComfyUI (0.3.6x+) calls it around every optimized_attention


class DiTCallPatch(KVPatchState):
    """A DiT patch's APPLY_MODEL wrapper; the mode supplies ``_plan``, ``_again``, ``_install``, ``_probe`` and
    ``_reached``, and names itself and what its patches sit on (``MODE``, ``PATCHED``) for the unreached error."""

    MODE = ""
    PATCHED = ""
    reach_checked = False  # whether a model call has shown that it reaches the mode's patches
    window = SigmaWindow()  # the schedule's sigma window (the patch's, from start_percent/end_percent)

    def reducible(self, layout: TokenLayout) -> bool:
        """Whether the mode reduces a call of this layout (enough tokens; kv: a window larger than one token)."""
        raise NotImplementedError

    def _read_call(self, base: Any, x: torch.Tensor, t: Any, context: Any,
                   extra: dict) -> Optional[Tuple[TokenLayout, Any]]:
        """(layout, step signal) of a model call the mode reduces, or None: the call's layout from the latent, the
        text and the keywords (refusing tokens it cannot place), and the sigma, read on the host only where a step
        window is set (else a device signal: the seeded picks are drawn on the sigma's device, no host read)."""
        if not self.config.enabled:
            return None
        refuse_unplaceable(base.diffusion_model, extra)
        layout = token_layout(base.diffusion_model, x, context if isinstance(context, torch.Tensor) else None, extra)
        if layout is None or not self.reducible(layout):
            return None
        if self.window != SigmaWindow():  # a window: the one host read of a model call
            sigma = sigma_value(t)
            return (layout, sigma) if self.window.contains(sigma) else None
        return layout, step_signal(t)

    def _plan(self, base: Any, x: torch.Tensor, t: Any, context: Any, extra: dict, options: dict) -> Any:
        """The call's plan, or None: leave it whole."""
        raise NotImplementedError

    def _again(self, plan: Any, base: Any, x: torch.Tensor, t: Any, context: Any, extra: dict,
               options: dict) -> Any:
        """The plan of a speed-check repeat of the call."""
        return plan

    def _install(self, options: dict, plan: Any) -> Callable[[], None]:
        """Put ``plan`` (or a probe) in the call's transformer_options; returns what takes it out again."""
        raise NotImplementedError

    def _probe(self) -> Any:
        """A plan that reduces nothing and records whether the call reached the patches."""
        raise NotImplementedError

    def _reached(self, plan: Any) -> bool:
        raise NotImplementedError

    def apply_model_wrapper(self, executor: Any, x: torch.Tensor, t: Any, c_concat: Any = None,
                            c_crossattn: Any = None, control: Any = None, transformer_options: Optional[dict] = None,
                            **kwargs: Any) -> Any:
        """APPLY_MODEL wrapper: this call's plan in its transformer_options for the call only."""
        options = transformer_options if transformer_options is not None else {}
        base = executor.class_obj
        plan = self._plan(base, x, t, c_crossattn, kwargs, options)
        if plan is not None and self.config.speed_check != "off":
            def run(reduced: bool) -> None:
                remove = self._install(options, self._again(plan, base, x, t, c_crossattn, kwargs, options)) \
                    if reduced else None
                try:
                    with torch.no_grad():
                        executor(x, t, c_concat, c_crossattn, control, options, **kwargs)
                finally:
                    if remove is not None:
                        remove()

            batch = int(x.shape[0])
            if not self.call_pays((type(base).__name__, plan.layout, batch), call_label(plan.layout.grid, batch),
                                  x.dtype, x.device, run):
                plan = None
        if plan is None and (self.reach_checked or not self.config.enabled):
            return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)
        if plan is None:  # the first call, outside the schedule: only check that the patches are reached
            plan = self._probe()
        remove = self._install(options, plan)
        try:
            out = executor(x, t, c_concat, c_crossattn, control, options, **kwargs)
        finally:
            remove()
        if not self.reach_checked:  # the first call only: a step cache may skip later ones whole
            if not self._reached(plan):  # checked again on the next run: the prompt fails until one of the two goes
                raise unreached_error(base.diffusion_model, self.MODE, self.PATCHED)
            self.reach_checked = True
        return out
