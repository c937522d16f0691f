"""Mode "merge" on ComfyUI's own Flux (Flux.1 and Flux.2 parameters), Qwen-Image and Wan classes: fewer image tokens
through whole blocks.

Reduced-size models with seeded weights (test_comfy_dit's and test_comfy_families' builders), sampled by ComfyUI
(comfy.sample.sample), so the wrappers, transformer_options and the "dit" block replace patches are ComfyUI's
own. What the blocks receive is recorded by a replace patch set by "another node" before ToMe, which ToMe
keeps and calls with the merged tokens.
"""
from __future__ import annotations

import pytest
import torch

from test_comfy_dit import comfy, flux, sample, spy_on, tome_package, wan  # noqa: F401
from test_comfy_families import flux2, ltxav, lumina2, qwen_image, z_image

from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
from tome_core.adapters.model_patcher.dit_call import OVERRIDE
from tome_core.adapters.model_patcher.plan import plan_patch
from tome_core.engine.config import ToMeConfig
from tome_core.engine.grid import TokenLayout

FAMILIES = {"flux": lambda comfy: flux(comfy)[:4], "flux2": lambda comfy: flux2(comfy)[:4],
            "qwen_image": lambda comfy: qwen_image(comfy)[:4], "wan": lambda comfy: wan(comfy)[:4],
            "z_image": lambda comfy: z_image(comfy)[:4], "lumina2": lambda comfy: lumina2(comfy)[:4],
            "ltx2": lambda comfy: ltxav(comfy)[:4]}
NEXT_DIT = ("z_image", "lumina2")  # NextDiT: its layers object-patched (it calls them without replace patches)
OWN_TEST = NEXT_DIT + ("ltx2",)  # what their blocks receive is checked by their own tests below
# The blocks of the default range: Flux its single blocks (as mode kv), Qwen-Image and Wan all (Wan's replace
# patches are keyed "double_block" too).
DEFAULT_BLOCKS = {"flux": [("single_block", 0), ("single_block", 1)],
                  "flux2": [("single_block", 0), ("single_block", 1)],
                  "qwen_image": [("double_block", 0), ("double_block", 1)],
                  "wan": [("double_block", 0), ("double_block", 1)]}
# Where "pe" has its tokens: Flux and Qwen-Image over [text, image] on axis 2, Wan over the video alone on axis 1.
PE = {"flux": (2, True), "flux2": (2, True), "qwen_image": (2, True), "wan": (1, False)}


def merge(ratio: float = 0.5, **settings) -> ToMeConfig:
    return ToMeConfig(ratio=ratio, mode="merge", **settings)


def record_blocks(patcher, blocks):
    """A replace patch on ``blocks`` set by another node: records each call's args, then runs the block."""
    seen = []
    for kind, index in blocks:
        def spy(args, extra, key=(kind, index)):
            seen.append((key, {k: v.clone() for k, v in args.items() if isinstance(v, torch.Tensor)}))
            return extra["original_block"](args)
        patcher.set_model_patch_replace(spy, "dit", kind, index)
    return seen


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_bounded_change_and_original_untouched(comfy, family):
    patcher, latent, cond, _ = FAMILIES[family](comfy)
    expected = sample(comfy, patcher, latent, cond)
    assert torch.equal(sample(comfy, patch_dit_model_patcher(patcher, merge(0.0)), latent, cond), expected)
    on = patch_dit_model_patcher(patcher, merge(0.5))
    changed = sample(comfy, on, latent, cond)
    rel = ((changed - expected).norm() / expected.norm()).item()
    assert torch.isfinite(changed).all() and 0 < rel < 1.0, rel
    assert not patcher.wrappers.get("apply_model")
    assert not patcher.model_options.get("transformer_options", {}).get("patches_replace")
    assert torch.equal(sample(comfy, patcher, latent, cond), expected)  # the input MODEL is unchanged
    assert torch.equal(sample(comfy, on, latent, cond), changed)  # same seed, same output


