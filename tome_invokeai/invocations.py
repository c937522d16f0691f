"""The ToMe denoise nodes of InvokeAI: each core denoise invocation of a family ToMe reduces, with ToMe's fields.

Why denoise nodes of our own, not a settings node feeding the core ones: InvokeAI's core denoise nodes apply only
what their own fields carry (LoRA, FreeU, seamless, ControlNet...) and load their model inside ``invoke()``, so ToMe
must run inside a denoise node. Each ToMe node *is* the core node (a subclass: every input, edge and default the same,
so a workflow swaps one for the other), plus the ToMe fields; its ``invoke`` runs the core's with the job's model
patched (``job.ToMeJob``). Which nodes exist is the catalogue's (``ModelFamily.invoke``) plus SD1.5/SDXL's
``denoise_latents``; a core node this InvokeAI lacks is skipped.
"""
from __future__ import annotations

from typing import Any, Dict, Literal, Tuple

from invokeai.app.invocations.baseinvocation import InvocationRegistry, invocation
from invokeai.app.invocations.fields import InputField

try:
    from ..tome_core.catalogue.defaults import UNET_DEFAULTS, ModelDefaults
    from ..tome_core.catalogue.families import CATALOGUE, TOMESD_RATIO
    from ..tome_core.engine.config import SPEED_CHECKS
except ImportError:
    from tome_core.catalogue.defaults import UNET_DEFAULTS, ModelDefaults
    from tome_core.catalogue.families import CATALOGUE, TOMESD_RATIO
    from tome_core.engine.config import SPEED_CHECKS
from .job import ToMeJob

UNET_DENOISE = ("denoise_latents", "SD1.5, SDXL")


def _fields(unet: bool) -> Dict[str, Tuple[Any, Any]]:
    """ToMe's fields: (annotation, InputField), after the core node's inputs."""
    fields = {
        "tome_ratio": (float, InputField(
            default=-1.0, ge=-1.0, le=0.75, title="ToMe Ratio", ui_order=1001,
            description=f"How many image tokens ToMe removes: higher is faster but softer. -1: the model's default "
                        f"({TOMESD_RATIO:g} on SD1.5/SDXL, each transformer family its measured one). 0 turns ToMe "
                        "off.")),
        "tome_mode": (Literal["default", "merge", "kv"], InputField(
            default="default", title="ToMe Mode", ui_order=1002,
            ui_choice_labels={"default": "model default", "merge": "merge", "kv": "kv"},
            description="merge: fewer tokens through attention (UNets) or whole blocks (transformers that take it). "
                        "kv: every token keeps its query, only keys/values are thinned (gentler). default: the "
                        "model's own.")),
        "tome_start": (float, InputField(
            default=0.0, ge=0.0, le=1.0, title="ToMe Start", ui_order=1004,
            description="Sampling progress from which ToMe is on (0 = the first step).")),
        "tome_end": (float, InputField(
            default=1.0, ge=0.0, le=1.0, title="ToMe End", ui_order=1005,
            description="Sampling progress after which ToMe is off (1 = until the last step).")),
        "tome_speed_check": (Literal[SPEED_CHECKS], InputField(
            default="auto", title="ToMe Speed Check", ui_order=1006,
            description="auto: on a GPU, ToMe times itself once per size and stays off where it would be slower "
                        "(the result is in the server log); the CPU is not timed. off: no timing, ToMe always "
                        "reduces. on: time on the CPU too.")),
    }
    if unet:
        fields["tome_max_downsample"] = (int, InputField(
            default=1, ge=1, le=8, title="ToMe Max Downsample", ui_order=1003,
            description="How deep ToMe goes in the UNet: 1, 2, 4 or 8 (1 = only the first attention level: most "
                        "of the speed, least damage)."))
    return fields


def asked_of(node: Any) -> Dict[str, Any]:
    """A node's ToMe fields as the engine's settings (ratio -1 and mode "default" left to the model)."""
    asked = {"ratio": node.tome_ratio, "mode": node.tome_mode, "start_percent": node.tome_start,
             "end_percent": node.tome_end, "speed_check": node.tome_speed_check}
    if hasattr(node, "tome_max_downsample"):
        asked["max_downsample"] = node.tome_max_downsample
    return asked


