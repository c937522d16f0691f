"""Mode "kv" on ComfyUI's own DiT classes (Flux, MMDiT/SD3, Wan, HunyuanVideo), in process, sampled by ComfyUI.

Reduced-size models built from comfy.supported_models / comfy.ldm classes with seeded weights,
patched with tome_core.adapters.model_patcher.dit.patch_dit_model_patcher and sampled with comfy.sample.sample,
so the wrappers, transformer_options and optimized_attention_override are ComfyUI's own.
Run with the interpreter of an environment that has ComfyUI >= 0.3.6x (.venv-comfy-next).
"""
from __future__ import annotations

import importlib
import importlib.util

import pytest
import torch

import comfy_env

from tome_core.catalogue.families import BY_NAME
from tome_core.engine.config import ToMeConfig
from tome_core.adapters.model_patcher.dit import OVERRIDE, has_image_only_attention, patch_dit_model_patcher


@pytest.fixture(scope="module")
def comfy():
    comfy_dir = comfy_env.require_comfyui("TOME_REQUIRE_COMFY", "use .venv-comfy-next/bin/python")
    comfy_env.import_comfy(comfy_dir)
    import comfy.ldm.modules.attention as attention

    if not hasattr(attention, "wrap_attn"):
        pytest.skip("this ComfyUI has no optimized_attention_override (needs ComfyUI 0.3.6x+)")
    import comfy.model_patcher
    import comfy.sample
    import comfy.supported_models
    return comfy


def _patcher(comfy, config_cls, unet_config):
    model = config_cls(unet_config).get_model({})
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():  # ComfyUI's ops skip weight init: seed every weight
        for p in model.diffusion_model.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 16
            p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    cpu = torch.device("cpu")
    return comfy.model_patcher.ModelPatcher(model, load_device=cpu, offload_device=cpu)


def _as_detected(params_cls, config: dict, **detected) -> dict:
    """``config`` plus the keys the running ComfyUI's model_detection sets for such a checkpoint, where its
    params dataclass has them (newer ComfyUIs require keys older ones do not know)."""
    fields = getattr(params_cls, "__dataclass_fields__", {})
    return {**config, **{key: value for key, value in detected.items() if key in fields}}


def flux(comfy):
    import comfy.ldm.flux.model

    patcher = _patcher(comfy, comfy.supported_models.Flux, _as_detected(comfy.ldm.flux.model.FluxParams, dict(
        image_model="flux", in_channels=16, patch_size=2, out_channels=16, vec_in_dim=32, context_in_dim=32,
        hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
        qkv_bias=True, guidance_embed=True), txt_ids_dims=[]))  # model_detection: Flux.1 has no text ids dims
    latent = torch.zeros(1, 16, 10, 13)  # 5 x 7 patches: odd sides
    cond = [[torch.randn(1, 5, 32, generator=torch.Generator().manual_seed(1)),
             {"pooled_output": torch.randn(1, 32, generator=torch.Generator().manual_seed(2)), "guidance": 3.5}]]
    return patcher, latent, cond, dict(prefix=5, grid=35, suffix=0)


def sd3(comfy):
    patcher = _patcher(comfy, comfy.supported_models.SD3, dict(
        in_channels=16, patch_size=2, depth=2, adm_in_channels=32, pos_embed_max_size=16, out_channels=16,
        context_embedder_config={"target": "torch.nn.Linear", "params": {"in_features": 32, "out_features": 128}},
        x_block_self_attn_layers=[0], pos_embed_scaling_factor=None))
    latent = torch.zeros(1, 16, 12, 10)
    cond = [[torch.randn(1, 6, 32, generator=torch.Generator().manual_seed(1)),
             {"pooled_output": torch.randn(1, 32, generator=torch.Generator().manual_seed(2))}]]
    return patcher, latent, cond, dict(prefix=6, grid=30, suffix=0)