@pytest.mark.parametrize("family", [name for name in FAMILIES if name not in OWN_TEST])
def test_blocks_carry_fewer_image_tokens_text_whole_and_rope_follows(comfy, family):
    """The blocks of the range get int(r * grid) fewer image tokens; the text rows (and, in the first reduced block,
    whose input is vanilla's, the text's hidden states) are unchanged; each image row of the rotary table is the
    row of a distinct real token, in raster order."""
    patcher, latent, cond, where = FAMILIES[family](comfy)
    blocks = DEFAULT_BLOCKS[family]
    vanilla_base = patcher.clone()
    vanilla = record_blocks(vanilla_base, blocks)
    sample(comfy, vanilla_base, latent, cond, steps=1)
    base = patcher.clone()
    merged = record_blocks(base, blocks)
    on = patch_dit_model_patcher(base, merge(0.5, seed=3))
    sample(comfy, on, latent, cond, steps=1)
    assert [key for key, _ in merged] == [key for key, _ in vanilla] and merged
    text, grid = where["prefix"], where["grid"]
    slots = grid - int(0.5 * grid)
    state = on.wrappers["apply_model"]["tome_dit_kv"][0].__self__  # the clone's DiTMergePatch
    kept = state.last_call.match.on(TokenLayout(state.last_call.layout.grid)).kept  # the grid's kept tokens
    assert kept.numel() == slots and torch.equal(kept, kept.unique())
    axis, with_text = PE[family]
    before = text if with_text else 0  # text rows of "pe"
    for (key, full), (_, cut) in zip(vanilla, merged):
        joint = key[0] == "single_block"  # Flux's single blocks: "img" is [text, image]
        assert cut["img"].shape[1] == (text if joint else 0) + slots
        assert cut["pe"].shape[axis] == before + slots
        assert torch.equal(cut["pe"].narrow(axis, 0, before), full["pe"].narrow(axis, 0, before))
        # each image slot at its own representative's position (the call's kept tokens, after the text)
        image = full["pe"].narrow(axis, before, grid)
        assert torch.equal(cut["pe"].narrow(axis, before, slots), image.index_select(axis, kept))
    (_, full), (_, cut) = vanilla[0], merged[0]
    if "txt" in full:
        assert torch.equal(cut["txt"], full["txt"])
    else:
        assert torch.equal(cut["img"][:, :text], full["img"][:, :text])


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("batch", [1, 3])
def test_odd_sizes_batches_and_bf16(comfy, family, dtype, batch):
    """Odd grid sides (5 x 7), a batch of 1 or 3, the model in float32 or bf16: ratio 0 is the unpatched output bit
    for bit; 0.75 changes it, stays finite, and reaches every block of the range."""
    from test_comfy_families import _seeded_patcher

    patcher, latent, cond, _ = FAMILIES[family](comfy)
    if dtype != torch.float32:
        config = patcher.model.model_config
        config.set_inference_dtype(dtype, None)
        patcher = _seeded_patcher(comfy, config.get_model({}))
    if family == "ltx2":  # a nested [video, audio] latent: each stream batched
        import comfy.nested_tensor

        latent = comfy.nested_tensor.NestedTensor([t.expand(batch, *t.shape[1:]).clone() for t in latent.tensors])
        cond = [[cond[0][0], {}]]  # no text mask: the tiny text of one sample serves the batch
    else:
        latent = latent.expand(batch, *latent.shape[1:]).clone()
    expected = sample(comfy, patcher, latent, cond, steps=1)
    assert torch.equal(sample(comfy, patch_dit_model_patcher(patcher, merge(0.0)), latent, cond, steps=1), expected)
    on = patch_dit_model_patcher(patcher, merge(0.75))
    changed = sample(comfy, on, latent, cond, steps=1)
    assert changed.shape == expected.shape and torch.isfinite(changed).all() and not torch.equal(changed, expected)


def test_another_nodes_block_patch_still_acts(comfy):
    """A replace patch set before ToMe on a block of its range is kept and called, with the merged tokens."""
    patcher, latent, cond, where = flux(comfy)
    base = patcher.clone()
    seen = record_blocks(base, [("single_block", 1)])
    on = patch_dit_model_patcher(base, merge(0.5))
    sample(comfy, on, latent, cond, steps=1)
    assert len(seen) == 1 and seen[0][1]["img"].shape[1] == where["prefix"] + where["grid"] - int(0.5 * where["grid"])
    again = patch_dit_model_patcher(on, merge(0.5))  # re-patching replaces ToMe's patch, keeps the other node's
    seen.clear()
    sample(comfy, again, latent, cond, steps=1)
    assert len(seen) == 1


