"""What each family's default and a higher ratio cost in quality, against tomesd r=0.5 on SD1.5 (the yardstick).

Read from ``quality.json`` beside this file, which ``python -m tome_bench.experiments.frontier --quality JSON`` writes
from a committed frontier run (its path, command and commit are in it; tests/test_quality.py checks it against that
run and the catalogue's defaults against its rule). Nothing here is written by hand: the node tooltips, the WebUI
accordion, the bench's ``--help`` and ``describe()`` all print these sentences.
"""
from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Dict, Optional

PATH = Path(__file__).with_name("quality.json")


@functools.lru_cache(maxsize=1)
def load() -> dict:
    """The committed summary: ``{"source", "command", "commit", "device", "yardstick", "families": {name: ...}}``;
    an empty ``families`` where the file is missing (a trimmed install)."""
    try:
        return json.loads(PATH.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {"families": {}}


def measured(name: str) -> Optional[dict]:
    """Family ``name``'s entry (its default by the rule, every setting measured), or None where not measured."""
    return load()["families"].get(name)


def _times(errors: Dict[str, float], yardstick: dict) -> float:
    """The worse of the setting's two errors, as a multiple of the yardstick's on the same content."""
    return max(errors[c] / yardstick[c] for c in ("noise", "photo"))


def _setting(entry: dict) -> str:
    return f"{entry['mode']} {entry['ratio']:g}"


def higher(name: str) -> Optional[dict]:
    """The setting shown beside the default: the next measured ratio above it in its mode; None where the default is
    the highest ratio measured (or the family was not measured)."""
    entry = measured(name)
    if entry is None:
        return None
    default, settings = entry["default"], entry["settings"]
    above = [s for s in settings if s["mode"] == default["mode"] and s["ratio"] > default["ratio"]]
    return min(above, key=lambda s: s["ratio"]) if above else None


def loses_quality_fast(name: str) -> bool:
    """Whether no measured setting of the family both holds tomesd's error and saves work."""
    entry = measured(name)
    return entry is not None and not entry["default"]["holds_and_saves"]


def trade(name: str, title: Optional[str] = None) -> Optional[str]:
    """One sentence: the family's default and a higher setting, each as a multiple of tomesd r=0.5's error on SD1.5
    (e.g. "Flux: default merge 0.2 (0.80x tomesd's error); merge 0.3: 1.01x"); None where not measured."""
    entry = measured(name)
    if entry is None:
        return None
    yard, default, title = load()["yardstick"], entry["default"], title or entry.get("title", name)
    text = f"{title}: default {_setting(default)} ({_times(default['errors'], yard):.2f}x tomesd's error)"
    more = higher(name)
    more_times = None if more is None else _times(more["errors"], yard)
    text += "; the highest ratio measured" if more is None else f"; {_setting(more)}: {more_times:.2f}x"
    if not default["holds_and_saves"]:
        text += (f". Loses quality fast under ToMe: no setting measured saves {load()['saves']:g}x work at tomesd's "
                 "error")
    return text


def trade_summary() -> str:
    """Every measured family's ``trade``, one sentence each, with where the figures come from."""
    data = load()
    if not data["families"]:
        return ""
    lines = [trade(name) for name in data["families"]]
    return (f"Error against tomesd r=0.5 on SD1.5 (1x: the quality tomesd users accept; {data['where']}). "
            + ". ".join(lines) + ".")


def defaults_table() -> str:
    """Markdown for the README: every transformer family's default mode and ratio (the catalogue's), its error as a
    multiple of tomesd's and the work it saves (counted operations) where measured, and the setting beside it."""
    from .families import CATALOGUE, short_title

    data = load()
    yard = data.get("yardstick")
    out = ["| family | default | error noise / photo (x tomesd r=0.5 on SD1.5) | less work (counted) "
           "| next setting: its error | measured at |", "| --- | --- | ---: | ---: | --- | --- |"]
    for family in CATALOGUE:
        entry = measured(family.name)
        setting = f"{family.default_mode} {family.default_ratio:g}"
        if entry is None:
            out.append(f"| {short_title(family)} | {setting} | not measured | - | - | - |")
            continue
        default, more = entry["default"], higher(family.name)
        errors = " / ".join(f"{default['errors'][c]:.3f} ({default['errors'][c] / yard[c]:.2f}x)"
                            for c in ("noise", "photo"))
        fast = "" if default["holds_and_saves"] else (
            f" (loses quality fast: nothing measured saves {data['saves']:g}x work at tomesd's error)")
        beside = "highest measured" if more is None else f"{_setting(more)}: {_times(more['errors'], yard):.2f}x"
        work = default.get("work_speedup")
        speed = "-" if work is None else f"{work:.2f}x"
        out.append(f"| {short_title(family)} | {setting}{fast} | {errors} | {speed} | {beside} | "
                   f"{entry['size']}, {entry['blocks']} blocks |")
    return "\n".join(out)