def wan(comfy):
    patcher = _patcher(comfy, comfy.supported_models.WAN21_T2V, dict(
        image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=32, ffn_dim=32, freq_dim=32,
        text_dim=32, out_dim=16, num_heads=2, num_layers=2))
    latent = torch.zeros(1, 16, 3, 6, 10)  # 3 frames: not a multiple of a 2-frame window
    cond = [[torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(1)), {}]]
    return patcher, latent, cond, dict(prefix=0, grid=45, suffix=0)


def host_where(patcher, where: dict, added: int = 0) -> dict:
    """``where`` (prefix, grid, suffix of the joint attention, as ComfyUI 0.3.x runs HunyuanVideo: [video, text]) on
    the running host: ComfyUI 0.13+ runs [text, video], so the suffix and the ``added`` tokens the model puts
    beside its text (byT5, vision) come before the grid there."""
    from tome_core.catalogue.comfy_lookup import comfy_model

    if comfy_model(patcher.model.diffusion_model).grid_last:
        return dict(prefix=where["prefix"] + where["suffix"] + added, grid=where["grid"], suffix=0)
    return where


def hunyuan_video(comfy):
    """[image, text] joint attention (text last; [text, image] on ComfyUI 0.13+), after a text refiner whose
    self-attention sees text only."""
    import comfy.ldm.hunyuan_video.model

    params = comfy.ldm.hunyuan_video.model.HunyuanVideoParams
    patcher = _patcher(comfy, comfy.supported_models.HunyuanVideo, _as_detected(params, dict(
        image_model="hunyuan_video", in_channels=16, patch_size=[1, 2, 2], out_channels=16, vec_in_dim=32,
        context_in_dim=32, hidden_size=32, mlp_ratio=2.0, num_heads=2, depth=1, depth_single_blocks=2,
        axes_dim=[4, 6, 6], theta=256, qkv_bias=True, guidance_embed=True, byt5=False, meanflow=False,
        use_cond_type_embedding=False, vision_in_dim=None), meanflow_sum=False))  # model_detection: no vision_in
    latent = torch.zeros(1, 16, 3, 6, 10)
    cond = [[torch.randn(1, 7, 32, generator=torch.Generator().manual_seed(1)),
             {"pooled_output": torch.randn(1, 32, generator=torch.Generator().manual_seed(2)), "guidance": 6.0}]]
    return patcher, latent, cond, host_where(patcher, dict(prefix=0, grid=45, suffix=7))


FAMILIES = {"flux": flux, "sd3": sd3, "wan": wan, "hunyuan_video": hunyuan_video}


def first_over_layout(calls, where) -> int:
    """Index of the first attention whose keys span the whole layout (HunyuanVideo's text refiner comes first)."""
    length = where["prefix"] + where["grid"] + where["suffix"]
    return next(i for i, (_, k, _, skip) in enumerate(calls) if k.shape[2 if skip else 1] == length)


def sample(comfy, patcher, latent, cond, steps: int = 2) -> torch.Tensor:
    """ComfyUI's sampler; a nested latent (LTX-2's [video, audio]) gets ComfyUI's own nested noise, and its
    streams come back flattened into one tensor. HiDream O1 keeps its text's keys/values on the model across samples
    (its later steps then run only the fresh queries): each sample starts without them, as a fresh run does, so
    samples compare bit for bit."""
    clear = getattr(patcher.model.diffusion_model, "clear_kv_cache", None)
    if callable(clear):
        clear()
    if getattr(latent, "is_nested", False):
        noise = comfy.sample.prepare_noise(latent, 0)
        out = comfy.sample.sample(patcher, noise, steps, 1.0, "euler", "simple", cond, cond, latent,
                                  denoise=1.0, seed=0, disable_pbar=True)
        return torch.cat([t.flatten(1) for t in out.unbind()], 1)
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    return comfy.sample.sample(patcher, noise, steps, 1.0, "euler", "simple", cond, cond, latent,
                               denoise=1.0, seed=0, disable_pbar=True)


