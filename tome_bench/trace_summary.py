"""What a profiled run of forwards did, read from a ``torch.profiler`` Chrome trace (Kineto's JSON).

A GPU run must explain itself to someone without a GPU: per forward, the kernels launched, the GPU's busy time
against the wall time (a launch-bound step leaves the GPU idle between kernels), the synchronising and allocating
CUDA runtime calls, the attention kernel every SDPA call ran, and the kernels that took the most time. Pure JSON
in, plain dict out, so it is tested on the CPU with a trace in torch's own format.

The trace is of ``forwards`` back-to-back forwards (each inside a ``FORWARD`` range) and one synchronisation.
Kineto's events used: ``cpu_op`` (ATen ops, with their thread and interval), ``user_annotation`` (our ranges),
``cuda_runtime`` / ``cuda_driver`` (host API calls: ``cudaLaunchKernel``, ``cudaMemcpyAsync``,
``cudaStreamSynchronize``, ..., each with a ``correlation`` id), and the device's ``kernel``, ``gpu_memcpy``
(named e.g. "Memcpy DtoH (Device -> Pinned)") and ``gpu_memset`` (each with the ``correlation`` of its launch).
"""
from __future__ import annotations

import gzip
import json
from collections import Counter, defaultdict
from pathlib import Path
from typing import Any, Iterable

FORWARD = "tome_bench::forward"  # the range around each profiled forward
DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
HOST_API_CATS = ("cuda_runtime", "cuda_driver")
# runtime calls that make the host wait for the device, or allocate (a sync on most allocators), counted by name
COUNTED_CALLS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMalloc",
                 "cudaFree", "cudaHostAlloc", "cudaMallocHost", "cudaFreeHost")
SYNC_CALLS = COUNTED_CALLS[:3]  # the host waits for the device
HTOD = "cudaMemcpy HtoD"  # a host-to-device copy: a value made on the host (``t[idx] = True`` on CUDA)
SDPA_OPS = {  # the aten op each SDPA backend dispatches to (as tome_bench.device.SDPA_KERNELS)
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash-cpu",
    "aten::_scaled_dot_product_efficient_attention": "mem-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused-other",
}
TOP = 5


def load(path: str | Path) -> dict:
    """A trace written by ``prof.export_chrome_trace`` (plain or gzipped JSON)."""
    path = Path(path)
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as f:
        return json.load(f)


def _complete(events: Iterable[dict], *cats: str) -> list[dict]:
    return [e for e in events if e.get("ph") == "X" and e.get("cat") in cats]


def _end(e: dict) -> float:
    return float(e["ts"]) + float(e.get("dur", 0.0))


def _union_us(intervals: list[tuple[float, float]]) -> float:
    """Microseconds covered by at least one interval (overlapping kernels on several streams count once)."""
    total, reach = 0.0, None
    for start, end in sorted(intervals):
        if reach is None or start > reach:
            total += end - start
            reach = end
        elif end > reach:
            total += end - reach
            reach = end
    return total


def _memcpy_direction(name: str) -> str | None:
    for direction in ("DtoH", "HtoD", "DtoD", "HtoH", "PtoP"):
        if direction in name:
            return direction
    return None


def _inside(op: dict, e: dict) -> bool:
    return op.get("tid") == e.get("tid") and op.get("pid") == e.get("pid") and \
        float(op["ts"]) <= float(e["ts"]) and _end(e) <= _end(op)


def _window(ranges: list[dict], spans: list[dict]) -> tuple[float, float]:
    """(start, stop) in us of the profiled forwards: their ranges, else everything in the trace."""
    if ranges:
        return min(float(e["ts"]) for e in ranges), max(_end(e) for e in ranges)
    return min((float(e["ts"]) for e in spans), default=0.0), max((_end(e) for e in spans), default=0.0)


def _counted_calls(host_api: list[dict], by_correlation: dict, start: float, stop: float) -> Counter:
    """``COUNTED_CALLS`` by name, and the host API copies by the direction of the copy each launched."""
    calls: Counter = Counter()
    for e in host_api:
        if float(e["ts"]) < start or float(e["ts"]) > stop:
            continue
        name = e.get("name", "")
        if name in COUNTED_CALLS:
            calls[name] += 1
        elif name.startswith("cudaMemcpy"):
            launched = by_correlation.get(e.get("args", {}).get("correlation"), [])
            direction = next((_memcpy_direction(d["name"]) for d in launched if d["cat"] == "gpu_memcpy"), None)
            calls[f"cudaMemcpy {direction or '?'}"] += 1
    return calls


