"""Mode "merge" on diffusers' Flux.1, Flux.2, Qwen-Image, Z-Image, Lumina 2 and Wan: fewer image tokens through whole
blocks, per-block hooks.

Tiny real diffusers classes with seeded weights (the fixtures of test_dit_diffusers and test_dit_families). What a
block receives is recorded by a ``ForwardSpy``: an instance forward over the block's own, which ToMe's marked forward
calls with the merged inputs (ToMe acts inside the block's call: torch hooks on the block see its whole tokens).
"""
from __future__ import annotations

import pytest
import torch

diffusers = pytest.importorskip("diffusers")

from tome_core import apply_patch, describe, is_patched, remove_patch  # noqa: E402
from conftest import (ForwardSpy, bound_inputs, check_identity_at_ratio_zero_and_after_removal,  # noqa: E402
                      check_reduced_output)
from tome_core.adapters.hooks.dit import STATE_ATTR  # noqa: E402
from test_dit_diffusers import flux, wan  # noqa: E402
from test_dit_families import flux2, ltx2, lumina2, qwen_image, run, z_image  # noqa: E402

FAMILIES = {"flux": flux, "flux2": flux2, "qwen_image": qwen_image, "z_image": z_image, "lumina2": lumina2, "wan": wan,
            "ltx2": ltx2}
OWN_TEST = ("z_image", "lumina2", "ltx2")  # the block inputs are checked by their own tests below
JOINT_ONLY = ("z_image", "lumina2")  # every merged layer takes the joint sequence [image, caption] / [caption, image]
# The blocks of the default range: Flux.1 its single blocks (as mode kv), Qwen-Image and Wan all.
DEFAULT_BLOCKS = {"flux": "single_transformer_blocks", "flux2": "transformer_blocks", "qwen_image": "transformer_blocks",
                  "wan": "blocks"}  # the block list the inputs are read from (Flux.2: its double blocks, text apart)
# Every block list of the default range (Flux.2: every block; its single blocks take [text, image]).
MERGED = {"flux": ("single_transformer_blocks",), "flux2": ("transformer_blocks", "single_transformer_blocks"),
          "qwen_image": ("transformer_blocks",), "z_image": ("layers",), "lumina2": ("layers",), "wan": ("blocks",),
          "ltx2": ("transformer_blocks",)}


def merged_blocks(model, family) -> list:
    return [block for attr in MERGED[family] for block in getattr(model, attr)]
# Where each family's rotary table has its tokens: Flux (cos, sin) [text + image, D], Qwen-Image (image, text)
# frequencies [tokens, D/2], Wan (cos, sin) [1, video tokens, 1, D].
ROPE_AXIS = {"flux": 0, "flux2": 0, "qwen_image": 0, "wan": 1}


def record_blocks(model, attr):
    """Inputs of every block of ``model.<attr>``, as the block itself receives them (Wan's by position)."""
    seen = []

    def spy(module, args, kwargs):
        named = bound_inputs(module, args, kwargs)
        rope = named.get("image_rotary_emb", named.get("rotary_emb"))
        seen.append(dict(hidden=named["hidden_states"].clone(), text=named["encoder_hidden_states"].clone(),
                         rope=tuple(t.clone() for t in rope)))
    return seen, [ForwardSpy(getattr(model, attr), spy)]


@pytest.mark.parametrize("family", FAMILIES)
def test_ratio_zero_and_removal_are_bit_identical(family):
    model, inputs, _ = FAMILIES[family](batch=2)
    state = check_identity_at_ratio_zero_and_after_removal(model, inputs, run, apply_patch, remove_patch, is_patched,
                                                           STATE_ATTR, mode="merge")
    assert state.reduced_calls == len(merged_blocks(model, family))


@pytest.mark.parametrize("family", [name for name in FAMILIES if name not in OWN_TEST])
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


# Z-Image / Lumina 2 layers: (hidden input, per-sample rotary table, mask) by name, and where the caption sits.
JOINT_INPUTS = {"z_image": ("x", "freqs_cis", "attn_mask"), "lumina2": ("hidden_states", "image_rotary_emb",
                                                                        "attention_mask")}


