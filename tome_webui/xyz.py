"""X/Y/Z plot axes for the ToMe ratio, hires ratio and max downsample.

The built-in ``xyz_grid.py`` script keeps its axes in the module list ``axis_options``; the WebUI
loads scripts by path, so that module is found through ``modules.scripts.scripts_data`` (whose
entries name their module ``xyz_grid.py``), after every script is loaded (``on_before_ui``).
An axis value lands on the per-cell copy of ``p`` as ``p.tome_overrides`` and turns ToMe on there.
"""
from __future__ import annotations

from typing import Any, Callable, Iterable

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


def register(scripts_data: Iterable[Any]) -> None:
    xyz_grid = find_xyz_module(scripts_data)
    if xyz_grid is not None:
        add_axes(xyz_grid)
