"""Run the comparison: for each model family and resolution, every variant, interleaved.

Every kind of model goes through the same rounds, statistics and rows; a kind (``KINDS``: UNets in
``unet_family``, DiTs in ``dit_runner``) brings its family names, defaults, model, inputs and row
fields as a ``family.BenchFamily``. Adding a kind is adding it to ``KINDS``."""
from __future__ import annotations

import contextlib
import gc
import statistics
import sys
import time
import warnings
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from . import content, measure, op_count, stats, trace_summary
from .comfy_host import COMFY
from .compile_counts import CompileCounts, reset as reset_compiled
from .dit_runner import DIT
from .family import BenchFamily, Case
from .measure import DTYPES
from .methods import METHODS, Variant, availability, patched
from .models import peaked_attention
from .unet_family import UNET

KINDS: tuple[BenchFamily, ...] = (UNET, DIT)  # every kind of model the benchmark runs
ALL_FAMILIES = tuple(name for kind in KINDS for name in kind.names)
# --host: diffusers (the kinds above, by family) or ComfyUI (its own classes and the ToMe node: comfy_host)
HOSTS: dict[str, BenchFamily | None] = {"diffusers": None, "comfyui": COMFY}


def kind_of(family: str) -> BenchFamily:
    """The kind of model that runs ``family`` (ValueError naming the choices if none)."""
    for kind in KINDS:
        if family in kind.names:
            return kind
    raise ValueError(f"families: unknown {family!r}; choose from {', '.join(ALL_FAMILIES)}")