@pytest.mark.parametrize("family", JOINT_ONLY)
def test_joint_layers_merge_the_grid_only_and_their_per_sample_tables_follow(family):
    """Z-Image ([image, padding, caption]) and Lumina 2 ([caption, image]): every layer gets int(r * grid) fewer tokens;
    its rotary rows (one table per sample, token axis 1) are those of the kept tokens; with captions of two lengths
    (Z-Image pads them, and masks the shorter) the mask is cut alike; the first layer's caption and padding are
    vanilla's."""
    model, inputs, where = FAMILIES[family](batch=2, text=40)
    if family == "z_image":  # captions of 40 and 7 tokens: 64 and 32 after padding, the second sample masked
        inputs["cap_feats"][1] = inputs["cap_feats"][1][:7]
    hidden_key, rope_key, mask_key = JOINT_INPUTS[family]
    seen = []

    def spy(module, args, kwargs):
        named = bound_inputs(module, args, kwargs)
        mask = named.get(mask_key)
        seen.append((named[hidden_key].clone(), named[rope_key].clone(), None if mask is None else mask.clone()))

    handles = [ForwardSpy(model.layers, spy)]
    run(model, inputs)
    vanilla, seen[:] = list(seen), []
    for handle in handles:
        handle.remove()
    apply_patch(model, ratio=0.5, mode="merge", seed=3)
    handles = [ForwardSpy(model.layers, spy)]
    run(model, inputs)
    grid = int(torch.tensor(where["grid"]).prod())
    call = model.__dict__[STATE_ATTR].current
    joint = call.merge_on(call.joint)
    assert len(seen) == len(vanilla) == 2 and joint.length == vanilla[0][0].shape[1]
    image = slice(call.joint.prefix, call.joint.prefix + grid)
    for (full, table, mask), (cut, rows, cut_mask) in zip(vanilla, seen):
        assert cut.shape[1] == full.shape[1] - int(0.5 * grid)
        assert torch.equal(rows, table.index_select(1, joint.kept))
        assert (mask is None) == (family == "lumina2") and (mask is None or torch.equal(cut_mask, mask[:, joint.kept]))
    whole = torch.ones(joint.length, dtype=torch.bool)
    whole[image] = False  # the tokens outside the grid, each its own slot, in order
    outside = joint.kept[(joint.kept < image.start) | (joint.kept >= image.stop)]
    assert torch.equal(outside, torch.nonzero(whole).flatten())
    first_full, first_cut = vanilla[0][0], seen[0][0]
    kept_outside = torch.isin(joint.kept, outside)
    assert torch.equal(first_cut[:, kept_outside], first_full[:, outside])


