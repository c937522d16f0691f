"""Benchmark output: environment record, printed table, JSON and the speed-up/error chart."""
from __future__ import annotations

import importlib
import importlib.metadata
import json
import os
import platform
import re
import sys
from pathlib import Path

import torch

# how each reported number is defined; written into the JSON next to the results
METRICS = {
    "time_s": "median over the timed rounds of the steady seconds of one model forward (UNet or DiT). CPU: "
              "one forward per round, wall clock. CUDA: per round, after the first forward (first_call_s), CUDA "
              "events around back-to-back forwards (at least 2, spanning 0.25 s), one synchronisation at the end: "
              "the GPU time per forward of a sampler's later steps",
    "first_call_s": "CUDA: median over rounds of the first forward right after the variant was applied, timed "
                    "alone (CUDA events): what a user pays once per size (the patch's tables, a speed check); "
                    "never part of time_s",
    "rounds": "timed rounds; each round runs every eager variant once, interleaved in a rotated "
              "order; more rounds run (up to the cap) while the noise bands overlap",
    "speedup": "eager: median t_vanilla / median t_method over the timed rounds (so it agrees with "
               "time_s); compiled: the same over the compiled vanilla times (compiled variants "
               "run in blocks)",
    "speedup_paired": "eager: median over rounds of t_vanilla / t_method, both timed in the same "
                      "round (paired); the band covers both it and speedup",
    "speedup_low": "lower edge of the noise band (about 95 %): speedup - h, where h = (s + d + "
                   "speedup * w) / (1 - w), s = t(rounds - 1) * 1.4826 * MAD / sqrt(rounds) of "
                   "the per-round paired ratios (Student-t 97.5 % quantile: 12.7 for 2 rounds, "
                   "4.3 for 3, 2.0 for many), d = |speedup_paired - speedup|, w = interference; "
                   "not below 0",
    "speedup_high": "upper edge of the noise band: speedup + h",
    "interference": "share of the time lost to other work (0..1), median over rounds of the "
                    "larger of vanilla's stretch over its fastest round (1 - min / t) and the "
                    "CPU wait of the paired forwards; widens the band, and at 1/3 or more "
                    "nothing is ranked ('too noisy: machine busy')",
    "cpu_wait": "per round: seconds this variant's threads were runnable but waited for a CPU "
                "(Linux schedstat, summed over threads) / its time; null where not measurable "
                "(CUDA, non-Linux)",
    "rank": "places, 1 = fastest; '2-3 (tied)': bands overlap (directly or through a chain), so "
            "these share their places; 'too noisy to rank': every band overlaps, nothing ranked; "
            "'too noisy: machine busy': other work took 1/3 or more of the time; '1 round: "
            "unranked': no noise estimate",
    "speedup_best": "min(t_vanilla) / min(t_method) over the rounds: other load only ever adds "
                    "time, so the fastest runs are the least disturbed",
    "speedup_vs_eager": "compiled rows: median eager vanilla time / median compiled time",
    "compile_s": "compiled rows: seconds of the first compiled call (compilation included)",
    "recompiles": "compiled rows: graphs compiled during the timed calls, after the first "
                  "call and one warm-up call (0 = no recompilation)",
    "compile_error": "compiled rows: why torch.compile failed for this variant",
    "compile_skipped": "compiled rows: why this mode does not run here (--host comfyui's cudagraphs backend on the CPU)",
    "compile_mode": "compiled rows: torch.compile's mode: 'default' (inductor) or 'reduce-overhead' (inductor + CUDA "
                    "graphs, on CUDA); --host comfyui: the backend of ComfyUI's TorchCompileModel node, 'inductor' or "
                    "'cudagraphs' (dynamo's CUDA graphs of the eager kernels); each mode's rows compare with compiled "
                    "vanilla of the same mode",
    "host": "--host comfyui rows: 'comfyui' (ComfyUI's own model classes, the ToMe node through ModelPatcher, the "
            "model call ComfyUI's sampler makes); rows without it are diffusers'",
    "graphs": "compiled rows: graphs dynamo compiled for the first calls (the model alone: 1; ToMe adds none)",
    "graph_breaks": "compiled rows: graph breaks dynamo made in the first calls (0 = the model compiled whole); "
                    "break_reasons: dynamo's reasons",
    "to_eager": "compiled rows: constructs dynamo could not trace that left a frame to run eagerly (0 expected)",
    "cudagraph_skips": "reduce-overhead rows on CUDA: compiled regions inductor did not run as CUDA graphs (0 = every "
                       "region captured); cudagraph_skip_reasons: inductor's reasons",
    "attention": "SDPA kernel the variant's attention dispatched to (from torch.profiler op "
                 "names): flash, flash-cpu, mem-efficient, cudnn, math; 'no SDPA' = explicit "
                 "bmm + softmax; compiled rows: inductor (its own kernels)",
    "rel_err": "||y - y_vanilla|| / ||y_vanilla|| of the model output (first timed round; "
               "compiled rows: compiled output against eager vanilla)",
    "cfg_err": "same for the CFG-combined prediction uncond + g * (cond - uncond) "
               "(batch = [uncond; cond]); null for odd batch; Flux (guidance-distilled, "
               "guided = 'distilled'): the output itself, = rel_err",
    "rel_err_peaked": "rel_err on the same model with self-attention q/k scaled by 'peaked' "
                      "(peaked attention, as in trained models; DiTs: their q/k RMSNorm weights, "
                      "which set their logit scale)",
    "cfg_err_peaked": "cfg_err on the peaked model",
    "content": "the timed inputs' latents: 'noise' (seeded), 'photo' (a photograph through the family's "
               "latent-to-RGB preview factors, noised to the step: tome_bench/content.py), 'both' (timed on "
               "noise; the *_photo errors from the photo's latents)",
    "rel_err_peaked_photo": "--content both: rel_err_peaked with the photo's latents in place of the noise "
                            "(one forward per variant in the warm-up round); without peaked: rel_err_photo",
    "cfg_err_peaked_photo": "--content both: cfg_err_peaked with the photo's latents; without peaked: "
                            "cfg_err_photo",
    "peak_mem_mb": "peak tensor memory allocated during one forward above the live set at its "
                   "start (weights and inputs excluded); CPU: torch.profiler memory events, "
                   "CUDA: torch.cuda.max_memory_allocated, reset per measured call",
    "mem_vs_vanilla": "peak_mem_mb / vanilla's peak_mem_mb",
    "image_tokens": "DiT rows: image (Wan, LTX-2: video) tokens of one sample: latent px / 8 (LTX-2: / 32), "
                    "2x2 patches (LTX-2: 1x1), Wan: x (1 + (frames - 1) / 4) latent frames (LTX-2: / 8)",
    "text_tokens": "DiT rows: text tokens of one sample (Flux, Wan: T5 512; SD3: CLIP 77 + T5 256; Z-Image, "
                   "Qwen-Image: the prompt's 128; LTX-2: 1024, cross-attention only)",
    "blocks": "DiT rows: blocks built at full width (Flux: double+single); 'real_blocks' has the "
              "released model's; per-block cost and attention share are the real model's",
    "frames": "Wan, LTX-2 rows: video frames (latent frames 1 + (frames - 1) / 4; LTX-2: / 8)",
    "attn_share": "DiT rows: share of one vanilla forward's time inside scaled_dot_product_attention "
                  "(the forward right after the warm-up round), the same on every row of a size",
    "speedup_ceiling": "DiT rows: 1 / (1 - attn_share), the speed-up if attention took no time: "
                       "no kv ratio can beat it",
    "guided": "DiT rows: what cfg_err compares: 'cfg' (CFG pair), 'distilled' (Flux, Z-Image-Turbo: the output)",
    "aten_ops": "--ops: ATen ops dispatched by one forward (the second after the patch is applied: "
                "the step's tables already built, as in every later call of a sampling step), views "
                "included; counted under a TorchDispatchMode, the same on any device: the proxy for a "
                "GPU's kernel launches where no GPU is at hand",
    "step_table_ops": "--ops: ATen ops the first forward of a step dispatches beyond that (building the "
                      "step's partitions or kept indices: small CPU tensors, then one copy each to the device)",
    "aten_ops_added": "--ops: aten_ops minus vanilla's",
    "moved_mib": "--ops: MiB of the tensors produced by gather/scatter/index ops in that forward "
                 "(an in-place one: the tensor written into)",
    "moved_mib_added": "--ops: moved_mib minus vanilla's",
    "host_syncs": "--ops: ops in that forward that make the host wait for the device (.item() etc.)",
    "tome_calls": "--ops: Python calls into tome_core in that forward (sys.setprofile): hooks and what they "
                  "call, each paid as launch time on a fast GPU",
    "ops_added_by_name": "--ops: per ATen op name, how many more times it ran than in vanilla",
    "trace": "--profile: per forward, from a torch.profiler trace of steady forwards (the variant applied, one "
             "call, then 2 profiled back to back; Kineto's Chrome trace summarised by tome_bench/trace_summary.py): "
             "kernels (device kernels launched), gpu_busy_ms (the union of kernel, copy and set intervals), wall_ms "
             "(first forward's start to the later of the last forward's end and the last device event), busy_share "
             "(gpu_busy / wall: low = launch-bound), calls (cudaStreamSynchronize, cudaDeviceSynchronize, "
             "cudaEventSynchronize, cudaMalloc, cudaFree, cudaHostAlloc, ... and the cudaMemcpy* calls by direction, "
             "e.g. 'cudaMemcpy DtoH'), sdpa (per SDPA backend: calls and the device kernels they ran), top_kernels "
             "(the 5 kernels with the most time: ms and launches); on the CPU only the CPU-side figures",
    "trace_vs_vanilla": "--profile: the method's trace figures minus vanilla's (kernels, gpu_busy_ms, wall_ms, calls)",
    "gpu_ms": "CUDA rows (traced on CUDA always, elsewhere with --profile): the GPU's time per steady forward, "
              "trace.gpu_busy_ms: the union of the device's kernel, copy and set intervals over the profiled forwards, "
              "per forward (idle gaps, e.g. while the host launches, left out); compiled rows: the compiled forward's",
    "gpu_speedup": "vanilla's gpu_ms / this row's (compiled rows: compiled vanilla's of the same mode): the speed-up "
                   "where the GPU is the bound (a slower GPU, a faster host, CUDA graphs); 'speedup' is the wall "
                   "clock's, which a launch-bound host caps",
    "syncs": "traced rows: host synchronisations (cudaStreamSynchronize, cudaDeviceSynchronize, "
             "cudaEventSynchronize) per steady forward, counted inside the forwards (not the profiled block's own "
             "final synchronisation)",
    "htod": "traced rows: host-to-device copies (cudaMemcpy* launching a HtoD copy) per steady forward, inside the "
            "forwards: a value made on the host, then uploaded",
    "syncs_added": "syncs minus vanilla's",
    "htod_added": "htod minus vanilla's",
    "syncs_over_vanilla": "true where syncs or htod exceed vanilla's: a steady forward of a patch should add neither "
                          "(marked '!' in the tables)",
    "depth": "DiT rows: 'blocks' (--blocks of each kind at full width) or 'released' (the released model's depth and "
             "width, weights made and seeded on the device in the run's dtype)",
    "weights_gb": "DiT rows: the model's parameters in GB (10^9 bytes) in the run's dtype",
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


COMMIT_FILE = "COMMIT"  # tome_bench/COMMIT: the commit written into the package where it is built or exported


def source_commit() -> str | None:
    """The commit of this project's own source, or None; never that of a git repository it merely sits inside.

    A checkout whose top level is the package's parent folder: its HEAD ('+dirty' when tracked files differ from it).
    Elsewhere (an export, a copy, an installed package): the commit written into the package when it was built or
    copied (``tome_bench/COMMIT``, e.g. ``git rev-parse HEAD > tome_bench/COMMIT`` before an export; ignored by git),
    else None. Every results.json the benchmark and its experiments write takes its commit from here."""
    import subprocess

    package = Path(__file__).resolve().parent

    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(package.parent), *args], capture_output=True, text=True,
                              timeout=10, check=True).stdout.strip()

    try:
        if Path(git("rev-parse", "--show-toplevel")).resolve() == package.parent:
            dirty = git("status", "--porcelain", "--untracked-files=no")
            return git("rev-parse", "HEAD") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        pass  # no git, or not a checkout: the written commit, if any
    try:
        written = (package / COMMIT_FILE).read_text().strip()
    except OSError:
        return None
    return written if re.fullmatch(r"[0-9a-f]{7,40}(\+dirty)?", written) else None


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
        dev = torch.device(device)
        env["gpu"] = torch.cuda.get_device_name(dev)
        env["cuda"] = torch.version.cuda
        env["sdpa_enabled"] = {  # what torch may choose from; the table says what it chose
            "flash": torch.backends.cuda.flash_sdp_enabled(),
            "mem_efficient": torch.backends.cuda.mem_efficient_sdp_enabled(),
            "math": torch.backends.cuda.math_sdp_enabled(),
            "cudnn": torch.backends.cuda.cudnn_sdp_enabled()}
    return env


