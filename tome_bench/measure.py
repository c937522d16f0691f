"""Timing, peak memory, CPU-wait and error measures for one model forward."""
from __future__ import annotations

import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

import torch

from tome_core.engine import timing

Forward = Callable[[], torch.Tensor]
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass(frozen=True)
class Inputs:
    """UNet inputs (see ``models.make_inputs``)."""

    sample: torch.Tensor
    timestep: torch.Tensor
    encoder_hidden_states: torch.Tensor
    added_cond_kwargs: dict | None

    def to(self, device: torch.device | str) -> "Inputs":
        added = None
        if self.added_cond_kwargs is not None:
            added = {k: v.to(device) for k, v in self.added_cond_kwargs.items()}
        return Inputs(self.sample.to(device), self.timestep.to(device),
                      self.encoder_hidden_states.to(device), added)


def forward(unet: torch.nn.Module, inputs: Inputs) -> torch.Tensor:
    """One UNet forward without autograd; returns the output ``[B, 4, h, w]`` as fp32."""
    with torch.inference_mode():
        out = unet(inputs.sample, inputs.timestep,
                   encoder_hidden_states=inputs.encoder_hidden_states,
                   added_cond_kwargs=inputs.added_cond_kwargs, return_dict=False)[0]
    return out.float()


GPU_ROUND_S = timing.STEADY_SPAN_S  # CUDA: back-to-back forwards per timing (the speed check's span too)
GPU_MAX_FORWARDS = timing.STEADY_MAX_CALLS


def once(fn: Forward, device: torch.device) -> tuple[float, torch.Tensor]:
    """Seconds of one ``fn()`` alone and its result (CUDA: events; e.g. a compiling first call)."""
    return timing.span(fn, timing.clock_for(device), 1)


def steady(fn: Forward, device: torch.device, clock: timing.Clock | None = None) -> timing.Timing:
    """``fn``'s steady time per call, its first call timed apart (``tome_core.engine.timing.steady``).

    CUDA: the first call alone (``first_s``: right after a variant is applied it includes the patch's one-time
    work: the seeded tables, a speed check), then CUDA events recorded on the current stream around back-to-back
    calls (as a sampler queues them: the host runs ahead, launches overlap the GPU's work), at least 2 and
    spanning ``GPU_ROUND_S``, with one synchronisation at the end: the GPU time per call of a user's 20th step.
    A single 28 ms forward timed alone varied by ±10 % and more between rounds on an idle H100. CPU: one call,
    wall clock (``first_s`` None). ``clock``: a stand-in (tests).
    """
    return timing.steady(fn, clock or timing.clock_for(device), GPU_ROUND_S, GPU_MAX_FORWARDS)


def alternate(forward: Callable[[], object], apply: Callable[[], None], remove: Callable[[], None],
              alternations: int, clock: timing.Clock) -> dict:
    """Vanilla and a patch in turn, V, P, V, P, ..., V, each a steady timing (:func:`steady`): each patched span
    is paired with the mean of the vanilla spans before and after it, so a host or clock drifting during the run
    cannot decide the sign. Returns the per-alternation ms and ratios, their median, min and max, and the first
    call after each ``apply`` (the patch's one-time work; None where calls do not queue)."""
    vanilla, patched, firsts = [steady(forward, None, clock).seconds], [], []
    for _ in range(alternations):
        apply()
        try:
            t = steady(forward, None, clock)
        finally:
            remove()
        patched.append(t.seconds)
        firsts.append(t.first_s)
        vanilla.append(steady(forward, None, clock).seconds)
    ratios = [(before + after) / 2 / p for before, after, p in zip(vanilla, vanilla[1:], patched)]
    return {"vanilla_ms": [1000 * v for v in vanilla], "patched_ms": [1000 * p for p in patched],
            "first_call_ms": [None if f is None else 1000 * f for f in firsts],
            "ratios": ratios, "ratio": statistics.median(ratios), "ratio_min": min(ratios), "ratio_max": max(ratios)}


def timed(fn: Forward, device: torch.device) -> tuple[float, torch.Tensor]:
    """Steady seconds of one ``fn()`` and its result (see :func:`steady`)."""
    t = steady(fn, device)
    return t.seconds, t.out


_TASKS = "/proc/self/task"


def cpu_wait() -> float | None:
    """Seconds this process's threads have spent runnable but waiting for a CPU, summed over
    its threads (Linux ``/proc/self/task/*/schedstat``, second field); None where the kernel
    does not tell. The difference around a forward, over its wall time, is the share of the
    forward lost to other work on the machine (or to more threads than cores)."""
    try:
        tasks = os.listdir(_TASKS)
    except OSError:
        return None
    total, seen = 0, False
    for tid in tasks:
        try:
            with open(f"{_TASKS}/{tid}/schedstat") as f:
                total += int(f.read().split()[1])
            seen = True
        except (OSError, IndexError, ValueError):  # a thread that ended, or no schedstat
            continue
    return total / 1e9 if seen else None