@pytest.mark.parametrize("rope_type", ["interleaved", "split"])
def test_ltx2_video_merged_audio_whole_and_video_tables_follow(rope_type):
    """LTX-2: each block carries int(r * grid) fewer video tokens; the audio stream, which the block also returns, is
    vanilla's in the first block; the video self- and cross-attention rotary rows ([B, tokens, D] or, split,
    [B, heads, tokens, D/2]) are the kept tokens'; a per-token timestep (image-to-video's conditioning frame) gives
    per-token modulation rows, cut alike."""
    model, inputs, where = ltx2(batch=2, h=6, w=8, rope_type=rope_type)
    tokens = int(torch.tensor(where["grid"]).prod())
    inputs["timestep"] = torch.full((2, tokens), 600.0)
    inputs["timestep"][:, :48] = 0.0  # the first latent frame: the conditioning image
    inputs["audio_timestep"] = torch.full((2,), 600.0)  # as LTX2ImageToVideoPipeline passes them
    axis = 1 if rope_type == "interleaved" else 2
    seen = []

    def spy(module, args, kwargs):
        seen.append({k: (tuple(t.clone() for t in v) if isinstance(v, tuple) else v.clone()) for k, v in kwargs.items()
                     if k in ("hidden_states", "audio_hidden_states", "video_rotary_emb", "ca_video_rotary_emb",
                              "temb", "temb_ca_gate")})

    handles = [ForwardSpy(model.transformer_blocks, spy)]
    expected = run(model, inputs)
    vanilla, seen[:] = list(seen), []
    for handle in handles:
        handle.remove()
    apply_patch(model, ratio=0.5, mode="merge", seed=3)
    handles = [ForwardSpy(model.transformer_blocks, spy)]
    out = run(model, inputs)
    kept = model.__dict__[STATE_ATTR].current.merge.kept
    slots = tokens - int(0.5 * tokens)
    assert len(seen) == len(vanilla) == 2 and kept.numel() == slots
    assert torch.isfinite(out).all() and not torch.equal(out, expected)
    for full, cut in zip(vanilla, seen):
        assert cut["hidden_states"].shape[1] == slots
        assert cut["audio_hidden_states"].shape == full["audio_hidden_states"].shape
        for key in ("video_rotary_emb", "ca_video_rotary_emb"):
            for table, rows in zip(cut[key], full[key]):
                assert torch.equal(table, rows.index_select(axis, kept))
        for key in ("temb", "temb_ca_gate"):
            assert full[key].shape[1] == tokens and torch.equal(cut[key], full[key][:, kept])
    assert torch.equal(seen[0]["audio_hidden_states"], vanilla[0]["audio_hidden_states"])


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
    if family in JOINT_ONLY:  # patched 2x2 from the latent itself
        size = dict(h=2 * size["h"], w=2 * size["w"])
    model, inputs, _ = FAMILIES[family](batch=batch, **size)
    state = check_reduced_output(model, inputs, run, apply_patch, STATE_ATTR, mode="merge")
    assert state.reduced_calls == len(merged_blocks(model, family))


@pytest.mark.parametrize("family", FAMILIES)
def test_bf16(family):
    model, inputs, _ = FAMILIES[family](batch=2)
    model = model.to(torch.bfloat16)
    def bf16(v):  # Z-Image takes its latents and captions as lists
        if isinstance(v, list):
            return [bf16(item) for item in v]
        return v.to(torch.bfloat16) if isinstance(v, torch.Tensor) and v.is_floating_point() else v

    inputs = {k: bf16(v) for k, v in inputs.items()}
    expected = run(model, inputs)
    apply_patch(model, ratio=0.0, mode="merge")
    assert torch.equal(run(model, inputs), expected)
    apply_patch(model, ratio=0.5, mode="merge")
    out = run(model, inputs)
    assert out.dtype == torch.bfloat16 and torch.isfinite(out).all() and not torch.equal(out, expected)


def test_families_without_merge_are_refused_naming_them():
    from test_dit_diffusers import sd3

    model, _, _ = sd3()
    with pytest.raises(ValueError, match="mode='merge' on transformers .*reaches flux, flux2, qwen_image, lumina2, "
                                         "z_image, wan, wan_vace, wan_animate, ltx2 so far; SD3Transformer2DModel is "
                                         "not among them.*"
                                         "mode='kv'"):
        apply_patch(model, ratio=0.5, mode="merge")
    assert not is_patched(model)


def test_describe_says_blocks_merged():
    model, _, _ = flux()
    apply_patch(model, ratio=0.5, mode="merge")
    assert describe(model).startswith("ToMe merge r=0.5 on FluxTransformer2DModel: 2 blocks carry merged image tokens")


