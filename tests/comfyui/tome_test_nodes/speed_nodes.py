"""Test-only nodes that force the speed check's timings inside the server process.

``TomeTestForceSpeedups`` passes its MODEL on unchanged and, when it runs, replaces
``tome_core.engine.speed_check.measure_speedup`` in every copy of the engine the server has loaded (the
repository is imported under its custom-node package name, and as the V1 twin) with a function that
returns the speed-ups given as "HxW=speedup, ...; *=default" for each level grid (a transformer's model
call, which has no level: the default), and forgets cached verdicts. A prompt can then decide levels by
a chosen figure on a CPU-only server. By default nothing is timed; with ``repeat`` on, the check's
real timing runs first wherever the host hands it the model call to repeat (every repeat the check
makes, as on a user's machine), its figure is dropped for the forced one, and a log line says how many
times the call ran: ``TomeTestForceSpeedups: ran the call 9 times; forced 1.40x``.

``TomeTestDiffusionModelWrapper`` adds a DIFFUSION_MODEL wrapper (ComfyUI's ``WrappersMP.DIFFUSION_MODEL``,
where EasyCache keeps its step state) under a key of its own that just calls the executor: another
node's wrapper inside the model call, which the speed check must not repeat.
"""
from __future__ import annotations

import sys

REAL = "_tome_test_real_measure_speedup"  # where the engine module keeps its own measure_speedup once replaced
FORCED_LOG = "TomeTestForceSpeedups: "


def _parse(text: str) -> tuple:
    table, default = {}, 1.4
    for entry in filter(None, (part.strip() for part in text.replace(";", ",").split(","))):
        key, _, value = entry.partition("=")
        if key.strip() == "*":
            default = float(value)
        else:
            h, _, w = key.strip().partition("x")
            table[(int(h), int(w))] = float(value)
    return table, default


class TomeTestForceSpeedups:
    RETURN_TYPES = ("MODEL",)
    FUNCTION = "force"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "speedups": ("STRING", {"default": "*=1.4"})},
                "optional": {"repeat": ("BOOLEAN", {"default": False})}}

    @classmethod
    def IS_CHANGED(cls, model, speedups, repeat=False):
        return float("nan")  # run every time: the override is process state, not an output

    def force(self, model, speedups, repeat=False):
        import logging

        table, default = _parse(speedups)

        def timer_of(real):
            def timer(config, shape, device, dtype, run=None, **options):
                figure = default if shape is None else table.get(tuple(shape.grid), default)
                if repeat and run is not None:
                    calls = [0]

                    def counted(reduced):
                        calls[0] += 1
                        return run(reduced)

                    real(config, shape, device, dtype, run=counted, **options)
                    logging.info(f"{FORCED_LOG}ran the call {calls[0]} times; forced {figure:.2f}x")
                return figure
            return timer

        engines = [module for name, module in list(sys.modules.items())
                   if name.endswith("tome_core.engine.speed_check") and hasattr(module, "measure_speedup")]
        for module in engines:
            module.__dict__.setdefault(REAL, module.measure_speedup)
            module.measure_speedup = timer_of(module.__dict__[REAL])
            module.forget_verdicts()
        return (model,)


class TomeTestDiffusionModelWrapper:
    """Passes on a clone of its MODEL with a DIFFUSION_MODEL wrapper keyed "tome_test_passthrough" that calls the
    executor and nothing else (the model's output unchanged)."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "wrap"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",)}}

    def wrap(self, model):
        import comfy.patcher_extension

        def passthrough(executor, *args, **kwargs):
            return executor(*args, **kwargs)

        patched = model.clone()
        patched.add_wrapper_with_key(comfy.patcher_extension.WrappersMP.DIFFUSION_MODEL, "tome_test_passthrough",
                                     passthrough)
        return (patched,)


# dict(...), not a literal: ComfyUI-Manager's scanner reads literal mappings in every .py of the repository,
# and these test nodes are not the pack's (tests/test_registry.py).
NODE_CLASS_MAPPINGS = dict(TomeTestForceSpeedups=TomeTestForceSpeedups,
                           TomeTestDiffusionModelWrapper=TomeTestDiffusionModelWrapper)