def test_blocks_run_without_the_replace_patches_stop_the_prompt(comfy):
    """A node that runs the model without ComfyUI's block replace patches (as a forward-replacing step cache does)
    would drop ToMe silently: the first model call raises, naming why and what to do."""
    patcher, latent, cond, _ = flux(comfy)
    on = patch_dit_model_patcher(patcher, merge(0.5))

    def without_block_patches(executor, x, t, c_concat=None, c_crossattn=None, control=None,
                              transformer_options=None, **kwargs):
        options = dict(transformer_options or {}, patches_replace={})
        return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)

    on.add_wrapper_with_key("apply_model", "a_cache_node", without_block_patches)
    with pytest.raises(RuntimeError, match="mode merge reached no block of Flux's first model call: its blocks ran "
                                           "without ComfyUI's transformer_options"):
        sample(comfy, on, latent, cond, steps=1)


def test_families_without_merge_are_refused(comfy):
    from test_comfy_dit import sd3

    patcher, _, _, _ = sd3(comfy)
    with pytest.raises(ValueError, match="mode='merge' on transformers .*reaches flux, qwen_image, lumina2, wan, "
                                         "wan_animate, wan_s2v, wan_scail, ltx2 so far; OpenAISignatureMMDITWrapper is not among them.*mode='kv'"):
        plan_patch(patcher, merge(0.5))


def test_qwen_image_edit_reference_tokens_pass_whole(comfy):
    """Qwen-Image Edit's reference latent (appended by the model after the grid): its tokens and their rotary rows
    reach the blocks whole; where the conditioning asks for the zero-timestep reference method (Edit 2511: the
    references modulated by position), merge stops the prompt naming mode kv."""
    patcher, latent, cond, where, _ = qwen_image(comfy, refs=True)
    blocks = DEFAULT_BLOCKS["qwen_image"]
    vanilla_base, merged_base = patcher.clone(), patcher.clone()
    vanilla, merged = record_blocks(vanilla_base, blocks), record_blocks(merged_base, blocks)
    sample(comfy, vanilla_base, latent, cond, steps=1)
    sample(comfy, patch_dit_model_patcher(merged_base, merge(0.5)), latent, cond, steps=1)
    refs, grid = 12, where["grid"]
    full, cut = vanilla[0][1], merged[0][1]
    assert full["img"].shape[1] == grid + refs and cut["img"].shape[1] == grid - int(0.5 * grid) + refs
    assert torch.equal(cut["img"][:, -refs:], full["img"][:, -refs:])
    assert torch.equal(cut["pe"][:, :, -refs:], full["pe"][:, :, -refs:])
    cond[0][1]["reference_latents_method"] = "index_timestep_zero"
    with pytest.raises(ValueError, match="qwen_image calls whose reference images take the zero timestep.*mode kv"):
        sample(comfy, patch_dit_model_patcher(patcher, merge(0.5)), latent, cond, steps=1)


def test_the_plan_describes_mode_merge(comfy):
    patcher, _, _, _ = flux(comfy)
    plan = plan_patch(patcher, merge(0.5))
    assert plan.kind == "dit" and plan.description["mode"] == "merge" and plan.description["kv_window"] == []
    assert plan.description["blocks"] == [2, 3] and plan.description["family"] == "flux"
    spy_on(patcher)  # an attention override set by another node does not stop mode merge
    assert plan.attach() is not patcher


