"""Reusing a merge's matching across steps (``match_every``): the error it adds and the work it saves.

ToMA recomputes its merge every few steps and CA-ToMe caches pairs; ``match_every=N`` keeps one model call's
matching for the next N - 1 calls of the same shape. This runs a sampling trajectory on the bench's seeded
models (a photograph noised to each step's level, so consecutive steps see the image a real run sees, not a
model's own drift) and compares, per step, the output of every ``match_every`` with vanilla's: the bench's
``cfg err peaked``, mean and worst over the steps. What reuse saves is counted on a call that reuses against
one that matches (ATen ops, Python calls into tome_core: launch time on a GPU), and timed as whole runs,
interleaved, median of rounds (CPU; not a GPU figure).

Run: python -m tome_bench.experiments.matching_reuse [--families sd15,flux,wan] [--every 1,2,4] [--steps 8]
"""
from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from typing import Callable, Dict, List, Tuple

import torch

import tome_core
from tome_bench import content, dit_models, measure
from tome_bench.models import build_unet, make_inputs, peaked_attention
from tome_bench.op_count import count_ops
from tome_bench.report import source_commit

from . import results_path

UNET_FAMILIES = ("sd15",)
SIZES = {"sd15": (512, 512), "flux": (512, 512), "qwen_image": (512, 512), "wan": (832, 480)}  # CPU-sized
PEAKED = 3.0
GUIDANCE = 7.5