def _fmt(x, spec: str) -> str:
    return "-" if x is None else format(x, spec)


COLUMNS = [  # header, row key, format, legend
    ("model", "family", "s", "model family (real architecture, seeded random weights)"),
    ("size", "size", "s", "image size in px (latent = px / 8); Wan: x frames"),
    ("blocks", "blocks", "s", "DiT: blocks built (full width unless --tiny; Flux: double+single; released, "
     "--depth released: Flux.1 19+38, SD3.5 medium 24, Wan 14B 40, Z-Image 30+2+2, Qwen-Image 60, LTX-2 48)"),
    ("tokens", "tokens", "s", "DiT: image (video) + text tokens of one sample"),
    ("method", "label", "s", "variant; r = merge ratio"),
    ("host", "host", "s", "--host comfyui: ComfyUI's models, the ToMe node, the sampler's model call"),
    ("run", "run", "s", "eager, or compiled with torch.compile after patching: 'compiled' (inductor), "
     "'cudagraphs' (mode reduce-overhead: inductor + CUDA graphs); --host comfyui, TorchCompileModel's backend: "
     "'inductor', 'cg backend' (cudagraphs: the eager kernels in CUDA graphs); 'regional': diffusers' "
     "compile_repeated_blocks(fullgraph=True)"),
    ("ms", "time_ms", ".0f", "median time of one model forward, ms"),
    ("x vanilla", "speedup", ".2f",
     "speed-up over vanilla: median vanilla ms / median ms (compiled rows: over compiled "
     "vanilla)"),
    ("+-", "noise", ".2f", "half-width of the noise band of 'x vanilla' (about 95 %; widened by "
     "the paired rounds' spread, by the paired median if it differs, and by 'lost %'; 0 with one "
     "round)"),
    ("GPU ms", "gpu_ms", ".1f", "CUDA (traced): the GPU's busy time per steady forward (kernels, copies; launch gaps "
     "left out)"),
    ("x GPU", "gpu_speedup", ".2f", "CUDA: vanilla's GPU ms / GPU ms: the speed-up where the GPU is the bound (a "
     "slower GPU or a faster host); 'x vanilla' is the wall clock's, which a launch-bound host caps"),
    ("busy %", "trace_busy_pct", ".0f", "--profile/CUDA: GPU busy time / wall time of a profiled forward (low: "
     "launch-bound)"),
    ("sync/HtoD", "waits", "s", "--profile/CUDA: host syncs / host-to-device copies per steady forward; '!': more "
     "than vanilla's (a patch's steady forward should add none)"),
    ("lost %", "lost_pct", ".0f", "% of the time lost to other work: median over rounds of "
     "vanilla's stretch over its fastest round or the CPU wait, if larger"),
    ("rank", "rank", "s", "places, 1 = fastest; 'a-b (tied)': overlapping bands share places; "
     "'too noisy to rank': all bands overlap; 'too noisy: machine busy': 'lost %' >= 33"),
    ("x fastest", "speedup_best", ".2f", "fastest vanilla round / fastest round of the method"),
    ("1st ms", "first_call_ms", ".0f", "CUDA: the first forward after applying the variant, alone (one-time work "
     "included; never part of 'ms')"),
    ("x eager van", "speedup_vs_eager", ".2f", "compiled rows: speed-up over eager vanilla"),
    ("compile s", "compile_s", ".0f", "compiled rows: seconds of the first (compiling) call"),
    ("recompiles", "recompiles", "d", "compiled rows: graphs compiled during the timed calls (0 = none)"),
    ("graphs", "graphs", "d", "compiled rows: graphs the first calls compiled (ToMe adds none to the model's)"),
    ("breaks", "graph_breaks", "d", "compiled rows: graph breaks (0 = compiled whole; reasons below the table)"),
    ("err", "rel_err", ".4f", "relative L2 error of the model output vs vanilla"),
    ("cfg err", "cfg_err", ".4f", "same for the CFG-combined prediction (guidance applied; "
     "Flux, guidance-distilled: the output)"),
    ("err peaked", "rel_err_peaked", ".4f",
     "'err' with self-attention q/k scaled (peaked attention, as in trained models)"),
    ("cfg err peaked", "cfg_err_peaked", ".4f", "'cfg err' with peaked attention"),
    ("cfg err (photo)", "cfg_err_photo", ".4f", "--content both: 'cfg err' on the photo's latents"),
    ("cfg err peaked (photo)", "cfg_err_peaked_photo", ".4f",
     "--content both: 'cfg err peaked' on the photo's latents"),
    ("peak MB", "peak_mem_mb", ".1f", "peak activation memory of one forward (weights excluded)"),
    ("mem x", "mem_vs_vanilla", ".2f", "peak MB / vanilla's peak MB (< 1 = saves memory)"),
    ("+ops", "aten_ops_added", "d", "--ops: ATen ops one forward dispatches beyond vanilla's (GPU kernel-launch proxy)"),
    ("moved MiB", "moved_mib_added", ".1f", "--ops: MiB gathered/scattered by the patch in one forward"),
    ("syncs", "host_syncs", "d", "--ops: host syncs in one forward (each stalls a GPU's launch queue)"),
    ("py calls", "tome_calls", "d", "--ops: Python calls into tome_core in one forward (launch time on a GPU)"),
    ("kernels", "trace_kernels", ".0f", "--profile: device kernels launched per forward"),
    ("attn %", "attn_pct", ".0f", "DiT: % of vanilla's forward time in attention (SDPA)"),
    ("ceiling", "speedup_ceiling", ".2f", "DiT: 1 / (1 - attention share): the most any kv ratio can give"),
    ("attention", "attention", "s",
     "SDPA kernel actually used (flash, flash-cpu, mem-efficient, cudnn, math)"),
]


