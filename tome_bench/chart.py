"""The benchmark's chart: speed-up against error, one panel per family and size, one line per method.

Each panel holds one model at one size: vanilla at (0, 1.0), then every method as a line through its ratios
(x: the error, y: the speed-up over vanilla), each point with its noise band as a bar and its ratio as a label
placed where it collides with no other label. Points whose rank is not a place of their own (tied, too noisy)
are hollow. ``python -m tome_bench.render_chart OUT.png RESULTS.json [...]`` draws it from results JSONs (also one
holding several runs, e.g. docs/results/gpu_h100_cacab79.json).
"""
from __future__ import annotations

import math
from pathlib import Path

ERRORS = (("cfg_err_peaked", "CFG error, peaked attention"), ("cfg_err", "CFG error"),
          ("rel_err_peaked", "error, peaked attention"), ("rel_err", "error"))
_STYLE = {"merge": ("tab:blue", "o"), "merge-level": ("tab:cyan", "D"), "merge-auto": ("tab:purple", "P"),
          "merge-reuse": ("tab:olive", "X"),
          "kv": ("tab:orange", "s"), "kv-avg": ("tab:brown", "v"), "tomesd": ("tab:green", "^")}
_EXTRA = ("tab:red", "tab:pink", "tab:olive", "tab:gray")


def runs_of(result: dict) -> list[list[dict]]:
    """The bench rows of a results JSON, run by run: its own ``rows``, or those of every part it holds
    (``{"parts": {...}}``); an experiment's rows in a part (no ``label``: not a bench row) are left out."""
    if "rows" in result:
        return [[row for row in result["rows"] if "label" in row]]
    parts = result.get("parts", result)
    return [[row for row in part.get("rows", ()) if isinstance(row, dict) and "label" in row]
            for part in parts.values() if isinstance(part, dict)]


def rows_of(result: dict) -> list[dict]:
    """The bench rows of a results JSON, every run's (``runs_of``) in one list."""
    return [row for run in runs_of(result) for row in run]


def one_per_case(rows: list[dict]) -> list[dict]:
    """The eager rows, one per case and label: the first, except that a traced row (its GPU time known) replaces an
    untraced one (a later run's repeat of a case, e.g. the GPU suite's compile part re-timing the eager rows)."""
    def traced(row: dict) -> bool:
        return (row.get("trace") or {}).get("gpu_busy_ms") is not None

    chosen: dict = {}
    for row in rows:
        if row.get("compiled"):
            continue
        key = (_case(row), row["label"])
        if key not in chosen or (not traced(chosen[key]) and traced(row)):
            chosen[key] = row
    return list(chosen.values())


def _case(row: dict) -> tuple:
    return (row["family"], row["width"], row["height"], row.get("frames"))


def _case_title(case: tuple) -> str:
    family, w, h, frames = case
    return f"{family} {w}x{h}" + (f" x {frames} frames" if frames else "")


def _line_name(row: dict) -> str:
    """The method without its ratio: one line per method, cell and block range."""
    label = row["label"]
    return " ".join(word for word in label.split() if not word.startswith("r="))


def _place_labels(ax, points: list[tuple[float, float, str]], fontsize: float = 7) -> None:
    """Each point's text at the first of eight offsets whose box overlaps no placed box (skipped if none)."""
    fig = ax.figure
    fig.canvas.draw()
    to_px = ax.transData.transform
    scale = fig.dpi / 72
    placed = [(*to_px((x, y)) - 3 * scale, *to_px((x, y)) + 3 * scale) for x, y, _ in points]  # the markers
    offsets = [(4, 3), (4, -10), (-4, 3), (-4, -10), (0, 8), (0, -14), (10, 0), (-10, 0)]
    for x, y, text in points:
        px, py = to_px((x, y))
        w, h = len(text) * fontsize * 0.55 * scale, fontsize * 1.1 * scale
        for dx, dy in offsets:
            left = px + dx * scale - (w if dx < 0 else (w / 2 if dx == 0 else 0))
            bottom = py + dy * scale
            box = (left, bottom, left + w, bottom + h)
            if all(box[2] <= b[0] or box[0] >= b[2] or box[3] <= b[1] or box[1] >= b[3] for b in placed):
                placed.append(box)
                ax.annotate(text, (x, y), xytext=(dx, dy), textcoords="offset points", fontsize=fontsize,
                            ha="right" if dx < 0 else ("center" if dx == 0 else "left"), va="bottom", color="0.25")
                break


