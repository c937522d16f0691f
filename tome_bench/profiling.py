"""Where the time of one forward goes, per variant (``--profile``).

``trace_forwards`` (every kind of model, every case): a few back-to-back forwards under ``torch.profiler`` (CPU and,
on a GPU, CUDA activity), exported as Kineto's Chrome trace and summarised by ``trace_summary``: kernels, GPU busy
against wall time, synchronising and allocating runtime calls, the SDPA kernels, the top kernels.

The rest of this module (UNets): time grouped by module scope, marked with ``torch.profiler.record_function`` from forward
hooks: self-attention (``attn1``), cross-attention (``attn2``) and MLP (``ff``) cover only
those modules' own ``forward``; "block other" is the rest of each transformer block — norms,
residual adds and any token merging/unmerging or key/value pooling a patch does in its hooks or
block forward; "rest of UNet" is everything outside transformer blocks (resnets, convs,
up/downsampling, projections in and out of the transformer).
"""
from __future__ import annotations

import gzip
import shutil
import tempfile
from pathlib import Path
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile, record_function

from . import measure, trace_summary
from .methods import Variant, patched

PROFILED_FORWARDS = 2  # forwards per trace: a steady one's figures, averaged over two


def trace_forwards(fn: Callable[[], object], device: torch.device, forwards: int = PROFILED_FORWARDS,
                   keep: Path | None = None) -> dict:
    """``forwards`` back-to-back calls of ``fn`` profiled (each in a ``trace_summary.FORWARD`` range, one
    synchronisation at the end) and summarised per forward (``trace_summary.summarize``). Run it after a warm-up
    call: the first call after patching is not a steady forward. ``keep``: also save the trace there, gzipped."""
    cuda = device.type == "cuda"
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    with profile(activities=activities) as prof:
        for _ in range(forwards):
            with record_function(trace_summary.FORWARD):
                fn()
        if cuda:
            torch.cuda.synchronize(device)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        summary = trace_summary.summarize(trace_summary.load(path), forwards)
        if keep is not None:
            keep.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
    return summary

_PREFIX = "bench::"
_CHILDREN = {"attn1": "self_attention", "attn2": "cross_attention", "ff": "mlp"}
GROUPS = ("self_attention", "cross_attention", "mlp", "block_other", "rest_of_unet")


def _is_block(module: torch.nn.Module) -> bool:
    return all(hasattr(module, c) for c in ("attn1", "attn2", "ff"))


def _add_scope(module, name: str, outer: bool, handles: list, sync) -> None:
    """Open a profiler range around ``module``'s call.

    outer=True: the range encloses other hooks on the module (a patch's own hooks fall inside);
    outer=False: it encloses only ``forward`` (a patch's hooks fall outside).
    sync: called at both ends, so on CUDA a range's CPU time includes its kernels.
    """
    stack = []

    def pre(mod, args):
        sync()
        rf = record_function(_PREFIX + name)
        rf.__enter__()
        stack.append(rf)

    def post(mod, args, out):
        sync()
        stack.pop().__exit__(None, None, None)

    handles.append(module.register_forward_pre_hook(pre, prepend=outer))
    handles.append(module.register_forward_hook(post, prepend=not outer))


def _scoped_forward(unet, inputs: measure.Inputs):
    device = inputs.sample.device
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    handles: list = []
    for module in unet.modules():
        if _is_block(module):
            _add_scope(module, "block", True, handles, sync)
            for child, group in _CHILDREN.items():
                if getattr(module, child) is not None:  # e.g. no attn2 in some blocks
                    _add_scope(getattr(module, child), group, False, handles, sync)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        with profile(activities=activities) as prof:
            with record_function(_PREFIX + "unet"):
                measure.forward(unet, inputs)
                sync()
    finally:
        for h in handles:
            h.remove()
    return prof


def _device_ms(event, self_only: bool = False) -> float:
    """An event's CUDA kernel time in ms (torch 2.x names it device_time, older cuda_time)."""
    names = ("self_device_time_total", "self_cuda_time_total") if self_only else ("device_time_total",
                                                                                    "cuda_time_total")
    for name in names:
        value = getattr(event, name, None)
        if value is not None:
            return value / 1000
    return 0.0


def profile_variant(unet, inputs: measure.Inputs, variant: Variant, options: dict,
                    top: int = 10) -> dict:
    """Profile one forward of ``variant``: ms per group and the ``top`` ops by self time.

    On CUDA the times are the kernels' (CUDA activity: each range's kernel time, each op's own
    kernels), not the CPU's launch time; on the CPU they are CPU time. Meant to run after the
    benchmark has warmed up these shapes (as ``runner.profile_case`` does), so no extra warm-up
    forward is spent here.
    """
    with patched(unet, variant, **options):
        prof = _scoped_forward(unet, inputs)
    events = prof.key_averages()
    on_device = inputs.sample.device.type == "cuda"

    def span(e):
        return _device_ms(e) if on_device else e.cpu_time_total / 1000

    def own(e):
        return _device_ms(e, self_only=True) if on_device else e.self_cpu_time_total / 1000

    total = {e.key[len(_PREFIX):]: span(e) for e in events if e.key.startswith(_PREFIX)}
    groups = {g: total.get(g, 0.0) for g in ("self_attention", "cross_attention", "mlp")}
    groups["block_other"] = total.get("block", 0.0) - sum(groups.values())
    groups["rest_of_unet"] = total.get("unet", 0.0) - total.get("block", 0.0)
    ops = sorted((e for e in events if not e.key.startswith(_PREFIX)), key=own, reverse=True)[:top]
    return {
        "label": variant.label,
        "clock": "CUDA kernels" if on_device else "CPU",
        "total_ms": total.get("unet", 0.0),
        "groups_ms": groups,
        "top_ops": [{"op": e.key, "self_ms": own(e), "calls": e.count} for e in ops],
    }


def format_profile(profiles: list[dict]) -> str:
    """Grouped table (ms and % of the forward) for all variants, then top ops per variant."""
    clock = profiles[0].get("clock", "CPU") if profiles else "CPU"
    lines = [f"{clock} time per group, ms (% of forward); profiled, so slower than the timed runs"]
    head = ["group"] + [p["label"] for p in profiles]
    rows = [head]
    for g in GROUPS:
        rows.append([g] + [f"{p['groups_ms'][g]:.0f} ({p['groups_ms'][g] / p['total_ms']:.0%})"
                           if p["total_ms"] else "-" for p in profiles])
    rows.append(["total"] + [f"{p['total_ms']:.0f}" for p in profiles])
    widths = [max(len(r[i]) for r in rows) for i in range(len(head))]
    lines += ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                        enumerate(zip(r, widths))) for r in rows]
    for p in profiles:
        lines.append(f"\ntop ops by self time: {p['label']}")
        for op in p["top_ops"]:
            lines.append(f"  {op['self_ms']:9.1f} ms  {op['calls']:5d}x  {op['op']}")
    return "\n".join(lines)