RUN_LABELS = {"reduce-overhead": "cudagraphs", "inductor": "inductor", "cudagraphs": "cg backend",  # compile_mode
              "regional": "regional"}


def _cells(r: dict) -> dict:
    return dict(r, size=f"{r['width']}x{r['height']}" + (f"x{r['frames']}f" if r.get("frames") else ""),
                tokens=f"{r['image_tokens']}+{r['text_tokens']}" if r.get("image_tokens") else None,
                attn_pct=None if r.get("attn_share") is None else 100 * r["attn_share"],
                lost_pct=None if r.get("interference") is None else 100 * r["interference"],
                run=RUN_LABELS.get(r.get("compile_mode"), "compiled") if r.get("compiled") else "eager",
                time_ms=None if r.get("time_s") is None else 1000 * r["time_s"],
                first_call_ms=None if r.get("first_call_s") is None else 1000 * r["first_call_s"],
                trace_kernels=(r.get("trace") or {}).get("kernels") or None,
                trace_busy_pct=None if (r.get("trace") or {}).get("busy_share") is None
                else 100 * r["trace"]["busy_share"],
                waits=None if r.get("syncs") is None else
                f"{r['syncs']:g}/{r['htod']:g}" + (" !" if r.get("syncs_over_vanilla") else ""),
                noise=None if r.get("speedup_low") is None else
                (r["speedup_high"] - r["speedup_low"]) / 2,
                rank=r.get("rank") or ("compile failed" if r.get("compile_error") else
                                       "skipped" if r.get("compile_skipped") else "-"))


