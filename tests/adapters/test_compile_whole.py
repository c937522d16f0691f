"""ToMe compiles whole under every torch.compile recipe diffusers users run, in both modes, on every merging DiT and on
a UNet (whose blocks compiled one by one with fullgraph=True mode merge refuses by name, before any block runs).

Recipes: ``torch.compile(model)``, ``torch.compile(model, fullgraph=True)``, ``model.compile()`` and diffusers'
regional recipe ``compile_repeated_blocks(fullgraph=True)``; orders: ToMe applied and run eagerly, then compiled (a
notebook, a server that warms up), and compiled and run, then ToMe applied. Dynamo's own counters
(``tome_bench.compile_counts``) against the same model compiled without ToMe in the same process: no graph break, no
frame left to eager, no more graphs (regional, mode merge: one more per block class at most, the first merged block
making the call's matching; never one per block instance: the models have 2 blocks of each kind), nothing compiled
after the first of 4 calls (each a new timestep), compiled equal to eager and different from the model without ToMe.
Backend ``eager`` (dynamo traces and counts as for inductor, without the C++ compile); tiny models of the bench, each
run once eagerly before anything is compiled (diffusers' Z-Image builds its rotary table at its first call inside a
``torch.device`` context, which dynamo cannot enter: a break of the model's own, with or without ToMe).
"""
from __future__ import annotations

from typing import Dict, List, Tuple

import pytest
import torch

from tome_bench.compile_counts import CompileCounts, reset
from tome_bench.dit_models import build_dit, make_dit_inputs, relative_error
from tome_core import apply_patch, remove_patch

FAMILIES = ("flux", "wan", "qwen_image", "z_image", "ltx2")
BLOCKS = 2
CALLS = 4
EXACT = 1e-5  # relative L2 (backend eager: measured 0)


def _inputs(model: torch.nn.Module, family: str) -> List[dict]:
    """One model call per step: the same latents at CALLS timesteps (rising for Z-Image)."""
    inputs = make_dit_inputs(model, family, 1 if family == "flux" else 2, 128, 128,
                             frames=9 if family in ("wan", "ltx2") else 1)
    key = "t" if "t" in inputs else "timestep"
    scale = 1000.0 if inputs[key].max() > 1.5 else 1.0
    return [dict(inputs, **{key: torch.full_like(inputs[key], (0.9 - 0.2 * i) * scale)}) for i in range(CALLS)]


def _out(model, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs, return_dict=False)[0]
    return torch.stack(out) if isinstance(out, list) else out


def _compiled(model: torch.nn.Module, recipe: str):
    if recipe == "torch.compile":
        return torch.compile(model, backend="eager")
    if recipe == "fullgraph":
        return torch.compile(model, backend="eager", fullgraph=True)
    if recipe == "model.compile":
        model.compile(backend="eager")
    else:
        model.compile_repeated_blocks(backend="eager", fullgraph=True)
    return model


_ALONE: Dict[Tuple[str, str], Tuple[CompileCounts, List[torch.Tensor]]] = {}


def _alone(family: str, recipe: str) -> Tuple[CompileCounts, List[torch.Tensor]]:
    """The model without ToMe, compiled the same way: its counts and outputs."""
    if (family, recipe) not in _ALONE:
        reset()
        model = build_dit(family, BLOCKS, scale="tiny")
        calls = _inputs(model, family)
        _out(model, calls[0])
        run = _compiled(model, recipe)
        outputs = [_out(run, call) for call in calls]
        _ALONE[family, recipe] = CompileCounts.now(), outputs
        reset()
    return _ALONE[family, recipe]


# (recipe, what comes first): fullgraph after ToMe only (compiled first it is torch.compile's case, the graph then
# refused a break); model.compile (torch.compile of the call, hooks inside) on two families
CASES = [("torch.compile", "tome"), ("torch.compile", "compiled"), ("fullgraph", "tome"), ("regional", "tome"),
         ("regional", "compiled")]
MODULE_COMPILE = [(family, mode, "model.compile", "tome") for family in ("flux", "wan") for mode in ("merge", "kv")]


@pytest.mark.parametrize("family,mode,recipe,first", [(family, mode, recipe, first) for family in FAMILIES
                                                      for mode in ("merge", "kv") for recipe, first in CASES]
                         + MODULE_COMPILE)