def spy_on(patcher):
    """An override set on the patcher's model options (by 'another node') that records the attention inputs."""
    calls = []

    def spy(func, *args, **kwargs):
        calls.append(tuple(a.clone() for a in args[:3]) + (kwargs.get("skip_reshape", False),))
        return func(*args, **kwargs)

    patcher.model_options.setdefault("transformer_options", {})[OVERRIDE] = spy
    return calls


@pytest.mark.parametrize("family", FAMILIES)
def test_identity_bounded_change_and_original_untouched(comfy, family):
    patcher, latent, cond, _ = FAMILIES[family](comfy)
    expected = sample(comfy, patcher, latent, cond)
    assert torch.isfinite(expected).all()
    off = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.0, mode="kv"))
    assert torch.equal(sample(comfy, off, latent, cond), expected)
    on = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    assert on is not patcher and not patcher.wrappers.get("apply_model")
    changed = sample(comfy, on, latent, cond)
    rel = ((changed - expected).norm() / expected.norm()).item()
    assert 0 < rel < 1.0, rel
    assert torch.equal(sample(comfy, patcher, latent, cond), expected)  # the input MODEL is unchanged
    assert torch.equal(sample(comfy, on, latent, cond), changed)  # same seed, same output


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("order", ["before", "after"])
def test_text_and_queries_untouched_and_overrides_chain(comfy, family, order):
    patcher, latent, cond, where = FAMILIES[family](comfy)
    vanilla_patcher = patcher.clone()
    vanilla = spy_on(vanilla_patcher)
    sample(comfy, vanilla_patcher, latent, cond, steps=1)
    if order == "before":  # an override already there is chained
        base = patcher.clone()
        patched_calls = spy_on(base)
        patched = patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv", seed=3, block_start=0.0))
    else:  # an override set after ours (replacing the slot) does not switch ToMe off
        patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv", seed=3, block_start=0.0))
        patched_calls = spy_on(patched)
    sample(comfy, patched, latent, cond, steps=1)
    assert len(vanilla) == len(patched_calls) > 0
    first = first_over_layout(vanilla, where)
    q0, k0, v0, skip = vanilla[first]
    q1, k1, v1, _ = patched_calls[first]
    seq = 2 if skip else 1
    assert torch.equal(q0, q1)
    n, m, pre, suf = k0.shape[seq], k1.shape[seq], where["prefix"], where["suffix"]
    assert m < n
    for kept, full in ((k1, k0), (v1, v0)):  # text (before or after the grid) untouched
        assert torch.equal(kept.narrow(seq, 0, pre), full.narrow(seq, 0, pre))
        assert torch.equal(kept.narrow(seq, m - suf, suf), full.narrow(seq, n - suf, suf))
    img0 = k0.narrow(seq, pre, n - pre - suf).movedim(seq, 1).flatten(2)[0]
    img1 = k1.narrow(seq, pre, m - pre - suf).movedim(seq, 1).flatten(2)[0]
    match = (img1[:, None] == img0[None]).all(-1)
    assert (match.sum(1) >= 1).all() and match.float().argmax(1).unique().numel() == img1.shape[0]
    for a, b in zip(vanilla, patched_calls):
        assert a[0].shape == b[0].shape  # every query, every block
    reduced = sum(1 for a, b in zip(vanilla, patched_calls) if b[1].shape != a[1].shape)
    assert reduced > 0


def _rows_in(patched: torch.Tensor, full: torch.Tensor, seq: int) -> torch.Tensor:
    """For each token of ``patched``'s keys, its index among ``full``'s (batch 0), asserting each is found once."""
    a, b = (t.movedim(seq, 1).flatten(2)[0] for t in (patched, full))
    match = (a[:, None] == b[None]).all(-1)
    assert (match.sum(1) == 1).all()
    return match.float().argmax(1)