@dataclass(frozen=True)
class Timed:
    """One timed round of a variant: steady seconds per forward, the output, the CPU-wait share (CPU only) and
    the first forward after the variant was applied (CUDA only)."""

    seconds: float
    out: torch.Tensor
    wait: float | None
    first_s: float | None


def timed_wait(fn: Forward, device: torch.device, clock: timing.Clock | None = None) -> Timed:
    """:func:`steady` plus the share of that time the threads waited for a CPU
    (0..1; None on CUDA, where the GPU time does not wait on host threads, or unmeasurable)."""
    before = cpu_wait() if device.type == "cpu" else None
    t = steady(fn, device, clock)
    after = cpu_wait() if before is not None else None
    wait = None
    if after is not None and t.seconds > 0:
        wait = min(max((after - before) / t.seconds, 0.0), 1.0)
    return Timed(t.seconds, t.out, wait, t.first_s)


@dataclass(frozen=True)
class WarmUp:
    """One profiled forward: its result, peak memory, SDPA kernels and wall seconds."""

    out: torch.Tensor
    peak_bytes: float
    attention: str
    seconds: float


def warm_up(fn: Forward, device: torch.device) -> WarmUp:
    """Run ``fn()`` once under ``torch.profiler`` (CPU activity): peak memory and the SDPA kernel
    actually dispatched (see ``device.kernels_used``).

    Peak memory is above what was live when the call started (weights and inputs excluded),
    so it is the activation/workspace peak of one forward. CUDA:
    ``torch.cuda.max_memory_allocated`` after ``reset_peak_memory_stats``. CPU: the running sum
    of torch's own CPU allocations and frees recorded by the profiler (``profile_memory``),
    maximised over the call; tensor memory only (not the Python heap, not allocator caching).
    """
    from torch.profiler import ProfilerActivity, profile

    from .device import kernels_used

    cuda = device.type == "cuda"
    if cuda:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU], profile_memory=not cuda) as prof:
        out = fn()
        if cuda:
            torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    events = list(prof.profiler.kineto_results.events())
    attention = kernels_used(e.name() for e in events)
    if cuda:
        return WarmUp(out, float(torch.cuda.max_memory_allocated(device) - base), attention,
                      seconds)
    mem = sorted((e for e in events if e.name() == "[memory]" and e.device_type().name == "CPU"),
                 key=lambda e: e.start_ns())
    live = peak = 0
    for e in mem:
        live += e.nbytes()
        peak = max(peak, live)
    return WarmUp(out, float(peak), attention, seconds)


def peak_memory(fn: Forward, device: torch.device) -> tuple[float, torch.Tensor]:
    """Peak bytes allocated by ``fn()`` above what was live when it started, and its result
    (see :func:`warm_up`)."""
    w = warm_up(fn, device)
    return w.peak_bytes, w.out


def rel_l2(y: torch.Tensor, ref: torch.Tensor) -> float:
    """||y - ref|| / ||ref|| in float64 (0.0 when both are zero)."""
    y, ref = y.double(), ref.double()
    den = ref.norm().item()
    num = (y - ref).norm().item()
    return num / den if den else (0.0 if num == 0 else float("inf"))


def cfg_combine(y: torch.Tensor, guidance: float) -> torch.Tensor:
    """uncond + guidance * (cond - uncond) for a batch ``[uncond; cond]`` of even size."""
    uncond, cond = y.chunk(2)
    return uncond + guidance * (cond - uncond)


def errors(y: torch.Tensor, ref: torch.Tensor, guidance: float) -> tuple[float, float | None]:
    """(relative L2 error of the output, of the CFG-combined prediction or None for odd batch)."""
    raw = rel_l2(y, ref)
    if y.shape[0] % 2:
        return raw, None
    return raw, rel_l2(cfg_combine(y, guidance), cfg_combine(ref, guidance))


def _register_cpu_attention_flops() -> None:
    """torch's flop counter has formulas for the CUDA fused attentions only: the CPU's SDPA kernel
    (``_scaled_dot_product_flash_attention_for_cpu``) counts 0. Its work is the two matmuls, Q·Kᵀ and P·V."""
    from torch.utils.flop_counter import flop_registry, register_flop_formula

    op = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention_for_cpu", None)
    if op is None or op in flop_registry or op.default in flop_registry:
        return

    @register_flop_formula(op)
    def _cpu_sdpa(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
        *batch, lq, d = query_shape
        lk, dv = key_shape[-2], value_shape[-1]
        n = 1
        for b in batch:
            n *= b
        return 2 * n * lq * lk * d + 2 * n * lq * lk * dv


def count_flops(fn: Forward) -> int:
    """The floating-point operations of one ``fn()`` (torch's flop counter: matmuls, convolutions and attention;
    elementwise work is not counted): the work a setting saves, the same on every device and free of timing noise."""
    from torch.utils.flop_counter import FlopCounterMode

    _register_cpu_attention_flops()
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        fn()
    return int(counter.get_total_flops())