def test_the_basic_node_uses_each_familys_default_mode_and_ratio(comfy, tome_package):
    """The basic node has no mode input: each family gets its catalogue default mode; ratio -1 (the widget's default)
    is the family's default ratio in that mode, the same patch as that ratio set by hand; an explicit ratio is kept
    as it is; any other negative ratio is refused naming -1."""
    from test_comfy_dit import _node_classes
    from tome_core.catalogue.families import BY_NAME

    tome_nodes = _node_classes(tome_package)
    for name in ("qwen_image", "wan", "z_image", "flux"):
        family = BY_NAME[name]
        patcher, latent, cond, _ = FAMILIES[name](comfy)
        out = tome_nodes.ToMe().patch(patcher, ratio=-1.0, max_downsample=1)
        info = out["ui"]["tome"][0]
        assert (info["mode"], info["ratio"]) == (family.default_mode, family.default_ratio)
        by_hand = tome_nodes.ToMe().patch(patcher, ratio=family.default_ratio, max_downsample=1)
        assert info["defaults"] == ["ratio"] and by_hand["ui"]["tome"][0]["defaults"] == []  # what the widget shows
        assert dict(by_hand["ui"]["tome"][0], defaults=["ratio"]) == info
        assert torch.equal(sample(comfy, out["result"][0], latent, cond, steps=1),
                           sample(comfy, by_hand["result"][0], latent, cond, steps=1))
        assert tome_nodes.ToMe().patch(patcher, ratio=0.5, max_downsample=1)["ui"]["tome"][0]["ratio"] == 0.5
    with pytest.raises(ValueError, match="use -1 for the model's default ratio"):
        tome_nodes.ToMe().patch(patcher, ratio=-0.5, max_downsample=1)


def test_another_nodes_attention_override_acts_on_the_merged_tokens(comfy):
    """An attention override set on the model by another node (KJNodes' Sage attention patch sets the same
    transformer_options key): both act, the override sees the blocks' shorter sequences."""
    patcher, latent, cond, where = flux(comfy)
    base = patcher.clone()
    calls = spy_on(base)
    sample(comfy, patch_dit_model_patcher(base, merge(0.5)), latent, cond, steps=1)
    lengths = sorted({q.shape[1 if not skip else 2] for q, _, _, skip in calls})
    full = where["prefix"] + where["grid"]
    assert full in lengths and full - int(0.5 * where["grid"]) in lengths  # double blocks whole, singles merged


@pytest.mark.parametrize("family", FAMILIES)
def test_the_merged_blocks_update_reaches_the_output(comfy, family):
    """Each merged block's own update is in the output: scaling the weights of the merged blocks changes what
    mode merge gives (ComfyUI's Flux blocks add to their input in place; an update taken against that same tensor
    would vanish and leave every merged block a no-op)."""
    patcher, latent, cond, _ = FAMILIES[family](comfy)
    model = patcher.model.diffusion_model
    attr = {"flux": "single_blocks", "flux2": "single_blocks", "qwen_image": "transformer_blocks", "wan": "blocks",
            "z_image": "layers", "lumina2": "layers", "ltx2": "transformer_blocks"}
    on = patch_dit_model_patcher(patcher, merge(0.5))
    before = sample(comfy, on, latent, cond, steps=1)
    with torch.no_grad():
        for p in getattr(model, attr[family]).parameters():
            p.mul_(1.7)
    after = sample(comfy, on, latent, cond, steps=1)
    assert ((after - before).norm() / before.norm()).item() > 1e-3


def record_layers(model):
    """What each NextDiT main layer itself receives (a forward pre-hook on the layer: ToMe's object patch calls it)."""
    seen = []

    def spy(module, args, kwargs):
        seen.append((args[0].clone(), args[2].clone()))

    return seen, [layer.register_forward_pre_hook(spy, with_kwargs=True) for layer in model.layers]