@pytest.mark.parametrize("cache", ["pyramid_attention_broadcast", "taylorseer"])
@pytest.mark.parametrize("order", ["cache_first", "tome_first"])
def test_step_caches_inside_merged_blocks_are_refused_naming_them(cache, order):
    """A cache inside a merged block (on its attention) would hand back another step's merged tokens: refused in both
    orders, at apply_patch or at the first model call, naming the cache and mode kv (with which they compose). Caches
    on whole blocks compose with merge: tests/adapters/test_step_caches.py."""
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
    """apply_patch without ``mode`` or ``ratio``: the catalogue's default mode and ratio (tome_core/catalogue/quality.json's
    rule), the same output as both set by hand; without ``ratio`` in the other mode, tomesd's 0.5; UNets keep tomesd's
    merge at 0.5 (test_engine_diffusers)."""
    from test_dit_diffusers import sd3
    from tome_core.catalogue.families import BY_NAME

    for make, name in ((qwen_image, "qwen_image"), (wan, "wan"), (z_image, "z_image"), (lumina2, "z_image"),
                       (ltx2, "ltx2"), (flux, "flux"), (sd3, "sd3")):
        family = BY_NAME[name]
        model, inputs, _ = make(batch=2)
        apply_patch(model)
        config = model.__dict__[STATE_ATTR].config
        assert (config.mode, config.ratio) == (family.default_mode, family.default_ratio), name
        by_default = run(model, inputs)
        apply_patch(model, ratio=family.default_ratio, mode=family.default_mode)
        assert torch.equal(run(model, inputs), by_default), name
        other = "kv" if family.default_mode == "merge" else ("merge" if name != "sd3" else "kv")
        apply_patch(model, mode=other)
        assert model.__dict__[STATE_ATTR].config.ratio == family.ratio_for(other), name


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
    seen = []  # what the block itself receives
    ForwardSpy(model.blocks[:1], lambda m, args, kwargs: seen.append(bound_inputs(m, args, kwargs)["temb"].shape))
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


def test_ltx2_token_pair_masks_leave_the_blocks_whole_with_a_warning(caplog):
    """An LTX-2 video self-attention mask (IC-LoRA's: one value per token pair) has no merged counterpart: the blocks
    run whole, bit-identical to the unpatched model, and the log says so, naming the input."""
    model, inputs, where = ltx2(batch=1)
    tokens = int(torch.tensor(where["grid"]).prod())
    inputs["video_self_attention_mask"] = torch.ones(1, tokens, tokens)
    expected = run(model, inputs)
    apply_patch(model, ratio=0.5, mode="merge")
    with caplog.at_level("WARNING"):
        assert torch.equal(run(model, inputs), expected)
    assert "called with self_attention_mask" in caplog.text and "runs whole" in caplog.text


@pytest.mark.parametrize("variant", ["wan_vace", "wan_animate"])
def test_wan_vace_and_animate(variant):
    """Wan VACE: its main blocks merge, its vace_blocks (the control video, taken apart) run whole, their hints land on
    the restored stream; Wan Animate: the reference frame before the grid reaches the first block as vanilla's.
    Ratio 0 and removal are bit-identical."""
    import test_dit_families

    model, inputs, where = getattr(test_dit_families, variant)(batch=2)
    state = check_identity_at_ratio_zero_and_after_removal(model, inputs, run, apply_patch, remove_patch, is_patched,
                                                           STATE_ATTR, mode="merge")
    assert [name for name, _ in state.blocks] == [f"blocks.{i}" for i in range(len(model.blocks))]
    seen = []

    def spy(module, args, kwargs):  # what the block itself receives
        seen.append(bound_inputs(module, args, kwargs)["hidden_states"].clone())

    handle = ForwardSpy(model.blocks[:1], spy)
    run(model, inputs)
    handle.remove()
    apply_patch(model, ratio=0.5, mode="merge")
    ForwardSpy(model.blocks[:1], spy)
    run(model, inputs)
    grid, prefix = int(torch.tensor(where["grid"]).prod()), where["prefix"]
    full, cut = seen
    assert cut.shape[1] == full.shape[1] - int(0.5 * grid)
    assert torch.equal(cut[:, :prefix], full[:, :prefix])