def _in_forwards(host_api: list[dict], ranges: list[dict], by_correlation: dict) -> tuple[int, int]:
    """(host syncs, host-to-device copies) among the host API calls made inside a forward's range (on its thread):
    what the forwards themselves did, without the profiled block's own synchronisation after them."""
    inside = [e for e in host_api if any(_inside(r, e) for r in ranges)]
    calls = _counted_calls(inside, by_correlation, float("-inf"), float("inf"))
    return sum(calls[name] for name in SYNC_CALLS), calls[HTOD]


def _sdpa_kernels(ops: list[dict], host_api: list[dict], by_correlation: dict, start: float) -> dict:
    """Per SDPA backend: its calls, and the device kernels launched inside them (same thread, within the op)."""
    sdpa: dict = {}
    launches_on_thread = defaultdict(list)
    for e in host_api:
        launches_on_thread[(e.get("pid"), e.get("tid"))].append(e)
    for op in ops:
        backend = SDPA_OPS.get(op.get("name"))
        if backend is None or float(op["ts"]) < start:
            continue
        entry = sdpa.setdefault(backend, {"calls": 0, "kernels": Counter()})
        entry["calls"] += 1
        for launch in launches_on_thread[(op.get("pid"), op.get("tid"))]:
            if _inside(op, launch):
                for d in by_correlation.get(launch.get("args", {}).get("correlation"), []):
                    if d["cat"] == "kernel":
                        entry["kernels"][d["name"]] += 1
    return sdpa


def summarize(trace: dict, forwards: int = 1) -> dict:
    """Per-forward figures of a trace of ``forwards`` forwards (see the module). Times in ms.

    Returns kernels (launched per forward), gpu_busy_ms (the union of the device's kernel, copy and set
    intervals), wall_ms (from the first forward's start to the later of the last forward's end and the last
    device event), busy_share (gpu_busy / wall; None without device events), calls (each ``COUNTED_CALLS`` name
    and ``cudaMemcpy DtoH`` / ``HtoD``: the host API copies by the direction of the copy they launched, per
    forward), sdpa (per SDPA backend: calls per forward and the device kernels they launched), top_kernels (the
    ``TOP`` kernels by time: name, ms and launches per forward), forward_syncs and forward_htod (the ``SYNC_CALLS``
    and host-to-device copies made inside the forwards' ranges, per forward; None without ranges).
    """
    events = trace.get("traceEvents", trace) if isinstance(trace, dict) else trace
    forwards = max(int(forwards), 1)
    ranges = [e for e in _complete(events, "user_annotation", "cpu_op") if e.get("name") == FORWARD]
    device, host_api, ops = (_complete(events, *DEVICE_CATS), _complete(events, *HOST_API_CATS),
                             _complete(events, "cpu_op"))
    start, stop = _window(ranges, ops + host_api + device)
    device = [e for e in device if float(e["ts"]) >= start]
    stop = max([stop] + [_end(e) for e in device])
    wall_us = stop - start
    busy_us = _union_us([(float(e["ts"]), _end(e)) for e in device])
    kernels = [e for e in device if e["cat"] == "kernel"]
    by_correlation = defaultdict(list)
    for e in device:
        correlation = e.get("args", {}).get("correlation")
        if correlation is not None:
            by_correlation[correlation].append(e)
    calls = _counted_calls(host_api, by_correlation, start, stop)
    syncs, htod = _in_forwards(host_api, ranges, by_correlation) if ranges else (None, None)
    sdpa = _sdpa_kernels(ops, host_api, by_correlation, start)
    per_kernel: dict = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        per_kernel[e["name"]][0] += float(e.get("dur", 0.0))
        per_kernel[e["name"]][1] += 1
    top = sorted(per_kernel.items(), key=lambda item: -item[1][0])[:TOP]

    def per(value: float) -> float:
        return round(value / forwards, 4)

    return {
        "forwards": forwards,
        "kernels": per(len(kernels)),
        "gpu_busy_ms": per(busy_us / 1000) if device else None,
        "wall_ms": per(wall_us / 1000),
        "busy_share": round(busy_us / wall_us, 3) if device and wall_us > 0 else None,
        "calls": {name: per(count) for name, count in sorted(calls.items())},
        "forward_syncs": None if syncs is None else per(syncs),
        "forward_htod": None if htod is None else per(htod),
        "sdpa": {backend: {"calls": per(entry["calls"]),
                           "kernels": {name: per(n) for name, n in entry["kernels"].most_common()}}
                 for backend, entry in sorted(sdpa.items())},
        "top_kernels": [{"name": name, "ms": per(us / 1000), "launches": per(count)}
                        for name, (us, count) in top],
    }


