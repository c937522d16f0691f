"""Settings > ToMe: the defaults the txt2img/img2img controls start with.

The WebUI registers settings (``script_callbacks.on_ui_settings``) before it builds the scripts'
UIs, so ``ui()`` can read these values with ``defaults(shared.opts)``.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from .options import FIELD_BY_NAME, MAX_DOWNSAMPLE_CHOICES, MODEL_RATIO, WebUIArgs

SECTION = ("tome", "ToMe")

# (option key, WebUIArgs field, label)
OPTIONS = (
    ("tome_default_enabled", "enabled", "Enable ToMe by default in txt2img and img2img"),
    ("tome_default_ratio", "ratio", "Default ToMe ratio (fraction of tokens merged; -1 = the model's default: 0.5 "
                                   "on UNets, on transformers their family's)"),
    ("tome_default_hr_ratio", "hr_ratio", "Default ToMe ratio of the hires-fix pass (0 = no merging there)"),
    ("tome_default_max_downsample", "max_downsample",
     "Default ToMe max downsample (1 = only the first attention level; higher = deeper levels too)"),
)


def add_settings(shared: Any, gr: Any) -> None:
    """Register the options; ``shared`` is ``modules.shared``, ``gr`` is gradio."""
    engine = WebUIArgs()
    ratio_slider = {"minimum": 0.0, "maximum": 0.75, "step": 0.05}
    components = {
        "enabled": (gr.Checkbox, None),
        "ratio": (gr.Slider, dict(ratio_slider, minimum=MODEL_RATIO)),
        "hr_ratio": (gr.Slider, ratio_slider),
        "max_downsample": (gr.Radio, {"choices": list(MAX_DOWNSAMPLE_CHOICES)}),
    }
    for key, name, label in OPTIONS:
        component, component_args = components[name]
        default = getattr(engine, name)
        if name == "max_downsample":
            default = str(default)
        shared.opts.add_option(key, shared.OptionInfo(default, label, component, component_args, section=SECTION))


def defaults(opts: Any) -> WebUIArgs:
    """The control defaults: the settings where set, else the engine's defaults."""
    values = {name: getattr(opts, key, None) for key, name, _ in OPTIONS}
    return replace(WebUIArgs(), **{k: FIELD_BY_NAME[k].convert(v) for k, v in values.items() if v is not None})
