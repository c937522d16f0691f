"""ToMe stacked with the step caches diffusers users run: vanilla, the cache alone, ToMe alone and both, per family.

A cache skips or approximates whole steps; ToMe makes each computed step cheaper. This runs a whole sampling loop
(``--steps`` Euler steps of flow matching, sigma 1 to 0, from seeded noise) on the bench's seeded DiTs (the real
architecture, ``--blocks`` blocks of each kind, ``--scale full``: the released width) and reports, per family and
setting: the steps whose last block ran (a cache serves the others), the share of block calls computed, the wall
time of the loop and its speed-up over vanilla with a band (rounds interleaved, rotated order, median of paired
ratios: ``tome_bench.stats.compare``), and the final latent's relative L2 error against vanilla's after the whole
loop. Caches (``--caches``): diffusers' FirstBlockCache (``fbc``), SeaCache (``sea``) and TaylorSeer lite
(``taylorseer_lite``), and
cache-dit's DBCache F1B0 (``dbcache``) and DBCache with its TaylorSeer calibrator (``dbcache_taylorseer``) where
cache-dit is installed. ToMe: the family's default mode and ratio (``--ratio`` sets another ratio), speed check off
(timed here). Each cache runs beside ToMe in the order the table's "order" column names (both orders give the
same latent: tests/adapters/test_step_caches.py).

Run (writes docs/results/<--out>.json and .md, and a chart .png where matplotlib is installed):
    python -m tome_bench.experiments.step_caches                                   # CPU, every family, fp32
    python -m tome_bench.experiments.step_caches --device cuda --dtype bf16 --blocks 8 --res 1024 \
        --families flux,wan --out step_caches_gpu                                    # a GPU
    python -m tome_bench.experiments.step_caches --tiny --rounds 1 --out ''       # the path only (tests)
    python -m tome_bench.experiments.step_caches --tables docs/results/step_caches_cpu.json  # its tables, its chart
    python -m tome_bench.experiments.step_caches --docs README.md docs/STEP_CACHES.md         # their summary tables
The CPU figures are a CPU's: a GPU user's speed-up is the GPU rows'.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import math
import os
import platform
import re
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import torch

import tome_core

os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "warning")  # read when cache_dit is first imported: its info lines
from tome_bench import dit_models, stats
from tome_bench.measure import rel_l2
from tome_bench.report import source_commit
from tome_core.adapters.hooks.api import defaults_of

from . import results_path

FAMILIES = ("flux", "qwen_image", "z_image", "wan", "ltx2", "sd3")
# where each family's prediction takes its step: (latent key, timestep key, timestep at sigma 1, rising)
_TIME = {"flux": ("hidden_states", "timestep", 1.0, False), "qwen_image": ("hidden_states", "timestep", 1.0, False),
         "wan": ("hidden_states", "timestep", 1000.0, False), "sd3": ("hidden_states", "timestep", 1000.0, False),
         "ltx2": ("hidden_states", "timestep", 1000.0, False), "z_image": ("x", "t", 1.0, True)}
# CPU defaults (--scale narrow): a whole loop in seconds on 2 cores, with a few thousand image tokens
CPU_SIZES = {"flux": (384, 384, 1), "qwen_image": (384, 384, 1), "z_image": (384, 384, 1), "sd3": (384, 384, 1),
             "wan": (256, 256, 9), "ltx2": (512, 512, 9)}
TEXT_TOKENS = 64  # --scale narrow: the prompt's tokens (the released text lengths would dominate a narrow model)


@dataclass(frozen=True)
class StepCache:
    """One cache users stack: how it is put on a transformer for a loop of ``steps`` and taken off again."""

    name: str
    label: str
    enable: Callable[[torch.nn.Module, int, Optional[float]], None]  # (model, steps, threshold)
    disable: Callable[[torch.nn.Module], None]
    needs: Optional[str] = None  # the package it comes from, where not diffusers
    thresholds: Tuple[float, ...] = ()  # tried in turn (``calibrate``); empty: the cache takes none
    supports: Callable[[torch.nn.Module], bool] = lambda model: True

    def refusal(self, model: torch.nn.Module) -> Optional[str]:
        """Why this cache cannot go on ``model`` (where its library offers it no way), or None."""
        if self.needs is not None and importlib.util.find_spec(self.needs) is None:
            return f"{self.needs} is not installed"
        return None if self.supports(model) else f"{type(model).__name__} has no enable_cache (diffusers' CacheMixin)"


def _diffusers_cache(config: Callable[[int, Optional[float]], object]) -> Tuple[Callable, Callable]:
    def enable(model: torch.nn.Module, steps: int, threshold: Optional[float]) -> None:
        model.enable_cache(config(steps, threshold))

    return enable, lambda model: model.disable_cache()


def _fbc(steps: int, threshold: Optional[float]):
    import diffusers
    return diffusers.FirstBlockCacheConfig(threshold=threshold)


def _sea(steps: int, threshold: Optional[float]):
    import diffusers
    return diffusers.SeaCacheConfig(threshold=threshold)


def _taylorseer_lite(steps: int, threshold: Optional[float]):
    import diffusers
    return diffusers.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=2, use_lite_mode=True,
                                           taylor_factors_dtype=torch.float32)


def _cache_dit(taylorseer: bool) -> Tuple[Callable, Callable]:
    def enable(model: torch.nn.Module, steps: int, threshold: Optional[float]) -> None:
        import cache_dit
        from cache_dit import DBCacheConfig
        extra = {}
        if taylorseer:
            from cache_dit import TaylorSeerCalibratorConfig
            extra["calibrator_config"] = TaylorSeerCalibratorConfig(taylorseer_order=1)
        # one call per step with the CFG pair batched (as diffusers' pipelines and the bench call the model): cache-dit
        # defaults to separate CFG calls on Wan and Qwen-Image, which this turns off
        cache_dit.enable_cache(model, cache_config=DBCacheConfig(
            Fn_compute_blocks=1, Bn_compute_blocks=0, residual_diff_threshold=threshold,
            max_warmup_steps=4 if taylorseer else 2,  # TaylorSeer extrapolates only from a computed step 3 or later
            num_inference_steps=steps, enable_separate_cfg=False), **extra)

    def disable(model: torch.nn.Module) -> None:
        import cache_dit
        cache_dit.disable_cache(model)
        # cache-dit 1.5.3 leaves its rewritten forward (Flux's functor) on the transformer after disable_cache: the
        # model's own is put back, so the next setting runs the model as the user would load it
        if model.__dict__.pop("_is_patched", None) is not None:
            model.__dict__.pop("forward", None)

    return enable, disable


# A residual threshold means nothing across seeded random weights (their residuals change more between steps than a
# trained model's), so each threshold cache is calibrated per model: the first of these at which the cache alone
# computes at most COMPUTED_SHARE of the steps, then the same threshold beside ToMe.
THRESHOLDS = (0.1, 0.2, 0.35, 0.5, 0.8, 1.2)
COMPUTED_SHARE = 0.625
CACHES: Dict[str, StepCache] = {
    "fbc": StepCache("fbc", "FirstBlockCache (diffusers)", *_diffusers_cache(_fbc), thresholds=THRESHOLDS,
                     supports=lambda model: hasattr(model, "enable_cache")),
    "sea": StepCache("sea", "SeaCache (diffusers)", *_diffusers_cache(_sea), thresholds=THRESHOLDS,
                     supports=lambda model: hasattr(model, "enable_cache")),
    "taylorseer_lite": StepCache("taylorseer_lite", "TaylorSeer lite (diffusers, interval 2)",
                                 *_diffusers_cache(_taylorseer_lite), supports=lambda model: hasattr(model, "enable_cache")),
    "dbcache": StepCache("dbcache", "cache-dit DBCache F1B0", *_cache_dit(False), needs="cache_dit",
                         thresholds=THRESHOLDS),
    "dbcache_taylorseer": StepCache("dbcache_taylorseer", "cache-dit DBCache F1B0 + TaylorSeer (warm-up 4)",
                                    *_cache_dit(True), needs="cache_dit", thresholds=THRESHOLDS),
}


class BlockCounter:
    """Counts, per model call, the blocks that computed: a pre-hook on each block's first child with parameters,
    which runs only where the block itself runs (a cache that serves a block returns before reaching it)."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.blocks = _blocks(model)
        self.calls: List[int] = []  # per block, its computed calls
        self.handles = []
        for index, block in enumerate(self.blocks):
            self.calls.append(0)
            inner = next(m for m in block.children() if any(True for _ in m.parameters()))
            self.handles.append(inner.register_forward_pre_hook(self._counter(index)))

    def _counter(self, index: int):
        def hook(module, args):
            self.calls[index] += 1
        return hook

    def reset(self) -> None:
        self.calls = [0] * len(self.blocks)

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()