def waits_line(row: dict) -> str:
    """The warning for a row whose steady forward waits on the host more than vanilla's (``syncs_over_vanilla``)."""
    run = f" ({_cells(row)['run']})" if row.get("compiled") else ""
    return (f"! more host waits than vanilla: {row['family']} {row['width']}x{row['height']} {row['label']}{run}: "
            f"{row['syncs_added']:+g} host syncs, {row['htod_added']:+g} host-to-device copies per steady forward")


def format_table(rows: list[dict], legend: bool = True) -> str:
    """The results as a fixed-width text table, columns without any value left out, then a
    legend of every column shown and the compile errors, if any."""
    cells_rows = [_cells(r) for r in rows]
    shown = [c for c in COLUMNS if any(r.get(c[1]) not in (None, "-") for r in cells_rows)
             or c[1] in ("family", "size", "label")]
    if not any(r.get("compiled") for r in rows):
        shown = [c for c in shown if c[1] != "run"]
    cells = [[h for h, _, _, _ in shown]]
    for r in cells_rows:
        cells.append([_fmt(r.get(k), f) for _, k, f, _ in shown])
    widths = [max(len(c[i]) for c in cells) for i in range(len(shown))]
    lines = ["  ".join(c.ljust(w) if shown[i][2] == "s" else c.rjust(w) for i, (c, w) in
                       enumerate(zip(line, widths))) for line in cells]
    lines.insert(1, "-" * len(lines[0]))
    if legend:
        lines.append("")
        lines += [f"{h:>14}: {text}" for h, _, _, text in shown]
    for r in rows:
        if r.get("syncs_over_vanilla"):
            lines.append(waits_line(r))
        if r.get("compile_error") or r.get("compile_skipped"):
            mode = f" ({r['compile_mode']})" if r.get("compile_mode") else ""
            lines.append(f"compile {'failed' if r.get('compile_error') else 'skipped'}: {r['family']} {r['width']}x"
                         f"{r['height']} {r['label']}{mode}: {r.get('compile_error') or r['compile_skipped']}")
        if r.get("graph_breaks") or r.get("to_eager"):
            reasons = "; ".join(r.get("break_reasons") or []) or "no reason recorded"
            lines.append(f"compiled in pieces: {r['family']} {r['width']}x{r['height']} {r['label']}: "
                         f"{r.get('graphs')} graph(s), {r.get('graph_breaks', 0)} graph break(s), "
                         f"{r.get('to_eager', 0)} to eager: {reasons}")
        if r.get("cudagraph_skips"):
            reasons = "; ".join(r.get("cudagraph_skip_reasons") or []) or "no reason logged"
            lines.append(f"CUDA graphs skipped {r['cudagraph_skips']} region(s): {r['family']} {r['width']}x"
                         f"{r['height']} {r['label']}: {reasons}")
    return "\n".join(lines)