def unet_trajectory(family: str, px: Tuple[int, int], steps: int, photo: str,
                    scale: str = "full") -> Tuple[torch.nn.Module, List[dict]]:
    """The UNet and one forward's inputs per step: timesteps 900 down to 100, x_t = a x0 + s noise (DDPM)."""
    unet = build_unet(family, scale)
    width, height = px
    sample, _, context, added = make_inputs(unet, family, 2, height, width)
    x0 = content.pack(family, content.photo_latent(family, 1, height // 8, width // 8, photo))
    calls = []
    for t in torch.linspace(900, 100, steps).round().long().tolist():
        alpha_bar = content._ddpm_alpha_bar(int(t))
        x = alpha_bar ** 0.5 * x0 + (1 - alpha_bar) ** 0.5 * sample
        calls.append(dict(sample=x, timestep=torch.full((2,), float(t)), encoder_hidden_states=context,
                          added_cond_kwargs=added))
    return unet, calls


_TIMESTEP = {"flux": ("timestep", 1.0), "qwen_image": ("timestep", 1.0), "wan": ("timestep", 1000.0)}


def dit_trajectory(family: str, px: Tuple[int, int], steps: int, photo: str, frames: int,
                   blocks: int, scale: str = "full",
                   dtype: torch.dtype = torch.bfloat16) -> Tuple[torch.nn.Module, List[dict]]:
    """The DiT (``blocks`` deep, in ``dtype``) and one forward's inputs per step: sigma 0.9 down to 0.1, flow
    matching."""
    model = torch.nn.Module.to(dit_models.build_dit(family, blocks, scale=scale), dtype)
    width, height = px
    inputs = dit_models.make_dit_inputs(model, family, 2, height, width, frames, dtype=torch.float32)
    f, h, w = dit_models.latent_shape(family, height, width, frames)
    x0 = content.pack(family, content.photo_latent(family, f, h, w, photo))
    noise = inputs["hidden_states"]
    key, scale = _TIMESTEP[family]
    calls = []
    for sigma in torch.linspace(0.9, 0.1, steps).tolist():
        call = dict(inputs, hidden_states=(1 - sigma) * x0 + sigma * noise)
        call[key] = torch.full_like(inputs[key], sigma * scale)
        calls.append(dit_models._cast(call, dtype))
    return model, calls


def forward_of(family: str, model: torch.nn.Module) -> Callable[[dict], torch.Tensor]:
    if family in UNET_FAMILIES:
        def run(inputs: dict) -> torch.Tensor:
            with torch.no_grad():
                return model(**inputs).sample.float()
        return run
    return lambda inputs: dit_models.forward(model, inputs).float()


def options_for(family: str, ratio: float, every: int) -> dict:
    """The patch: the hosts' UNet default (merge, level matching) or DiT merge, speed check off (timed here)."""
    if family in UNET_FAMILIES:
        return dict(ratio=ratio, mode="merge", matching="level", match_every=every)
    return dict(ratio=ratio, mode="merge", match_every=every)


def errors_of(family: str, y: torch.Tensor, ref: torch.Tensor) -> float:
    raw, guided = measure.errors(y, ref, GUIDANCE)
    return raw if family == "flux" or guided is None else guided  # Flux is guidance-distilled: its raw output


def run_family(family: str, everies: List[int], ratio: float, steps: int, photo: str, frames: int, blocks: int,
               rounds: int, size: Tuple[int, int] = None, scale: str = "full",
               dtype: torch.dtype = torch.bfloat16) -> dict:
    size = size or SIZES[family]
    if family in UNET_FAMILIES:
        model, calls = unet_trajectory(family, size, steps, photo, scale)
        peaked = peaked_attention(model, PEAKED)
    else:
        model, calls = dit_trajectory(family, size, steps, photo, frames, blocks, scale, dtype)
        peaked = dit_models.peaked_attention(model, PEAKED)
    forward = forward_of(family, model)
    rows: Dict[int, dict] = {}
    with peaked:
        start = time.perf_counter()
        reference = [forward(c) for c in calls]
        times: Dict[object, List[float]] = {"vanilla": [time.perf_counter() - start]}

        def run_all(every: object) -> Tuple[float, List[torch.Tensor]]:
            if every != "vanilla":
                tome_core.apply_patch(model, **options_for(family, ratio, every))
            try:
                start = time.perf_counter()
                outs = [forward(c) for c in calls]
                return time.perf_counter() - start, outs
            finally:
                tome_core.remove_patch(model)

        for every in everies:
            seconds, outs = run_all(every)
            errs = [errors_of(family, y, ref) for y, ref in zip(outs, reference)]
            rows[every] = dict(match_every=every, err_mean=statistics.fmean(errs), err_max=max(errs),
                               err_per_step=[round(e, 4) for e in errs])
            times[every] = [seconds]
        for _ in range(rounds):  # interleaved whole runs: vanilla, then each setting
            for every in ["vanilla"] + everies:
                times[every].append(run_all(every)[0])
        # what one reused call saves against one that matches (count_ops runs the call twice: every call
        # matches with match_every 1, and none after the first with a count that never runs out)
        counted = {}
        for every in (1, 1 << 20):
            tome_core.apply_patch(model, **options_for(family, ratio, every))
            try:
                forward(calls[0])
                counted[every], _ = count_ops(lambda: forward(calls[1]))
            finally:
                tome_core.remove_patch(model)
        matched, reused = counted[1], counted[1 << 20]
        vanilla_ops, _ = count_ops(lambda: forward(calls[0]))
    base = statistics.median(times["vanilla"])
    first = statistics.median(times[everies[0]])
    for every, row in rows.items():  # timed only with rounds (the error pass alone is no timing)
        row["speedup_vs_vanilla"] = round(base / statistics.median(times[every]), 3) if rounds else None
        row["speedup_vs_every_call"] = round(first / statistics.median(times[every]), 3) if rounds else None
    return dict(family=family, scale=scale, dtype=str(dtype).replace("torch.", "") if family not in UNET_FAMILIES
                else "float32", size=f"{size[0]}x{size[1]}" + (f" x {frames} frames" if family == "wan" else ""),
                ratio=ratio, steps=steps, photo=photo, blocks=None if family in UNET_FAMILIES else blocks,
                ops=dict(vanilla=vanilla_ops.total, matching_call=matched.total, reusing_call=reused.total,
                         saved_per_reused_call=matched.total - reused.total,
                         tome_calls_matching=matched.tome_calls, tome_calls_reusing=reused.tome_calls),
                rows=list(rows.values()))


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="sd15,flux,wan")
    parser.add_argument("--every", default="1,2,4", help="match_every values (the first is the baseline: 1)")
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--frames", type=int, default=9, help="Wan's pixel frames (latent: (frames - 1) / 4 + 1)")
    parser.add_argument("--blocks", type=int, default=2, help="DiT depth, as the bench's --blocks")
    parser.add_argument("--rounds", type=int, default=2, help="timed rounds after the error pass (0: errors and "
                        "op counts only)")
    parser.add_argument("--dtype", choices=("bf16", "fp32"), default="bf16", help="DiTs' dtype (UNets: fp32)")
    parser.add_argument("--photo", default="astronaut")
    parser.add_argument("--size", default=None, help="WxH for every family (default: each family's, SIZES)")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny models (a check that it runs)")
    parser.add_argument("--out", default="matching_reuse_cpu.json", help="file in docs/results ('' : none)")
    args = parser.parse_args(argv)
    everies = [int(e) for e in args.every.split(",")]
    results = []
    for family in args.families.split(","):
        size = tuple(int(v) for v in args.size.split("x")) if args.size else None
        found = run_family(family, everies, args.ratio, args.steps, args.photo, args.frames, args.blocks, args.rounds,
                           size, "tiny" if args.tiny else "full", measure.DTYPES[args.dtype])
        results.append(found)
        print(json.dumps(found, indent=1), flush=True)
    out = {"device": "cpu", "commit": source_commit(), "experiment": "matching_reuse",
           "command": "python -m tome_bench.experiments.matching_reuse " + " ".join(argv or []),
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "threads": torch.get_num_threads(),
           "note": "errors: cfg err peaked per step vs vanilla on a noised photo trajectory; speed-ups: CPU, "
                   "whole runs interleaved, median of rounds (noisy on a shared machine; not a GPU figure)",
           "results": results}
    if args.out:
        path = results_path(args.out)
        path.write_text(json.dumps(out, indent=2) + "\n")
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
