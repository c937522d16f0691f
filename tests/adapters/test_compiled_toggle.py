"""apply_patch / remove_patch on a compiled diffusers model take effect at the next call.

Dynamo does not guard the hooks of a module it inlines (``torch._dynamo.config.skip_nnmodule_hook_guards``), and
ToMe's block hooks come and go after the graph was traced (a patch applied or removed, a call ToMe leaves whole): a
graph traced without them would ignore them, one traced with them would keep running them. While its hooks are on a
module, ToMe sets that module's instance ``forward`` to one of its own that reads the patch's serial
(``adapters/hooks/switched.py``), which dynamo guards by value. Here, as a notebook or a server that toggles ToMe per
request would: one compiled transformer, the sequences of the issue, each output against a fresh eager model in the
same state. Tiny Flux and Wan (``tome_bench.dit_models``, what the bench runs) and a tiny diffusers UNet; dynamo's
"eager" backend (the guards are dynamo's whatever the backend; inductor's compile would cost minutes), ``EXACT``.
"""
from __future__ import annotations

from typing import Callable, Dict, Optional

import pytest
import torch

from tome_bench.dit_models import build_dit, forward, make_dit_inputs, relative_error
from tome_bench.models import build_unet, make_inputs
from tome_core import apply_patch, remove_patch

EXACT = 1e-5  # relative L2; measured 0


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


class Case:
    """A family's tiny model and inputs, and eager outputs of fresh models per ToMe setting (None: unpatched)."""

    def __init__(self, family: str) -> None:
        self.family = family
        self.inputs = make_dit_inputs(self.fresh(), family, 2, 128, 128, frames=5 if family == "wan" else 1)
        self.eager: Dict[Optional[tuple], torch.Tensor] = {}

    def fresh(self) -> torch.nn.Module:
        return build_dit(self.family, scale="tiny")

    def run(self, model: Callable) -> torch.Tensor:
        with torch.no_grad():
            return forward(model, self.inputs)

    def expected(self, **setting) -> torch.Tensor:
        key = tuple(sorted(setting.items())) if setting else None
        if key not in self.eager:
            model = self.fresh()
            if setting:
                apply_patch(model, **setting)
            self.eager[key] = self.run(model)
        return self.eager[key]

    def check(self, label: str, output: torch.Tensor, **setting) -> None:
        error = relative_error(output, self.expected(**setting))
        assert error < EXACT, f"{self.family}, {label}: compiled differs from eager by {error:.3g}"
        if setting:
            assert relative_error(output, self.expected()) > 1e-3, f"{self.family}, {label}: ToMe changed nothing"


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_patch_compile_remove_reapply_and_reconfigure(family):
    case = Case(family)
    model = case.fresh()
    apply_patch(model, ratio=0.5, mode="merge")
    model.compile(backend="eager")
    case.check("merge 0.5, compiled", case.run(model), ratio=0.5, mode="merge")
    remove_patch(model)
    case.check("removed", case.run(model))
    apply_patch(model, ratio=0.5, mode="merge")
    case.check("merge 0.5 again", case.run(model), ratio=0.5, mode="merge")
    apply_patch(model, ratio=0.25, mode="merge")  # applying again replaces the patch
    case.check("merge 0.25", case.run(model), ratio=0.25, mode="merge")
    remove_patch(model)
    apply_patch(model, ratio=0.5, mode="kv")
    case.check("kv 0.5", case.run(model), ratio=0.5, mode="kv")
    remove_patch(model)
    case.check("removed again", case.run(model))
    assert not [name for name, module in model.named_modules() if "forward" in module.__dict__]  # no mark left


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_compile_first_then_patch(family):
    """module.compile() and torch.compile(module), each run unpatched first."""
    case = Case(family)
    model = case.fresh()
    model.compile(backend="eager")
    case.check("vanilla compiled", case.run(model))
    apply_patch(model, ratio=0.5, mode="kv")
    case.check("kv after compiling", case.run(model), ratio=0.5, mode="kv")
    torch._dynamo.reset()
    model = case.fresh()
    compiled = torch.compile(model, backend="eager")
    case.run(compiled)
    apply_patch(model, ratio=0.5, mode="merge")
    case.check("merge after torch.compile", case.run(compiled), ratio=0.5, mode="merge")