def format_markdown(rows: list[dict], title: str = "") -> str:
    """The same table in GitHub markdown, with the legend below (for --gpu-suite / docs)."""
    cells_rows = [_cells(r) for r in rows]
    shown = [c for c in COLUMNS if any(r.get(c[1]) not in (None, "-") for r in cells_rows)]
    out = [f"### {title}", ""] if title else []
    out.append("| " + " | ".join(h for h, _, _, _ in shown) + " |")
    out.append("|" + "|".join("---" if f == "s" else "---:" for _, _, f, _ in shown) + "|")
    for r in cells_rows:
        out.append("| " + " | ".join(_fmt(r.get(k), f) for _, k, f, _ in shown) + " |")
    out += [""] + [f"- **{h}**: {text}" for h, _, _, text in shown]
    for r in rows:
        if r.get("syncs_over_vanilla"):
            out.append(f"- {waits_line(r)}")
        if r.get("compile_error"):
            out.append(f"- compile failed for {r['label']} at {r['width']}x{r['height']}: "
                       f"`{r['compile_error']}`")
    return "\n".join(out) + "\n"


def device_name(env: dict) -> str:
    """The device a run's ``environment`` ran on, as the JSONs name it: the GPU's name, else the CPU's and its cores."""
    return env.get("gpu") or (f"cpu ({env['cpu']}, {env.get('cpu_count')} cores)" if env.get("cpu")
                              else env.get("device", "cpu"))


def write_json(result: dict, path: Path) -> Path:
    """Write a run's result, led by the device and commit it was measured on (from its ``environment``), which every
    JSON in docs/results names."""
    env = result.get("environment") or {}
    if env and "device" not in result:
        result = {"device": device_name(env), "commit": env.get("commit"), **result}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, allow_nan=True) + "\n")
    return path


def _bench_extra() -> str:
    """How to install the benchmark's extras: by the distribution that holds tome_core when it
    is installed (its name may change), else the generic hint."""
    try:
        dists = importlib.metadata.packages_distributions().get("tome_core") or []
    except Exception:  # noqa: BLE001 - a broken environment only loses the exact name
        dists = []
    return f"pip install '{dists[0]}[bench]'" if dists else "the package's [bench] extra"


def chart_missing() -> str | None:
    """None when the chart can be drawn, else one line saying why not and how to get it."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return (f"no chart: matplotlib is not installed (pip install matplotlib, or "
                f"{_bench_extra()}); the table, results.json and results.md are complete")
    return None
