"""python -m tome_core bench (or tome-bench): compare vanilla, tome_core and tomesd.

Defaults (a few minutes on 2 CPU cores): full SD1.5 UNet, 512x512 and 768x768, ratio 0.5,
batch 2 (CFG halves), bf16, 3 timed repeats after one warm-up, errors also on a peaked-attention
copy (q/k x3). --tiny is the CI setting (tiny models of all three families, 64x64, 1 repeat);
--quick is a short real run (SD1.5, 512x512, 1 repeat). Writes results.json and
speedup_vs_error.png into --out.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from .methods import DEFAULT_METHODS, DESCRIPTIONS, METHODS
from .models import FAMILIES
from .runner import ATTENTION_BACKENDS, BenchConfig

DEFAULTS = dict(families="sd15", res="512,768", repeats=3)
PRESETS = {
    # one thread: tiny forwards are too short for threading to pay, and on a busy machine
    # OpenMP threads waiting on each other make them 100x slower
    "tiny": dict(families="sd15,sd2,sdxl", res="64", repeats=1, threads=1),
    "quick": dict(families="sd15", res="512", repeats=1),
}


def _csv(kind):
    def parse(text: str):
        try:
            return tuple(kind(x) for x in text.split(",") if x.strip())
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
    return parse


def _size(text: str) -> tuple[int, int]:
    w, _, h = text.lower().partition("x")
    w, h = int(w), int(h or w)
    if w < 8 or h < 8:
        raise ValueError(f"image size must be at least 8 px per side, got {text!r}")
    return w, h


def build_parser() -> argparse.ArgumentParser:
    methods = "; ".join(f"{k}: {v}" for k, v in DESCRIPTIONS.items())
    p = argparse.ArgumentParser(
        prog="python -m tome_core bench", description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter)
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--tiny", action="store_true",
                        help="CI setting: tiny sd15/sd2/sdxl models, 64 px, 1 repeat, 1 thread "
                             "(seconds)")
    preset.add_argument("--quick", action="store_true",
                        help="short real run: full sd15 at 512 px, 1 repeat")
    p.add_argument("--families", type=_csv(str), default=None,
                   help=f"comma list of {', '.join(FAMILIES)} (default: {DEFAULTS['families']})")
    p.add_argument("--res", type=_csv(_size), default=None,
                   help="comma list of image sizes in px, 'W' or 'WxH' (latent = px/8) "
                        f"(default: {DEFAULTS['res']})")
    p.add_argument("--ratios", type=_csv(float), default=(0.5,),
                   help="comma list of merge ratios (default: 0.5)")
    p.add_argument("--methods", type=_csv(str), default=DEFAULT_METHODS,
                   help=f"comma list from {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)}; "
                        f"unavailable ones are skipped); METHOD@RATIO runs that method at that ratio "
                        f"only, e.g. kv@0.75, and METHOD@RATIO:SXxSY also sets its cell, e.g. kv@0.88:3x3. "
                        f"{methods}")
    p.add_argument("--batch", type=int, default=2,
                   help="batch size; even = [uncond; cond] CFG halves (default: 2)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default="bf16",
                   help="weights and activations (default: bf16; fp16 only on CUDA)")
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed rounds after the warm-up (default: {DEFAULTS['repeats']})")
    p.add_argument("--peaked", type=float, default=3.0,
                   help="also measure errors with self-attention q/k scaled by this factor "
                        "(peaked attention as in trained models); 1 = off (default: 3.0)")
    p.add_argument("--guidance", type=float, default=7.5,
                   help="CFG scale for the combined-prediction error (default: 7.5)")
    p.add_argument("--max-downsample", type=int, default=1,
                   help="passed to apply_patch of both packages (default: 1)")
    p.add_argument("--no-rand", dest="use_rand", action="store_false",
                   help="use_rand=False in apply_patch (deterministic destination choice)")
    p.add_argument("--seed", type=int, default=0, help="weights, inputs and ToMe seed")
    p.add_argument("--device", default="cpu", help="torch device (default: cpu)")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="default",
                   help="SDPA backend of every attention: torch's own choice (flash on CPU and recent "
                        "GPUs: no N x N scores), or 'math', which materialises the N x N scores as "
                        "attention without flash/memory-efficient kernels does (such hosts, the "
                        "published ToMe memory figures); use it to see ToMe's memory saving")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--profile", action="store_true",
                   help="also profile one forward per variant for the first family, size and "
                        "ratio, and print where the time goes")
    p.add_argument("--out", type=Path, default=Path("bench_out"),
                   help="output folder for results.json and speedup_vs_error.png "
                        "(default: ./bench_out)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    return p


def config_from_args(args: argparse.Namespace):
    preset = PRESETS["tiny"] if args.tiny else PRESETS["quick"] if args.quick else DEFAULTS
    families = args.families or _csv(str)(preset["families"])
    resolutions = args.res or _csv(_size)(preset["res"])
    repeats = preset["repeats"] if args.repeats is None else args.repeats
    try:
        return BenchConfig(
            families=families, resolutions=resolutions, ratios=args.ratios,
            methods=args.methods, batch=args.batch, dtype=args.dtype, repeats=repeats,
            peaked=args.peaked, guidance=args.guidance, scale="tiny" if args.tiny else "full",
            seed=args.seed, max_downsample=args.max_downsample, use_rand=args.use_rand,
            device=args.device, attention=args.attention)
    except ValueError as e:
        raise SystemExit(f"python -m tome_core bench: {e}") from None


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code."""
    args = build_parser().parse_args(argv)
    cfg = config_from_args(args)
    # silence kineto's per-session "profiler_start/stop" lines (memory is measured with it)
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")

    import torch

    from . import report
    from .models import _import_diffusers
    from .runner import run_benchmark

    _import_diffusers()  # fail early, with the install hint, before any work
    threads = args.threads or (PRESETS["tiny"]["threads"] if args.tiny else None)
    if threads:
        torch.set_num_threads(threads)
    env = report.environment(cfg.device)
    load, cores = env.get("load_avg_1min_at_start"), env.get("cpu_count") or 1
    if cfg.device == "cpu" and load is not None and load > cores / 2:
        print(f"note: the machine is busy (load {load} on {cores} cores): timings will be noisy; "
              "compare 'best x' or use more --repeats (or --threads 1)", file=sys.stderr)
    json_path = args.out / "results.json"

    def save(rows: list[dict], complete: bool, **extra) -> None:
        report.write_json({"config": cfg.as_dict(), "environment": env,
                           "metrics": report.METRICS, "skipped": cfg.skipped,
                           "complete": complete, "rows": rows, **extra}, json_path)

    run = run_benchmark(cfg, progress_bar=not args.no_progress, profile=args.profile,
                        on_rows=lambda rows: save(rows, complete=False))
    env["load_avg_1min_at_end"] = report.load_avg()
    save(run["rows"], complete=True, **{k: run[k] for k in ("profile",) if k in run})

    for method, reason in cfg.skipped.items():
        print(f"skipped {method}: {reason}", file=sys.stderr)
    print(report.format_table(run["rows"]))
    for r in run["rows"]:
        if r.get("vanilla_drift"):
            print(f"WARNING: {r['family']} {r['width']}x{r['height']}: vanilla output changed "
                  f"after patches were applied and removed (rel. L2 {r['vanilla_drift']:.2e})",
                  file=sys.stderr)
    if "profile" in run:
        from .profiling import format_profile

        prof = run["profile"]
        print(f"\nprofile: {prof['family']} {prof['width']}x{prof['height']}, "
              f"batch {prof['batch']}, {prof['dtype']}\n" + format_profile(prof["variants"]))
    chart = report.write_chart(run["rows"], args.out / "speedup_vs_error.png")
    print(f"\nwrote {json_path}" + (f" and {chart}" if chart else ""))
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
