"""ComfyUI's step caches inside the model call, and the speed check's repeats of that call.

The speed check times a model call by running it again through ToMe's APPLY_MODEL wrapper (whole, then reduced).
A DIFFUSION_MODEL wrapper runs inside that call, so it would see each repeat: ComfyUI's EasyCache keeps its per-step
state there, takes a repeat for a step, serves the real call from it and counts every repeat as a skipped step. So a
repeat runs with EasyCache's DIFFUSION_MODEL wrapper stepped over: a step the cache computes, its state as the real
call finds it. Another node's DIFFUSION_MODEL wrapper, whose state ToMe cannot know, leaves the call unrepeated: a
transformer's call is not timed (reduced, and the verdict says the call could not be repeated), a UNet's levels are
timed by their self-attention alone (the stand-in of hosts that cannot repeat the call). LazyCache (PREDICT_NOISE) and
EasyCache's other wrappers (OUTER_SAMPLE, CALC_COND_BATCH) sit outside APPLY_MODEL and never see a repeat.
"""
from __future__ import annotations

from typing import Any, Optional

DIFFUSION_MODEL = "diffusion_model"  # comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL: runs inside APPLY_MODEL
STEPPED_OVER = ("easycache",)  # comfy_extras/nodes_easycache.py's wrapper key: its forward wrapper keeps step state


def repeat_options(options: Any) -> Optional[dict]:
    """The transformer_options a speed-check repeat of this call runs with: ``options`` itself where no other node
    wraps the diffusion model, a copy without EasyCache's DIFFUSION_MODEL wrapper where it does, or None (not timed)
    where another node's DIFFUSION_MODEL wrapper would see the repeat."""
    wrappers = options.get("wrappers") if isinstance(options, dict) else None
    inside = (wrappers.get(DIFFUSION_MODEL) or {}) if isinstance(wrappers, dict) else {}
    present = {key for key, functions in inside.items() if functions}
    if not present:
        return options
    if present - set(STEPPED_OVER):
        return None
    stepped = dict(options)
    stepped["wrappers"] = dict(wrappers)
    stepped["wrappers"][DIFFUSION_MODEL] = {key: functions for key, functions in inside.items()
                                             if key not in STEPPED_OVER}
    return stepped