def test_sd35_image_only_attention_keeps_the_joint_attentions_grid_picks(comfy):
    """SD3.5's MMDiT-X runs, in a block with x_block_self_attn, the joint [text, image] attention and then
    an image-only one: on the real attention inputs both keep the same image tokens, every query stays."""
    patcher, latent, cond, where = sd3(comfy)
    assert has_image_only_attention(patcher.model.diffusion_model)
    vanilla_patcher = patcher.clone()
    vanilla = spy_on(vanilla_patcher)
    sample(comfy, vanilla_patcher, latent, cond, steps=1)
    base = patcher.clone()
    patched_calls = spy_on(base)
    sample(comfy, patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv", seed=5)), latent, cond, steps=1)
    pre, grid = where["prefix"], where["grid"]
    seq = 2 if vanilla[0][3] else 1
    assert [c[1].shape[seq] for c in vanilla] == [pre + grid, grid, pre + grid]  # block 0: joint, x_block; block 1
    (_, joint_k, _, _), (image_q, image_k, image_v, _) = patched_calls[:2]
    assert torch.equal(image_q, vanilla[1][0]) and image_k.shape[seq] == image_v.shape[seq] < grid
    joint_rows = _rows_in(joint_k, vanilla[0][1], seq)
    image_rows = _rows_in(image_k, vanilla[1][1], seq)
    assert torch.equal(joint_rows[:pre], torch.arange(pre))  # the text keys, all of them, first
    assert torch.equal(image_rows, joint_rows[pre:] - pre)  # the same grid picks in both attentions
    assert torch.equal(image_v, vanilla[1][2].index_select(seq, image_rows))


def test_refuses_pixart_and_merge_naming_the_model(comfy):
    """Mode merge reaches Flux, Qwen-Image, Lumina 2 / Z-Image, Wan and LTX-2 (test_comfy_dit_merge); other families
    refuse it naming the model."""
    patcher, *_ = sd3(comfy)
    with pytest.raises(ValueError, match="reaches flux, qwen_image, lumina2, wan, wan_animate, wan_s2v, wan_scail, ltx2 "
                                         "so far; OpenAISignatureMMDITWrapper is not among them.*use mode='kv'"):
        patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5))
    pixart = _patcher(comfy, comfy.supported_models.PixArtAlpha, dict(
        image_model="pixart_alpha", input_size=8, patch_size=2, in_channels=4, hidden_size=32, depth=1, num_heads=2,
        caption_channels=32, pe_interpolation=1.0))
    with pytest.raises(TypeError, match="PixArtMS is not a DiT that ToMe's kv mode can reach"):
        patch_dit_model_patcher(pixart, ToMeConfig(ratio=0.5, mode="kv"))
    assert not patcher.wrappers.get("apply_model") and not pixart.wrappers.get("apply_model")


@pytest.fixture(scope="module")
def tome_package():
    """The repository root imported as a package under its own name: imported here, after comfy, it
    exports the V3 entry point only, which must not change what the session's other tests import."""
    return comfy_env.import_repo_package("tome_custom_node_dit_test")


def _node_classes(tome_package):
    return importlib.import_module(f"{tome_package.__name__}.nodes.tome_nodes")


@pytest.mark.parametrize("family", FAMILIES)
def test_the_basic_node_patches_a_dit_in_its_default_mode_and_matches_the_engine(comfy, tome_package, family):
    """The same node id that speeds up UNets takes Flux/SD3/Wan: the family's default mode (the basic node has no mode
    input: the catalogue's, merge on Flux and Wan, kv on SD3), the image equals patch_dit_model_patcher's at the same
    settings, the input MODEL is unchanged."""
    tome_nodes = _node_classes(tome_package)
    patcher, latent, cond, _ = FAMILIES[family](comfy)
    expected = sample(comfy, patcher, latent, cond)
    result = tome_nodes.ToMe().patch(patcher, ratio=0.5, max_downsample=1)
    patched, info = result["result"][0], result["ui"]["tome"][0]
    mode = BY_NAME[family].default_mode
    assert info["family"] == family and info["mode"] == mode and bool(info["kv_window"]) == (mode == "kv")
    engine = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode))
    image = sample(comfy, patched, latent, cond)
    assert torch.equal(image, sample(comfy, engine, latent, cond))
    assert not torch.equal(image, expected)
    assert torch.equal(sample(comfy, patcher, latent, cond), expected)


