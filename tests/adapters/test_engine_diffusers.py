"""The engine's promises on real diffusers UNets (SD1.5 and SDXL level layouts, reduced channels)."""
from __future__ import annotations

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
import tomesd

import tome_core
from tome_bench.models import build_unet, make_inputs

from conftest import REPO_ROOT, hook_count, relative_error, unet_output

# Parity tolerance with tomesd (fp32, use_rand=False): the maths is identical; only the order of
# additions inside a merged token's mean (scatter_add_ vs scatter_reduce) and the order of tokens
# in the merged sequence differ, which moves fp32 results by a few ulps per op. Measured: ~1e-6.
PARITY_RTOL = 1e-5


def _patched_output(package, unet, inputs, **kwargs):
    """The UNet's output with ``package`` (tomesd or tome_core) applied; the patch is removed after."""
    package.apply_patch(unet, **kwargs)
    try:
        return unet_output(unet, inputs)
    finally:
        package.remove_patch(unet)


def _tomesd_output(unet, inputs, **kwargs):
    return _patched_output(tomesd, unet, inputs, **kwargs)


def _our_output(unet, inputs, **kwargs):
    return _patched_output(tome_core, unet, inputs, **kwargs)


def test_ratio_zero_is_bit_identical(sd15_unet, sd15_inputs):
    vanilla = unet_output(sd15_unet, sd15_inputs)
    tome_core.apply_patch(sd15_unet, ratio=0.0)
    assert tome_core.is_patched(sd15_unet)
    assert torch.equal(unet_output(sd15_unet, sd15_inputs), vanilla)
    tome_core.remove_patch(sd15_unet)


def test_remove_patch_restores_exactly_and_leaves_nothing_behind(sd15_unet, sd15_inputs):
    vanilla = unet_output(sd15_unet, sd15_inputs)
    hooks_before = hook_count(sd15_unet)
    classes_before = [type(m) for m in sd15_unet.modules()]

    tome_core.apply_patch(sd15_unet, ratio=0.5, merge_crossattn=True, merge_mlp=True, max_downsample=8)
    patched = unet_output(sd15_unet, sd15_inputs)
    assert relative_error(patched, vanilla) > 1e-3
    tome_core.remove_patch(sd15_unet)

    assert torch.equal(unet_output(sd15_unet, sd15_inputs), vanilla)
    assert hook_count(sd15_unet) == hooks_before
    assert [type(m) for m in sd15_unet.modules()] == classes_before
    assert not any("_tome_core" in m.__dict__ for m in sd15_unet.modules())
    assert not tome_core.is_patched(sd15_unet)


def test_applying_twice_equals_applying_once(sd15_unet, sd15_inputs):
    tome_core.apply_patch(sd15_unet, ratio=0.5, seed=3)
    once, hooks_once = unet_output(sd15_unet, sd15_inputs), hook_count(sd15_unet)  # block hooks: after a call
    tome_core.apply_patch(sd15_unet, ratio=0.5, seed=3)
    try:
        assert torch.equal(unet_output(sd15_unet, sd15_inputs), once)
        assert hook_count(sd15_unet) == hooks_once
    finally:
        tome_core.remove_patch(sd15_unet)


@pytest.mark.parametrize(
    "options",
    [
        dict(ratio=0.5),
        dict(ratio=0.3, max_downsample=2),
        dict(ratio=0.6, max_downsample=8, merge_crossattn=True, merge_mlp=True),
        dict(ratio=0.4, sx=3, sy=2),
    ],
    ids=["defaults", "ds2", "everything", "strides3x2"],
)
@pytest.mark.parametrize("latent_hw", [(32, 32), (33, 47)], ids=["32x32", "33x47"])
def test_parity_with_tomesd(sd15_unet, options, latent_hw):
    inputs = make_inputs(sd15_unet, "sd15", batch=2, height_px=latent_hw[0] * 8, width_px=latent_hw[1] * 8, seed=2)
    reference = _tomesd_output(sd15_unet, inputs, use_rand=False, **options)
    ours = _our_output(sd15_unet, inputs, use_rand=False, **options)
    vanilla = unet_output(sd15_unet, inputs)
    assert relative_error(reference, vanilla) > 1e-3  # the comparison is not trivial
    assert relative_error(ours, reference) < PARITY_RTOL


