"""Benchmark output: environment record, printed table, JSON and the speed-up/error chart."""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import sys
from pathlib import Path

import torch

# how each reported number is defined; written into the JSON next to the results
METRICS = {
    "time_s": "median wall-clock seconds of one UNet forward over the timed repeats",
    "speedup": "median over repeats of t_vanilla / t_method, both from the same interleaved round",
    "speedup_best": "min(t_vanilla) / min(t_method) over the repeats: less sensitive to other "
                    "load on the machine, which only ever adds time",
    "rel_err": "||y - y_vanilla|| / ||y_vanilla|| of the UNet output (first timed repeat)",
    "cfg_err": "same for the CFG-combined prediction uncond + g * (cond - uncond) "
               "(batch = [uncond; cond]); null for odd batch",
    "rel_err_peaked": "rel_err on the same UNet with self-attention q/k scaled by 'peaked' "
                      "(peaked attention, as in trained models)",
    "cfg_err_peaked": "cfg_err on the peaked UNet",
    "peak_mem_mb": "peak tensor memory allocated during one forward above the live set at its "
                   "start (weights and inputs excluded); CPU: torch.profiler memory events, "
                   "CUDA: torch.cuda.max_memory_allocated",
    "mem_vs_vanilla": "peak_mem_mb / vanilla's peak_mem_mb",
    "vanilla_drift": "vanilla row only: rel. L2 between vanilla outputs before and after every "
                     "other variant was applied and removed (0 = removal restores the model)",
}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        pass
    try:  # a source checkout that is not installed
        return getattr(importlib.import_module(name), "__version__", "unknown")
    except ImportError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def load_avg() -> float | None:
    """1-minute load average: other work on the machine makes timings noisy."""
    return round(os.getloadavg()[0], 2) if hasattr(os, "getloadavg") else None


def environment(device: str = "cpu") -> dict:
    env = {
        "python": sys.version.split()[0],
        "platform": platform.platform(),
        "torch": torch.__version__,
        "diffusers": _version("diffusers"),
        "tomesd": _version("tomesd"),
        "tome_core": _version("tome_core"),
        "cpu": _cpu_model(),
        "cpu_count": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "device": device,
    }
    env["load_avg_1min_at_start"] = load_avg()
    if device.startswith("cuda") and torch.cuda.is_available():
        env["gpu"] = torch.cuda.get_device_name(torch.device(device))
    return env


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


COLUMNS = [  # header, row key, format
    ("model", "family", "s"), ("size", "size", "s"), ("method", "label", "s"),
    ("time ms", "time_ms", ".0f"), ("speedup", "speedup", ".2f"),
    ("best x", "speedup_best", ".2f"),
    ("err", "rel_err", ".4f"), ("cfg err", "cfg_err", ".4f"),
    ("err pk", "rel_err_peaked", ".4f"), ("cfg err pk", "cfg_err_peaked", ".4f"),
    ("peak MB", "peak_mem_mb", ".1f"), ("mem x", "mem_vs_vanilla", ".2f"),
]


def format_table(rows: list[dict]) -> str:
    """The results as a fixed-width text table (err pk = on the peaked-attention UNet)."""
    cells = [[h for h, _, _ in COLUMNS]]
    for r in rows:
        r = dict(r, size=f"{r['width']}x{r['height']}",
                 time_ms=None if r.get("time_s") is None else 1000 * r["time_s"])
        cells.append([_fmt(r.get(k), f) for _, k, f in COLUMNS])
    widths = [max(len(c[i]) for c in cells) for i in range(len(COLUMNS))]
    lines = ["  ".join(c.ljust(w) if i < 3 else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)


def write_json(result: dict, path: Path) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=True) + "\n")
    return path


_METHOD_STYLE = {"merge": ("tab:blue", "o"), "kv": ("tab:green", "s"), "kv-avg": ("tab:olive", "D"),
                 "tomesd": ("tab:red", "^")}


def write_chart(rows: list[dict], path: Path) -> Path | None:
    """Scatter of speed-up vs error for every non-vanilla row; one panel per error measure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rows if r["method"] != "vanilla" and r.get("speedup") is not None]
    panels = [("cfg_err", "CFG-combined rel. L2 error"), ("rel_err", "rel. L2 error")]
    if any(r.get("cfg_err_peaked") is not None for r in rows):
        panels.append(("cfg_err_peaked", "CFG-combined rel. L2 error, peaked attention"))
    panels = [(k, t) for k, t in panels if any(r.get(k) is not None for r in rows)]
    if not rows or not panels:
        return None
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4.5), squeeze=False)
    for ax, (key, title) in zip(axes[0], panels):
        seen = set()
        for r in rows:
            if r.get(key) is None:
                continue
            color, marker = _METHOD_STYLE.get(r["method"], ("tab:gray", "x"))
            name = r["method"] if r["method"] not in seen else None
            seen.add(r["method"])
            ax.scatter(r[key], r["speedup"], c=color, marker=marker, label=name)
            ax.annotate(f"{r['family']} {r['width']}x{r['height']} r={r['ratio']:g}",
                        (r[key], r["speedup"]), fontsize=7, xytext=(4, 3),
                        textcoords="offset points")
        ax.axhline(1.0, color="gray", lw=0.8, ls="--")
        ax.margins(x=0.25, y=0.15)  # room for the labels
        ax.set_xlim(0, ax.get_xlim()[1])  # errors from zero: no exaggerated differences
        ax.set_xlabel(title)
        ax.set_ylabel("speed-up vs vanilla (x)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle("Token merging: speed-up vs error (higher and further left is better)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