def write_chart(rows: list[dict], path: Path, title: str = "") -> Path | None:
    """Speed-up vs error per family and size (see the module); None when no row has both. Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from .stats import BUSY, is_rank

    rows = [r for r in rows if not r.get("compiled") and r.get("speedup") is not None]
    key, xlabel = next(((k, t) for k, t in ERRORS if any(r.get(k) is not None for r in rows
                                                        if r["method"] != "vanilla")), (None, None))
    if key is None:
        return None
    cases = list(dict.fromkeys(_case(r) for r in rows))
    cols = min(3, len(cases))
    nrows = math.ceil(len(cases) / cols)
    fig, axes = plt.subplots(nrows, cols, figsize=(4.6 * cols, 3.8 * nrows + 0.9), squeeze=False)
    handles: dict[str, object] = {}
    extra = iter(_EXTRA * 8)
    styles: dict[str, tuple[str, str]] = {}
    for ax, case in zip(axes.flat, cases):
        here = [r for r in rows if _case(r) == case]
        van = ax.plot([0], [1.0], marker="*", ms=11, color="black", ls="none")[0]
        handles.setdefault("vanilla (1.0)", van)
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        labels = []
        for name in dict.fromkeys(_line_name(r) for r in here if r["method"] != "vanilla"):
            line = sorted((r for r in here if _line_name(r) == name and r.get(key) is not None),
                          key=lambda r: r["ratio"])
            if not line:
                continue
            method = line[0]["method"]
            if name not in styles:  # a method's own colour; a variant of it (cell, blocks) the next spare one
                own = _STYLE.get(method)
                styles[name] = own if own and name == method else (next(extra), own[1] if own else "x")
            color, marker = styles[name]
            xs, ys = [r[key] for r in line], [r["speedup"] for r in line]
            handles.setdefault(name, ax.plot(xs, ys, color=color, lw=1.3, marker=marker, ms=5)[0])
            photo = [(r[key + "_photo"], r["speedup"]) for r in line if r.get(key + "_photo") is not None]
            if photo:  # --content both: the same speed-ups against the photo latents' errors, dashed
                handles.setdefault("dashed: photo latents", ax.plot(*zip(*photo), color=color, lw=1, ls="--",
                                                                    marker=marker, ms=4, mfc="white")[0])
            for r in line:
                low, high = r.get("speedup_low"), r.get("speedup_high")
                if low is not None and high is not None:
                    ax.errorbar(r[key], r["speedup"], yerr=[[r["speedup"] - low], [high - r["speedup"]]],
                                color=color, capsize=2, lw=0.8)
                ax.plot([r[key]], [r["speedup"]], marker=marker, ms=5, color=color, ls="none",
                        mfc=color if is_rank(r.get("rank")) else "white")
                labels.append((r[key], r["speedup"], f"{r['ratio']:g}"))
        ax.set_xlim(0, max([r.get(k) or 0 for r in here for k in (key, key + "_photo")] + [0.01]) * 1.2)
        ax.margins(y=0.15)
        ax.set_title(_case_title(case) + (" (machine busy)" if any(r.get("rank") == BUSY for r in here) else ""),
                     fontsize=9)
        ax.set_xlabel(xlabel, fontsize=8)
        ax.set_ylabel("speed-up over vanilla (x)", fontsize=8)
        ax.tick_params(labelsize=7)
        ax.grid(alpha=0.3)
        _place_labels(ax, labels)
    for ax in list(axes.flat)[len(cases):]:
        ax.set_visible(False)
    fig.legend(list(handles.values()), list(handles), loc="lower center", ncol=min(len(handles), 7), fontsize=8,
               frameon=False)
    fig.suptitle((title + "\n" if title else "") + "speed-up vs error per model and size: up and left is better; "
                 "numbers: the ratio; bars: noise band; hollow: not ranked apart", fontsize=9)
    fig.tight_layout(rect=(0, 0.45 / (3.8 * nrows + 0.9), 1, 1))
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