def test_the_advanced_node_refuses_merge_and_avg_on_a_dit_naming_the_fix(comfy, tome_package):
    """Merge where the family has it (Flux: the node's default mode runs, its text says merge), refused elsewhere
    (SD3) naming the model and kv; avg refused on every DiT."""
    tome_nodes = _node_classes(tome_package)
    patcher, latent, cond, _ = flux(comfy)
    values = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0, mode="merge",
                  merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0)
    merged = tome_nodes.ToMeAdvanced().patch(patcher, **values)
    assert merged["ui"]["tome"][0]["mode"] == "merge" and merged["ui"]["tome"][0]["family"] == "flux"
    assert torch.isfinite(sample(comfy, merged["result"][0], latent, cond)).all()
    with pytest.raises(ValueError, match="OpenAISignatureMMDITWrapper is not among them.*use mode='kv'"):
        tome_nodes.ToMeAdvanced().patch(sd3(comfy)[0], **values)
    with pytest.raises(ValueError, match="kv_downsample='avg' is not supported on Flux.*'nearest'"):
        tome_nodes.ToMeAdvanced().patch(patcher, **dict(values, mode="kv"), kv_downsample="avg")
    assert not patcher.wrappers.get("apply_model")
    result = tome_nodes.ToMeAdvanced().patch(patcher, **dict(values, mode="kv", end_percent=0.5, tome_seed=7))
    assert torch.isfinite(sample(comfy, result["result"][0], latent, cond)).all()


def test_the_v3_node_gives_the_v1_image_on_a_dit(comfy, tome_package):
    pytest.importorskip("comfy_api.latest")
    tome_nodes = _node_classes(tome_package)
    tome_v3 = importlib.import_module(f"{tome_package.__name__}.nodes.tome_v3")

    patcher, latent, cond, _ = wan(comfy)
    v1 = tome_nodes.ToMe().patch(patcher, ratio=0.6, max_downsample=1)["result"][0]
    v3 = next(node for node in tome_v3.V3_NODES if node.__name__ == "ToMeV3")
    output = v3.execute(model=patcher, ratio=0.6, max_downsample=1)
    assert torch.equal(sample(comfy, output.result[0], latent, cond), sample(comfy, v1, latent, cond))


@pytest.mark.parametrize("family, start, end, reduced, blocks", [
    ("flux", 0.0, 0.5, [True, True, False], [2, 3]),  # 1 double + 2 single blocks: centres 1/6, 1/2, 5/6
    ("sd3", 0.5, 1.0, [False, False, True], [1, 2]),  # block 0: joint, then SD3.5's image-only attention
    ("sd3", 0.0, 0.5, [True, True, False], [1, 2]),  # the x_block attention goes with its block's joint one
    ("wan", 0.0, 0.5, [True, False, False, False], [1, 2]),  # per block: self-, then cross-attention
    # the text refiner's 2 self-attentions (text only, never reduced), then 1 double + 2 single blocks
    ("hunyuan_video", 0.34, 1.0, [False, False, False, True, True], [2, 3]),
])
def test_the_advanced_node_reduces_only_its_block_range(comfy, tome_package, family, start, end, reduced, blocks):
    """Checked on the keys each attention call really gets (a spy chained after ToMe's override)."""
    tome_nodes = _node_classes(tome_package)
    patcher, latent, cond, _ = FAMILIES[family](comfy)
    vanilla_patcher = patcher.clone()
    vanilla = spy_on(vanilla_patcher)
    sample(comfy, vanilla_patcher, latent, cond, steps=1)
    base = patcher.clone()
    patched_calls = spy_on(base)
    values = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0, mode="kv",
                  merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0)
    result = tome_nodes.ToMeAdvanced().patch(base, **values, block_start=start, block_end=end)
    assert result["ui"]["tome"][0]["blocks"] == blocks
    sample(comfy, result["result"][0], latent, cond, steps=1)
    assert len(vanilla) == len(patched_calls)
    seq = [2 if call[3] else 1 for call in vanilla]
    assert [b[1].shape[s] < a[1].shape[s] for a, b, s in zip(vanilla, patched_calls, seq)] == reduced


