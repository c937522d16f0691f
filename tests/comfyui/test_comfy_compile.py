"""torch.compile through ComfyUI's own TorchCompileModel node on a ToMe-patched model, in process.

TorchCompileModel (comfy_extras/nodes_torch_compile.py, ComfyUI 0.3.x) clones the MODEL and adds an
APPLY_MODEL wrapper that swaps ``diffusion_model`` for ``torch.compile(diffusion_model)`` (inductor,
CPU here) for each model call. The models are real ComfyUI ones: the tiny SD1.5 UNet of
``comfy_env.tiny_sd15_unet_config`` built by ``comfy.supported_models.SD15`` with seeded weights,
and the reduced Flux of test_comfy_dit; they are patched by our nodes and sampled with
``comfy.sample.sample`` (euler; the UNet at cfg 5, so every call runs the cond and uncond halves).
Attention is ComfyUI's ``attention_pytorch`` (SDPA, what it picks on a GPU), set through
``transformer_options["optimized_attention_override"]``: the CPU default, ``attention_sub_quad``,
reads the free memory with psutil inside the model, which breaks ComfyUI's own graph with or without
ToMe. So without ToMe the compiled UNet is one graph with no break (the control test), and every
graph break below is ToMe's.

What is checked, fp32: the compiled sample equals the eager sample of the same patch within a
relative L2 of ``TOLERANCE`` = 1e-3 (measured 3.3e-6 for kv and 3.4e-6 for merge on the UNet,
3.8e-6 on Flux; a different ToMe seed moves the eager sample by 0.12), differs from the unpatched
sample (the patch was compiled in), and the patched model compiles exactly as the unpatched one
does: one graph, no graph break, nothing compiled after the first model call of a sampling loop
(every step's sigma differs) nor in a second loop with the same compiled model, in both orders
(ToMe then TorchCompileModel, and TorchCompileModel then ToMe).

Why that holds (torch 2.13, ComfyUI 0.3.75): ToMe's per-call work runs in its own APPLY_MODEL
wrapper, in eager Python outside the compiled ``diffusion_model``: on the UNet it reads the sigma
once, seeds the generator and builds every level's partition (merge) or kept-key index (kv) for
the call, and hands them to the blocks in ``transformer_options``; the blocks' attn1 patches then
only look their grid up (shapes and tensors, no float, no generator: a float there would be
guarded on and recompiled at every step). Flux's wrapper sets the attention override with the
call's kept indices the same way. On ComfyUIs without model wrappers the patches read the step
themselves (once per model call) and torch.compile breaks the graph there.

The 2024 ComfyUI has no TorchCompileModel: the tests skip there. Run time on two busy cores: about
2 minutes with an empty inductor cache (mostly inductor's C++ compile; the control alone ~40 s),
about 45 s with a warm one.
"""
from __future__ import annotations

import importlib
import importlib.util
import re
from typing import Dict, List, Tuple

import pytest
import torch
from torch._dynamo.utils import counters

import comfy_env

TOLERANCE = 1e-3  # relative L2, fp32; measured ~3.5e-6
ONE_GRAPH = (1, 1, 0)  # (graphs, frames, graph breaks) compiled so far, after a model call
STEPS = 5


@pytest.fixture(scope="module")
def comfy():
    comfy_dir = comfy_env.require_comfyui("TOME_REQUIRE_COMFY", "use .venv-comfy-next/bin/python")
    comfy_env.import_comfy(comfy_dir)
    if not (comfy_dir / "comfy_extras" / "nodes_torch_compile.py").is_file():
        pytest.skip(f"this ComfyUI ({comfy_dir}) has no TorchCompileModel node "
                    "(comfy_extras/nodes_torch_compile.py, ComfyUI 0.3.x)")
    import comfy.ldm.modules.attention as attention

    if not hasattr(attention, "wrap_attn"):
        pytest.skip("this ComfyUI has no optimized_attention_override to select SDPA (needs ComfyUI 0.3.6x+)")
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models
    return comfy


@pytest.fixture(scope="module")
def compile_node(comfy):
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    def apply(patcher):
        return TorchCompileModel.execute(model=patcher, backend="inductor").result[0]

    return apply