@pytest.mark.parametrize("family", NEXT_DIT)
def test_next_dit_layers_carry_fewer_image_tokens_caption_whole_and_rope_follows(comfy, family):
    """Z-Image ([caption + padding, image + padding]) and Lumina 2 ([caption, image]): through object patches of its
    layers, each gets int(r * grid) fewer tokens; the caption and padding rows and their rotary rows are vanilla's
    in the first layer; every image rotary row is its kept token's. The input MODEL holds no object patch."""
    patcher, latent, cond, where = FAMILIES[family](comfy)
    model = patcher.model.diffusion_model
    vanilla, handles = record_layers(model)
    sample(comfy, patcher, latent, cond, steps=1)
    for handle in handles:
        handle.remove()
    on = patch_dit_model_patcher(patcher, merge(0.5, seed=3))
    assert sorted(on.object_patches) == ["diffusion_model.layers.0", "diffusion_model.layers.1"]
    assert not patcher.object_patches
    merged, handles = record_layers(model)
    sample(comfy, on, latent, cond, steps=1)
    for handle in handles:
        handle.remove()
    assert len(merged) == len(vanilla) == 2
    sample(comfy, patcher, latent, cond, steps=1)  # the input MODEL loaded again: ComfyUI takes the object patches off
    assert all(type(layer).__name__ == "JointTransformerBlock" for layer in model.layers)
    prefix, grid, suffix = where["prefix"], where["grid"], where["suffix"]
    slots = grid - int(0.5 * grid)
    state = on.wrappers["apply_model"]["tome_dit_kv"][0].__self__
    kept = state.last_call.match.on(TokenLayout(state.last_call.layout.grid)).kept
    for (full, pe), (cut, cut_pe) in zip(vanilla, merged):
        assert cut.shape[1] == prefix + slots + suffix and cut_pe.shape[1] == cut.shape[1]
        assert torch.equal(cut_pe[:, :prefix], pe[:, :prefix]) and torch.equal(cut_pe[:, prefix + slots:],
                                                                               pe[:, prefix + grid:])
        assert torch.equal(cut_pe[:, prefix:prefix + slots], pe[:, prefix:prefix + grid].index_select(1, kept))
    assert torch.equal(merged[0][0][:, :prefix], vanilla[0][0][:, :prefix])
    assert torch.equal(merged[0][0][:, prefix + slots:], vanilla[0][0][:, prefix + grid:])


def test_next_dit_object_patches_chain_and_re_patching_replaces(comfy):
    """Another node's object patch on a NextDiT layer (set before ToMe) is kept and called with the merged tokens;
    re-patching the patched clone replaces ToMe's copy instead of stacking a second merge on it."""
    patcher, latent, cond, where = FAMILIES["z_image"](comfy)
    layer = patcher.model.diffusion_model.layers[1]
    seen = []

    class Other(type(layer)):  # another node's replacement of the layer, sharing its weights
        def forward(self, x, *args, **kwargs):
            seen.append(x.shape[1])
            return super().forward(x, *args, **kwargs)

    other = type(layer).__new__(Other)
    other.__dict__.update(layer.__dict__)
    base = patcher.clone()
    base.add_object_patch("diffusion_model.layers.1", other)
    on = patch_dit_model_patcher(base, merge(0.5))
    sample(comfy, on, latent, cond, steps=1)
    merged_length = where["prefix"] + where["grid"] - int(0.5 * where["grid"]) + where["suffix"]
    assert seen == [merged_length]
    again = patch_dit_model_patcher(on, merge(0.5))
    assert again.object_patches["diffusion_model.layers.1"].__dict__["_tome_previous"] is other
    seen.clear()
    sample(comfy, again, latent, cond, steps=1)
    assert seen == [merged_length]


def _rows(value):
    """A per-token input as rows [B, tokens, C] (LTX-2's CompressedTimestep expanded)."""
    return value if isinstance(value, torch.Tensor) else value.expand()