def test_a_block_range_is_refused_on_a_unet_and_when_it_holds_no_block(comfy, tome_package):
    tome_nodes = _node_classes(tome_package)
    values = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0, mode="kv",
                  merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0)
    patcher, _, _, _ = flux(comfy)
    with pytest.raises(ValueError, match="holds none of Flux's 3 blocks"):
        tome_nodes.ToMeAdvanced().patch(patcher, **values, block_start=0.2, block_end=0.3)
    with pytest.raises(ValueError, match=r"block_start=0\.333333\.\.block_end=0\.3 holds none of Flux's 3 blocks"):
        tome_nodes.ToMeAdvanced().patch(patcher, **values, block_end=0.3)  # the default start: the single blocks
    with pytest.raises(ValueError, match="need 0 <= block_start < block_end <= 1"):
        tome_nodes.ToMeAdvanced().patch(patcher, **values, block_start=0.5, block_end=0.5)
    assert not patcher.wrappers.get("apply_model")
    model = comfy.supported_models.SD15(comfy_env.tiny_sd15_unet_config()).get_model({})
    unet = comfy.model_patcher.ModelPatcher(model, load_device=torch.device("cpu"), offload_device=torch.device("cpu"))
    with pytest.raises(ValueError, match="BaseModel is a UNet, whose levels max_downsample chooses"):
        tome_nodes.ToMeAdvanced().patch(unet, **values, block_end=0.5)
    assert not unet.model_options.get("transformer_options", {}).get("patches")


def test_the_block_comes_from_the_models_block_report_not_a_count(comfy):
    """Flux reports block_type/block_index in transformer_options: with double block 0 replaced by another
    patch that skips it (no attention call), the single blocks keep their depth index 1 and 2. Counting
    the attention calls instead would take single block 0 for block 0 and leave it unreduced."""
    patcher, latent, cond, _ = flux(comfy)
    base = patcher.clone()
    base.set_model_patch_replace(lambda args, extra: {"img": args["img"], "txt": args["txt"]},
                                 "dit", "double_block", 0)
    vanilla_patcher = base.clone()
    vanilla = spy_on(vanilla_patcher)
    sample(comfy, vanilla_patcher, latent, cond, steps=1)
    calls = spy_on(base)
    patched = patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv", block_start=0.34))
    sample(comfy, patched, latent, cond, steps=1)
    seq = [2 if call[3] else 1 for call in vanilla]
    assert len(vanilla) == len(calls) == 2  # the two single blocks
    assert [b[1].shape[s] < a[1].shape[s] for a, b, s in zip(vanilla, calls, seq)] == [True, True]


