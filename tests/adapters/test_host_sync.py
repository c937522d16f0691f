"""No device-to-host sync inside the per-block path: at most one per model call, in every host path.

A ``TorchDispatchMode`` records every op that needs the host to read device data
(``aten._local_scalar_dense`` is what ``.item()``, ``float(t)``, ``int(t)`` and ``bool(t)`` dispatch
to) or whose output shape depends on the data (``nonzero``, ``bincount``, ``unique``,
``masked_select``: a sync on CUDA). On CPU these cost nothing, but each is a stall of the launch
queue on a GPU. The counts of the patched model are compared with the same model unpatched.
"""
from __future__ import annotations

from collections import Counter

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tome_core
from tome_core import ToMeConfig
from tome_bench.models import build_unet, make_inputs
from tome_core.adapters.model_patcher.unet import SigmaWindow, make_patches

_SYNC_OPS = {"_local_scalar_dense", "nonzero", "nonzero_static", "bincount", "unique", "_unique", "_unique2",
             "unique_dim", "unique_consecutive", "masked_select", "is_nonzero", "equal", "item", "tolist"}

CONFIGS = [
    pytest.param(dict(mode=mode, use_rand=use_rand, start_percent=start), id=f"{mode}-rand{int(use_rand)}-start{start}")
    for mode in ("merge", "kv") for use_rand in (False, True) for start in (0.0, 0.3)
]