@pytest.fixture(scope="module")
def tome_nodes(comfy):
    """Our node classes, from the repository root imported as a package under its own name."""
    name = comfy_env.import_repo_package("tome_custom_node_compile_test").__name__
    return importlib.import_module(f"{name}.nodes.tome_nodes")


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from nothing (inductor's on-disk cache may still answer) and leaves nothing."""
    torch._dynamo.reset()
    counters.clear()
    yield
    torch._dynamo.reset()
    counters.clear()


def with_sdpa(comfy, patcher):
    """ComfyUI's attention_pytorch for this patcher's models, through ComfyUI's override slot."""
    import comfy.ldm.modules.attention as attention

    def sdpa(func, *args, **kwargs):
        return attention.attention_pytorch(*args, **kwargs)

    patcher.model_options.setdefault("transformer_options", {})["optimized_attention_override"] = sdpa
    return patcher


def sd15(comfy):
    model = comfy.supported_models.SD15(comfy_env.tiny_sd15_unet_config()).get_model({})
    comfy_env._seeded_init(model.diffusion_model, 0)
    cpu = torch.device("cpu")
    return with_sdpa(comfy, comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu))


def sample_sd15(comfy, patcher, steps: int = STEPS) -> torch.Tensor:
    return comfy_env.sample_tiny_sd15(comfy, patcher, steps)


def tome(tome_nodes, patcher, mode: str, seed: int = 0):
    values = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=seed, mode=mode,
                  merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0)
    return tome_nodes.ToMeAdvanced().patch(patcher, **values)["result"][0]


def counted(patcher) -> Tuple[object, List[Tuple[int, int, int]]]:
    """A clone whose model calls record (graphs, frames, graph breaks) compiled so far, after each call."""
    calls: List[Tuple[int, int, int]] = []

    def wrapper(apply_model, args):
        out = apply_model(args["input"], args["timestep"], **args["c"])
        calls.append((counters["stats"]["unique_graphs"], counters["frames"]["total"],
                      sum(counters["graph_break"].values())))
        return out

    clone = patcher.clone()
    clone.set_model_unet_function_wrapper(wrapper)
    return clone, calls


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def break_report() -> Dict[str, object]:
    """What dynamo recorded: each graph-break reason (first line) with its count, and the resume points
    (function, line) where traced code went on after a break."""
    reasons = {key.splitlines()[0]: count for key, count in counters["graph_break"].items()}
    resumes = [re.fullmatch(r"torch_dynamo_resume_in_(.+)_at_(\d+)", name) for name in counters["resumes"]]
    return {"reasons": reasons, "resumes": sorted((m.group(1), int(m.group(2))) if m else (name, -1)
                                                  for m, name in zip(resumes, counters["resumes"]))}


def test_the_unpatched_unet_compiles_to_one_graph(comfy, compile_node):
    """The control: without ToMe, ComfyUI's UNet (with SDPA) is one graph with no break."""
    base = sd15(comfy)
    eager = sample_sd15(comfy, base, steps=3)
    compiled, calls = counted(compile_node(base))
    result = sample_sd15(comfy, compiled, steps=3)
    assert rel(result, eager) < TOLERANCE
    assert calls == [ONE_GRAPH] * 3, calls


@pytest.mark.parametrize("mode", ["kv", "merge"])
def test_tome_then_compile_matches_eager_and_stops_compiling(comfy, compile_node, tome_nodes, mode):
    base = sd15(comfy)
    eager = sample_sd15(comfy, tome(tome_nodes, base, mode))
    other_seed = sample_sd15(comfy, tome(tome_nodes, base, mode, seed=1))
    plain = sample_sd15(comfy, base)
    compiled, calls = counted(compile_node(tome(tome_nodes, base, mode)))
    result = sample_sd15(comfy, compiled)
    report = break_report()
    print(f"{mode}: (graphs, frames, breaks) per call {calls}; {report}")
    error = rel(result, eager)
    assert error < TOLERANCE, error
    assert error < rel(other_seed, eager) / 100  # the same random partition at every step
    assert rel(result, plain) > 1e-2  # ToMe was compiled in
    assert calls == [ONE_GRAPH] * STEPS, (calls, report)
    calls.clear()
    assert torch.equal(sample_sd15(comfy, compiled), result)  # a second loop: nothing new compiled
    assert calls == [ONE_GRAPH] * STEPS, calls


def test_compile_then_tome_matches_eager(comfy, compile_node, tome_nodes):
    """TorchCompileModel before ToMe: the patches travel in transformer_options into the compiled UNet.
    One mode (merge, which has more plan code in the graph) to keep the file near two minutes."""
    base, mode = sd15(comfy), "merge"
    eager = sample_sd15(comfy, tome(tome_nodes, base, mode), steps=3)
    compiled, calls = counted(tome(tome_nodes, compile_node(base), mode))
    result = sample_sd15(comfy, compiled, steps=3)
    assert rel(result, eager) < TOLERANCE
    assert rel(result, sample_sd15(comfy, base, steps=3)) > 1e-2
    assert calls == [ONE_GRAPH] * 3, (calls, break_report())


