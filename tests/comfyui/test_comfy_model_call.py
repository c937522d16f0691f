"""ToMe's once-per-model-call work on the UNet, in process, on each ComfyUI: where it runs and what it spares.

Before each model call ToMe builds the call's per-level tables (one matching per level, the speed check) and, when
the call reduces nothing, hands the model patch lists without its own patches. ComfyUI 0.3.x runs that in ToMe's
APPLY_MODEL wrapper (``add_wrapper_with_key``). The 2024 ComfyUI has no model wrappers; there (and in Forge, whose
UnetPatcher keeps the same slot) ToMe takes ``model_options["model_function_wrapper"]``, which
``comfy.samplers`` calls as ``wrapper(model.apply_model, {"input", "timestep", "c", "cond_or_uncond"})``. That slot
holds one function: a wrapper a node set before ToMe is chained (both act); one set after ToMe replaces ToMe's, and
ToMe's patches then still reduce, matching per block, and say so in the log.

The model is ComfyUI's own (``comfy.supported_models.SD15`` built from ``comfy_env.tiny_sd15_unet_config``, seeded
weights), patched by our node and sampled with ``comfy.sample.sample`` (euler, cfg 5: cond and uncond in one call).
Level 1 of the 16x16 latent has 3 transformer blocks (1 down, 2 up).
"""
from __future__ import annotations

import importlib
import logging

import pytest
import torch

import comfy_env

STEPS = 2
LEVEL_1_BLOCKS = 3


@pytest.fixture(scope="module")
def comfy():
    comfy_dir = comfy_env.require_comfyui("TOME_REQUIRE_COMFY", "run tests/comfyui/setup_env.sh")
    comfy_env.import_comfy(comfy_dir)
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models
    return comfy


@pytest.fixture(scope="module")
def package(comfy):
    """The repository root imported as a package, as ComfyUI's loader does."""
    return comfy_env.import_repo_package("tome_custom_node_model_call_test").__name__


@pytest.fixture(scope="module")
def base(comfy):
    model = comfy.supported_models.SD15(comfy_env.tiny_sd15_unet_config()).get_model({})
    comfy_env._seeded_init(model.diffusion_model, 0)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def has_model_wrappers(patcher) -> bool:
    return callable(getattr(patcher, "add_wrapper_with_key", None))


def sample(comfy, patcher) -> torch.Tensor:
    return comfy_env.sample_tiny_sd15(comfy, patcher, STEPS)


def tome(package, patcher, **changes):
    values = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=False, tome_seed=0, mode="merge",
                  merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0, matching="level",
                  speed_check="off")
    values.update(changes)
    nodes = importlib.import_module(f"{package}.nodes.tome_nodes")
    return nodes.ToMeAdvanced().patch(patcher, **values)["result"][0]


def recorder(calls: list):
    """A node's model_function_wrapper (the hook sampler add-ons use): records each call and runs the model."""
    def wrapper(apply_model, args):
        calls.append(tuple(args["input"].shape))
        return apply_model(args["input"], args["timestep"], **args["c"])

    return wrapper


@pytest.fixture()
def matchings(package, monkeypatch):
    """How many matchings the sampling makes (calls of the engine's ``match_tokens``)."""
    return comfy_env.count_calls(monkeypatch, importlib.import_module(f"{package}.tome_core.engine.plan"),
                                 "match_tokens")


def test_level_matching_matches_once_per_level_and_model_call(comfy, package, base, matchings):
    plain = sample(comfy, base)
    level = sample(comfy, tome(package, base))
    assert matchings[0] == STEPS  # one model call per step (cond and uncond batched), one level reduced
    matchings[0] = 0
    block = sample(comfy, tome(package, base, matching="block"))
    assert matchings[0] == STEPS * LEVEL_1_BLOCKS
    assert not torch.equal(level, plain) and not torch.equal(level, block)


@pytest.fixture(scope="module")
def full_layout(comfy):
    """SD1.5's block layout (16 transformer blocks on 4 levels, 5 of them on level 1) at 64 channels."""
    config = comfy_env.tiny_sd15_unet_config(
        model_channels=64, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
        transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0])
    model = comfy.supported_models.SD15(config).get_model({})
    comfy_env._seeded_init(model.diffusion_model, 0)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


@pytest.mark.parametrize("changes, most_calls", [
    (dict(min_tokens=1 << 20), 5),  # every level left whole: the wrapper's own few calls, nothing per block
    (dict(speed_check="auto"), 104),  # the hosts' default (merge, level matching): a third of cacab79's 312
    (dict(mode="kv"), 108),  # half of cacab79's 216
])
def test_python_calls_into_tome_core_per_model_call(comfy, package, full_layout, monkeypatch, changes, most_calls):
    """The targets of the issue "Free when it does nothing" in ComfyUI, counted as the bench's ``--ops`` counts
    them (``sys.setprofile``, host syncs under a ``TorchDispatchMode``): on a fast GPU each Python call is launch
    time, and a sync stops the host from running ahead. A call that reduces nothing hands
    the blocks patch lists without ToMe's, so no block calls into tome_core."""
    from tome_bench.op_count import count_ops

    vanilla, plain = count_ops(lambda: sample(comfy, full_layout))
    patched = tome(package, full_layout, **changes)
    seen = []
    attention = importlib.import_module("comfy.ldm.modules.attention")
    real_block_forward = attention.BasicTransformerBlock.forward

    def block_forward(self, x, context=None, transformer_options={}):
        seen.append(len((transformer_options.get("patches") or {}).get("attn1_patch") or []))
        return real_block_forward(self, x, context=context, transformer_options=transformer_options)

    monkeypatch.setattr(attention.BasicTransformerBlock, "forward", block_forward)
    sample(comfy, patched)  # the first call of a size works out its levels
    seen.clear()
    count, _ = count_ops(lambda: sample(comfy, patched))
    assert len(seen) == 2 * 16 * STEPS  # count_ops runs it twice; one model call per step (cond and uncond batched)
    assert 0 < count.tome_calls <= most_calls * STEPS, count.tome_calls / STEPS
    assert count.syncs == vanilla.syncs  # no host sync of ToMe's in any model call
    monkeypatch.undo()
    if most_calls == 5:
        assert set(seen) == {0}, seen  # no attn1 patch in any block
        assert torch.equal(sample(comfy, patched), plain)
    else:
        assert set(seen) == {1}, seen
        assert not torch.equal(sample(comfy, patched), plain)


