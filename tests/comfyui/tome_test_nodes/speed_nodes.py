"""A test-only node that forces the speed check's timings inside the server process.

``TomeTestForceSpeedups`` passes its MODEL on unchanged and, when it runs, replaces
``tome_core.engine.speed_check.measure_speedup`` in every copy of the engine the server has loaded (the
repository is imported under its custom-node package name, and as the V1 twin) with a function that
returns the speed-ups given as "HxW=speedup, ...; *=default" for each level grid, and forgets cached
verdicts. A prompt can then decide levels by a chosen figure on a CPU-only server: nothing is timed.
"""
from __future__ import annotations

import sys


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
        return {"required": {"model": ("MODEL",), "speedups": ("STRING", {"default": "*=1.4"})}}

    @classmethod
    def IS_CHANGED(cls, model, speedups):
        return float("nan")  # run every time: the override is process state, not an output

    def force(self, model, speedups):
        table, default = _parse(speedups)

        def timer(config, shape, device, dtype, run=None):
            return table.get(tuple(shape.grid), default)

        engines = [module for name, module in list(sys.modules.items())
                   if name.endswith("tome_core.engine.speed_check") and hasattr(module, "measure_speedup")]
        for module in engines:
            module.measure_speedup = timer
            module.forget_verdicts()
        return (model,)


# dict(...), not a literal: ComfyUI-Manager's scanner reads literal mappings in every .py of the repository,
# and these test nodes are not the pack's (tests/test_registry.py).
NODE_CLASS_MAPPINGS = dict(TomeTestForceSpeedups=TomeTestForceSpeedups)
