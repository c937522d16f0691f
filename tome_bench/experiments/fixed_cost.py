"""What one UNet forward pays for a ToMe patch, on any device's terms and, on a GPU, in time.

Counted on every device (the second forward after ``apply_patch``, as ``bench --ops`` counts, ``tome_bench.op_count``):
host syncs, ATen ops added over vanilla, Python calls into ``tome_core`` and Python calls added in all (a host's
property walking the model counts too), for patches that reduce nothing (ratio
0, every level left whole by ``min_tokens``, a call outside the step window) and for the reduced paths (the hosts'
default, tomesd's defaults, kv).

Timed where calls queue (CUDA; ``--device cuda``): vanilla and each patch alternate (``--alternations``, at least 5),
each timed as the bench times a step (``tome_core.engine.timing``: the first call after applying timed apart, then
CUDA events around back-to-back calls), so a drifting host or clock cannot decide the sign: each patched span is
paired with the mean of the vanilla spans on either side of it. On CUDA the host syncs are also counted by the
driver (``torch.cuda.set_sync_debug_mode``). Default on CUDA: SD1.5 512² and SDXL 1024², fp16, batch 2.

Run: python -m tome_bench.experiments.fixed_cost [PX]                       CPU: counts only (default 256 px, SD1.5)
     python -m tome_bench.experiments.fixed_cost --device cuda [--case sd15:512 --case sdxl:1024] [--alternations 5]
"""
from __future__ import annotations

import argparse
import json
import platform
import warnings
from typing import Callable

import torch

import tome_core
from tome_bench.measure import alternate
from tome_bench.models import build_unet, make_inputs
from tome_bench.op_count import count_ops, count_python_calls
from tome_bench.report import environment, source_commit
from tome_core.engine import timing

from . import results_path

HOST_DEFAULTS = dict(matching="level", speed_check="auto")
CASES = (
    ("ratio 0", dict(ratio=0.0, **HOST_DEFAULTS)),
    ("every level whole (min_tokens)", dict(min_tokens=1 << 20, **HOST_DEFAULTS)),
    ("outside the step window (start_percent 0.6 at t=500)", dict(start_percent=0.6, **HOST_DEFAULTS)),
    ("hosts' default (merge, level matching, speed check auto)", dict(HOST_DEFAULTS)),
    ("tomesd's defaults (merge, block matching)", dict()),
    ("kv r=0.5", dict(mode="kv")),
)
GPU_CASES = ("sd15:512", "sdxl:1024")


def cuda_syncs(forward: Callable[[], object]) -> int:
    """Synchronisations the CUDA driver reports for one forward (``set_sync_debug_mode``)."""
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(1)
    try:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            forward()
    finally:
        torch.cuda.set_sync_debug_mode(0)
    return sum("synchroniz" in str(w.message) for w in seen)


def run_case(family: str, px: int, device: torch.device, dtype: torch.dtype, alternations: int,
             clock: timing.Clock | None = None, log: Callable[[str], None] = print,
             unet: torch.nn.Module | None = None, on_row: Callable[[dict], None] | None = None) -> dict:
    """Every patch of ``CASES`` on ``family`` at ``px``: counts, and where calls queue (or ``clock`` is given),
    interleaved timings. ``unet``: a model of ``family`` already built (tests), else the full-width one.
    on_row(case so far): called after each row, so a run stopped by its time limit keeps what it measured."""
    unet = unet if unet is not None else build_unet(family, dtype=dtype).to(device)
    sample, _, context, added = make_inputs(unet, family, 2, px, px, dtype=dtype)
    sample, context = sample.to(device), context.to(device)
    added = None if added is None else {k: v.to(device) for k, v in added.items()}
    step = torch.full((2,), 500.0, device=device)

    def forward():
        with torch.inference_mode():
            return unet(sample, step, encoder_hidden_states=context, added_cond_kwargs=added).sample

    clock = clock or timing.clock_for(device)
    timed = clock.back_to_back
    forward()
    vanilla, _ = count_ops(forward)
    vanilla_calls = count_python_calls(forward)
    rows = []
    case = {"family": family, "px": px, "batch": 2, "dtype": str(dtype).replace("torch.", ""),
            "vanilla": {"host_syncs": vanilla.syncs, "aten_ops": vanilla.total}, "rows": rows}
    for label, options in CASES:
        tome_core.apply_patch(unet, **options)
        try:
            forward()
            count, _ = count_ops(forward)
            row = {"case": label, "options": options, "host_syncs": count.syncs,
                   "aten_ops_added": count.total - vanilla.total, "tome_calls": count.tome_calls,
                   "python_calls_added": count_python_calls(forward) - vanilla_calls,  # in any package
                   "describe": tome_core.describe(unet)}
            if device.type == "cuda":
                row["cuda_syncs"] = cuda_syncs(forward)
        finally:
            tome_core.remove_patch(unet)
        if timed:
            row["timing"] = alternate(forward, lambda: tome_core.apply_patch(unet, **options),
                                      lambda: tome_core.remove_patch(unet), alternations, clock)
        rows.append(row)
        speed = f", {row['timing']['ratio']:.3f}x vanilla (min {row['timing']['ratio_min']:.3f}, max " \
                f"{row['timing']['ratio_max']:.3f})" if timed else ""
        log(f"{family} {px}px {label}: syncs {count.syncs}, ATen ops +{count.total - vanilla.total}, "
            f"Python calls into tome_core {count.tome_calls}, in all +{row['python_calls_added']}{speed}")
        if on_row is not None:
            on_row(case)
    return case


def main(argv=None) -> None:
    p = argparse.ArgumentParser(prog="python -m tome_bench.experiments.fixed_cost", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("px", nargs="?", type=int, default=None, help="CPU: image size (default 256; the counts do "
                   "not depend on it)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--case", action="append", default=None,
                   help="FAMILY:PX, repeatable (CUDA default: sd15:512 and sdxl:1024; CPU: sd15:PX)")
    p.add_argument("--alternations", type=int, default=5, help="vanilla/patch alternations per patch (>= 5)")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if args.alternations < 5 and device.type == "cuda":
        p.error("--alternations must be at least 5 on CUDA")
    cuda = device.type == "cuda"
    dtype = torch.float16 if cuda else torch.float32
    cases = args.case or (list(GPU_CASES) if cuda else [f"sd15:{args.px or 256}"])
    command = "python -m tome_bench.experiments.fixed_cost " + " ".join(argv if argv is not None else
                                                                          __import__("sys").argv[1:])
    out = {"experiment": "fixed_cost", "command": command.strip(), "device": str(device),
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__, "commit": source_commit(),
           "environment": environment(args.device), "cases": []}
    path = results_path(f"fixed_cost_{device.type}.json" if cuda else "fixed_cost_sd15_cpu.json")

    def write(case: dict) -> None:  # after every row: a run stopped by its limit keeps its rows
        out["cases"] = [c for c in out["cases"] if c is not case] + [case]
        if not cuda and len(out["cases"]) == 1:  # the CPU file keeps its layout: one case's rows at the top
            out.update(model=f"SD1.5 UNet (full width, seeded weights), batch 2, {case['px']}x{case['px']} px, "
                       "fp32", vanilla=case["vanilla"], rows=case["rows"])
        path.write_text(json.dumps(out, indent=2, default=str) + "\n")

    for spec in cases:
        family, _, px = spec.partition(":")
        run_case(family, int(px or 512), device, dtype, args.alternations, on_row=write)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
