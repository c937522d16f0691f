"""X/Y/Z plot axes for the ToMe ratio, hires ratio and max downsample.

The built-in ``xyz_grid.py`` script keeps its axes in the module list ``axis_options``; the WebUI
loads scripts by path, so that module is found through ``modules.scripts.scripts_data`` (whose
entries name their module ``xyz_grid.py``), after every script is loaded (``on_before_ui``).
An axis value lands on the per-cell copy of ``p`` as ``p.tome_overrides`` and turns ToMe on there.

Started API-only (``--nowebui``), the WebUI builds the scripts' UI in ``Api.__init__``
(``ui.create_ui()``) before ``webui.api_only`` runs the ``on_before_ui`` callbacks (A1111 1.8
c8a5322d; Forge dfdcbab's ``api_only_worker`` alike). ``xyz_grid``'s ``Script.ui`` has then already
fixed ``current_axis_options``, the list ``run`` resolves an axis index in, and the X/Y/Z type choices
``/sdapi/v1/script-info`` lists; ``register`` brings those up to date too (``refresh_built``).
"""
from __future__ import annotations

from typing import Any, Callable, Iterable, Sequence

from .options import FIELD_BY_NAME, MAX_DOWNSAMPLE_CHOICES, WebUIArgs
from .runner import OVERRIDES_ATTR

XYZ_MODULE_NAMES = ("xyz_grid.py", "xy_grid.py", "scripts.xyz_grid")

# (axis label, value type, WebUIArgs field, choices)
AXES = (
    ("[ToMe] Ratio", float, "ratio", None),
    ("[ToMe] Hires ratio", float, "hr_ratio", None),
    ("[ToMe] Max downsample", int, "max_downsample", lambda: list(MAX_DOWNSAMPLE_CHOICES)),
)


def find_xyz_module(scripts_data: Iterable[Any]) -> Any:
    for data in scripts_data:
        if getattr(data.script_class, "__module__", None) in XYZ_MODULE_NAMES and hasattr(data, "module"):
            return data.module
    return None


def _apply(name: str) -> Callable:
    def apply(p: Any, x: Any, xs: Any) -> None:
        # A new dict: xyz_grid's cells are shallow copies of one p.
        setattr(p, OVERRIDES_ATTR, {**(getattr(p, OVERRIDES_ATTR, None) or {}), name: x})

    return apply


def _confirm(name: str) -> Callable:
    def confirm(p: Any, xs: Any) -> None:
        for x in xs:  # fail before the grid starts, with the engine's message
            WebUIArgs(**{name: FIELD_BY_NAME[name].parse(x)}).config(hires=name == "hr_ratio")

    return confirm


def add_axes(xyz_grid: Any) -> int:
    """Append the ToMe axes to ``xyz_grid.axis_options`` (once); returns how many were added."""
    present = {option.label for option in xyz_grid.axis_options}
    added = 0
    for label, value_type, name, choices in AXES:
        if label in present:
            continue
        xyz_grid.axis_options.append(
            xyz_grid.AxisOption(label, value_type, _apply(name), confirm=_confirm(name), choices=choices)
        )
        added += 1
    return added


def refresh_built(xyz_grid: Any, runners: Sequence[Any]) -> int:
    """Redo, for each ``xyz_grid`` Script of ``runners`` whose ``ui()`` already ran, what that
    ``ui()`` computes from ``axis_options`` (``current_axis_options``, and the X/Y/Z type choices of
    its ``api_info``); returns how many Scripts were brought up to date.

    ``axis_options`` is only appended to, so every index ``ui()`` handed out keeps its meaning.
    """
    refreshed = 0
    for runner in runners:
        for script in getattr(runner, "scripts", None) or []:
            if not isinstance(script, xyz_grid.Script) or not hasattr(script, "current_axis_options"):
                continue
            is_img2img = getattr(script, "is_img2img", False)
            # As xyz_grid.py Script.ui: type(x) == AxisOption or x.is_img2img == is_img2img.
            script.current_axis_options = [x for x in xyz_grid.axis_options
                                           if type(x) == xyz_grid.AxisOption or x.is_img2img == is_img2img]
            labels = [x.label for x in script.current_axis_options]
            for arg in getattr(getattr(script, "api_info", None), "args", None) or []:
                if getattr(arg, "label", None) in ("X type", "Y type", "Z type"):
                    arg.choices = list(labels)
            refreshed += 1
    return refreshed


def register(scripts_data: Iterable[Any], runners: Sequence[Any] = ()) -> None:
    """on_before_ui: add the axes; ``runners`` (``scripts_txt2img``, ``scripts_img2img``; None where
    not created yet) may hold an ``xyz_grid`` Script whose UI was built before this callback."""
    xyz_grid = find_xyz_module(scripts_data)
    if xyz_grid is not None and add_axes(xyz_grid):
        refresh_built(xyz_grid, [r for r in runners if r is not None])
