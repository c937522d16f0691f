"""Run the comparison: for each model family and resolution, every variant, interleaved."""
from __future__ import annotations

import contextlib
import gc
import statistics
from dataclasses import asdict, dataclass, field
from typing import Callable

import torch

from . import measure
from .methods import DEFAULT_METHODS, METHODS, Variant, availability, patched
from .models import FAMILIES, build_unet, make_inputs, peaked_attention

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
# "math": PyTorch's reference SDPA kernel, which materialises the N x N score matrix as attention
# does without flash/memory-efficient kernels (such hosts, the published ToMe memory figures)
ATTENTION_BACKENDS = ("default", "math")


def attention_backend(name: str) -> contextlib.AbstractContextManager:
    """The SDPA backend every attention of the run uses: torch's choice, or the math kernel only."""
    if name == "default":
        return contextlib.nullcontext()
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([SDPBackend.MATH])


@dataclass
class BenchConfig:
    """What to run. Resolutions are (width, height) in pixels; latents are px // 8."""

    families: tuple[str, ...] = ("sd15",)
    resolutions: tuple[tuple[int, int], ...] = ((512, 512), (768, 768))
    ratios: tuple[float, ...] = (0.5,)
    methods: tuple[str, ...] = DEFAULT_METHODS
    batch: int = 2
    dtype: str = "bf16"
    repeats: int = 3
    peaked: float = 3.0
    guidance: float = 7.5
    scale: str = "full"
    seed: int = 0
    max_downsample: int = 1
    use_rand: bool = True
    device: str = "cpu"
    attention: str = "default"
    skipped: dict = field(default_factory=dict)  # method -> reason, filled by ``resolve``

    def __post_init__(self) -> None:
        method_names = tuple(m.split(":")[0].split("@")[0] for m in self.methods)
        for name, given, allowed in (("families", self.families, FAMILIES),
                                     ("methods", method_names, METHODS)):
            bad = [x for x in given if x not in allowed]
            if bad or not given:
                raise ValueError(f"{name}: unknown or empty {bad or given}; "
                                 f"choose from {', '.join(allowed)}")
        if self.repeats < 1 or self.batch < 1:
            raise ValueError(f"repeats and batch must be >= 1, got {self.repeats} and {self.batch}")
        if not self.ratios or not all(0 <= r < 1 for r in self.ratios):
            raise ValueError(f"ratios must be in [0, 1), got {self.ratios}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")

    def resolve(self) -> list[Variant]:
        """The variants to run (vanilla first); records unavailable methods in ``skipped``."""
        variants = [Variant("vanilla")]
        for entry in self.methods:  # "kv", "kv@0.75" (that ratio only), "kv@0.88:3x3" (and sx=3, sy=3)
            method = entry.split(":")[0].split("@")[0]
            if method == "vanilla":
                continue
            reason = availability(method)
            if reason:
                self.skipped[method] = reason
                continue
            variants += [v for v in Variant.parse(entry, self.ratios) if v not in variants]
        return variants

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "skipped"}

    def patch_options(self) -> dict:
        return dict(max_downsample=self.max_downsample, use_rand=self.use_rand, seed=self.seed)


Progress = Callable[[str], None]


def _round_robin(variants: list[Variant], repeat: int) -> list[Variant]:
    # rotate the order each repeat so no variant always runs right after the same neighbour
    k = repeat % len(variants)
    return variants[k:] + variants[:k]


def case_inputs(unet, family: str, size: tuple[int, int], cfg: BenchConfig) -> measure.Inputs:
    width, height = size
    inputs = make_inputs(unet, family, cfg.batch, height, width, cfg.seed, DTYPES[cfg.dtype])
    return measure.Inputs(*inputs).to(torch.device(cfg.device))


@dataclass
class _Measured:
    """Raw measurements of one case, per variant."""

    mem: dict = field(default_factory=dict)         # peak bytes of one forward
    out_peaked: dict = field(default_factory=dict)  # output of the peaked UNet
    times: dict = field(default_factory=dict)       # seconds per timed round
    out: dict = field(default_factory=dict)         # output of the first timed round
    drift: float = 0.0                              # vanilla before vs after all patches


def _measure(unet, inputs: measure.Inputs, variants: list[Variant], cfg: BenchConfig,
             progress: Progress) -> _Measured:
    device, options, m = torch.device(cfg.device), cfg.patch_options(), _Measured()

    def run(v: Variant, how):
        with patched(unet, v, **options):
            result = how(lambda: measure.forward(unet, inputs), device)
        progress(v.label)
        return result

    with peaked_attention(unet, cfg.peaked):
        for v in variants:
            m.mem[v], m.out_peaked[v] = run(v, measure.peak_memory)
        # vanilla again after every patch was applied and removed: must be unchanged
        _, again = run(variants[0], measure.timed)
    m.drift = measure.rel_l2(again, m.out_peaked[variants[0]])
    for rep in range(cfg.repeats):
        for v in _round_robin(variants, rep):
            t, y = run(v, measure.timed)
            m.times.setdefault(v, []).append(t)
            m.out.setdefault(v, y)
    return m