def test_ltx2_video_merged_audio_whole_and_video_inputs_follow(comfy):
    """LTX-2 (2026 ComfyUIs): "img" is (video, audio); each block gets int(r * grid) fewer video tokens and the whole
    audio stream (vanilla's in the first block); the video self- and cross-attention rotary rows and the per-frame
    (compressed) timestep rows are those of the kept tokens."""
    patcher, latent, cond, where = FAMILIES["ltx2"](comfy)
    keys = ("v_pe", "v_cross_pe", "v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep")

    def record(base):
        seen = []
        for index in range(2):
            def spy(args, extra):
                seen.append(dict({key: args[key] for key in keys}, video=args["img"][0].clone(),
                                 audio=args["img"][1].clone()))
                return extra["original_block"](args)
            base.set_model_patch_replace(spy, "dit", "double_block", index)
        return seen

    vanilla_base, merged_base = patcher.clone(), patcher.clone()
    vanilla, merged = record(vanilla_base), record(merged_base)
    sample(comfy, vanilla_base, latent, cond, steps=1)
    on = patch_dit_model_patcher(merged_base, merge(0.5, seed=3))
    sample(comfy, on, latent, cond, steps=1)
    grid = where["grid"]
    slots = grid - int(0.5 * grid)
    state = on.wrappers["apply_model"]["tome_dit_kv"][0].__self__
    kept = state.last_call.match.on(TokenLayout(state.last_call.layout.grid)).kept
    assert len(merged) == len(vanilla) == 2 and kept.numel() == slots
    for full, cut in zip(vanilla, merged):
        assert cut["video"].shape[1] == slots and cut["audio"].shape == full["audio"].shape
        for key in ("v_pe", "v_cross_pe"):
            assert torch.equal(cut[key][0], full[key][0].index_select(1, kept)) and cut[key][1:] == full[key][1:]
        for key in ("v_timestep", "v_cross_scale_shift_timestep", "v_cross_gate_timestep"):
            rows = _rows(full[key])
            if rows.shape[1] == grid:  # one row per token (a single row per sample passes as it is)
                assert torch.equal(_rows(cut[key]), rows[:, kept])
    assert torch.equal(merged[0]["audio"], vanilla[0]["audio"])


WAN_VARIANTS = ("wan_vace", "wan_phantom", "wan_animate", "wan_s2v", "wan_scail", "wan_dancer")


@pytest.mark.parametrize("variant", WAN_VARIANTS)
def test_wan_variants_merge_the_video_and_keep_their_other_tokens_whole(comfy, variant):
    """Wan VACE (its vace_blocks run whole over the control video; their hints land on the restored stream), Phantom
    (subject frames after the video), Animate (the reference frame before it), S2V, SCAIL and WanDancer: ratio 0 is
    bit-identical; at 0.5 every main block gets int(r * grid) fewer tokens, the tokens before and after the grid
    reach the first block as vanilla's, and the output changes boundedly."""
    import test_comfy_families

    patcher, latent, cond, where, _ = getattr(test_comfy_families, variant)(comfy)
    expected = sample(comfy, patcher, latent, cond, steps=1)
    assert torch.equal(sample(comfy, patch_dit_model_patcher(patcher, merge(0.0)), latent, cond, steps=1), expected)
    blocks = [("double_block", 0), ("double_block", 1)]
    vanilla_base, merged_base = patcher.clone(), patcher.clone()
    vanilla, merged = record_blocks(vanilla_base, blocks), record_blocks(merged_base, blocks)
    sample(comfy, vanilla_base, latent, cond, steps=1)
    on = patch_dit_model_patcher(merged_base, merge(0.5))
    changed = sample(comfy, on, latent, cond, steps=1)
    rel = ((changed - expected).norm() / expected.norm()).item()
    assert torch.isfinite(changed).all() and 0 < rel < 1.0, rel
    prefix, grid = where["prefix"], where["grid"]
    assert len(merged) == len(vanilla) == 2
    for (_, full), (_, cut) in zip(vanilla, merged):
        assert cut["img"].shape[1] == full["img"].shape[1] - int(0.5 * grid)
    full, cut = vanilla[0][1]["img"], merged[0][1]["img"]
    after = full.shape[1] - prefix - grid
    assert torch.equal(cut[:, :prefix], full[:, :prefix])
    assert torch.equal(cut[:, cut.shape[1] - after:], full[:, full.shape[1] - after:])


def test_wan_humo_refuses_merge_naming_it(comfy):
    """HuMo's audio cross-attention, inside each block, reshapes the video tokens by frame: merge is refused there,
    naming the class and mode kv."""
    import test_comfy_families

    patcher = test_comfy_families.wan_humo(comfy)[0]
    with pytest.raises(ValueError, match="HumoWanModel is not among them.*mode='kv'"):
        patch_dit_model_patcher(patcher, merge(0.5))