def test_a_wrapper_set_before_tome_keeps_acting_beside_it(comfy, package, base, matchings):
    calls = []
    first = base.clone()
    first.set_model_unet_function_wrapper(recorder(calls))
    alone = sample(comfy, tome(package, base))
    matchings[0] = 0
    both = sample(comfy, tome(package, first))
    assert len(calls) == STEPS  # the node's wrapper still runs, once per model call
    assert matchings[0] == STEPS  # and ToMe still matches once per level and call
    assert torch.equal(both, alone)  # the recorder changes nothing, so ToMe's image is unchanged


def test_a_wrapper_set_after_tome_leaves_tome_reducing(comfy, package, base, matchings, caplog):
    calls = []
    plain = sample(comfy, base)
    patched = tome(package, base)
    after = patched.clone()
    after.set_model_unet_function_wrapper(recorder(calls))
    matchings[0] = 0
    with caplog.at_level(logging.WARNING):
        both = sample(comfy, after)
    assert len(calls) == STEPS
    assert not torch.equal(both, plain)  # ToMe still reduces
    if has_model_wrappers(base):  # ToMe's wrapper is keyed, not in the slot: unchanged
        assert torch.equal(both, sample(comfy, patched))
    else:  # its slot was taken: ToMe matches per block, and the log says why and what to do
        assert matchings[0] == STEPS * LEVEL_1_BLOCKS
        warned = [r.getMessage() for r in caplog.records if "replaced its model_function_wrapper" in r.getMessage()]
        assert len(warned) == 1 and "Apply ToMe after that node" in warned[0], warned


def test_match_every_on_the_advanced_node(comfy, package, base, matchings):
    """match_every=2: the second model call of a run reuses the first's matching, and each run starts afresh (ComfyUI
    0.3's ``sample_sigmas``); refused with the fix where the host marks no sampling run (the 2024 ComfyUI)."""
    if not has_model_wrappers(base):
        with pytest.raises(ValueError, match="match_every=2 .* needs ComfyUI 0.3.*set match_every=1"):
            tome(package, base, match_every=2)
        return
    every_call = sample(comfy, tome(package, base))
    reusing = tome(package, base, match_every=2)
    matchings[0] = 0
    first = sample(comfy, reusing)
    assert matchings[0] == 1  # STEPS = 2 model calls, one matching
    second = sample(comfy, reusing)
    assert matchings[0] == 2  # the second run matched afresh
    assert torch.equal(first, second) and not torch.equal(first, every_call)
    with pytest.raises(ValueError, match="match_every"):
        tome(package, base, match_every=2, mode="kv")


def tiler(calls: list):
    """A wrapper like Forge's MultiDiffusion (extensions-builtin/sd_forge_multidiffusion): the model runs on each 8x8
    quarter of the 16x16 latent. A quarter has 64 tokens on its first level, as the whole latent has on its second."""
    def wrapper(apply_model, args):
        x, t, c = args["input"], args["timestep"], args["c"]
        out = torch.zeros_like(x)
        for i in (0, 8):
            for j in (0, 8):
                calls.append((i, j))
                out[:, :, i:i + 8, j:j + 8] = apply_model(x[:, :, i:i + 8, j:j + 8], t, **c)
        return out

    return wrapper


def test_a_tiling_wrapper_before_tome_gets_each_tile_reduced(comfy, package, base, matchings):
    """ToMe prepares each call the wrapper makes, for that call's latent: every tile's first level is matched once
    (on hosts without model wrappers ToMe hands the earlier wrapper an apply_model it prepares)."""
    calls = []
    tiled = base.clone()
    tiled.set_model_unet_function_wrapper(tiler(calls))
    tiles_alone = sample(comfy, tiled)
    matchings[0] = 0
    both = sample(comfy, tome(package, tiled))
    assert len(calls) == 2 * 4 * STEPS
    assert matchings[0] == 4 * STEPS  # one matching per tile call, on its level 1
    assert not torch.equal(both, tiles_alone)


def test_the_speed_check_repeats_are_not_taken_for_a_replaced_wrapper(comfy, package, base, caplog):
    """The speed check repeats a call ToMe prepared; the fallback's check must not read that as a node having taken
    ToMe's wrapper slot (it warned on a plain run in the real Forge)."""
    with caplog.at_level(logging.WARNING):
        sample(comfy, tome(package, base, speed_check="on"))
    assert not [r for r in caplog.records if "replaced its model_function_wrapper" in r.getMessage()]