def test_sdxl_merges_its_first_attention_level_at_defaults(sdxl_unet):
    inputs = make_inputs(sdxl_unet, "sdxl", batch=2, height_px=256, width_px=256, seed=0)
    vanilla = unet_output(sdxl_unet, inputs)
    assert tome_core.attention_base_downsample(sdxl_unet) == 2
    # tomesd at its defaults leaves SDXL untouched: it only looks at the (attention-free) 1x level.
    assert torch.equal(_tomesd_output(sdxl_unet, inputs), vanilla)

    seen = {}  # attn1 name -> tokens it received, recorded after our merge hook

    def record(name):
        return lambda module, args: seen.__setitem__(name, args[0].shape[1])

    tome_core.apply_patch(sdxl_unet)  # defaults: ratio 0.5, max_downsample 1
    handles = [m.register_forward_pre_hook(record(n)) for n, m in sdxl_unet.named_modules() if n.endswith("attn1")]
    patched = unet_output(sdxl_unet, inputs)
    for h in handles:
        h.remove()
    tome_core.remove_patch(sdxl_unet)

    first_level = 16 * 16  # 256 px -> 32x32 latent -> 16x16 tokens at SDXL's first attention level
    merged = {n: t for n, t in seen.items() if t == first_level - first_level // 2}
    untouched = {n: t for n, t in seen.items() if t == first_level // 4}
    assert merged and untouched and len(merged) + len(untouched) == len(seen)
    assert all(n.startswith(("down_blocks.1", "up_blocks.1")) for n in merged)
    assert relative_error(patched, vanilla) > 1e-3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize(
    "px,batch", [((520, 776), 1), ((1000, 600), 2), ((264, 200), 3), ((136, 72), 4)],
    ids=["520x776-b1", "1000x600-b2", "264x200-b3", "136x72-b4"],
)
def test_any_size_batch_and_dtype(sd15_unet, px, batch, dtype):
    unet = sd15_unet if dtype == torch.float32 else copy.deepcopy(sd15_unet).to(dtype)
    sample, timestep, context, added = make_inputs(unet, "sd15", batch=batch, height_px=px[0], width_px=px[1], seed=4)
    inputs = (sample.to(dtype), timestep, context.to(dtype), added)
    vanilla = unet_output(unet, inputs)
    for mode, kv_downsample in (("merge", "nearest"), ("kv", "nearest"), ("kv", "avg")):
        tome_core.apply_patch(unet, ratio=0.5, max_downsample=2, mode=mode, kv_downsample=kv_downsample)
        out = unet_output(unet, inputs)
        tome_core.remove_patch(unet)
        assert out.shape == vanilla.shape == sample.shape
        assert torch.isfinite(out).all()
        assert 1e-4 < relative_error(out, vanilla) < 0.5


def test_same_seed_same_output_and_global_rng_untouched(sd15_unet, sd15_inputs):
    tome_core.apply_patch(sd15_unet, ratio=0.5, use_rand=True, seed=7)
    rng_before = torch.get_rng_state()
    first = unet_output(sd15_unet, sd15_inputs)
    assert torch.equal(torch.get_rng_state(), rng_before)
    tome_core.apply_patch(sd15_unet, ratio=0.5, use_rand=True, seed=7)
    second = unet_output(sd15_unet, sd15_inputs)
    tome_core.apply_patch(sd15_unet, ratio=0.5, use_rand=True, seed=8)
    other_seed = unet_output(sd15_unet, sd15_inputs)
    tome_core.remove_patch(sd15_unet)
    assert torch.equal(first, second)
    assert not torch.equal(first, other_seed)


def test_same_seed_same_output_across_processes(sd15_unet, sd15_inputs, tmp_path):
    tome_core.apply_patch(sd15_unet, ratio=0.5, use_rand=True, seed=11)
    here = unet_output(sd15_unet, sd15_inputs)
    tome_core.remove_patch(sd15_unet)
    script = textwrap.dedent(
        f"""
        import torch, tome_core
        from tome_bench.models import build_unet, make_inputs
        torch.manual_seed(12345)  # a different global RNG state must not matter
        unet = build_unet("sd15", "tiny", seed=0)
        sample, t, ctx, added = make_inputs(unet, "sd15", batch=2, height_px=256, width_px=256, seed=1)
        tome_core.apply_patch(unet, ratio=0.5, use_rand=True, seed=11)
        with torch.inference_mode():
            torch.save(unet(sample, t, ctx).sample, r"{tmp_path / 'out.pt'}")
        """
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    subprocess.run([sys.executable, "-c", script], check=True, env=env)
    assert torch.equal(torch.load(tmp_path / "out.pt"), here)


def test_cfg_halves_share_one_partition(sd15_unet):
    """Identical rows give identical outputs; cond run alone matches its half of the CFG batch."""
    sample, timestep, context, _ = make_inputs(sd15_unet, "sd15", batch=2, height_px=256, width_px=256, seed=5)
    tome_core.apply_patch(sd15_unet, ratio=0.5, use_rand=True, seed=1)
    same_rows = unet_output(sd15_unet, (sample, timestep, context[:1].repeat(2, 1, 1), None))
    pair = unet_output(sd15_unet, (sample, timestep, context, None))
    cond_alone = unet_output(sd15_unet, (sample[1:], timestep[1:], context[1:], None))
    uncond_alone = unet_output(sd15_unet, (sample[:1], timestep[:1], context[:1], None))
    tome_core.remove_patch(sd15_unet)
    assert torch.equal(same_rows[0], same_rows[1])
    assert torch.allclose(cond_alone[0], pair[1], rtol=1e-4, atol=1e-5)
    assert torch.allclose(uncond_alone[0], pair[0], rtol=1e-4, atol=1e-5)


def test_partition_changes_with_the_step(sd15_unet):
    sample, _, context, _ = make_inputs(sd15_unet, "sd15", batch=2, height_px=256, width_px=256, seed=5)
    tome_core.apply_patch(sd15_unet, ratio=0.5, use_rand=True)
    state = sd15_unet._tome_core
    partitions = []
    for t in (900.0, 100.0, 900.0):
        unet_output(sd15_unet, (sample, torch.full((2,), t), context, None))
        partitions.append(state.tables[(32, 32)])  # this call's partition of level 1 (drawn for its step)
    tome_core.remove_patch(sd15_unet)
    assert not torch.equal(partitions[0].dst_idx, partitions[1].dst_idx)
    assert torch.equal(partitions[0].dst_idx, partitions[2].dst_idx)  # the same step draws the same partition


def test_step_schedule_limits_where_tome_acts(sd15_unet):
    sample, _, context, _ = make_inputs(sd15_unet, "sd15", batch=2, height_px=256, width_px=256, seed=5)
    early, late = (sample, torch.full((2,), 950.0), context, None), (sample, torch.full((2,), 50.0), context, None)
    vanilla_early, vanilla_late = unet_output(sd15_unet, early), unet_output(sd15_unet, late)
    tome_core.apply_patch(sd15_unet, ratio=0.5, start_percent=0.0, end_percent=0.5)
    patched_early, patched_late = unet_output(sd15_unet, early), unet_output(sd15_unet, late)
    tome_core.remove_patch(sd15_unet)
    assert not torch.equal(patched_early, vanilla_early)
    assert torch.equal(patched_late, vanilla_late)


def test_min_tokens_leaves_small_levels_alone(sd15_unet, sd15_inputs):
    vanilla = unet_output(sd15_unet, sd15_inputs)
    assert torch.equal(_our_output(sd15_unet, sd15_inputs, ratio=0.5, min_tokens=1025), vanilla)  # 1024 tokens
    assert not torch.equal(_our_output(sd15_unet, sd15_inputs, ratio=0.5, min_tokens=1024), vanilla)


def test_kv_mode_keeps_every_query(sd15_unet, sd15_inputs):
    received = []
    tome_core.apply_patch(sd15_unet, ratio=0.75, mode="kv")
    attn = sd15_unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    handle = attn.register_forward_pre_hook(lambda m, a, k: received.append((a[0].shape, k["encoder_hidden_states"].shape)),
                                            with_kwargs=True)
    unet_output(sd15_unet, sd15_inputs)
    handle.remove()
    tome_core.remove_patch(sd15_unet)
    (queries, keys), = received
    assert queries[1] == 1024 and keys[1] == 256  # 32x32 tokens, keys/values pooled 2x2


@pytest.mark.parametrize("kv_downsample", ["nearest", "avg"])
def test_kv_keys_values_are_real_tokens_or_window_averages(sd15_unet, sd15_inputs, kv_downsample):
    """nearest: every key/value source is one of the block's own tokens (ToDo); avg: a 2x2 mean."""
    received = []
    attn = sd15_unet.down_blocks[0].attentions[0].transformer_blocks[0].attn1
    tome_core.apply_patch(sd15_unet, ratio=0.75, mode="kv", kv_downsample=kv_downsample, seed=5)
    handle = attn.register_forward_pre_hook(
        lambda m, a, k: received.append((a[0].clone(), k["encoder_hidden_states"].clone())), with_kwargs=True)
    unet_output(sd15_unet, sd15_inputs)
    handle.remove()
    tome_core.remove_patch(sd15_unet)
    (hidden, context), = received
    grid = hidden.view(hidden.shape[0], 32, 32, -1)
    windows = grid.view(hidden.shape[0], 16, 2, 16, 2, -1).permute(0, 1, 3, 2, 4, 5).reshape(hidden.shape[0], 256, 4, -1)
    if kv_downsample == "avg":
        assert torch.allclose(context, windows.mean(2), atol=1e-6)
    else:  # each pooled row equals exactly one token of its window, the same one in every batch row
        match = (windows == context.unsqueeze(2)).all(-1)  # [B, 256, 4]
        assert (match.sum(-1) >= 1).all()
        assert torch.equal(match[0], match[-1])


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(ratio=-0.1), ValueError, "ratio must be in [0, 1), got -0.1"),
        (dict(ratio=1.0), ValueError, "ratio must be in [0, 1), got 1.0"),
        (dict(ratio=0.8), ValueError, "above the mergeable fraction 1 - 1/(sx*sy) = 0.75"),
        (dict(ratio=0.2, sx=1, sy=1), ValueError, "above the mergeable fraction"),
        (dict(sx=0), ValueError, "sx must be an int >= 1, got 0"),
        (dict(sy=1.5), TypeError, "sy must be an int >= 1"),
        (dict(max_downsample=3), ValueError, "max_downsample must be one of (1, 2, 4, 8), got 3"),
        (dict(mode="fast"), ValueError, "mode must be one of ('merge', 'kv')"),
        (dict(mode="kv", merge_mlp=True), ValueError, "mode='kv' only pools self-attention"),
        (dict(mode="kv", kv_downsample="max"), ValueError, "kv_downsample must be one of ('nearest', 'avg')"),
        (dict(ratio="0.5"), TypeError, "ratio must be a finite number"),
        (dict(start_percent=0.8, end_percent=0.2), ValueError, "start_percent <= end_percent"),
    ],
)
def test_bad_values_raise_before_patching(sd15_unet, kwargs, error, message):
    hooks_before = hook_count(sd15_unet)
    with pytest.raises(error) as excinfo:
        tome_core.apply_patch(sd15_unet, **kwargs)
    assert message in str(excinfo.value)
    assert hook_count(sd15_unet) == hooks_before and not tome_core.is_patched(sd15_unet)


def test_models_without_unet_transformer_blocks_are_refused():
    from diffusers import DiTTransformer2DModel, UNet2DModel

    dit = DiTTransformer2DModel(num_attention_heads=2, attention_head_dim=8, in_channels=4, num_layers=1,
                                sample_size=8, num_embeds_ada_norm=10, norm_num_groups=8)
    with pytest.raises(TypeError, match="DiTTransformer2DModel has no UNet with transformer blocks"):
        tome_core.apply_patch(dit)
    assert hook_count(dit) == 0
    plain_unet = UNet2DModel(block_out_channels=(8, 8), norm_num_groups=4, down_block_types=("DownBlock2D",) * 2,
                             up_block_types=("UpBlock2D",) * 2)
    with pytest.raises(TypeError, match="UNet2DModel has no UNet with transformer blocks"):
        tome_core.apply_patch(plain_unet)
    with pytest.raises(TypeError, match="cannot patch a str"):
        tome_core.apply_patch("unet")