def test_match_every_reuses_within_a_run_and_each_run_starts_afresh(comfy):
    """Two steps with match_every=3: the second step runs on the first's matching; a second run with the same
    seed gives the same image (ComfyUI's new sample_sigmas restarts the count: no run starts on the last run's)."""
    patcher, latent, cond, _ = FAMILIES["flux"](comfy)
    every_call = sample(comfy, patch_dit_model_patcher(patcher, merge(0.5)), latent, cond)
    reusing = patch_dit_model_patcher(patcher, merge(0.5, match_every=3))
    first = sample(comfy, reusing, latent, cond)
    assert not torch.equal(first, every_call)
    assert torch.equal(sample(comfy, reusing, latent, cond), first)
    one_step = sample(comfy, patch_dit_model_patcher(patcher, merge(0.5)), latent, cond, steps=1)
    assert torch.equal(sample(comfy, reusing, latent, cond, steps=1), one_step)  # the first call matches
    with pytest.raises(ValueError, match="mode='merge'"):
        ToMeConfig(ratio=0.5, mode="kv", match_every=2)


def spy_masks(patcher):
    """An attention override set by another node: records each attention's key count and the mask it is handed
    (ToMe's per-block override chains it, so it sees the mask ToMe adds)."""
    calls = []

    def spy(func, *args, **kwargs):
        k = args[1] if len(args) >= 3 else kwargs["k"]
        mask = args[4] if len(args) >= 5 else kwargs.get("mask")
        calls.append((k.shape[2 if kwargs.get("skip_reshape", False) else 1], None if mask is None else mask.clone()))
        return func(*args, **kwargs)

    patcher.model_options.setdefault("transformer_options", {})[OVERRIDE] = spy
    return calls


@pytest.mark.parametrize("how", ["balanced", "proportional"])
@pytest.mark.parametrize("family", FAMILIES)
def test_merged_keys_weigh_as_the_tokens_they_hold(comfy, family, how):
    """In every attention over a merged stream the stream's keys weigh as its tokens: exp of their bias sums to the
    stream's token count (text and tokens outside the grid at 0); balanced leaves an attention over the grid alone
    (Wan's and LTX-2's video self-attention) unmasked; ratio 0 is the unpatched output bit for bit, the input MODEL
    is untouched, and the plan names the attention."""
    patcher, latent, cond, where = FAMILIES[family](comfy)
    expected = sample(comfy, patcher, latent, cond, steps=1)
    assert torch.equal(sample(comfy, patch_dit_model_patcher(patcher, merge(0.0, merge_attention=how)), latent, cond,
                              steps=1), expected)
    base = patcher.clone()
    calls = spy_masks(base)
    on = patch_dit_model_patcher(base, merge(0.5, merge_attention=how))
    changed = sample(comfy, on, latent, cond, steps=1)
    assert torch.isfinite(changed).all() and not torch.equal(changed, expected)
    state = on.wrappers["apply_model"]["tome_dit_kv"][0].__self__
    # the merges of the call, by the key count of an attention over each: the stream alone, or the text before it
    text = where.get("prefix", 0)
    merges = {merge_.slots + extra: merge_ for merge_ in state.last_call.merges.values() for extra in (0, text)}
    weighed = [(keys, mask) for keys, mask in calls if mask is not None and mask.dtype != torch.bool and keys in merges]
    if family in ("wan", "ltx2") and how == "balanced":
        assert not weighed
    else:
        assert weighed
    for keys, mask in weighed:
        merge_ = merges[keys]
        stream = mask.reshape(-1, keys)[0, keys - merge_.slots:].float()
        finite = stream[torch.isfinite(stream) & (stream > -1e4)]
        assert finite.exp().sum().item() == pytest.approx(merge_.length - (stream.numel() - finite.numel()), rel=1e-2)
    assert plan_patch(patcher, merge(0.5, merge_attention=how)).description["merge_attention"] == how
    assert torch.equal(sample(comfy, patcher, latent, cond, steps=1), expected)


def test_each_familys_default_merge_attention(comfy):
    """Without merge_attention the family's catalogue default: balanced on Qwen-Image, plain on the others."""
    from tome_core.catalogue.families import BY_NAME

    for family in ("qwen_image", "flux", "wan", "z_image"):
        patcher = FAMILIES[family](comfy)[0]
        described = plan_patch(patcher, merge(0.5)).description["merge_attention"]
        assert described == BY_NAME[family].merge_attention
    assert plan_patch(FAMILIES["qwen_image"](comfy)[0], merge(0.5)).description["merge_attention"] == "balanced"