def test_compiles_whole(family, mode, recipe, first):
    alone, plain = _alone(family, recipe)
    assert alone.whole, alone  # the control: the model alone compiles whole
    model = build_dit(family, BLOCKS, scale="tiny")
    calls = _inputs(model, family)
    _out(model, calls[0])
    reset()
    if first == "tome":
        apply_patch(model, ratio=0.5, mode=mode, speed_check="off")
        eager = [_out(model, call) for call in calls]
        run = _compiled(model, recipe)
        before = CompileCounts(0, 0, 0)
    else:
        run = _compiled(model, recipe)
        assert relative_error(_out(run, calls[0]), plain[0]) < EXACT
        before = CompileCounts.now()
        apply_patch(model, ratio=0.5, mode=mode, speed_check="off")
        eager = None
    outputs, counts = [], []
    for call in calls:
        outputs.append(_out(run, call))
        counts.append(CompileCounts.now().minus(before))
    reset()
    last = counts[-1]
    assert last.whole, last
    extra = 1 if recipe == "regional" and mode == "merge" else 0  # the first merged block, which matches
    assert last.graphs <= alone.graphs + extra, (last, alone)
    assert counts[0].graphs == last.graphs, counts  # nothing compiled after the first call
    if eager is not None:
        assert max(relative_error(o, e) for o, e in zip(outputs, eager)) < EXACT
    assert min(relative_error(o, p) for o, p in zip(outputs, plain)) > 1e-3  # ToMe acted


UNET_RECIPES = ("fullgraph", "model.compile")  # torch.compile without fullgraph: the DiT tests above


@pytest.mark.parametrize("recipe", UNET_RECIPES)
@pytest.mark.parametrize("mode", ["merge", "kv"])
def test_a_unet_compiles_whole(mode, recipe):
    """SD1.5 (the tiny UNet of the bench): ToMe run eagerly, then the UNet compiled whole (``model.compile`` here with
    fullgraph=True): the UNet alone's graphs, no break, nothing compiled after the first call, compiled equal to eager."""
    from tome_bench.models import build_unet, make_inputs

    def calls(unet):
        sample, _, context, _ = make_inputs(unet, "sd15", 2, 128, 128, seed=1)
        return [dict(sample=sample, timestep=torch.full((2,), t), encoder_hidden_states=context)
                for t in (900.0, 700.0, 500.0)]

    def out(model, call):
        with torch.no_grad():
            return model(**call).sample

    def compiled(unet):
        if recipe == "model.compile":
            unet.compile(backend="eager", fullgraph=True)
            return unet
        return torch.compile(unet, backend="eager", fullgraph=recipe == "fullgraph")

    reset()
    unet = build_unet("sd15", "tiny", seed=0)
    plain = [out(compiled(unet), call) for call in calls(unet)]
    alone = CompileCounts.now()
    reset()
    unet = build_unet("sd15", "tiny", seed=0)
    apply_patch(unet, ratio=0.5, mode=mode)
    eager = [out(unet, call) for call in calls(unet)]
    run = compiled(unet)
    counts = []
    for call, expected in zip(calls(unet), eager):
        assert relative_error(out(run, call), expected) < EXACT
        counts.append(CompileCounts.now())
    reset()
    assert alone.whole and counts[-1].whole, (alone, counts[-1])
    assert counts[-1].graphs <= alone.graphs and counts[0].graphs == counts[-1].graphs, (alone, counts)
    assert min(relative_error(e, p) for e, p in zip(eager, plain)) > 1e-3


def test_unet_blocks_compiled_alone_with_fullgraph_refuse_merge_and_take_kv():
    """A UNet's transformer blocks compiled one by one with fullgraph=True: mode merge's block hooks would run outside
    those graphs and could not hand them their plan (dynamo stopped the call: "Reconstruction failure"), so ToMe refuses
    by name before any block runs, at apply_patch where the blocks are compiled already, else at the next call (ToMe
    run eagerly first); mode kv, whose hook sits inside the block, compiles and equals eager."""
    from tome_bench.models import build_unet, make_inputs
    from tome_core import is_patched

    unet = build_unet("sd15", "tiny", seed=0)
    sample, _, context, _ = make_inputs(unet, "sd15", 2, 128, 128, seed=1)

    def run(model):
        with torch.no_grad():
            return model(sample, torch.full((2,), 500.0), encoder_hidden_states=context).sample

    def compile_blocks(model):
        for block in (m for m in model.modules() if type(m).__name__ == "BasicTransformerBlock"):
            block.compile(backend="eager", fullgraph=True)

    refusal = r"BasicTransformerBlock of the UNet is compiled alone with fullgraph=True.*Compile the whole UNet"
    reset()
    apply_patch(unet, ratio=0.5, mode="merge")
    run(unet)
    compile_blocks(unet)
    with pytest.raises(RuntimeError, match=refusal):
        run(unet)
    remove_patch(unet)
    with pytest.raises(RuntimeError, match=refusal):
        apply_patch(unet, ratio=0.5, mode="merge")
    assert not is_patched(unet)
    eager = build_unet("sd15", "tiny", seed=0)
    apply_patch(eager, ratio=0.5, mode="kv")
    apply_patch(unet, ratio=0.5, mode="kv")
    assert relative_error(run(unet), run(eager)) < EXACT
    assert CompileCounts.now().whole
    reset()
