"""The DiTs under ComfyUI's own TorchCompileModel compile as whole with ToMe as without it, in both modes.

TorchCompileModel (comfy_api.torch_helpers.set_torch_compile_wrapper) hands the sampled model call a
``torch.compile(diffusion_model)``; dynamo's own counters (graphs, graph breaks, frames it gave up on and ran eagerly)
say whether ToMe's block patches were traced into the model's one graph. Backend ``eager``: dynamo traces and counts
as it does for inductor (a break is a break), without the C++ compile, so every family and mode runs in a few
seconds. The models are ComfyUI's own classes built small with seeded weights (the fixtures of test_comfy_dit and
test_comfy_families; LTX-2 where the ComfyUI has it: 2026), sampled with ComfyUI's sampler (euler, 3 steps: every
step a new sigma).

What is checked per family and mode, against the same model compiled without ToMe in the same process: no more
graphs, no graph break, no frame left to eager, nothing compiled after the first step, and the compiled sample equals
the eager sample of the same patch (relative L2 < 1e-4) and differs from the unpatched one (ToMe acted).
"""
from __future__ import annotations

import pytest
import torch
from torch._dynamo.utils import counters

import comfy_env

STEPS = 3
TOLERANCE = 1e-4


@pytest.fixture(scope="module")
def comfy():
    comfy_dir = comfy_env.require_comfyui("TOME_REQUIRE_COMFY", "use .venv-comfy-next/bin/python")
    comfy_env.import_comfy(comfy_dir)
    if not (comfy_dir / "comfy_api" / "torch_helpers").is_dir():
        pytest.skip(f"this ComfyUI ({comfy_dir}) has no TorchCompileModel wrapper (comfy_api.torch_helpers)")
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models
    return comfy


def _family(comfy, name):
    """(patcher, latent, cond) of ``name`` on ComfyUI's SDPA attention (``test_comfy_compile.with_sdpa``: the CPU
    default reads free memory with psutil inside the model, which breaks ComfyUI's own graph with or without ToMe)."""
    import test_comfy_compile
    import test_comfy_dit
    import test_comfy_families

    build = {"flux": test_comfy_dit.flux, "wan": test_comfy_dit.wan, "qwen_image": test_comfy_families.qwen_image,
             "z_image": test_comfy_families.z_image, "ltx2": test_comfy_families.ltxav}[name]
    patcher, latent, cond = build(comfy)[:3]
    return test_comfy_compile.with_sdpa(comfy, patcher), latent, cond


def compiled(patcher):
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    clone = patcher.clone()
    set_torch_compile_wrapper(model=clone, backend="eager")
    return clone


def counted(patcher):
    """A clone whose model calls record (graphs, graph breaks, frames run eagerly) so far, after each call."""
    calls = []

    def wrapper(apply_model, args):
        out = apply_model(args["input"], args["timestep"], **args["c"])
        calls.append(dynamo_counts())
        return out

    clone = patcher.clone()
    clone.set_model_unet_function_wrapper(wrapper)
    return clone, calls


def dynamo_counts():
    return (counters["stats"]["unique_graphs"], sum(counters["graph_break"].values()),
            sum(1 for key in counters["graph_break"] if "falling back to eager" in key or "Skipping frame" in key))


def fresh():
    torch._dynamo.reset()
    counters.clear()


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("mode", ["merge", "kv"])
@pytest.mark.parametrize("family", ["flux", "wan", "qwen_image", "z_image", "ltx2"])
def test_tome_compiles_to_the_graphs_of_the_model_alone(comfy, family, mode):
    import test_comfy_dit
    from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
    from tome_core.engine.config import ToMeConfig

    patcher, latent, cond = _family(comfy, family)
    patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode, speed_check="off"))
    plain = test_comfy_dit.sample(comfy, patcher, latent, cond, steps=STEPS)
    eager = test_comfy_dit.sample(comfy, patched, latent, cond, steps=STEPS)

    fresh()
    alone, alone_calls = counted(compiled(patcher))
    test_comfy_dit.sample(comfy, alone, latent, cond, steps=STEPS)
    fresh()
    with_tome, calls = counted(compiled(patched))
    result = test_comfy_dit.sample(comfy, with_tome, latent, cond, steps=STEPS)
    reasons = sorted({key.splitlines()[0][:160] for key in counters["graph_break"]})
    print(f"{family} {mode}: (graphs, breaks, to eager) per call, alone {alone_calls}, with ToMe {calls}; {reasons}")
    assert calls[-1][1:] == (0, 0), reasons
    assert calls[-1][0] <= alone_calls[-1][0], (calls, alone_calls)
    assert calls[0] == calls[-1], calls  # nothing compiled after the first step
    assert rel(result, eager) < TOLERANCE
    assert rel(result, plain) > 1e-3