def test_a_step_window_in_one_compiled_model():
    """end_percent 0.5: calls past it are whole (ToMe's block hooks off), the earlier ones reduced, in one compiled
    model, alternating: each equals the same patch eager."""
    case = Case("flux")
    model, eager = case.fresh(), case.fresh()
    for m in (model, eager):
        apply_patch(m, ratio=0.5, mode="merge", end_percent=0.5)
    model.compile(backend="eager")
    outputs = []
    for step in (0.9, 0.2, 0.9, 0.2):
        case.inputs["timestep"] = torch.full_like(case.inputs["timestep"], step)
        result, expected = case.run(model), case.run(eager)
        assert relative_error(result, expected) < EXACT, step
        outputs.append(result)
    remove_patch(eager)
    assert relative_error(outputs[1], case.run(eager)) == 0  # whole past the window, as unpatched
    case.inputs["timestep"] = torch.full_like(case.inputs["timestep"], 0.9)
    assert relative_error(outputs[2], case.run(eager)) > 1e-3  # reduced inside it


def test_unet_compiled_then_patched_and_removed():
    """A diffusers UNet (tomesd's path, the same switched hooks), compiled and run unpatched first."""
    unet = build_unet("sd15", "tiny", seed=0)
    inputs = make_inputs(unet, "sd15", batch=2, height_px=256, width_px=256, seed=1)

    def run() -> torch.Tensor:
        sample, timestep, context, added = inputs
        with torch.no_grad():
            return unet(sample, timestep, context, added_cond_kwargs=added).sample

    plain = run()
    unet.compile(backend="eager")
    assert relative_error(run(), plain) < EXACT
    apply_patch(unet, ratio=0.5)
    result = run()
    unet._compiled_call_impl = None  # the same patch, eager
    expected = run()
    assert relative_error(result, expected) < EXACT and relative_error(result, plain) > 1e-3
    unet.compile(backend="eager")
    remove_patch(unet)
    assert relative_error(run(), plain) < EXACT
    apply_patch(unet, ratio=0.5)
    assert relative_error(run(), expected) < EXACT


def test_the_marked_forward_keeps_the_module_its_own():
    """While ToMe's hooks are on, the module's instance forward is ToMe's mark; it calls the module's own forward (its
    class's as it is when the hooks go on: the WebUI swaps CrossAttention.forward on the class between generations),
    shows its signature, restores an instance forward another library set before, and leaves one set over it since in
    place."""
    import functools
    import inspect

    from tome_core.adapters.hooks.switched import SwitchedHooks

    class Block(torch.nn.Module):
        def forward(self, x, scale: float = 1.0):
            return x + scale

    one = torch.zeros(1)
    block, hooks = Block(), SwitchedHooks()
    hooks.add(block, lambda module, args: None, "pre-plain")
    hooks.attach()
    assert "forward" in block.__dict__ and list(inspect.signature(block.forward).parameters) == ["x", "scale"]
    assert block(one).item() == 1.0
    hooks.remove()
    Block.forward = lambda self, x, scale=1.0: x + 2 * scale
    hooks.attach()
    assert block(one).item() == 2.0
    hooks.remove()
    assert "forward" not in block.__dict__ and block(one).item() == 2.0

    theirs = functools.partial(lambda x, scale=1.0: x + 10, )  # another library's instance forward
    block.forward = theirs
    hooks.attach()
    assert block.forward is not theirs and block(one).item() == 10.0
    hooks.remove()
    assert block.__dict__["forward"] is theirs

    hooks.attach()
    mark = block.forward
    block.forward = lambda x: mark(x) * 3  # a wrapper set over the mark since
    hooks.remove()
    assert block(one).item() == 30.0  # left in place: it still calls the module's own through the mark


@pytest.mark.parametrize("fullgraph", [False, True])
def test_regional_compile_as_diffusers_recommends(fullgraph):
    """diffusers' regional recipe, ``compile_repeated_blocks`` (its documented fullgraph=True too): ToMe acts with it in
    every order (compiled first, then ToMe; ToMe, then compiled; ToMe run eagerly, then compiled, as a notebook or a
    server that warms up does), compiled equals eager, and removal and another mode take effect at the next call."""
    case = Case("flux")
    model = case.fresh()
    model.compile_repeated_blocks(fullgraph=fullgraph, backend="eager")
    case.run(model)
    apply_patch(model, ratio=0.5, mode="merge")
    case.check("regional, merge", case.run(model), ratio=0.5, mode="merge")
    remove_patch(model)
    case.check("regional, removed", case.run(model))

    model = case.fresh()
    apply_patch(model, ratio=0.5, mode="kv")
    model.compile_repeated_blocks(fullgraph=fullgraph, backend="eager")
    case.check("regional after ToMe, kv", case.run(model), ratio=0.5, mode="kv")

    model = case.fresh()
    apply_patch(model, ratio=0.5, mode="kv")
    case.check("eager, kv", case.run(model), ratio=0.5, mode="kv")
    model.compile_repeated_blocks(fullgraph=fullgraph, backend="eager")
    case.check("regional after an eager run, kv", case.run(model), ratio=0.5, mode="kv")
    apply_patch(model, ratio=0.5, mode="merge")
    case.check("regional, merge after kv", case.run(model), ratio=0.5, mode="merge")
