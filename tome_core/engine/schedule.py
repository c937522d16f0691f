"""Where sampling is, from whatever signal a host gives: one rule for every adapter.

Hosts hand the model a timestep (diffusers and LDM/A1111 UNets: 1000 at the first step, falling to 0;
some DiTs on 0..1, Lumina 2 / Z-Image / Mochi rising) or a sigma (ComfyUI, Forge). Progress is 0 at
the first, noisiest step and 1 at the last; ``ToMeConfig.in_schedule(progress)`` says whether ToMe is on.
Sigma hosts bound the schedule with the model's own ``percent_to_sigma``, as they bound ControlNet and
conditioning ranges (``SigmaWindow``). Reading a tensor's value is a host sync: adapters read it once
per model call, never per block.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional, Tuple

import torch


def timestep_value(timestep: Any) -> Optional[float]:
    """A timestep argument as a float (a tensor's largest element: rows share a step), or None when there is none."""
    if timestep is None:
        return None
    if isinstance(timestep, torch.Tensor):  # the batch's largest: two ops, one host read
        return None if timestep.numel() == 0 else float(timestep.max())
    return float(timestep)


def step_signal(value: Any) -> Any:
    """A model call's step as the per-step tables take it without reading it (engine ``step_choice``): the tensor
    itself (hashed on its device: no host sync), a number as a float, 0.0 when there is none."""
    if isinstance(value, torch.Tensor):
        return value if value.numel() else 0.0
    return 0.0 if value is None else float(max(value) if isinstance(value, (list, tuple)) else value)


def call_step(timestep: Any, config: Any, progress: Callable[[float], float]) -> Tuple[bool, Any]:
    """(whether ToMe is on, the step key) of a model call given its timestep. A user-set window (``config``'s
    start/end_percent) needs the step's value: the one host read of a call; otherwise nothing is read and the
    step goes on as it is (``step_signal``: the seeded tables are drawn on its device). progress: the family's
    timestep-to-progress map (``TimestepScale.progress``)."""
    if config.start_percent > 0 or config.end_percent < 1:
        value = timestep_value(timestep) or 0.0
        return config.in_schedule(progress(value)), value
    return True, step_signal(timestep)


def sigma_value(sigmas: Any) -> Optional[float]:
    """The step's sigma as a float: the largest of the batch's (rows may differ), or None when there is none."""
    if sigmas is None:
        return None
    if isinstance(sigmas, torch.Tensor):
        return float(sigmas.detach().max())
    return float(max(sigmas)) if isinstance(sigmas, (list, tuple)) else float(sigmas)


@dataclass(frozen=True)
class TimestepScale:
    """A timestep signal: its value at the first step (``scale``), and whether it rises from 0 instead."""

    scale: float = 1000.0
    rising: bool = False

    def progress(self, value: float) -> float:
        share = value / self.scale
        return min(max(share if self.rising else 1.0 - share, 0.0), 1.0)


UNET_TIMESTEPS = TimestepScale(1000.0)  # SD1.x/SD2.x/SDXL are trained on 1000 DDPM timesteps


@dataclass(frozen=True)
class SigmaWindow:
    """The part of the schedule where ToMe is on, as sigmas: active iff low <= sigma <= high."""

    high: float = float("inf")
    low: float = 0.0

    def contains(self, sigma: float) -> bool:
        return self.low <= sigma <= self.high

    @classmethod
    def from_percents(cls, start_percent: float, end_percent: float,
                      percent_to_sigma: Callable[[float], Any]) -> "SigmaWindow":
        """The window of [start_percent, end_percent] by the model's own percent-to-sigma map."""
        return cls(high=float(percent_to_sigma(start_percent)), low=float(percent_to_sigma(end_percent)))