def flux(comfy):
    import test_comfy_dit

    patcher, latent, cond, _ = test_comfy_dit.flux(comfy)
    return with_sdpa(comfy, patcher), latent, cond


def sample_flux(comfy, patcher, latent, cond) -> torch.Tensor:
    import test_comfy_dit

    return test_comfy_dit.sample(comfy, patcher, latent, cond, steps=3)


def test_flux_tome_then_compile_is_one_graph_matching_eager(comfy, compile_node, tome_nodes):
    """A DiT in kv: ToMe's per-call work runs in its APPLY_MODEL wrapper, outside the compiled module."""
    patcher, latent, cond = flux(comfy)
    patched = tome(tome_nodes, patcher, "kv")
    eager = sample_flux(comfy, patched, latent, cond)
    compiled, calls = counted(compile_node(patched))
    result = sample_flux(comfy, compiled, latent, cond)
    print(f"flux kv: (graphs, frames, breaks) per call {calls}; {break_report()}")
    assert rel(result, eager) < TOLERANCE
    assert rel(result, sample_flux(comfy, patcher, latent, cond)) > 1e-3
    assert calls == [ONE_GRAPH] * 3, (calls, break_report())


def test_flux_compile_then_tome(comfy, compile_node, tome_nodes):
    """TorchCompileModel's wrapper, added first, runs outside ToMe's: ToMe sees the OptimizedModule (mode kv)."""
    patcher, latent, cond = flux(comfy)
    compiled, calls = counted(tome(tome_nodes, compile_node(patcher), "kv"))
    patched = tome(tome_nodes, patcher, "kv")
    assert rel(sample_flux(comfy, compiled, latent, cond), sample_flux(comfy, patched, latent, cond)) < TOLERANCE
    assert calls == [ONE_GRAPH] * 3, (calls, break_report())


def z_image(comfy):
    import test_comfy_families

    patcher, latent, cond, _, _ = test_comfy_families.z_image(comfy)
    return with_sdpa(comfy, patcher), latent, cond


@pytest.mark.parametrize("family", ["flux", "z_image"])
def test_dit_merge_then_compile_matches_eager(comfy, compile_node, tome_nodes, family):
    """A DiT in mode merge: Flux's block replace patches, or Z-Image's object-patched layers (copies sharing the
    weights), run inside the compiled module (the matching at the first reduced block, the merge and unmerge at each);
    compiled equals eager, reports its graphs, and does not recompile from step to step."""
    patcher, latent, cond = {"flux": flux, "z_image": z_image}[family](comfy)
    patched = tome(tome_nodes, patcher, "merge")
    eager = sample_flux(comfy, patched, latent, cond)
    compiled, calls = counted(compile_node(patched))
    result = sample_flux(comfy, compiled, latent, cond)
    print(f"{family} merge: (graphs, frames, breaks) per call {calls}; {break_report()}")
    assert rel(result, eager) < TOLERANCE
    assert rel(result, sample_flux(comfy, patcher, latent, cond)) > 1e-3
    assert calls[-1] == calls[-2], (calls, break_report())  # no recompiling from step to step


def test_dit_merge_with_weighed_keys_then_compile_matches_eager(comfy, compile_node):
    """Flux's merged single blocks with balanced attention: the per-block attention override that adds the keys' bias
    runs inside the compiled module; compiled equals eager and does not recompile from step to step."""
    from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
    from tome_core.engine.config import ToMeConfig

    patcher, latent, cond = flux(comfy)
    patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="merge", merge_attention="balanced"))
    plain = sample_flux(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="merge",
                                                                          merge_attention="plain")), latent, cond)
    eager = sample_flux(comfy, patched, latent, cond)
    assert rel(eager, plain) > 1e-4  # the bias acts
    compiled, calls = counted(compile_node(patched))
    result = sample_flux(comfy, compiled, latent, cond)
    print(f"flux merge, balanced: (graphs, frames, breaks) per call {calls}; {break_report()}")
    assert rel(result, eager) < TOLERANCE
    assert calls[-1] == calls[-2], (calls, break_report())  # no recompiling from step to step
