"""Mode "merge" on diffusers' Flux.1, Qwen-Image and Wan: fewer image tokens through whole blocks, per-block hooks.

Tiny real diffusers classes with seeded weights (the fixtures of test_dit_diffusers and test_dit_families). What a
block receives is recorded by a forward pre-hook registered after ToMe's, so it sees the merged inputs.
"""
from __future__ import annotations

import inspect

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tome_core import apply_patch, describe, is_patched, remove_patch  # noqa: E402
from conftest import check_identity_at_ratio_zero_and_after_removal, check_reduced_output  # noqa: E402
from tome_core.adapters.hooks.dit import STATE_ATTR  # noqa: E402
from test_dit_diffusers import flux, run, wan  # noqa: E402
from test_dit_families import flux2, qwen_image  # noqa: E402

FAMILIES = {"flux": flux, "flux2": flux2, "qwen_image": qwen_image, "wan": wan}
# The blocks of the default range: Flux.1 its single blocks (as mode kv), Qwen-Image and Wan all.
DEFAULT_BLOCKS = {"flux": "single_transformer_blocks", "flux2": "transformer_blocks", "qwen_image": "transformer_blocks",
                  "wan": "blocks"}  # the block list the inputs are read from (Flux.2: its double blocks, text apart)
# Every block list of the default range (Flux.2: every block; its single blocks take [text, image]).
MERGED = {"flux": ("single_transformer_blocks",), "flux2": ("transformer_blocks", "single_transformer_blocks"),
          "qwen_image": ("transformer_blocks",), "wan": ("blocks",)}


def merged_blocks(model, family) -> list:
    return [block for attr in MERGED[family] for block in getattr(model, attr)]
# Where each family's rotary table has its tokens: Flux (cos, sin) [text + image, D], Qwen-Image (image, text)
# frequencies [tokens, D/2], Wan (cos, sin) [1, video tokens, 1, D].
ROPE_AXIS = {"flux": 0, "flux2": 0, "qwen_image": 0, "wan": 1}


def record_blocks(model, attr):
    """Inputs of every block of ``model.<attr>``, as the block itself receives them (Wan's by position)."""
    seen, handles = [], []
    for block in getattr(model, attr):
        def spy(module, args, kwargs):
            named = inspect.signature(module.forward).bind(*args, **kwargs).arguments
            rope = named.get("image_rotary_emb", named.get("rotary_emb"))
            seen.append(dict(hidden=named["hidden_states"].clone(), text=named["encoder_hidden_states"].clone(),
                             rope=tuple(t.clone() for t in rope)))
        handles.append(block.register_forward_pre_hook(spy, with_kwargs=True))
    return seen, handles


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_and_removal_are_bit_identical(family):
    model, inputs, _ = FAMILIES[family](batch=2)
    state = check_identity_at_ratio_zero_and_after_removal(model, inputs, run, apply_patch, remove_patch, is_patched,
                                                           STATE_ATTR, mode="merge")
    assert state.reduced_calls == len(merged_blocks(model, family))


@pytest.mark.parametrize("family", FAMILIES)
def test_blocks_carry_fewer_image_tokens_text_whole_and_rope_follows(family):
    """Each block of the range gets int(r * grid) fewer image tokens; its text input is vanilla's in the first one
    (whose input is vanilla's); each image row of the rotary table is a distinct real token's row, in raster order."""
    model, inputs, where = FAMILIES[family](batch=2)
    attr = DEFAULT_BLOCKS[family]
    grid = int(torch.tensor(where["grid"]).prod())
    slots = grid - int(0.5 * grid)
    vanilla, handles = record_blocks(model, attr)
    run(model, inputs)
    for handle in handles:
        handle.remove()
    apply_patch(model, ratio=0.5, mode="merge", seed=3)
    merged, _ = record_blocks(model, attr)
    run(model, inputs)
    assert len(merged) == len(vanilla) > 0
    text, kept = where["prefix"], model.__dict__[STATE_ATTR].current.merge.kept
    assert kept.numel() == slots and torch.equal(kept, kept.unique())
    for full, cut in zip(vanilla, merged):
        assert cut["hidden"].shape[1] == slots and cut["text"].shape == full["text"].shape
        table, rows, axis = cut["rope"][0], full["rope"][0], ROPE_AXIS[family]
        if family in ("flux", "flux2"):  # (cos, sin) over [text, image]
            assert torch.equal(table[:text], rows[:text])
            table, rows = table[text:], rows[text:]
        assert table.shape[axis] == slots
        assert torch.equal(table, rows.index_select(axis, kept))  # each slot's own representative's position
    assert torch.equal(merged[0]["text"], vanilla[0]["text"])


def test_qwen_image_edit_reference_tokens_pass_whole():
    """Qwen-Image Edit: the reference image's tokens after the grid are never merged; in the first block their
    hidden states and their rotary rows are vanilla's."""
    model, inputs, where = qwen_image(batch=2, refs=True)
    vanilla, handles = record_blocks(model, "transformer_blocks")
    run(model, inputs)
    for handle in handles:
        handle.remove()
    apply_patch(model, ratio=0.5, mode="merge")
    merged, _ = record_blocks(model, "transformer_blocks")
    run(model, inputs)
    refs = where["suffix"]
    assert refs == 12 and merged[0]["hidden"].shape[1] == 42 - 21 + refs
    assert torch.equal(merged[0]["hidden"][:, -refs:], vanilla[0]["hidden"][:, -refs:])
    assert torch.equal(merged[0]["rope"][0][-refs:], vanilla[0]["rope"][0][-refs:])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("batch", [1, 4])
