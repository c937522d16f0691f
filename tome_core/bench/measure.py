"""Timing, peak memory and error measures for one UNet forward."""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable

import torch

Forward = Callable[[], torch.Tensor]


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


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(fn: Forward, device: torch.device) -> tuple[float, torch.Tensor]:
    """Wall-clock seconds of ``fn()`` (synchronised on CUDA) and its result."""
    _sync(device)
    t0 = time.perf_counter()
    out = fn()
    _sync(device)
    return time.perf_counter() - t0, out


def peak_memory(fn: Forward, device: torch.device) -> tuple[float, torch.Tensor]:
    """Peak bytes allocated by ``fn()`` above what was live when it started, and its result.

    CUDA: ``torch.cuda.max_memory_allocated`` minus the allocation at the start.
    CPU: the running sum of torch's own CPU allocations and frees recorded by
    ``torch.profiler(profile_memory=True)``, maximised over the call. This counts tensor
    memory only (not the Python heap, not allocator caching); weights and inputs, allocated
    before the call, are excluded, so the figure is the activation/workspace peak of one forward.
    """
    if device.type == "cuda":
        _sync(device)
        torch.cuda.reset_peak_memory_stats(device)
        base = torch.cuda.memory_allocated(device)
        out = fn()
        _sync(device)
        return float(torch.cuda.max_memory_allocated(device) - base), out
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()
    events = [e for e in prof.profiler.kineto_results.events()
              if e.name() == "[memory]" and e.device_type().name == "CPU"]
    events.sort(key=lambda e: e.start_ns())
    live = peak = 0
    for e in events:
        live += e.nbytes()
        peak = max(peak, live)
    return float(peak), out


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