def _row(family: str, size: tuple[int, int], v: Variant, base: Variant, m: _Measured,
         cfg: BenchConfig) -> dict:
    width, height = size
    row = dict(family=family, scale=cfg.scale, width=width, height=height,
               latent=f"{height // 8}x{width // 8}", batch=cfg.batch, dtype=cfg.dtype,
               method=v.method, ratio=v.ratio, label=v.label,
               time_s=statistics.median(m.times[v]), times_s=m.times[v],
               # paired within each interleaved round, so drifting machine load cancels out
               speedup=statistics.median(tb / tv for tb, tv in zip(m.times[base], m.times[v])),
               # other load only ever adds time, so the fastest runs are the least disturbed
               speedup_best=min(m.times[base]) / min(m.times[v]))
    row["rel_err"], row["cfg_err"] = measure.errors(m.out[v], m.out[base], cfg.guidance)
    if cfg.peaked != 1.0:
        row["peaked"] = cfg.peaked
        row["rel_err_peaked"], row["cfg_err_peaked"] = measure.errors(
            m.out_peaked[v], m.out_peaked[base], cfg.guidance)
    if v == base:
        row["vanilla_drift"] = m.drift
    row["peak_mem_mb"] = m.mem[v] / 2**20
    row["mem_vs_vanilla"] = m.mem[v] / m.mem[base] if m.mem[base] else None
    return row


def run_case(unet, family: str, size: tuple[int, int], variants: list[Variant],
             cfg: BenchConfig, progress: Progress) -> list[dict]:
    """All variants at one resolution (``variants[0]`` is vanilla): one row each.

    A warm-up round runs on the peaked UNet (when ``cfg.peaked != 1``) and measures peak
    memory and the peaked-attention errors, then runs vanilla once more to check that removing
    the patches restored the model; ``cfg.repeats`` timed rounds follow on the plain UNet,
    each over all variants in a rotated order, and the first gives the plain errors.
    """
    m = _measure(unet, case_inputs(unet, family, size, cfg), variants, cfg, progress)
    return [_row(family, size, v, variants[0], m, cfg) for v in variants]


def profile_case(unet, family: str, size: tuple[int, int], variants: list[Variant],
                 cfg: BenchConfig) -> dict:
    """Where the time goes for vanilla and every variant at the first ratio (see profiling)."""
    from . import profiling

    inputs = case_inputs(unet, family, size, cfg)
    chosen = [v for v in variants if v.method == "vanilla" or v.ratio == cfg.ratios[0]]
    return {"family": family, "width": size[0], "height": size[1], "batch": cfg.batch,
            "dtype": cfg.dtype, "groups": profiling.GROUPS,
            "variants": [profiling.profile_variant(unet, inputs, v, cfg.patch_options())
                         for v in chosen]}


def run_benchmark(cfg: BenchConfig, progress_bar: bool = True, profile: bool = False,
                  on_rows: Callable[[list[dict]], None] | None = None) -> dict:
    """Run everything in ``cfg``; returns ``{"config", "rows", "skipped"}`` (and ``"profile"``
    of the first family and size when ``profile``). ``on_rows(rows_so_far)`` is called after
    each family/size, so a long run that is stopped early still leaves its results."""
    from tqdm.auto import tqdm

    variants = cfg.resolve()
    n_forwards = len(cfg.families) * len(cfg.resolutions) * (len(variants) * (1 + cfg.repeats) + 1)
    bar = tqdm(total=n_forwards, unit="fwd", disable=not progress_bar, dynamic_ncols=True)
    rows, prof = [], None
    try:
        with attention_backend(cfg.attention):
            for family in cfg.families:
                bar.set_description(f"{family}: building UNet")
                unet = build_unet(family, cfg.scale, cfg.seed, DTYPES[cfg.dtype]).to(cfg.device)
                for size in cfg.resolutions:
                    def progress(label: str, _s=size) -> None:
                        bar.set_description(f"{family} {_s[0]}x{_s[1]} {label}")
                        bar.update(1)
                    rows += run_case(unet, family, size, variants, cfg, progress)
                    if on_rows:
                        on_rows(rows)
                    if profile and prof is None:
                        bar.set_description(f"{family} {size[0]}x{size[1]} profiling")
                        prof = profile_case(unet, family, size, variants, cfg)
                del unet
                gc.collect()
    finally:
        bar.close()
    result = {"config": cfg.as_dict(), "rows": rows, "skipped": dict(cfg.skipped)}
    if prof is not None:
        result["profile"] = prof
    return result