def test_flux_reference_latent_tokens_after_the_grid_are_kept_whole(comfy):
    """Flux Kontext appends reference-image tokens after the grid ([text, image, reference]): the image grid
    is reduced, every reference key/value is kept."""
    patcher, latent, cond, where = flux(comfy)
    reference = torch.randn(1, 16, 6, 8, generator=torch.Generator().manual_seed(5))  # 3 x 4 = 12 tokens
    cond = [[cond[0][0], dict(cond[0][1], reference_latents=[reference])]]
    vanilla_patcher = patcher.clone()
    vanilla = spy_on(vanilla_patcher)
    sample(comfy, vanilla_patcher, latent, cond, steps=1)
    base = patcher.clone()
    calls = spy_on(base)
    sample(comfy, patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode="kv", block_start=0.0)), latent, cond,
           steps=1)
    q0, k0, v0, skip = vanilla[0]
    q1, k1, v1, _ = calls[0]
    seq, refs = 2 if skip else 1, 12
    n, m = k0.shape[seq], k1.shape[seq]
    assert n == where["prefix"] + where["grid"] + refs and m < n and torch.equal(q0, q1)
    for kept, full in ((k1, k0), (v1, v0)):
        assert torch.equal(kept.narrow(seq, 0, where["prefix"]), full.narrow(seq, 0, where["prefix"]))
        assert torch.equal(kept.narrow(seq, m - refs, refs), full.narrow(seq, n - refs, refs))


@pytest.mark.parametrize("family,mode,full", [("wan", "kv", 45), ("wan", "merge", 45), ("z_image", "merge", 64)])
@pytest.mark.parametrize("order", ["tome_first", "easycache_first"])
@pytest.mark.parametrize("cache", ["EasyCache", "LazyCache"])
def test_composes_with_easycache_in_either_order(comfy, caplog, order, family, mode, full, cache):
    """ComfyUI's EasyCache and LazyCache (OUTER_SAMPLE / CALC_COND_BATCH / DIFFUSION_MODEL wrappers, skipping whole
    model calls) and ToMe's APPLY_MODEL wrapper (mode merge: with its block replace patches, or NextDiT's object
    patches): the same image in either node order, the cache's own image at ratio 0, and with ratio 0.5 both act:
    steps skipped and attention calls shorter than the ``full`` self-attention (Wan's 45-token video, Z-Image's
    64-token [caption, image])."""
    import comfy_extras.nodes_easycache as nodes_easycache

    cache_node = getattr(nodes_easycache, f"{cache}Node", None)
    if cache_node is None:
        pytest.skip(f"this ComfyUI has no {cache}")

    if family == "wan":
        patcher, latent, cond, _ = wan(comfy)
    else:
        import test_comfy_families

        patcher, latent, cond, _, _ = test_comfy_families.z_image(comfy)

    def easycache(model):
        return cache_node.execute(model, reuse_threshold=3.0, start_percent=0.0, end_percent=1.0,
                                  verbose=False).result[0]

    def tome(model, ratio):
        return patch_dit_model_patcher(model, ToMeConfig(ratio=ratio, mode=mode))

    def run(model):
        caplog.clear()
        with caplog.at_level("INFO"):
            image = sample(comfy, model, latent, cond, steps=6)
        skipped = [r.getMessage() for r in caplog.records if f"{cache} - skipped" in r.getMessage()]
        assert skipped, f"{cache} did not run"
        return image, int(skipped[-1].split("skipped ")[1].split("/")[0])

    cached_only, skips = run(easycache(patcher))
    assert skips > 0
    first = (lambda r: easycache(tome(patcher, r))) if order == "tome_first" else (lambda r: tome(easycache(patcher), r))
    off, off_skips = run(first(0.0))
    assert torch.equal(off, cached_only) and off_skips == skips
    both = first(0.5)
    spy = spy_on(both)
    image, both_skips = run(both)
    assert both_skips > 0 and torch.isfinite(image).all() and not torch.equal(image, cached_only)
    assert any(call[1].shape[1 if not call[3] else 2] < full for call in spy)  # the self-attention, reduced
    other = (lambda r: tome(easycache(patcher), r)) if order == "tome_first" else (lambda r: easycache(tome(patcher, r)))
    assert torch.equal(run(other(0.5))[0], image)