def _style_reference_on(node: Any) -> bool:
    reference = getattr(node, "style_reference", None)
    return reference is not None and getattr(reference, "style_strength", 0) > 0


# Options of the core nodes ToMe cannot run beside, each found from the node's own fields: (is it on, why, the way
# out). Refused before anything runs, never left to reduce part of a step silently.
PARTNERS = (
    (lambda node: bool(getattr(node, "hidiffusion", False)), "HiDiffusion (this node's hidiffusion)",
     "regroups the UNet's first-level tokens into windows between a block's input and its self-attention, where "
     "ToMe merges them with a plan made for the whole image (measured: the windows' tokens get mixed)",
     "turn hidiffusion off"),
    (_style_reference_on, "Krea-2's style reference (this node's style_reference)",
     "adds the reference image's keys to each attention, which ToMe does not place", "remove the style reference"),
)


def refuse_partners(node: Any) -> None:
    """Refuse, before anything runs, an option of the core node ToMe cannot run beside (``PARTNERS``)."""
    if node.tome_ratio == 0:
        return
    for on, what, why, fix in PARTNERS:
        if on(node):
            raise ValueError(f"ToMe: {what} {why}: {fix}, or set tome_ratio 0 (or use the core node) to keep it.")


def _invoke(core: type):
    def invoke(self, context):  # the core node's, with the job's denoising model patched while it holds it
        refuse_partners(self)
        # settings no model takes are refused before anything runs; what ToMe does goes to the log and the progress
        job = ToMeJob(asked_of(self), context.logger, context.util.signal_progress)
        return core.invoke(self, job.context(context))
    invoke.__annotations__ = dict(core.invoke.__annotations__)  # InvokeAI reads the output type from it
    invoke.__doc__ = core.invoke.__doc__
    return invoke


def _default_words(defaults: ModelDefaults, kv_only: bool) -> str:
    mode = defaults.mode
    return (f"Left at the model's default, ToMe runs {mode} {defaults.ratio(mode):g}"
            + (" (this model takes mode kv only)." if kv_only else "."))


def tome_node(core: type, title: str, defaults: ModelDefaults, kv_only: bool) -> type:
    """The ToMe variant of the core denoise invocation ``core``, registered as "tome_<core type>"; ``defaults``: what
    its model runs at when ratio and mode are left to it (said in the node's description)."""
    fields = _fields(unet=defaults is UNET_DEFAULTS)
    core_config = core.UIConfig
    # one sentence, not the core's docstring (some are a page of developer notes): the node picker lists it
    doc = (f"{core_config.title or title}, with Token Merging (ToMe): faster, for a little detail. "
           f"{_default_words(defaults, kv_only)}")
    namespace = {"__module__": __name__, "__annotations__": {name: kind for name, (kind, _) in fields.items()},
                 "__doc__": doc, "invoke": _invoke(core)}
    namespace.update({name: field for name, (_, field) in fields.items()})
    cls = type(f"ToMe{core.__name__}", (core,), namespace)
    # the core node's version, plain X.Y.Z: InvokeAI's workflow editor validates saved workflows' node versions as
    # three numbers (a "+build" suffix makes every workflow with the node fail to load), and a core update that
    # changes the inputs is one for this node too
    version = core_config.version
    return invocation(f"tome_{core.get_type()}", title=f"{core_config.title or title} + ToMe",
                      tags=list(core_config.tags or []) + ["tome", "token merging", "speed"],
                      category=core_config.category, version=version)(cls)


def denoise_nodes() -> Dict[str, type]:
    """The ToMe nodes of this InvokeAI: one per core denoise invocation it has that a family of ToMe's runs."""
    wanted = [(*UNET_DENOISE, UNET_DEFAULTS, False)] + [
        (d.invocation, d.title, ModelDefaults(family, d.merges), not d.merges)
        for family in CATALOGUE for d in family.invoke]
    made = {}
    for invocation_type, title, defaults, kv_only in wanted:
        core = InvocationRegistry.get_invocation_for_type(invocation_type)
        if core is not None:
            made[f"tome_{invocation_type}"] = tome_node(core, title, defaults, kv_only)
    return made


NODES = denoise_nodes()

__all__ = ["NODES", "asked_of", "denoise_nodes", "refuse_partners", "tome_node"]