@pytest.mark.parametrize("size", [dict(h=5, w=3), dict(h=7, w=9)])
def test_odd_sizes_and_batches(family, batch, size):
    if family == "wan":  # a latent of 3 frames, patched 2x2: odd token grids from latents of twice the size
        size = dict(frames=3, h=2 * size["h"], w=2 * size["w"])
    model, inputs, _ = FAMILIES[family](batch=batch, **size)
    state = check_reduced_output(model, inputs, run, apply_patch, STATE_ATTR, mode="merge")
    assert state.reduced_calls == len(merged_blocks(model, family))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16(family):
    model, inputs, _ = FAMILIES[family](batch=2)
    model = model.to(torch.bfloat16)
    inputs = {k: v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v
              for k, v in inputs.items()}
    expected = run(model, inputs)
    apply_patch(model, ratio=0.0, mode="merge")
    assert torch.equal(run(model, inputs), expected)
    apply_patch(model, ratio=0.5, mode="merge")
    out = run(model, inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and not torch.equal(out, expected)


def test_families_without_merge_are_refused_naming_them():
    from test_dit_diffusers import sd3

    model, _, _ = sd3()
    with pytest.raises(ValueError, match="mode='merge' on transformers .*reaches flux, flux2, qwen_image, wan so far; "
                                         "SD3Transformer2DModel is not among them.*mode='kv'"):
        apply_patch(model, ratio=0.5, mode="merge")
    assert not is_patched(model)


def test_describe_says_blocks_merged():
    model, _, _ = flux()
    apply_patch(model, ratio=0.5, mode="merge")
    assert describe(model).startswith("ToMe merge r=0.5 on FluxTransformer2DModel: 2 blocks carry merged image tokens")


@pytest.mark.parametrize("cache", ["first_block_cache", "mag_cache", "pyramid_attention_broadcast"])
@pytest.mark.parametrize("order", ["cache_first", "tome_first"])
def test_step_caches_on_merged_blocks_are_refused_naming_them(cache, order):
    """A cache on (or in) a merged block would hand back another step's merged tokens: refused in both orders, at
    apply_patch or at the first model call, naming the cache and mode kv (with which they compose)."""
    from test_dit_families import _CACHES, _sampling_loop

    model, inputs, _ = flux(h=6, w=6)
    now = [0.0]
    if order == "cache_first":
        model.enable_cache(_CACHES[cache](now))
        with pytest.raises(RuntimeError, match=r"diffusers' \w+ caches .*use mode='kv' on this transformer"):
            apply_patch(model, ratio=0.5, mode="merge", block_start=0.0)
        assert not is_patched(model)
    else:
        apply_patch(model, ratio=0.5, mode="merge", block_start=0.0)
        model.enable_cache(_CACHES[cache](now))
        with pytest.raises(RuntimeError, match=r"diffusers' \w+ caches .*use mode='kv' on this transformer"):
            _sampling_loop(model, inputs, now)


def test_group_offloading_composes():
    """diffusers' group offloading (its hooks move each block's weights on and off) beside merge: the same output
    as merge alone."""
    model, inputs, _ = flux(batch=2)
    apply_patch(model, ratio=0.5, mode="merge")
    alone = run(model, inputs)
    model.enable_group_offload(torch.device("cpu"), offload_type="block_level", num_blocks_per_group=1)
    assert torch.equal(run(model, inputs), alone)


def test_without_a_mode_each_family_gets_its_default():
    """apply_patch without ``mode``: the catalogue's default (Qwen-Image and Wan merge, Flux.1 and the others kv);
    UNets keep tomesd's merge (test_engine_diffusers)."""
    from test_dit_diffusers import sd3

    for make, expected in ((qwen_image, "merge"), (wan, "merge"), (flux, "kv"), (sd3, "kv")):
        model, _, _ = make()
        apply_patch(model, ratio=0.5)
        assert model.__dict__[STATE_ATTR].config.mode == expected


def test_wan_per_token_timesteps_follow_the_merged_tokens():
    """Wan 2.2 ti2v gives every video token its own timestep (the pipeline's expand_timesteps: a [B, tokens] timestep,
    a [B, tokens, 6, C] modulation): the blocks get the kept tokens' rows, and ratio 0 stays bit-identical."""
    model, inputs, where = wan(batch=2)
    tokens = int(torch.tensor(where["grid"]).prod())
    inputs["timestep"] = torch.full((2, tokens), 600.0)
    inputs["timestep"][:, :5] = 0.0  # the first frame's tokens: the conditioning image, timestep 0
    expected = run(model, inputs)
    apply_patch(model, ratio=0.0, mode="merge")
    assert torch.equal(run(model, inputs), expected)
    apply_patch(model, ratio=0.5, mode="merge")
    seen = []  # registered after ToMe's hooks: what the block itself receives
    model.blocks[0].register_forward_pre_hook(lambda m, args, kwargs: seen.append(
        inspect.signature(m.forward).bind(*args, **kwargs).arguments["temb"].shape), with_kwargs=True)
    out = run(model, inputs)
    assert torch.isfinite(out).all() and not torch.equal(out, expected)
    assert len(seen[0]) == 4 and seen[0][1] == tokens - int(0.5 * tokens)


@pytest.mark.parametrize("family", FAMILIES)
def test_the_merged_blocks_update_reaches_the_output(family):
    """Each merged block's own update is in the output: scaling the weights of the merged blocks changes it (a block
    that added to its input in place would cancel an update taken against that input)."""
    model, inputs, _ = FAMILIES[family](batch=2)
    apply_patch(model, ratio=0.5, mode="merge")
    before = run(model, inputs)
    with torch.no_grad():
        for p in torch.nn.ModuleList(merged_blocks(model, family)).parameters():
            p.mul_(1.7)
    after = run(model, inputs)
    assert ((after - before).norm() / before.norm()).item() > 1e-3