class SyncRecorder(TorchDispatchMode):
    """Counts host-syncing and data-dependent-shape aten ops while active."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.overloadpacket.__name__
        if name in _SYNC_OPS:
            self.ops[name] += 1
        return func(*args, **(kwargs or {}))

    @property
    def syncs(self) -> int:
        return sum(self.ops.values())


def _record(fn) -> Counter:
    with torch.inference_mode(), SyncRecorder() as recorder:
        fn()
    return recorder.ops


def _allowed_extra(config: dict) -> int:
    """The diffusers hook reads the timestep once per UNet call, only where a step window needs its value (a random
    partition is drawn from the timestep tensor on its device: no read)."""
    return 1 if config["start_percent"] > 0 else 0


@pytest.fixture(scope="module")
def unet():
    return build_unet("sd15", "tiny", seed=0)


@pytest.mark.parametrize("config", CONFIGS)
def test_diffusers_unet_syncs_at_most_once_per_call(unet, config):
    sample, _, context, added = make_inputs(unet, "sd15", batch=2, height_px=128, width_px=128, seed=1)
    vanilla = _record(lambda: unet(sample, torch.tensor(500), context, added_cond_kwargs=added))
    tome_core.apply_patch(unet, ratio=0.5, **config)
    try:
        for timestep in (900, 100):  # fresh steps: the per-step tables are built inside the call
            patched = _record(lambda: unet(sample, torch.tensor(timestep), context, added_cond_kwargs=added))
            extra = patched - vanilla
            assert sum(extra.values()) <= _allowed_extra(config), (timestep, dict(extra))
            assert set(extra) <= {"_local_scalar_dense", "item"}, dict(extra)
    finally:
        tome_core.remove_patch(unet)


@pytest.mark.parametrize("config", CONFIGS[:4])
def test_diffusers_controlnet_syncs_at_most_once_per_call(unet, config):
    from diffusers import ControlNetModel

    controlnet = ControlNetModel.from_unet(unet).eval()
    sample, _, context, _ = make_inputs(unet, "sd15", batch=2, height_px=128, width_px=128, seed=1)
    hint = torch.rand(2, 3, 128, 128, generator=torch.Generator().manual_seed(3))

    def call(timestep):
        return lambda: controlnet(sample, torch.tensor(timestep), context, controlnet_cond=hint)

    vanilla = _record(call(500))
    tome_core.apply_patch(controlnet, ratio=0.5, **config)
    try:
        for timestep in (900, 100):
            extra = _record(call(timestep)) - vanilla
            assert sum(extra.values()) <= _allowed_extra(config), (timestep, dict(extra))
    finally:
        tome_core.remove_patch(controlnet)


def _comfy_model_call(patches, sigma: float, levels) -> list:
    """One UNet call the way ComfyUI's ``BasicTransformerBlock._forward`` (comfy/ldm/modules/attention.py)
    drives the patches: per block, a fresh ``extra_options`` copied from transformer_options (so the
    ``sigmas`` tensor object is shared by every block of the call), ``attn1_patch(n, n, n, extra_options)``,
    attention, then ``attn1_output_patch(out, extra_options)``. Returns the syncs recorded per block."""
    sigmas = torch.full((2,), sigma)  # BaseModel._apply_model: transformer_options["sigmas"] = t
    transformer_options = {"original_shape": [2, 4, 32, 32], "sigmas": sigmas}
    per_block = []
    for tokens in levels:
        n = torch.randn(2, tokens, 16, generator=torch.Generator().manual_seed(tokens))
        with torch.inference_mode(), SyncRecorder() as recorder:
            extra_options = dict(transformer_options)
            n2, context, value = patches.attn1(n, n, n, extra_options)
            weights = torch.softmax(n2 @ context.transpose(1, 2) / 4.0, dim=-1)
            patches.attn1_output(weights @ value, extra_options)
        per_block.append(recorder.syncs)
    return per_block


@pytest.mark.parametrize("config", CONFIGS)
def test_model_patcher_patches_sync_at_most_once_per_call_and_never_in_untouched_blocks(config):
    """SD1.5 block layout on a 32x32 latent: 1024-token blocks (ToMe acts) and 256/64-token ones (left alone)."""
    window = SigmaWindow(high=10.0, low=0.0) if config["start_percent"] > 0 else SigmaWindow()
    patches = make_patches(ToMeConfig(ratio=0.5, **config), base_downsample=1, window=window)
    levels = [256, 64, 1024, 1024, 256, 256, 64, 1024, 1024, 1024]  # untouched blocks first
    needs_sigma = config["start_percent"] > 0  # a window reads the sigma; random partitions are drawn on its device
    for sigma in (14.0, 5.0, 1.0):  # 14 is outside the window: the sigma is read, ToMe stays off
        per_block = _comfy_model_call(patches, sigma, levels)
        assert sum(per_block) == (1 if needs_sigma else 0), per_block
        assert all(count == 0 for count, tokens in zip(per_block, levels) if tokens != 1024), per_block


@pytest.mark.parametrize("config", CONFIGS)
def test_model_patcher_apply_model_wrapper_reads_the_step_once_and_the_blocks_never(config):
    """ComfyUI 0.3.x: the APPLY_MODEL wrapper (``BaseModel.apply_model``'s executor) reads the sigma at
    most once and hands the call's tables to the blocks, which then sync nowhere; their outputs equal
    those of the patches reading the step themselves (hosts without model wrappers)."""
    window = SigmaWindow(high=10.0, low=0.0) if config["start_percent"] > 0 else SigmaWindow()
    wrapped = make_patches(ToMeConfig(ratio=0.5, **config), base_downsample=1, window=window)
    direct = make_patches(ToMeConfig(ratio=0.5, **config), base_downsample=1, window=window)
    levels = [256, 64, 1024, 1024, 256, 1024]
    needs_sigma = config["start_percent"] > 0  # a window reads the sigma; random partitions are drawn on its device

    def blocks(patches, transformer_options, recorder=None):
        outs = []
        for tokens in levels:
            n = torch.randn(2, tokens, 16, generator=torch.Generator().manual_seed(tokens))
            extra_options = dict(transformer_options)  # BasicTransformerBlock's copy, per block
            with (recorder if recorder is not None else torch.inference_mode()):
                n2, context, value = patches.attn1(n, n, n, extra_options)
                weights = torch.softmax(n2 @ context.transpose(1, 2) / 4.0, dim=-1)
                outs.append(patches.attn1_output(weights @ value, extra_options))
        return outs

    for sigma in (14.0, 5.0, 1.0):
        sigmas = torch.full((2,), sigma)
        x = torch.zeros(2, 4, 32, 32)
        in_blocks = SyncRecorder()

        def executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
            transformer_options["original_shape"] = list(x.shape)  # UNetModel._forward
            return blocks(wrapped, transformer_options, in_blocks)

        options = {"sigmas": sigmas}
        with torch.inference_mode(), SyncRecorder() as whole:
            outs = wrapped.apply_model_wrapper(executor, x, sigmas, None, None, None, options)
        assert in_blocks.syncs == 0, dict(in_blocks.ops)
        assert whole.syncs == (1 if needs_sigma else 0), dict(whole.ops)
        assert options == {"sigmas": sigmas, "original_shape": [2, 4, 32, 32]}  # the tables were removed
        expected = blocks(direct, {"original_shape": [2, 4, 32, 32], "sigmas": sigmas})
        assert all(torch.equal(a, b) for a, b in zip(outs, expected))
        unpatched = blocks(direct, {})  # no original_shape: the patches leave every block alone
        active = not (config["start_percent"] > 0 and sigma == 14.0)
        assert any(not torch.equal(o, u) for o, u in zip(outs, unpatched)) == active


def test_model_patcher_patches_sit_out_a_call_that_reduces_nothing():
    """ComfyUI 0.3.x: outside the window, or with every level left whole, the APPLY_MODEL wrapper hands the model
    a call whose patch lists lack ToMe's (no ToMe code in any block); they are back for the next call, and another
    node's patches stay."""
    other = lambda n, context, value, extra_options: (n, context, value)  # noqa: E731 - another node's patch
    for config, window, sigma in ((ToMeConfig(ratio=0.5, start_percent=0.3), SigmaWindow(high=10.0, low=0.0), 14.0),
                                  (ToMeConfig(ratio=0.5, min_tokens=1 << 20), SigmaWindow(), 5.0)):
        patches = make_patches(config, base_downsample=1, window=window)
        listed = {"attn1_patch": [other, patches.attn1], "attn1_output_patch": [patches.attn1_output]}
        options = {"patches": listed}
        seen = []

        def executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
            seen.append({kind: list(fns) for kind, fns in transformer_options["patches"].items()})

        with torch.inference_mode():
            patches.apply_model_wrapper(executor, torch.zeros(2, 4, 32, 32), torch.full((2,), sigma), None, None,
                                        None, options)
        assert seen[-1] == {"attn1_patch": [other], "attn1_output_patch": []}
        assert options["patches"] is listed and listed["attn1_patch"] == [other, patches.attn1]