# "math": PyTorch's reference SDPA kernel, which materialises the N x N score matrix as attention
# does without flash/memory-efficient kernels (such hosts, the published ToMe memory figures)
ATTENTION_BACKENDS = ("default", "math")
# torch.compile modes the compiled rows take: inductor alone, and inductor with CUDA graphs (reduce-overhead: a
# captured graph replays each compiled region's kernels with one launch; on the CPU it is inductor alone); "regional":
# diffusers' regional recipe, the DiT's repeated blocks compiled one class at a time with fullgraph=True (inductor)
COMPILE_MODES = ("default", "reduce-overhead", "regional")
# what runs a compiled row's forward, per compile mode (the ComfyUI host's: TorchCompileModel's backends)
COMPILED_KERNELS = {"default": "inductor", "reduce-overhead": "inductor + CUDA graphs", "inductor": "inductor",
                    "regional": "inductor, regional (compile_repeated_blocks, fullgraph)",
                    "cudagraphs": "CUDA graphs of the eager kernels"}


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
    # None: the kind's default sizes (UNets 512 and 768 px; DiTs their native size)
    resolutions: tuple[tuple[int, int], ...] | None = None
    ratios: tuple[float, ...] = (0.5,)
    methods: tuple[str, ...] | None = None  # None: the kind's (UNets: DEFAULT_METHODS; DiTs: vanilla, kv)
    batch: int | None = None    # None: the kind's, 2 = [uncond; cond] (Flux, guidance-distilled: 1)
    dtype: str = "bf16"
    repeats: int = 3            # timed rounds at least
    max_repeats: int | None = None  # at most, while rounds disagree (None: = repeats)
    compile: bool = False       # also torch.compile every variant (compiled rows)
    # torch.compile modes of the compiled rows: "default" (inductor), "reduce-overhead" (inductor + CUDA graphs)
    compile_modes: tuple[str, ...] = ("default",)
    budget_s: float | None = None  # no extra rounds beyond this many seconds of the whole run
    peaked: float = 3.0
    guidance: float = 7.5
    scale: str = "full"
    seed: int = 0
    max_downsample: int = 1
    use_rand: bool = True
    device: str = "cpu"
    attention: str = "default"
    blocks: int = 2             # DiTs: blocks of each kind (full depth does not fit a CPU)
    depth: str = "blocks"       # DiTs: "blocks" (``blocks`` of each kind) or "released" (the released models, on a GPU)
    frames: int = 33            # Wan: video frames (4k + 1)
    ops: bool = False           # also count ATen ops and bytes moved per forward (op_count)
    # latents: "noise" (seeded), "photo" (a photograph at the bench's step, see ``content``), or "both":
    # timed on noise, errors also on the photo (the warm-up round runs each variant on it as well)
    content: str = "noise"
    photo: str = "astronaut"    # --content photo/both: which of content.PHOTOS
    # every case's rows carry a profiled trace's summary (trace_summary), their GPU time from it: --profile, and
    # always on CUDA
    trace: bool = False
    trace_dir: str | None = None  # where the traces are kept, gzipped (None: summaries only)
    skipped: dict = field(default_factory=dict)  # method -> reason, filled by ``resolve``
    host: str = "diffusers"     # whose models and patch path: "diffusers" (UNet and DiT kinds) or "comfyui" (HOSTS)
    # errors only: the warm-up round alone (peaked errors on noise, and on the photo with --content both), no timed
    # rounds and no vanilla re-run; the rows' times are the warm-up's (one profiled forward each, ``timing``
    # "warm-up"): a deep model's errors at a third of the forwards (tome_bench.experiments.frontier --errors-only)
    errors_only: bool = False
    # also count each variant's floating-point operations in one more forward (``measure.count_flops``): the rows'
    # ``flops`` and ``work_speedup`` (vanilla's over the variant's), the work saved on any device
    flops: bool = False

    def __post_init__(self) -> None:
        if self.host not in HOSTS:
            raise ValueError(f"host must be one of {', '.join(HOSTS)}, got {self.host!r}")
        known = HOSTS[self.host].names if HOSTS[self.host] else ALL_FAMILIES
        bad = [f for f in self.families if f not in known]
        if bad or not self.families:
            raise ValueError(f"families: unknown or empty {bad or self.families}; "
                             f"choose from {', '.join(known)}")
        by_kind: dict = {}
        for f in self.families if HOSTS[self.host] is None else ():
            by_kind.setdefault(kind_of(f).kind, []).append(f)
        if len(by_kind) > 1:
            raise ValueError("families: " + " and ".join(f"{','.join(fs)} ({k})" for k, fs in by_kind.items())
                             + " need separate runs (their methods differ): "
                             + ", then ".join(f"--families {','.join(fs)}" for fs in by_kind.values()))
        kind = self.kind
        if self.methods is None:
            self.methods = kind.methods
            self.skipped.update(kind.skipped)  # say why the other methods are missing
        if kind.defaults_in_config:  # the same for every family of the kind: written down
            self.resolutions = self.resolutions or kind.default_sizes(self.families[0])
            self.batch = self.batch if self.batch is not None else kind.default_batch(self.families[0])
        method_names = tuple(m.split(":")[0].split("@")[0] for m in self.methods)
        known = getattr(kind, "method_names", METHODS)
        bad = [x for x in method_names if x not in known]
        if bad or not method_names:
            raise ValueError(f"methods: unknown or empty {bad or method_names}; "
                             f"choose from {', '.join(known)}")
        if self.repeats < 1 or (self.batch is not None and self.batch < 1):
            raise ValueError(f"repeats and batch must be >= 1, got {self.repeats} and {self.batch}")
        if self.max_repeats is None:
            self.max_repeats = self.repeats
        if self.max_repeats < self.repeats:
            raise ValueError(f"max repeats ({self.max_repeats}) must be >= repeats ({self.repeats})")
        if not self.ratios or not all(0 <= r < 1 for r in self.ratios):
            raise ValueError(f"ratios must be in [0, 1), got {self.ratios}")
        if self.attention not in ATTENTION_BACKENDS:
            raise ValueError(f"attention must be one of {', '.join(ATTENTION_BACKENDS)}, got {self.attention!r}")
        modes = getattr(kind, "compile_modes", COMPILE_MODES)  # ComfyUI: TorchCompileModel's backends
        if self.compile_modes == ("default",) and "default" not in modes:
            self.compile_modes = modes[:1]
        bad = [m for m in self.compile_modes if m not in modes]
        if bad or not self.compile_modes:
            raise ValueError(f"compile modes must be from {', '.join(modes)}, got {bad or self.compile_modes}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        content.check(self.content, self.photo)
        kind.check(self, method_names)
        self.trace = self.trace or torch.device(self.device).type == "cuda"

    @property
    def kind(self) -> BenchFamily:
        """The kind of model of this run (a run holds one kind: their methods differ; a host other than diffusers
        is one kind)."""
        return HOSTS[self.host] or kind_of(self.families[0])

    @property
    def dit(self) -> bool:
        """Whether this run benchmarks DiT families."""
        return self.kind is DIT

    def sizes_for(self, family: str) -> tuple[tuple[int, int], ...]:
        return self.resolutions or kind_of(family).default_sizes(family)

    def batch_for(self, family: str) -> int:
        return self.batch if self.batch is not None else kind_of(family).default_batch(family)

    def resolve(self) -> list[Variant]:
        """The variants to run (vanilla first); records unavailable methods in ``skipped``."""
        variants = [Variant("vanilla")]
        for entry in self.methods:  # "kv", "kv@0.75" (that ratio only), "kv@0.88:3x3" (and sx=3, sy=3)
            method = entry.split(":")[0].split("@")[0]
            if method == "vanilla":
                continue
            reason = getattr(self.kind, "availability", availability)(method)
            if reason:
                self.skipped[method] = reason
                continue
            variants += [v for v in Variant.parse(entry, self.ratios) if v not in variants]
        return variants

    def as_dict(self) -> dict:
        return {k: v for k, v in asdict(self).items() if k != "skipped"}

    @property
    def inputs_content(self) -> str:
        """The content of the inputs that are timed: the photo only with --content photo."""
        return "photo" if self.content == "photo" else "noise"

    def patch_options(self) -> dict:
        return dict(max_downsample=self.max_downsample, use_rand=self.use_rand, seed=self.seed)


Progress = Callable[[str], None]
Log = Callable[[str], None]


def _round_robin(variants: list[Variant], repeat: int) -> list[Variant]:
    # rotate the order each repeat so no variant always runs right after the same neighbour
    k = repeat % len(variants)
    return variants[k:] + variants[:k]


def case_inputs(unet, family: str, size: tuple[int, int], cfg: BenchConfig) -> measure.Inputs:
    """A UNet's inputs at ``size`` (see ``unet_family``)."""
    return UNET.inputs(unet, family, size, cfg)


class Clock:
    """Time estimate from measured forwards: each case's warm-up gives the seconds per
    forward of every variant; cases not yet warmed up are extrapolated from the last measured
    one by pixel count (marked rough). Updated after every round."""

    def __init__(self, cfg: BenchConfig, n_variants: int, log: Log) -> None:
        self.cfg, self.n_variants, self.log = cfg, n_variants, log
        self.t0 = time.perf_counter()
        self.cases = [(f, s) for f in cfg.families for s in cfg.sizes_for(f)]
        self.done = 0           # cases finished
        self.round_s = None     # seconds of one round of the current case (measured)
        self.rounds_left = 0    # minimum rounds still to run in the current case
        self.printed_first = False
        self.first: dict | None = None  # the first estimate: when, and the total it predicted
        self.deadline = None if cfg.budget_s is None else self.t0 + cfg.budget_s

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0

    def _compile_forwards(self) -> int:
        if not self.cfg.compile:
            return 0
        return self.n_variants * len(self.cfg.compile_modes) * (3 + self.cfg.repeats)

    def estimate(self) -> tuple[float, float, bool]:
        """(seconds left at the minimum rounds, at the cap, whether extrapolated)."""
        if self.round_s is None:
            return 0.0, 0.0, True
        per_fwd = self.round_s / self.n_variants
        cfg, (_, (w0, h0)) = self.cfg, self.cases[min(self.done, len(self.cases) - 1)]
        extra = cfg.max_repeats - cfg.repeats
        low = self.rounds_left * self.round_s + self._compile_forwards() * per_fwd
        high = low + extra * self.round_s
        rest = self.cases[self.done + 1:]
        for _, (w, h) in rest:  # rough: time grows with pixels (more with attention's N^2)
            scale = (w * h) / (w0 * h0)
            fwd = (self.n_variants * (1 + cfg.repeats) + 1 + self._compile_forwards()) * per_fwd
            low += scale * fwd
            high += scale * (fwd + extra * self.round_s)
        if self.deadline is not None:
            high = min(high, max(low, self.deadline - time.perf_counter()))
        return low, high, bool(rest)

    def text(self) -> str:
        low, high, rough = self.estimate()
        span = f"~{low:.0f} s" + (f" (up to {high:.0f} s if rounds disagree)" if high > low * 1.05 else "")
        span += " (cases not yet warmed up: extrapolated by pixel count)" if rough else ""
        return span + (" + compilation (not estimated)" if self.cfg.compile else "")

    def warmed(self, seconds: dict[Variant, float]) -> None:
        """A case's warm-up is done: ``seconds`` per variant of one plain forward."""
        self.round_s = sum(seconds.values())
        self.rounds_left = self.cfg.repeats
        if not self.printed_first:
            self.printed_first = True
            low, high, _ = self.estimate()
            self.first = {"at_s": round(self.elapsed(), 1),
                          "total_s": round(self.elapsed() + low, 1),
                          "total_up_to_s": round(self.elapsed() + high, 1)}
            self.log(f"{self.elapsed():.0f} s so far; estimated time left, from the measured "
                     f"warm-up: {self.text()}")

    def round_done(self, seconds: float) -> None:
        self.round_s = seconds
        self.rounds_left = max(0, self.rounds_left - 1)

    def room_for_round(self, extra: bool = True) -> bool:
        """Whether one more round fits in the time budget (always, without one); ``extra`` False: whether the
        minimum rounds still to run do (on a slow CPU the budget then ends a case after its first round)."""
        if self.deadline is None or self.round_s is None:
            return True
        low, _, _ = self.estimate()
        return time.perf_counter() + (self.round_s if extra else 0.0) + low <= self.deadline

    def case_done(self) -> None:
        self.done += 1


@dataclass
class _Measured:
    """Raw measurements of one case, per variant."""

    mem: dict = field(default_factory=dict)         # peak bytes of one forward
    out_peaked: dict = field(default_factory=dict)  # output of the peaked UNet
    out_photo: dict = field(default_factory=dict)   # --content both: the same on the photo's latents
    attention: dict = field(default_factory=dict)   # SDPA kernels used (device.kernels_used)
    times: dict = field(default_factory=dict)       # seconds per timed round (steady: see measure.steady)
    firsts: dict = field(default_factory=dict)      # per round: the first forward after applying (CUDA; else None)
    waits: dict = field(default_factory=dict)       # per round: share of it spent waiting for a CPU
    out: dict = field(default_factory=dict)         # output of the first timed round
    drift: float = 0.0                              # vanilla before vs after all patches
    ops: dict = field(default_factory=dict)         # variant -> op_count.OpCount of one forward
    flops: dict = field(default_factory=dict)       # variant -> floating-point operations of one forward (cfg.flops)

    def ratios(self, variants: list[Variant]) -> dict:
        """Speed-ups over ``variants[0]`` (vanilla) with their bands (see ``stats``)."""
        return stats.summarize({v: self.times[v] for v in variants}, vanilla=variants[0],
                               cpu_waits={v: self.waits.get(v) for v in variants})


def _measure(unet, inputs, variants: list[Variant], cfg: BenchConfig, progress: Progress,
             clock: Clock, forward=None, peaked=None, probe=None, photo_inputs=None, patch=None) -> _Measured:
    """forward(model, inputs) -> fp32 output (default ``measure.forward``, a UNet's);
    patch(model, variant, **options): context applying a variant, yielding what forward takes (``Case.patched``);
    peaked(model, factor): context with peaked attention (default ``models.peaked_attention``);
    probe(fn, device) -> (seconds, output): times the vanilla forward after the warm-up round
    (default ``measure.timed``; the DiT runner measures its attention share there);
    photo_inputs (--content both): each variant also runs once on them in the warm-up round."""
    device, options, m = torch.device(cfg.device), cfg.patch_options(), _Measured()
    forward, peaked, patch = forward or measure.forward, peaked or peaked_attention, patch or patched

    def run(v: Variant, how):
        with patch(unet, v, **options) as model:
            result = how(lambda: forward(model, inputs), device)
        progress(v.label)
        return result

    warm = {}
    with peaked(unet, cfg.peaked):
        for v in variants:
            w = run(v, measure.warm_up)
            m.mem[v], m.out_peaked[v], m.attention[v], warm[v] = (
                w.peak_bytes, w.out, w.attention, w.seconds)
            if photo_inputs is not None:  # same patch, same model state: only the latents differ
                with patch(unet, v, **options) as model:
                    m.out_photo[v] = forward(model, photo_inputs)
                progress(f"{v.label} (photo)")
        if cfg.flops:  # the patched forward's work, under the same (peaked) attention as the errors
            for v in variants:
                with patch(unet, v, **options) as model:
                    m.flops[v] = measure.count_flops(lambda: forward(model, inputs))
                progress(f"{v.label} (flops)")
        if cfg.errors_only:  # the warm-up's times stand for the rounds (one profiled forward each)
            m.drift = None
            for v in variants:
                m.times[v], m.waits[v], m.firsts[v] = [warm[v]], [None], [None]
            return m
        # vanilla again after every patch was applied and removed: must be unchanged
        warm[variants[0]], again = run(variants[0], probe or measure.timed)  # no first-call cost now
    m.drift = measure.rel_l2(again, m.out_peaked[variants[0]])
    clock.warmed(warm)
    if cfg.ops:  # the first forward after patching builds the step's tables; the second reuses them
        for v in variants:
            with patch(unet, v, **options) as model:
                first = op_count.count_ops(lambda: forward(model, inputs))[0]
                m.ops[v] = (op_count.count_ops(lambda: forward(model, inputs))[0], first)
    rounds = 0
    while True:
        round_start = time.perf_counter()  # wall time: on CUDA a round runs several calls per variant
        for v in _round_robin(variants, rounds):
            t = run(v, measure.timed_wait)
            m.times.setdefault(v, []).append(t.seconds)
            m.waits.setdefault(v, []).append(t.wait)
            m.firsts.setdefault(v, []).append(t.first_s)
            m.out.setdefault(v, t.out)
        rounds += 1
        clock.round_done(time.perf_counter() - round_start)
        if rounds < cfg.repeats and clock.room_for_round(extra=False):
            continue
        ratios = m.ratios(variants)
        if (rounds >= cfg.max_repeats or not stats.unsettled(ratios)
                or not clock.room_for_round()):
            break
    return m


@contextlib.contextmanager
def _torch_compiled(unet, v: Variant, mode: str, **options):
    """``v`` applied, then ``torch.compile(model, mode=mode)`` as a diffusers user compiles (``Case.compiled``'s
    default); mode "regional": diffusers' ``compile_repeated_blocks(fullgraph=True)``, its blocks made eager again
    after."""
    with patched(unet, v, **options):
        if mode != "regional":
            yield torch.compile(unet, mode=None if mode == "default" else mode)
            return
        if not getattr(unet, "_repeated_blocks", None):
            raise ValueError(f"{type(unet).__name__} names no repeated blocks for diffusers' regional recipe")
        unet.compile_repeated_blocks(fullgraph=True)
        try:
            yield unet
        finally:
            for module in unet.modules():
                module._compiled_call_impl = None


def _compile_variant(unet, inputs: measure.Inputs, v: Variant, cfg: BenchConfig, forward=measure.forward,
                     mode: str = "default", case: Case | None = None) -> dict:
    """Patch, then ``torch.compile(model, mode=mode)`` as a user would (a UNet, or a DiT with its case's ``forward``):
    the first call (compilation) is timed alone, two more calls warm the rest (CUDA graphs: warm-up, then
    capture), then ``cfg.repeats`` steady timings, counting the graphs compiled during them (``recompiles``, 0
    expected), what the first calls compiled (``compile_counts``: graphs, graph breaks, frames left to eager, with
    dynamo's reasons; 0 breaks and 0 to eager expected) and, on CUDA, the regions CUDA graphs skipped
    (``cudagraph_skips``, with inductor's reasons). Errors
    are reported, not hidden. ``case``: its ``compiled`` (how a host compiles; the ComfyUI host: TorchCompileModel)
    and ``compile_skip`` (a mode this device cannot run: ``{"skipped": reason}``)."""
    import logging

    import torch._dynamo
    from torch._dynamo.utils import counters

    device = torch.device(cfg.device)
    skip = case.compile_skip(mode) if case is not None and case.compile_skip else None
    if skip:
        return {"skipped": skip}
    compile_in = case.compiled if case is not None and case.compiled else _torch_compiled
    reset_compiled()  # each variant compiles from scratch: compile time and counts are its own
    graphs = counters["stats"]
    skips_before = counters["inductor"]["cudagraph_skips"]
    reasons: list[str] = []

    class Skips(logging.Handler):  # inductor says why it skipped CUDA graphs in a perf hint
        def emit(self, record: logging.LogRecord) -> None:
            text = record.getMessage()
            if "cudagraph" in text.lower() and len(reasons) < 5:
                reasons.append(text.strip().splitlines()[0][:200])

    handler, torch_log = Skips(), logging.getLogger("torch")
    torch_log.addHandler(handler)
    try:
        with compile_in(unet, v, mode, **cfg.patch_options()) as compiled, warnings.catch_warnings():
            # diffusers' lru_cache'd version checks: dynamo traces through them, harmlessly
            warnings.filterwarnings("ignore", message=".*functools.lru_cache.*")
            first_s, out = measure.once(lambda: forward(compiled, inputs), device)
            # Warm-up calls: CUDA graph trees run one eagerly, then capture; no graph is expected from them or later
            # (tests: a 12-step loop, both modes).
            forward(compiled, inputs)
            forward(compiled, inputs)
            compiled_counts = CompileCounts.now()
            before = graphs["unique_graphs"]
            times = [measure.timed(lambda: forward(compiled, inputs), device)[0]
                     for _ in range(cfg.repeats)]
            recompiles = graphs["unique_graphs"] - before
            if cfg.trace:  # the compiled forward's GPU time and host waits (CUDA graphs: the replayed kernels)
                from .profiling import trace_forwards

                trace = trace_forwards(lambda: forward(compiled, inputs), device)
    except Exception as e:  # noqa: BLE001 - any compile failure is a result to report
        msg = (str(e).strip().splitlines() or [""])[0][:200]
        return {"error": f"{type(e).__name__}: {msg}"}
    finally:
        torch_log.removeHandler(handler)
        torch._dynamo.reset()
    result = {"times": times, "first_s": first_s, "out": out, "recompiles": recompiles, "graphs": before,
              "graph_breaks": compiled_counts.breaks, "to_eager": compiled_counts.to_eager,
              "break_reasons": list(compiled_counts.reasons[:5])}
    if cfg.trace:
        result["trace"] = trace
    if mode in ("reduce-overhead", "cudagraphs") and device.type == "cuda":
        result["cudagraph_skips"] = counters["inductor"]["cudagraph_skips"] - skips_before
        result["cudagraph_skip_reasons"] = reasons
    return result


def _row(family: str, size: tuple[int, int], v: Variant, base: Variant, m: _Measured,
         cfg: BenchConfig, ranks: dict, ratios: dict, errors=measure.errors) -> dict:
    """One eager row; ``errors(y, ref, guidance)`` -> (output error, guided error)."""
    width, height = size
    r = ratios[v]
    row = dict(family=family, scale=cfg.scale, width=width, height=height,
               latent=f"{height // 8}x{width // 8}", batch=cfg.batch_for(family), dtype=cfg.dtype,
               device=cfg.device, method=v.method, ratio=v.ratio, label=v.label, compiled=False,
               content=cfg.content,
               attention=m.attention[v],
               time_s=statistics.median(m.times[v]), times_s=m.times[v], rounds=r.n,
               # ratio of the median times (what the ms column says), its band widened by the
               # paired rounds' spread and by the time lost to other work
               speedup=r.median, speedup_low=r.low, speedup_high=r.high, rank=ranks[v],
               speedup_paired=r.paired, interference=r.interference, cpu_wait=m.waits.get(v),
               # other load only ever adds time, so the fastest runs are the least disturbed
               speedup_best=min(m.times[base]) / min(m.times[v]))
    firsts = [f for f in m.firsts.get(v, ()) if f is not None]
    if firsts:  # CUDA: what the first forward after applying the variant cost (its one-time work included)
        row["first_call_s"] = statistics.median(firsts)
        row["first_calls_s"] = m.firsts[v]
    if m.out:  # the first timed round's (none with errors_only)
        row["rel_err"], row["cfg_err"] = errors(m.out[v], m.out[base], cfg.guidance)
    else:
        row["timing"] = "warm-up"
    if cfg.peaked != 1.0:
        row["peaked"] = cfg.peaked
        row["rel_err_peaked"], row["cfg_err_peaked"] = errors(
            m.out_peaked[v], m.out_peaked[base], cfg.guidance)
    if m.out_photo:  # the photo's errors, under the same (peaked or plain) attention as the warm-up round
        peaked = "_peaked" if cfg.peaked != 1.0 else ""
        row[f"rel_err{peaked}_photo"], row[f"cfg_err{peaked}_photo"] = errors(
            m.out_photo[v], m.out_photo[base], cfg.guidance)
    if m.flops:
        row["flops"], row["work_speedup"] = m.flops[v], m.flops[base] / m.flops[v]
    if v == base:
        row["vanilla_drift"] = m.drift
    row["peak_mem_mb"] = m.mem[v] / 2**20
    if m.ops:
        row.update(op_count.row_fields(*m.ops[v], vanilla=m.ops[base][0]))
    row["mem_vs_vanilla"] = m.mem[v] / m.mem[base] if m.mem[base] else None
    return row


def _compiled_row(eager: dict, v: Variant, c: dict, cb: dict, base_times: list, cfg: BenchConfig, out_base,
                  mode: str, errors=measure.errors) -> dict:
    """A compiled row: ``c`` this variant's ``_compile_variant`` result, ``cb`` compiled vanilla's (same mode)."""
    row = {k: eager[k] for k in ("family", "scale", "width", "height", "latent", "batch",
                                 "dtype", "device", "method", "ratio", "label", "host") if k in eager}
    row.update(compiled=True, compile_mode=mode, attention=COMPILED_KERNELS.get(mode, mode))
    if "error" in c or "skipped" in c:
        row["compile_error" if "error" in c else "compile_skipped"] = c.get("error") or c["skipped"]
        return row
    t = statistics.median(c["times"])
    row.update(time_s=t, times_s=c["times"], rounds=len(c["times"]), compile_s=c["first_s"],
               recompiles=c["recompiles"], graphs=c["graphs"], speedup_vs_eager=statistics.median(base_times) / t)
    for key in ("graph_breaks", "to_eager", "break_reasons", "cudagraph_skips", "cudagraph_skip_reasons"):
        if key in c:
            row[key] = c[key]
    if "error" not in cb:
        # compiled variants run in blocks (a patch change would recompile), not interleaved
        row["speedup"] = statistics.median(cb["times"]) / t
        row["speedup_best"] = min(cb["times"]) / min(c["times"])
        if "trace" in c and "trace" in cb:
            row["trace"] = c["trace"]
            row.update(trace_summary.versus_vanilla(c["trace"], cb["trace"]))
    # compiled output against the eager vanilla output: compile error and patch error together
    row["rel_err"], row["cfg_err"] = errors(c["out"], out_base, cfg.guidance)
    return row


def run_case(model, family: str, size: tuple[int, int], variants: list[Variant],
             cfg: BenchConfig, progress: Progress, clock: Clock | None = None,
             emit: Callable[[list[dict]], None] | None = None) -> list[dict]:
    """All variants at one resolution (``variants[0]`` is vanilla): one row each, for any kind
    of model (its :class:`~.family.Case` gives inputs, forward, peaked attention, errors, extra fields).

    A warm-up round runs on the peaked model (when ``cfg.peaked != 1``) and measures peak
    memory and the peaked-attention errors, then runs vanilla once more to check that removing
    the patches restored the model; ``cfg.repeats`` timed rounds follow on the plain model,
    each over all variants in a rotated order, and the first gives the plain errors; more
    rounds follow, up to ``cfg.max_repeats`` (and ``cfg.budget_s``), while the noise bands
    overlap or other work takes too much of the time (see ``stats``). With ``cfg.compile``,
    compiled rows follow, per compile mode vanilla first. ``emit(rows so far)`` is called once the eager rows
    are done and after each compiled row, so a run stopped during a long compilation keeps what it measured.
    """
    clock = clock or Clock(cfg, len(variants), lambda _: None)
    case: Case = cfg.kind.case(model, family, size, cfg)
    m = _measure(model, case.inputs, variants, cfg, progress, clock, forward=case.forward,
                 peaked=case.peaked, probe=case.probe, photo_inputs=case.photo_inputs, patch=case.patched)
    ratios = m.ratios(variants)
    ranks = stats.ranking(ratios)
    extra = case.extra()
    rows = [dict(_row(family, size, v, variants[0], m, cfg, ranks, ratios, case.errors), **extra)
            for v in variants]
    if cfg.trace:
        traces = trace_variants(model, case, family, size, variants, cfg, progress)
        for row, v in zip(rows, variants):
            row["trace"] = traces[v]
            row.update(trace_summary.versus_vanilla(traces[v], traces[variants[0]]))
            if v != variants[0]:
                row["trace_vs_vanilla"] = trace_summary.difference(traces[v], traces[variants[0]])
    emit = emit or (lambda _: None)
    emit(rows)
    if cfg.compile:
        eager = dict(zip(variants, rows[:]))
        for mode in cfg.compile_modes:
            results = {}
            for v in variants:
                results[v] = _compile_variant(model, case.inputs, v, cfg, case.forward, mode, case)
                rows.append(_compiled_row(eager[v], v, results[v], results[variants[0]], m.times[variants[0]], cfg,
                                          m.out[variants[0]], mode, case.errors))
                progress(f"{v.label} compiled" + ("" if mode == "default" else f" ({mode})"))
                emit(rows)
    return rows


def trace_variants(model, case: Case, family: str, size: tuple[int, int], variants: list[Variant],
                   cfg: BenchConfig, progress: Progress) -> dict:
    """Per variant, a profiled trace's summary of steady forwards (``profiling.trace_forwards``): the variant
    applied, one call to do its one-time work, then the profiled forwards."""
    from . import profiling

    device, traces = torch.device(cfg.device), {}
    for v in variants:
        keep = None
        if cfg.trace_dir:
            name = "".join(c if c.isalnum() or c in ".-" else "_" for c in v.label)
            keep = Path(cfg.trace_dir) / f"{family}_{size[0]}x{size[1]}_{name}.json.gz"
        with case.patched(model, v, **cfg.patch_options()) as applied:
            case.forward(applied, case.inputs)
            traces[v] = profiling.trace_forwards(lambda: case.forward(applied, case.inputs), device, keep=keep)
        progress(f"{v.label} traced")
    return traces


def profile_case(unet, family: str, size: tuple[int, int], variants: list[Variant],
                 cfg: BenchConfig) -> dict:
    """Where the time goes for vanilla and every variant at the first ratio (see profiling)."""
    from . import profiling

    inputs = case_inputs(unet, family, size, cfg)
    chosen = [v for v in variants if v.method == "vanilla" or v.ratio == cfg.ratios[0]]
    return {"family": family, "width": size[0], "height": size[1], "batch": cfg.batch_for(family),
            "dtype": cfg.dtype, "groups": profiling.GROUPS,
            "variants": [profiling.profile_variant(unet, inputs, v, cfg.patch_options())
                         for v in chosen]}


def run_benchmark(cfg: BenchConfig, progress_bar: bool = True, profile: bool = False,
                  on_rows: Callable[[list[dict]], None] | None = None,
                  log: Log | None = None, profile_every_case: bool = False) -> dict:
    """Run everything in ``cfg``; returns ``{"config", "rows", "skipped"}`` (and ``"profile"``
    of the first family and size when ``profile``; with ``profile_every_case`` also ``"profiles"``,
    one per family and size). ``on_rows(rows_so_far)`` is called after each family/size, so a long
    run that is stopped early still leaves its results."""
    from tqdm.auto import tqdm

    variants = cfg.resolve()
    timed = 0 if cfg.errors_only else cfg.repeats  # and one vanilla re-run
    per_case = (len(variants) * (1 + timed) + (0 if cfg.errors_only else 1)
                + (len(variants) * len(cfg.compile_modes) if cfg.compile else 0)
                + (len(variants) if cfg.content == "both" else 0) + (len(variants) if cfg.trace else 0)
                + (len(variants) if cfg.flops else 0))
    n_forwards = sum(len(cfg.sizes_for(f)) for f in cfg.families) * per_case
    # no tqdm ETA: forwards differ in cost; the Clock's estimate (from measured warm-ups) is shown
    bar = tqdm(total=n_forwards, unit="fwd", disable=not progress_bar, dynamic_ncols=True,
               bar_format="{desc}: {n_fmt}/{total_fmt} forwards [{elapsed}] {postfix}")
    log = log or (lambda text: tqdm.write(text, file=sys.stderr))
    clock = Clock(cfg, len(variants), log)
    kind = cfg.kind
    log(f"{n_forwards} {kind.kind} forwards to run; a time estimate follows "
        "the first warm-up round")
    rows, prof, profiles = [], None, []
    try:
        with attention_backend(cfg.attention):
            for family in cfg.families:
                bar.set_description(f"{family}: building the {kind.kind}")
                model = kind.build(family, cfg)
                for size in cfg.sizes_for(family):
                    def progress(label: str, _s=size) -> None:
                        bar.set_description(f"{family} {_s[0]}x{_s[1]} {label}")
                        if clock.round_s is not None:
                            bar.set_postfix_str(f"left {clock.text()}", refresh=False)
                        bar.update(1)
                    done = list(rows)
                    rows += run_case(model, family, size, variants, cfg, progress, clock,
                                     emit=(lambda new, _done=done: on_rows(_done + new)) if on_rows else None)
                    clock.case_done()
                    if profile and (prof is None or profile_every_case) and kind.compiles:
                        bar.set_description(f"{family} {size[0]}x{size[1]} profiling")
                        profiles.append(profile_case(model, family, size, variants, cfg))
                        prof = prof or profiles[0]
                del model  # one model at a time: a released DiT takes up to half an 80 GB card
                gc.collect()
                if torch.device(cfg.device).type == "cuda":
                    torch.cuda.empty_cache()
    finally:
        bar.close()
    result = {"config": cfg.as_dict(), "rows": rows, "skipped": dict(cfg.skipped),
              "estimate": clock.first, "run_s": round(clock.elapsed(), 1)}
    if prof is not None:
        result["profile"] = prof
    if profile_every_case:
        result["profiles"] = profiles
    return result