def host_waits(summary: dict) -> tuple[float, float]:
    """(host syncs, host-to-device copies) per steady forward: inside the forwards (``forward_syncs``,
    ``forward_htod``), or for a summary written before those (their window's ``calls``) the stream and event
    synchronisations and the HtoD copies, leaving out the device synchronisation that ends the profiled block."""
    if summary.get("forward_syncs") is not None:
        return summary["forward_syncs"], summary["forward_htod"]
    calls = summary.get("calls") or {}
    return sum(calls.get(name, 0.0) for name in SYNC_CALLS if name != "cudaDeviceSynchronize"), calls.get(HTOD, 0.0)


def versus_vanilla(summary: dict, vanilla: dict) -> dict:
    """A row's GPU time and host waits against vanilla's, from the two trace summaries: gpu_ms (the device's busy time
    per forward: kernels, copies and sets), gpu_speedup (vanilla's gpu_ms over the row's; None without device
    events), syncs / htod per forward, their excess over vanilla's and ``syncs_over_vanilla``: either is higher (a
    steady forward of a patch should add no host sync and no upload). Empty for a trace without device events (the
    CPU's: no GPU time, no CUDA calls)."""
    gpu, base = summary.get("gpu_busy_ms"), vanilla.get("gpu_busy_ms")
    if gpu is None:
        return {}
    (syncs, htod), (base_syncs, base_htod) = host_waits(summary), host_waits(vanilla)
    return {"gpu_ms": gpu, "gpu_speedup": round(base / gpu, 4) if gpu and base else None,
            "syncs": syncs, "htod": htod, "syncs_added": round(syncs - base_syncs, 3),
            "htod_added": round(htod - base_htod, 3), "syncs_over_vanilla": syncs > base_syncs or htod > base_htod}


def difference(method: dict, vanilla: dict) -> dict:
    """What a method's forward adds over vanilla's: kernels, GPU busy and wall ms, and each counted call."""
    def delta(a: Any, b: Any) -> Any:
        return None if a is None or b is None else round(a - b, 3)

    names = sorted(set(method["calls"]) | set(vanilla["calls"]))
    return {"kernels": delta(method["kernels"], vanilla["kernels"]),
            "gpu_busy_ms": delta(method["gpu_busy_ms"], vanilla["gpu_busy_ms"]),
            "wall_ms": delta(method["wall_ms"], vanilla["wall_ms"]),
            "calls": {n: delta(method["calls"].get(n, 0.0), vanilla["calls"].get(n, 0.0)) for n in names}}


def text(summary: dict) -> str:
    """One line: kernels, GPU busy against wall, the syncs and allocations, the SDPA backends."""
    busy = summary["gpu_busy_ms"]
    if busy is None:
        line = f"wall {summary['wall_ms']:.2f} ms (no device events)"
    else:
        line = (f"{summary['kernels']:g} kernels, wall {summary['wall_ms']:.2f} ms, GPU busy {busy:.2f} ms "
                f"({100 * summary['busy_share']:.0f} %)")
    calls = ", ".join(f"{n} {c:g}" for n, c in summary["calls"].items() if c)
    sdpa = ", ".join(f"{b} x{e['calls']:g}" for b, e in summary["sdpa"].items())
    return line + (f"; {calls}" if calls else "") + (f"; SDPA {sdpa}" if sdpa else "")