class SpyMasks(torch.overrides.TorchFunctionMode):
    """The key count and the mask of every scaled_dot_product_attention call, as the kernel gets them (a mode entered
    before ToMe's, so it sees what ToMe hands on)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.scaled_dot_product_attention:
            bound = dict(zip(("query", "key", "value", "attn_mask"), args), **kwargs)
            mask = bound.get("attn_mask")
            self.calls.append((bound["key"].shape[-2], None if mask is None else mask.clone()))
        return func(*args, **kwargs)


@pytest.mark.parametrize("how", ["balanced", "proportional"])
@pytest.mark.parametrize("family", ["flux", "flux2", "qwen_image", "z_image", "wan", "ltx2"])
def test_merged_keys_weigh_as_the_tokens_they_hold(family, how):
    """In every attention over a merged stream the keys of the stream weigh as its tokens: exp of their bias sums to
    the stream's token count (text and tokens outside the grid at 0); balanced leaves attention over the grid alone
    (Wan's and LTX-2's video self-attention) unmasked; ratio 0 and removal stay bit-identical."""
    model, inputs, _ = FAMILIES[family](batch=2)
    check_identity_at_ratio_zero_and_after_removal(model, inputs, run, apply_patch, remove_patch, is_patched,
                                                   STATE_ATTR, mode="merge", merge_attention=how)
    apply_patch(model, ratio=0.5, mode="merge", merge_attention=how)
    state = model.__dict__[STATE_ATTR]
    spy = SpyMasks()
    with spy:
        run(model, inputs)
    call = state.current
    merges = {merge.slots + extra: merge for merge in call.merges.values() for extra in (0, call.text)}
    weighed = [(keys, mask) for keys, mask in spy.calls if mask is not None and mask.dtype != torch.bool
               and keys in merges]
    joint = family not in ("wan", "ltx2")
    assert len(weighed) >= (len(merged_blocks(model, family)) if joint or how == "proportional" else 0)
    if not joint and how == "balanced":
        assert not weighed  # one value on every key would change nothing: no mask
    for keys, mask in weighed:
        merge = merges[keys]
        stream = mask.reshape(-1, keys)[0, keys - merge.slots:].float()
        finite = stream[torch.isfinite(stream)]
        assert finite.exp().sum().item() == pytest.approx(merge.length - (stream.numel() - finite.numel()), rel=1e-2)
    assert "attention" in describe(model) and how in describe(model)
    remove_patch(model)


@pytest.mark.parametrize("how", ["balanced", "proportional"])
def test_weighed_keys_with_every_size_one_is_plain_attention(how):
    """A ratio that removes no token (every slot holds one token): the bias is 0 on every key, the output is plain
    merge's within float tolerance."""
    model, inputs, _ = qwen_image(batch=2)
    apply_patch(model, ratio=0.01, mode="merge", merge_attention="plain")
    plain = run(model, inputs)
    assert model.__dict__[STATE_ATTR].current.match.removed == 0
    apply_patch(model, ratio=0.01, mode="merge", merge_attention=how)
    assert torch.allclose(run(model, inputs), plain, atol=1e-5)
    remove_patch(model)


def test_weighed_keys_change_the_output_and_compile_without_recompiling():
    """Balanced attention on Qwen-Image changes merge's output; torch.compile of the patched transformer matches eager
    at every step and compiles nothing after the first (the bias is built per call, outside any guard)."""
    from torch._dynamo.utils import counters

    model, inputs, _ = qwen_image(batch=2)
    apply_patch(model, ratio=0.5, mode="merge", merge_attention="plain")
    plain = run(model, inputs)
    apply_patch(model, ratio=0.5, mode="merge", merge_attention="balanced")
    assert not torch.allclose(run(model, inputs), plain, atol=1e-4)
    torch._dynamo.reset()
    counters.clear()
    compiled = torch.compile(model)
    graphs = []
    for step in (0.6, 0.5, 0.4, 0.3):
        inputs["timestep"] = torch.full((2,), step)
        eager, result = run(model, inputs), run(compiled, inputs)
        assert ((result - eager).norm() / eager.norm()).item() < 1e-4
        graphs.append(counters["stats"]["unique_graphs"])
    assert graphs[0] > 0 and graphs == [graphs[0]] * 4, graphs
    remove_patch(model)
    torch._dynamo.reset()


def test_merge_attention_is_refused_where_it_means_nothing():
    model, _, _ = qwen_image()
    with pytest.raises(ValueError, match="merge_attention='balanced' weighs merged keys, which mode='kv' has none"):
        apply_patch(model, ratio=0.5, mode="kv", merge_attention="balanced")
    with pytest.raises(ValueError, match="merge_attention must be one of"):
        apply_patch(model, ratio=0.5, mode="merge", merge_attention="soft")
    assert not is_patched(model)