def _blocks(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The transformer's repeated blocks, in run order (every ModuleList of blocks at the top level)."""
    found = []
    for name, child in model.named_children():
        if isinstance(child, torch.nn.ModuleList) and name in _BLOCK_LISTS:
            found.extend(child)
    return found


_BLOCK_LISTS = ("transformer_blocks", "single_transformer_blocks", "blocks", "layers")  # the lists caches hook


NARROW_HEADS = 4
# the released width's keys to narrow: heads (and what is as wide as the heads) to NARROW_HEADS of them
_WIDTH_KEYS = {"num_attention_heads": "heads", "n_heads": "heads", "n_kv_heads": "heads",
               "audio_num_attention_heads": "heads", "dim": "width", "ffn_dim": "scaled",
               "caption_projection_dim": "scaled", "cross_attention_dim": "width", "audio_cross_attention_dim": "width"}


def build_model(family: str, blocks: int, scale: str, dtype: torch.dtype) -> torch.nn.Module:
    """The bench's DiT (``dit_models.build_dit``); ``scale`` "narrow": the released architecture with NARROW_HEADS
    heads of the released head width (and its feed-forward in proportion), so a whole sampling loop fits a CPU while
    each token keeps the released per-head attention and the image tokens dominate the work."""
    if scale != "narrow":
        return dit_models.build_dit(family, blocks, dtype=dtype, scale=scale)
    import diffusers
    cls_name, cfg = dit_models.dit_config(family, blocks, "full")
    heads = cfg.get("num_attention_heads", cfg.get("n_heads"))
    share = NARROW_HEADS / heads
    narrowed = dict(cfg)
    for key, how in _WIDTH_KEYS.items():
        if key in cfg:
            narrowed[key] = NARROW_HEADS if how == "heads" else (
                round(cfg[key] * share / 16) * 16 if how == "scaled" else cfg[key] * NARROW_HEADS // heads)
    if "n_refiner_layers" in cfg:  # Z-Image: its noise and caption refiners, as released (cache-dit expects them)
        narrowed["n_refiner_layers"] = max(1, cfg["n_refiner_layers"])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = getattr(diffusers, cls_name)(**narrowed)
    dit_models.seed_parameters(model, torch.Generator().manual_seed(1))
    if dtype != torch.float32:
        model = torch.nn.Module.to(model, dtype)
    return model.eval().requires_grad_(False)


def sampling_loop(model: torch.nn.Module, family: str, inputs: dict, steps: int) -> torch.Tensor:
    """``steps`` Euler steps of flow matching from ``inputs``' latent (sigma 1 to 0); the final latent."""
    latent_key, time_key, scale, rising = _TIME[family]
    x = inputs[latent_key]
    x = torch.stack(x) if isinstance(x, list) else x.clone()
    sigmas = torch.linspace(1.0, 0.0, steps + 1).tolist()
    template = inputs[time_key]
    for index, (sigma, following) in enumerate(zip(sigmas[:-1], sigmas[1:])):
        call = dict(inputs)
        call[latent_key] = list(x.unbind(0)) if latent_key == "x" else x
        call[time_key] = torch.full_like(template, (1.0 - sigma if rising else sigma) * scale)
        # where the loop is, as diffusers' pipelines tell their caches (SeaCache needs it)
        context = model.cache_context("cond", step_index=index, sigma=sigma, num_inference_steps=steps) \
            if hasattr(model, "_diffusers_hook") else contextlib.nullcontext()
        with context:
            velocity = dit_models.forward(model, call).to(x.dtype)
        step = following - sigma
        x = x - step * velocity if rising else x + step * velocity  # Z-Image predicts noise -> data
    return x.float()


def tome_settings(model: torch.nn.Module, ratio: Optional[float]) -> dict:
    """The family's default mode and ratio (``ratio`` overrides the ratio), speed check off (timed here)."""
    defaults = defaults_of(model)
    mode = defaults.mode
    return dict(mode=mode, ratio=defaults.ratio(mode) if ratio is None else ratio, speed_check="off")


def calibrate(model: torch.nn.Module, family: str, inputs: dict, steps: int, cache: StepCache,
              counter: BlockCounter) -> Optional[float]:
    """The first of the cache's thresholds at which it alone computes at most ``COMPUTED_SHARE`` of the steps (the
    largest where none does); None for a cache without one."""
    for threshold in cache.thresholds:
        cache.enable(model, steps, threshold)
        counter.reset()
        try:
            sampling_loop(model, family, inputs, steps)
        finally:
            cache.disable(model)
        if counter.calls[-1] <= math.ceil(steps * COMPUTED_SHARE):
            return threshold
    if cache.thresholds and counter.calls[-1] >= steps:
        raise NoSkip(f"computes every step by itself, even at threshold {cache.thresholds[-1]:g}")
    return cache.thresholds[-1] if cache.thresholds else None


class NoSkip(Exception):
    """A cache that skips nothing alone on this model (SeaCache on packed latents runs "fail-open")."""


def calibrated(model: torch.nn.Module, family: str, inputs: dict, steps: int, caches: List[str],
               counter: BlockCounter) -> Tuple[Dict[str, Optional[float]], Dict[str, str]]:
    """Each cache's threshold on this model (``calibrate``), and why each cache that cannot run here does not."""
    skipped = {name: why for name in caches if (why := CACHES[name].refusal(model)) is not None}
    thresholds = {}
    for name in caches:
        if name in skipped:
            continue
        try:
            thresholds[name] = calibrate(model, family, inputs, steps, CACHES[name], counter)
        except NoSkip as why:
            skipped[name] = str(why)
        except Exception as error:  # the cache alone fails on this class: said in the table, as the user would see
            skipped[name] = f"fails by itself on {type(model).__name__}: {type(error).__name__}: {error}"
    return thresholds, skipped


def setting(model: torch.nn.Module, name: str, steps: int, tome: dict, thresholds: Dict[str, Optional[float]],
            order: str) -> Tuple[Callable[[], None], Callable[[], None]]:
    """(put, take) of one setting: "vanilla", "tome", a cache's name, or "<cache>+tome" in ``order``."""
    cache = CACHES.get(name.split("+")[0]) if name not in ("vanilla", "tome") else None
    with_tome = name == "tome" or name.endswith("+tome")

    def put() -> None:
        if order == "tome_first" and with_tome:
            tome_core.apply_patch(model, **tome)
        if cache is not None:
            cache.enable(model, steps, thresholds[cache.name])
        if order != "tome_first" and with_tome:
            tome_core.apply_patch(model, **tome)

    def take() -> None:
        if with_tome:
            tome_core.remove_patch(model)
        if cache is not None:
            cache.disable(model)
    return put, take


def timed_loop(model: torch.nn.Module, family: str, inputs: dict, steps: int,
               device: torch.device) -> Tuple[torch.Tensor, float]:
    """The final latent of one loop and its wall time (synchronised on CUDA)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    latent = sampling_loop(model, family, inputs, steps)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return latent, time.perf_counter() - start


def run_family(family: str, caches: List[str], steps: int, rounds: int, blocks: int, size: Tuple[int, int, int],
               scale: str, dtype: torch.dtype, device: torch.device, ratio: Optional[float],
               order: str = "cache_first") -> dict:
    """Every setting of ``family`` with ``caches``: a warm-up round (latents, steps computed), then ``rounds`` timed
    rounds, interleaved in rotated order; one row per setting."""
    width, height, frames = size
    model = build_model(family, blocks, scale, dtype).to(device)
    batch = dit_models.DEFAULT_BATCH.get(family, 2)
    text = TEXT_TOKENS if scale == "narrow" else None
    inputs = dit_models.to_device(dit_models.make_dit_inputs(model, family, batch, height, width, frames,
                                                             dtype=dtype, text_tokens=text), device)
    tome = tome_settings(model, ratio)
    counter = BlockCounter(model)
    thresholds, skipped = calibrated(model, family, inputs, steps, caches, counter)
    names = ["vanilla", "tome"] + [n for c in caches if c not in skipped for n in (c, f"{c}+tome")]
    times: Dict[str, List[float]] = {n: [] for n in names}
    latents: Dict[str, torch.Tensor] = {}
    computed: Dict[str, Tuple[int, float]] = {}
    for index in range(rounds + 1):  # round 0: warm-up, latents and counts; then timed rounds, rotated order
        for name in names[index % len(names):] + names[:index % len(names)] if index else names:
            put, take = setting(model, name, steps, tome, thresholds, order)
            put()
            counter.reset()
            try:
                latent, elapsed = timed_loop(model, family, inputs, steps, device)
            finally:
                take()
            if index == 0:
                latents[name], calls = latent, counter.calls
                computed[name] = (calls[-1], sum(calls) / (len(calls) * steps))
            else:
                times[name].append(elapsed)
    counter.remove()
    speedups = stats.summarize(times) if rounds else {}
    rows = [row_of(name, thresholds, computed[name], times[name], speedups.get(name), latents) for name in names]
    return dict(family=family, model=type(model).__name__, blocks=blocks, scale=scale, size=list(size),
                batch=batch, steps=steps, rounds=rounds, tome=tome, order=order, rows=rows,
                not_run={CACHES[name].label: why for name, why in skipped.items()})


def row_of(name: str, thresholds: Dict[str, Optional[float]], computed: Tuple[int, float], times: List[float],
           found: Optional[stats.Ratio], latents: Dict[str, torch.Tensor]) -> dict:
    """One setting's row of the results JSON."""
    return dict(
        setting=name, cache=name.split("+")[0] if name not in ("vanilla", "tome") else None,
        threshold=thresholds.get(name.split("+")[0]),
        tome=name == "tome" or name.endswith("+tome"), steps_computed=computed[0],
        block_share=round(computed[1], 3),
        wall_s=round(statistics.median(times), 4) if times else None,
        speedup=None if found is None else round(found.median, 3),
        band=None if found is None else [round(found.low, 3), round(found.high, 3)],
        error=round(rel_l2(latents[name], latents["vanilla"]), 4),
        finite=bool(torch.isfinite(latents[name]).all()))


def label_of(name: str) -> str:
    if name == "vanilla":
        return "vanilla"
    if name == "tome":
        return "ToMe"
    cache, _, tome = name.partition("+")
    return CACHES[cache].label + (" + ToMe" if tome else "")


def table(results: List[dict]) -> str:
    """One markdown table: family, setting, steps computed, block share, wall, speed-up (band), final error."""
    lines = ["| family (ToMe setting) | setting | steps computed | blocks computed | wall s | speed-up (band) | "
             "final-latent error |", "| --- | --- | ---: | ---: | ---: | --- | ---: |"]
    for found in results:
        tome = found["tome"]
        head = f"{found['family']} ({tome['mode']} {tome['ratio']:g}; {found.get('library', 'diffusers')})"
        for row in found["rows"]:
            setting = label_of(row["setting"])
            if row.get("threshold") is not None:
                setting = setting.replace(" + ToMe", "") + f" ({row['threshold']:g})" + \
                    (" + ToMe" if row["tome"] else "")
            band = "" if row["band"] is None else f" ({row['band'][0]:.2f}-{row['band'][1]:.2f})"
            speed = "" if row["speedup"] is None else f"{row['speedup']:.2f}x{band}"
            wall = "" if row["wall_s"] is None else f"{row['wall_s']:.3f}"
            lines.append(f"| {head} | {setting} | {row['steps_computed']}/{found['steps']} | "
                         f"{row['block_share']:.0%} | {wall} | {speed} | {row['error']:.4f} |")
        for label, why in found.get("not_run", {}).items():
            lines.append(f"| {head} | {label} | not run: {why} | | | | |")
    return "\n".join(lines)


# a table in README or docs between these markers is the summary of the JSON it names (tests/test_docs.py)
# (``step caches full``: every row, ``table``)
BLOCK = re.compile(r"(<!-- step caches( full)?: ([^>]*?) -->\n)(.*?)(<!-- /step caches -->)", re.S)


def summary_table(result: dict) -> str:
    """Per family, the fastest measured pair of a cache with ToMe, beside the cache alone and ToMe alone: speed-up
    (band), steps computed, final-latent error. Read from a results JSON of this experiment."""
    lines = ["| family | best pair (ToMe setting; library) | speed-up, both | the cache alone | ToMe alone |",
             "| --- | --- | --- | --- | --- |"]

    def cell(row: dict, steps: int) -> str:
        low, high = row["band"]
        return (f"{row['speedup']:.2f}x ({low:.2f}-{high:.2f}), {row['steps_computed']}/{steps} steps, "
                f"err {row['error']:.3f}")
    best: Dict[str, Tuple[dict, dict, dict, dict]] = {}
    for found in result["results"]:
        rows = {row["setting"]: row for row in found["rows"]}
        for name, row in rows.items():
            if not name.endswith("+tome") or row["speedup"] is None:
                continue
            known = best.get(found["family"])
            if known is None or row["speedup"] > known[1]["speedup"]:
                best[found["family"]] = (found, row, rows[name.split("+")[0]], rows["tome"])
    for family, (found, row, alone, tome_alone) in best.items():
        tome, steps = found["tome"], found["steps"]
        threshold = "" if row.get("threshold") is None else f" {row['threshold']:g}"
        lines.append(f"| {family} | {label_of(row['setting']).replace(' + ToMe', '')}{threshold} + ToMe "
                     f"({tome['mode']} {tome['ratio']:g}; {found.get('library', 'diffusers')}) | {cell(row, steps)} | "
                     f"{cell(alone, steps)} | {cell(tome_alone, steps)} |")
    return "\n".join(lines) + "\n"


def rewrite_docs(text: str, root: Path = Path(".")) -> str:
    """``text`` with each marked block written again from the JSON its marker names."""
    def block(match: "re.Match[str]") -> str:
        result = json.loads((root / match.group(3).strip()).read_text(encoding="utf-8"))
        body = table(result["results"]) + "\n" if match.group(2) else summary_table(result)
        return match.group(1) + body + match.group(5)
    return BLOCK.sub(block, text)


def chart(results: List[dict], path) -> Optional[object]:
    """Speed-up against final-latent error, one panel per family: where a person would rather look than read."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    timed = [r for r in results if any(row["speedup"] is not None for row in r["rows"])]
    if not timed:
        return None
    columns = min(len(timed), 5)
    rows = math.ceil(len(timed) / columns)
    fig, axes = plt.subplots(rows, columns, figsize=(4.2 * columns, 3.8 * rows), squeeze=False)
    styles = {"vanilla": ("k", "o"), "tome": ("tab:blue", "s")}
    for ax in axes.flat[len(timed):]:
        ax.set_visible(False)
    for ax, found in zip(axes.flat, timed):
        for row in found["rows"]:
            name = row["setting"]
            color, marker = styles.get(name, ("tab:orange" if not row["tome"] else "tab:green",
                                              "^" if not row["tome"] else "D"))
            low, high = row["band"]
            ax.errorbar(row["error"], row["speedup"], yerr=[[row["speedup"] - low], [high - row["speedup"]]],
                        fmt=marker, color=color, capsize=3)
            ax.annotate(label_of(name).replace(" (", "\n("), (row["error"], row["speedup"]), fontsize=6,
                        xytext=(4, 2), textcoords="offset points")
        tome = found["tome"]
        ax.set_title(f"{found['family']} ({found.get('library', 'diffusers')}): ToMe {tome['mode']} "
                     f"{tome['ratio']:g}, {found['steps']} steps", fontsize=9)
        ax.set_xlabel("final-latent error vs vanilla (rel. L2)", fontsize=8)
        ax.set_ylabel("speed-up over vanilla (band)", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.5)
        ax.grid(alpha=0.3)
    fig.suptitle("ToMe with step caches: whole sampling loops (green: both; orange: the cache alone; blue: ToMe "
                 "alone)", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--caches", default=",".join(CACHES), help=f"of {', '.join(CACHES)} (cache-dit's where "
                        "installed)")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=3, help="timed rounds after the warm-up round")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of each kind, as the bench's --blocks (a cache's "
                        "probe block runs whole beside ToMe: its share of the work is 1/blocks here, 1/30-1/60 released)")
    parser.add_argument("--res", default=None, help="WxH for every family (default: CPU_SIZES)")
    parser.add_argument("--frames", type=int, default=None, help="video frames (Wan 4k+1, LTX-2 8k+1)")
    parser.add_argument("--ratio", type=float, default=None, help="ToMe's ratio (default: the family's)")
    parser.add_argument("--order", choices=("cache_first", "tome_first"), default="cache_first")
    parser.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default="fp32")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--threads", type=int, default=1, help="CPU threads (1: on a shared machine, OpenMP threads "
                        "waiting on each other make a loop many times slower, and the bands say nothing)")
    parser.add_argument("--scale", choices=("narrow", "full"), default="narrow",
                        help=f"narrow (CPU): the released architecture with {NARROW_HEADS} heads; full: released width")
    parser.add_argument("--tiny", action="store_true", help="the tests' tiny models (a check that it runs)")
    parser.add_argument("--out", default="step_caches_cpu", help="name in docs/results ('': write nothing)")
    parser.add_argument("--docs", nargs="+", metavar="FILE", default=None,
                        help="write the marked summary tables of each FILE again from the JSON each marker names")
    parser.add_argument("--tables", default=None, metavar="JSON", help="print a results JSON's tables, draw its chart "
                        "again beside it (.png) and stop")
    args = parser.parse_args(argv)
    if args.tables:
        result = json.loads(Path(args.tables).read_text(encoding="utf-8"))
        print(table(result["results"]) + "\n\n" + summary_table(result))
        chart(result["results"], Path(args.tables).with_suffix(".png"))
        return result
    if args.docs:
        for name in args.docs:
            path = Path(name)
            path.write_text(rewrite_docs(path.read_text(encoding="utf-8")), encoding="utf-8")
            print(f"rewrote {path}")
        return {}
    if args.device == "cpu":
        torch.set_num_threads(args.threads)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype]
    device = torch.device(args.device)
    caches = args.caches.split(",")
    results = []
    for family in args.families.split(","):
        width, height, frames = CPU_SIZES[family]
        if args.res:
            w, _, h = args.res.partition("x")
            width, height = int(w), int(h or w)
        if args.tiny:
            width, height = 64, 64
        frames = args.frames or frames
        # one fresh model per library: cache-dit 1.5.3 leaves its changes on a transformer after disable_cache, so
        # its caches run on their own model, with their own vanilla and ToMe rows interleaved beside them
        for library in dict.fromkeys(CACHES[name].needs or "diffusers" for name in caches):
            group = [name for name in caches if (CACHES[name].needs or "diffusers") == library]
            found = run_family(family, group, args.steps, args.rounds, args.blocks, (width, height, frames),
                               "tiny" if args.tiny else args.scale, dtype, device, args.ratio, args.order)
            found["library"] = library.replace("_", "-")
            results.append(found)
            print(table([found]), flush=True)
    out = {"device": str(device) if device.type != "cuda" else torch.cuda.get_device_name(device),
           "commit": source_commit(), "experiment": "step_caches",
           "command": "python -m tome_bench.experiments.step_caches " + " ".join(argv or []),
           "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "threads": torch.get_num_threads(), "caches": {n: CACHES[n].label for n in caches},
           "not_run": {r["family"]: r["not_run"] for r in results if r["not_run"]},
           "note": "steps computed: steps whose last block ran; blocks computed: share of block calls run; speed-up: "
                   "whole loops, rounds interleaved in rotated order, median of paired ratios with a ~95 % band; "
                   "error: final latent after the whole loop vs vanilla's (relative L2). CPU figures are a CPU's.",
           "results": results}
    if args.out:
        path = results_path(args.out + ".json")
        path.write_text(json.dumps(out, indent=2) + "\n")
        path.with_suffix(".md").write_text(table(results) + "\n")
        drawn = chart(results, path.with_suffix(".png"))
        print(f"wrote {path}" + (f" and {drawn}" if drawn else ""))
    return out


if __name__ == "__main__":
    main()