@pytest.mark.parametrize("backend", ["attention_basic", "attention_split", "attention_sub_quad", "attention_pytorch"])
@pytest.mark.parametrize("skip_reshape", [False, True])
def test_every_attention_backend_comfyui_can_select_gets_the_shortened_keys(comfy, backend, skip_reshape):
    """ComfyUI picks one attention function at start-up (--use-split-cross-attention, --use-quad-cross-attention,
    --use-pytorch-cross-attention, or the basic one; xformers/sage/flash on CUDA): each is wrapped by wrap_attn,
    so ToMe's override reaches it, and it computes exactly the attention over the kept keys/values."""
    import comfy.ldm.modules.attention as attention
    from tome_core.adapters.model_patcher.dit import CallPlan, DiTKVPatch
    from tome_core.catalogue.comfy_lookup import binding_named
    from tome_core.engine.grid import TokenLayout
    from tome_core.engine.schedule import SigmaWindow

    function = getattr(attention, backend)
    layout = TokenLayout((4, 5), prefix=3)
    state = DiTKVPatch(ToMeConfig(ratio=0.5, mode="kv"), window=SigmaWindow(high=1.0, low=0.0), family=binding_named("flux"),
                       block_offsets={"double": 0})
    keep = state.keep_for(layout, 0.5, torch.device("cpu"))
    g = torch.Generator().manual_seed(0)
    shape = (2, 2, layout.length, 8) if skip_reshape else (2, layout.length, 16)
    q, k, v = (torch.randn(shape, generator=g) for _ in range(3))
    options = {OVERRIDE: state.override(CallPlan(layout, keep, 0.5), previous=None), "block_type": "double",
               "block_index": 0}
    out = function(q, k, v, 2, skip_reshape=skip_reshape, transformer_options=options)
    seq = 2 if skip_reshape else 1
    expected = function(q, k.index_select(seq, keep), v.index_select(seq, keep), 2, skip_reshape=skip_reshape)
    assert state.reduced_calls == 1 and keep.numel() < layout.length
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-6)
    assert not torch.allclose(out, function(q, k, v, 2, skip_reshape=skip_reshape), atol=1e-4)


@pytest.mark.parametrize("family, reduced, blocks", [
    ("flux", [False, True, True], [2, 3]),  # 1 double + 2 single blocks: the single blocks only
    ("sd3", [True, True, True], [2, 2]),  # block 0: joint, then its image-only x_block attention; block 1: joint
    ("wan", [True, False, True, False], [2, 2]),  # self-, then cross-attention per block
    ("hunyuan_video", [False, False, True, True, True], [3, 3]),  # text refiner (2), then every block
])
def test_the_default_block_range_is_the_familys_on_both_nodes(comfy, tome_package, family, reduced, blocks):
    """Without a block range (the basic node; the advanced node's block_start at its default -1), Flux
    reduces its single blocks only, the other families every block; block_start 0 reduces every block."""
    tome_nodes = _node_classes(tome_package)
    patcher, latent, cond, _ = FAMILIES[family](comfy)
    vanilla_patcher = patcher.clone()
    vanilla = spy_on(vanilla_patcher)
    sample(comfy, vanilla_patcher, latent, cond, steps=1)
    seq = [2 if call[3] else 1 for call in vanilla]
    values = dict(ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0, mode="kv",
                  merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0)
    runs = {"basic": lambda m: tome_nodes.ToMe().patch(m, ratio=0.5, max_downsample=1),
            "advanced": lambda m: tome_nodes.ToMeAdvanced().patch(m, **values),
            "every block": lambda m: tome_nodes.ToMeAdvanced().patch(m, **values, block_start=0.0)}
    for name, run in runs.items():
        base = patcher.clone()
        calls = spy_on(base)
        result = run(base)
        sample(comfy, result["result"][0], latent, cond, steps=1)
        got = [b[1].shape[s] < a[1].shape[s] for a, b, s in zip(vanilla, calls, seq)]
        if name == "every block":
            assert result["ui"]["tome"][0]["blocks"] == [blocks[1], blocks[1]]
            assert sum(got) == (3 if family == "flux" else sum(reduced)), name
        else:
            assert result["ui"]["tome"][0]["blocks"] == blocks and got == reduced, name
