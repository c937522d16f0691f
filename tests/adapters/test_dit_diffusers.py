"""Mode "kv" on real diffusers DiTs (Flux, SD3/3.5, Wan, HunyuanVideo), reduced in size, seeded weights."""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tome_core import apply_patch, is_patched, remove_patch  # noqa: E402
from conftest import SpyAttention, check_identity_at_ratio_zero_and_after_removal, check_reduced_output  # noqa: E402
from conftest import seed_weights as _seed_weights  # noqa: E402
from tome_core.adapters.hooks.dit import STATE_ATTR  # noqa: E402


def flux(h: int = 6, w: int = 7, batch: int = 1, text: int = 5):
    model = _seed_weights(diffusers.FluxTransformer2DModel(
        patch_size=1, in_channels=16, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, axes_dims_rope=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(h, w, 3)
    ids[..., 1] = torch.arange(h)[:, None]
    ids[..., 2] = torch.arange(w)[None, :]
    inputs = dict(hidden_states=torch.randn(batch, h * w, 16, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
                  pooled_projections=torch.randn(batch, 32, generator=g), timestep=torch.full((batch,), 0.6),
                  img_ids=ids.reshape(-1, 3), txt_ids=torch.zeros(text, 3))
    return model, inputs, dict(prefix=text, suffix=0, grid=(h, w))


def sd3(h: int = 10, w: int = 14, batch: int = 1, text: int = 6):
    model = _seed_weights(diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=4, num_layers=2, attention_head_dim=8, num_attention_heads=2,
        joint_attention_dim=32, caption_projection_dim=16, pooled_projection_dim=32, out_channels=4,
        pos_embed_max_size=32, dual_attention_layers=(0,)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, h, w, generator=g),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g),
                  pooled_projections=torch.randn(batch, 32, generator=g), timestep=torch.full((batch,), 600.0))
    return model, inputs, dict(prefix=0, suffix=text, grid=(h // 2, w // 2))


def wan(frames: int = 5, h: int = 10, w: int = 6, batch: int = 1):
    model = _seed_weights(diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=g),
                  encoder_hidden_states=torch.randn(batch, 7, 16, generator=g),
                  timestep=torch.full((batch,), 600.0))
    return model, inputs, dict(prefix=0, suffix=0, grid=(frames, h // 2, w // 2))


def hunyuan_video(frames: int = 3, h: int = 6, w: int = 10, batch: int = 1, text: int = 7):
    """[image, text] joint attention (text last, its two padding tokens masked), after a text refiner."""
    model = _seed_weights(diffusers.HunyuanVideoTransformer3DModel(
        in_channels=4, out_channels=4, num_attention_heads=2, attention_head_dim=16, num_layers=1,
        num_single_layers=2, num_refiner_layers=1, mlp_ratio=2.0, patch_size=2, patch_size_t=1,
        text_embed_dim=32, pooled_projection_dim=32, rope_axes_dim=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    mask = torch.ones(batch, text, dtype=torch.long)
    mask[:, -2:] = 0
    inputs = dict(hidden_states=torch.randn(batch, 4, frames, h, w, generator=g), timestep=torch.full((batch,), 600.0),
                  encoder_hidden_states=torch.randn(batch, text, 32, generator=g), encoder_attention_mask=mask,
                  pooled_projections=torch.randn(batch, 32, generator=g), guidance=torch.full((batch,), 6000.0))
    return model, inputs, dict(prefix=0, suffix=text, grid=(frames, h // 2, w // 2))


FAMILIES = {"flux": flux, "sd3": sd3, "wan": wan, "hunyuan_video": hunyuan_video}


def first_over_layout(calls, where) -> int:
    """Index of the first attention whose keys span the whole layout (HunyuanVideo's text refiner comes first)."""
    length = where["prefix"] + int(torch.tensor(where["grid"]).prod()) + where["suffix"]
    return next(i for i, (_, k, _) in enumerate(calls) if k.shape[-2] == length)


def run(model, inputs) -> torch.Tensor:
    with torch.inference_mode():
        return model(**inputs, return_dict=False)[0]


def spied(model, inputs):
    spy = SpyAttention()
    with spy:
        out = run(model, inputs)
    return out, spy.calls


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_and_removal_are_bit_identical(family):
    model, inputs, _ = FAMILIES[family]()
    check_identity_at_ratio_zero_and_after_removal(model, inputs, run, apply_patch, remove_patch, is_patched,
                                                   STATE_ATTR)


@pytest.mark.parametrize("family", FAMILIES)
def test_queries_and_text_untouched_image_keys_are_real_picks(family):
    model, inputs, where = FAMILIES[family]()
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", seed=4, block_start=0.0)  # every block, Flux's double ones too
    _, patched = spied(model, inputs)
    state = model.__dict__[STATE_ATTR]
    assert len(patched) == len(vanilla) and state.reduced_calls > 0
    first = first_over_layout(vanilla, where)
    q0, k0, v0 = vanilla[first]
    q1, k1, v1 = patched[first]  # the first attention over the layout: same inputs with and without the patch
    assert torch.equal(q0, q1)
    pre, suf = where["prefix"], where["suffix"]
    n = k0.shape[-2]
    assert k1.shape[-2] < n
    if pre:
        assert torch.equal(k1[..., :pre, :], k0[..., :pre, :]) and torch.equal(v1[..., :pre, :], v0[..., :pre, :])
    if suf:
        assert torch.equal(k1[..., -suf:, :], k0[..., -suf:, :]) and torch.equal(v1[..., -suf:, :], v0[..., -suf:, :])
    # Every kept image key is a real rotated key of the unpatched run, each from a different position.
    img0 = k0[..., pre:n - suf, :]
    img1 = k1[..., pre:k1.shape[-2] - suf, :]
    match = (img1[0, 0][:, None, :] == img0[0, 0][None, :, :]).all(-1)
    assert (match.sum(1) >= 1).all()
    assert match.float().argmax(1).unique().numel() == img1.shape[-2]
    for (qa, _, _), (qb, kb, vb) in zip(vanilla, patched):
        assert qa.shape == qb.shape  # every query kept in every block
        assert kb.shape[-2] == vb.shape[-2]


@pytest.mark.parametrize("family,size", [("flux", dict(h=5, w=3)), ("sd3", dict(h=6, w=10)),
                                         ("wan", dict(frames=3, h=6, w=10)), ("wan", dict(frames=1, h=6, w=6)),
                                         ("hunyuan_video", dict(frames=5, h=6, w=10))])
@pytest.mark.parametrize("batch", [1, 4])
def test_odd_sizes_and_batches(family, size, batch):
    model, inputs, where = FAMILIES[family](batch=batch, **size)
    state = check_reduced_output(model, inputs, run, apply_patch, STATE_ATTR)
    assert state.reduced_calls > 0


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16(family):
    model, inputs, _ = FAMILIES[family]()
    model = model.to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if v.is_floating_point() and "ids" not in k else v for k, v in inputs.items()}
    expected = run(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv")
    out = run(model, inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out.float()).all()
    remove_patch(model)
    assert torch.equal(run(model, inputs), expected)


@pytest.mark.parametrize("family", FAMILIES)
def test_same_seed_same_output_other_seed_other_picks(family):
    model, inputs, _ = FAMILIES[family]()
    apply_patch(model, ratio=0.5, mode="kv", seed=1)
    a, b = run(model, inputs), run(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", seed=2)
    c = run(model, inputs)
    assert torch.equal(a, b) and not torch.equal(a, c)


def test_pipeline_like_object_patches_its_transformer():
    model, inputs, _ = flux()

    class Holder:  # what apply_patch reads of a pipeline without a components dict
        transformer = model

    holder = Holder()
    apply_patch(holder, ratio=0.5, mode="kv")
    assert STATE_ATTR in model.__dict__
    remove_patch(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_and_avg_are_refused_naming_the_model(family):
    """Mode merge where the family has none (Flux.1 and Wan have it: test_dit_merge_diffusers), avg on every DiT."""
    model, inputs, _ = FAMILIES[family]()
    name = type(model).__name__
    if family not in ("flux", "wan"):
        with pytest.raises(ValueError, match=f"reaches flux, flux2, qwen_image, lumina2, z_image, wan, wan_vace, "
                                             f"wan_animate, ltx2 so far; {name} "
                                             "is not among them.*kv'"):
            apply_patch(model, ratio=0.5, mode="merge")
    with pytest.raises(ValueError, match=f"not supported on {name}.*RoPE.*kv_downsample='nearest'"):
        apply_patch(model, ratio=0.5, mode="kv", kv_downsample="avg")
    assert not is_patched(model)


def test_a_dit_outside_the_catalogue_is_refused_naming_the_model():
    model = diffusers.HunyuanDiT2DModel(
        num_attention_heads=2, attention_head_dim=8, in_channels=4, patch_size=2, sample_size=8, hidden_size=16,
        num_layers=2, cross_attention_dim=16, cross_attention_dim_t5=16, pooled_projection_dim=16, text_len=4,
        text_len_t5=4)
    with pytest.raises(TypeError, match="HunyuanDiT2DModel has no UNet with transformer blocks.*not a DiT"):
        apply_patch(model, ratio=0.5, mode="kv")
    assert not is_patched(model)


def test_schedule_turns_reduction_off_outside_its_range():
    model, inputs, _ = flux()
    expected = run(model, inputs)  # flux timestep 0.6 -> progress 0.4
    apply_patch(model, ratio=0.5, mode="kv", start_percent=0.5)
    assert torch.equal(run(model, inputs), expected)
    apply_patch(model, ratio=0.5, mode="kv", end_percent=0.5)
    assert not torch.equal(run(model, inputs), expected)


def test_flux_reference_tokens_are_left_alone():
    """Kontext-style ids (a second image with first id 1) cannot be placed on one grid: nothing is reduced."""
    model, inputs, _ = flux(h=4, w=4)
    ids = inputs["img_ids"].clone()
    ids[8:, 0] = 1
    inputs["img_ids"] = ids
    expected = run(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv")
    assert torch.equal(run(model, inputs), expected)
    assert model.__dict__[STATE_ATTR].reduced_calls == 0


def test_a_non_sdpa_attention_backend_is_refused_not_silently_ignored():
    """kv reaches attention through torch's scaled_dot_product_attention: a diffusers backend that does
    not end there (flash-attn, sage, xformers, flex) is refused at apply_patch when set on the model,
    and stops the call with the fix when set globally (diffusers' attention_backend context)."""
    from diffusers.models.attention_dispatch import attention_backend

    model, inputs, _ = flux()
    name, attention = next((n, m) for n, m in model.named_modules()  # an attention Flux's default range patches
                           if n.startswith("single_") and hasattr(getattr(m, "processor", None), "_attention_backend"))
    attention.processor._attention_backend = "flex"  # what model.set_attention_backend("flex") stores
    with pytest.raises(ValueError, match=f"attention {name} uses the diffusers attention backend 'flex'.*"
                                         "set_attention_backend\\('native'\\)"):
        apply_patch(model, ratio=0.5, mode="kv")
    assert not is_patched(model)
    attention.processor._attention_backend = "_native_math"  # ends in SDPA: accepted
    apply_patch(model, ratio=0.5, mode="kv")
    run(model, inputs)
    attention.processor._attention_backend = None
    with attention_backend("flex"), pytest.raises(RuntimeError, match="without torch's scaled_dot_product_attention"):
        run(model, inputs)
    remove_patch(model)


@pytest.mark.parametrize("family, start, end, reduced, hooked", [
    # SDPA calls in order. Flux: 1 double + 2 single blocks (centres 1/6, 1/2, 5/6)
    ("flux", 0.0, 0.5, [True, True, False], ["single_transformer_blocks.0", "transformer_blocks.0"]),
    ("flux", 0.5, 1.0, [False, True, True], ["single_transformer_blocks.0", "single_transformer_blocks.1"]),
    # SD3.5: block 0 runs the joint attention, then its image-only dual attention; block 1 the joint one
    ("sd3", 0.0, 0.5, [True, True, False], ["transformer_blocks.0"]),
    # Wan: per block self-attention, then cross-attention (text keys: never reduced)
    ("wan", 0.5, 1.0, [False, False, True, False], ["blocks.1"]),
    # HunyuanVideo: the text refiner's attention (never reduced), then 1 double + 2 single blocks
    ("hunyuan_video", 0.34, 1.0, [False, False, True, True], ["single_transformer_blocks.0",
                                                              "single_transformer_blocks.1"]),
])
def test_block_range_reduces_exactly_the_blocks_in_it(family, start, end, reduced, hooked):
    """Checked on the keys each attention really gets: full length outside the range, shorter inside."""
    model, inputs, _ = FAMILIES[family]()
    expected = run(model, inputs)
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv", block_start=start, block_end=end)
    _, patched = spied(model, inputs)
    assert [kb.shape[-2] < ka.shape[-2] for (_, ka, _), (_, kb, _) in zip(vanilla, patched)] == reduced
    assert sorted({name.rsplit(".", 1)[0] for name, _, _ in model.__dict__[STATE_ATTR].modules}) == hooked
    remove_patch(model)
    assert torch.equal(run(model, inputs), expected)


@pytest.mark.parametrize("family, reduced", [
    ("flux", [False, True, True]),  # 1 double + 2 single blocks: the single blocks only
    ("sd3", [True, True, True]),
    ("wan", [True, False, True, False]),  # self-attentions; cross-attentions never
    ("hunyuan_video", [False, True, True, True]),  # text refiner, then every block
])
def test_the_default_block_range_is_the_familys(family, reduced):
    """No block_start: Flux reduces its single blocks only (the lowest error per unit of speed-up, measured
    with tome_bench.dit_blocks), the other families every block; block_start=0 reduces every block."""
    model, inputs, _ = FAMILIES[family]()
    _, vanilla = spied(model, inputs)
    apply_patch(model, ratio=0.5, mode="kv")
    _, default = spied(model, inputs)
    assert [kb.shape[-2] < ka.shape[-2] for (_, ka, _), (_, kb, _) in zip(vanilla, default)] == reduced
    apply_patch(model, ratio=0.5, mode="kv", block_start=0.0)
    _, every = spied(model, inputs)
    assert sum(kb.shape[-2] < ka.shape[-2] for (_, ka, _), (_, kb, _) in zip(vanilla, every)) == \
        (3 if family == "flux" else sum(reduced))
    with pytest.raises(ValueError, match=r"block_start=0\.\d+\.\.block_end=0\.3 holds none" if family == "flux"
                       else r"block_start=0\.\.block_end=0\.1 holds none"):
        apply_patch(model, ratio=0.5, mode="kv", block_end=0.3 if family == "flux" else 0.1)


def test_block_range_holding_no_block_and_on_a_unet_is_refused():
    model, inputs, _ = flux()
    with pytest.raises(ValueError, match="holds none of FluxTransformer2DModel's 3 blocks"):
        apply_patch(model, ratio=0.5, mode="kv", block_start=0.2, block_end=0.3)
    assert not is_patched(model)
    with pytest.raises(ValueError, match="need 0 <= block_start < block_end <= 1"):
        apply_patch(model, ratio=0.5, mode="kv", block_start=0.6, block_end=0.4)
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=32, attention_head_dim=8, norm_num_groups=8)
    with pytest.raises(ValueError, match="UNet2DConditionModel is a UNet, whose levels max_downsample chooses"):
        apply_patch(unet, ratio=0.5, block_end=0.5)
    assert not is_patched(unet)


def test_torch_compile_matches_eager_and_compiles_nothing_after_the_first_step():
    """torch.compile(transformer) after apply_patch (inductor): eager output within 1e-4 at every step, and no
    recompilation as the timestep changes (the per-call step read and seeded picks run eagerly, in the
    model's pre-hook). Not one graph: diffusers' processors call Tensor.unflatten, which dynamo cannot
    trace under ToMe's TorchFunctionMode, so each attention block adds a break (16 on this model)."""
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
    model, inputs, _ = flux(h=8, w=8)
    apply_patch(model, ratio=0.5, mode="kv")
    compiled = torch.compile(model)
    graphs = []
    for step in (0.6, 0.5, 0.4, 0.3):
        inputs["timestep"] = torch.full((1,), step)
        eager, result = run(model, inputs), run(compiled, inputs)
        assert ((result - eager).norm() / eager.norm()).item() < 1e-4
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == [graphs[0]] * 4, graphs
    vanilla = run(model, inputs)
    remove_patch(model)
    assert not torch.equal(run(model, inputs), vanilla)
    torch._dynamo.reset()
