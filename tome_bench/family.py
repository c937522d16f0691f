"""What a kind of model brings to the benchmark, so the runner runs every kind the same way.

The runner owns the rounds, the statistics and the rows (``runner.run_case``); a kind of model
(UNets, DiTs; ``runner.KINDS``) says which family names it runs, its defaults, how to build a
model and, per image size, its :class:`Case`: inputs, forward, peaked attention, errors and the
extra row fields. Adding a kind is one object with :class:`BenchFamily`'s attributes, listed in
``runner.KINDS``; adding a family to a kind is that kind's business (e.g. ``dit_models``).
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from . import measure, methods

Errors = Callable[[torch.Tensor, torch.Tensor, float], "tuple[float, float | None]"]


@dataclass
class Case:
    """One model at one size, as the runner's rounds need it.

    forward(model, inputs) -> fp32 output; peaked(model, factor): context with peaked attention;
    probe(fn, device) -> (seconds, output): times the vanilla forward after the warm-up round
    (None: ``measure.timed``); errors(y, ref, guidance) -> (output error, guided error);
    extra() -> row fields known once the rounds are done (it may read what ``probe`` saw);
    photo_inputs: with --content both, the same inputs with the photo's latents (errors only);
    patched(model, variant, **options): context in which ``variant`` is applied, yielding what ``forward`` takes
    (default ``methods.patched``: patched in place, the model itself; the ComfyUI host: a patched clone's session);
    compiled(model, variant, mode, **options): the same, compiled with ``mode`` (None: ``patched``, then
    ``torch.compile(model, mode=mode)``); compile_skip(mode): why this case cannot run ``mode`` here, or None."""

    inputs: Any
    forward: Callable[[torch.nn.Module, Any], torch.Tensor]
    peaked: Callable[[torch.nn.Module, float], contextlib.AbstractContextManager]
    probe: Callable | None = None
    errors: Errors = measure.errors
    extra: Callable[[], dict] = field(default=dict)
    photo_inputs: Any = None
    patched: Callable[..., contextlib.AbstractContextManager] = methods.patched
    compiled: Callable[..., contextlib.AbstractContextManager] | None = None
    compile_skip: Callable[[str], "str | None"] | None = None


class BenchFamily(Protocol):
    """A kind of model the benchmark runs (one kind per run: their methods differ)."""

    kind: str                     # "UNet", "DiT": printed, and named when kinds are mixed
    names: tuple[str, ...]        # the --families it runs
    methods: tuple[str, ...]      # default --methods
    skipped: dict[str, str]       # methods it never runs, and why (printed with the results)
    compiles: bool                # whether --compile and --profile apply
    defaults_in_config: bool      # whether default sizes/batch are one for all its families

    def check(self, cfg: Any, method_names: tuple[str, ...]) -> None:
        """Raise ValueError naming the fix when ``cfg`` (a ``runner.BenchConfig``) cannot run."""

    def default_sizes(self, name: str) -> tuple[tuple[int, int], ...]:
        """Image sizes (width, height) in px when --res is not given."""

    def default_batch(self, name: str) -> int:
        """Batch when --batch is not given."""

    def build(self, name: str, cfg: Any) -> torch.nn.Module:
        """The model of family ``name``, on ``cfg.device`` in ``cfg.dtype``."""

    def case(self, model: torch.nn.Module, name: str, size: tuple[int, int], cfg: Any) -> Case:
        """Inputs and hooks for ``model`` at ``size`` (width, height)."""
