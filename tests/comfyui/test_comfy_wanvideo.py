"""ToMe (WanVideoWrapper) on a stand-in of kijai's ComfyUI-WanVideoWrapper, in process, on each ComfyUI.

CI cannot fetch the wrapper, so its transformer, blocks, model object and sampler loop are a stand-in
(``wanvideo_standin.py``, which names the file and line of the wrapper at v1.4.7, kijai 088128b, each piece mirrors);
the ``ModelPatcher`` is ComfyUI's own, as the wrapper's loader makes it. The real wrapper was run locally on the same
checks (docs/COMFYUI.md, "ComfyUI-WanVideoWrapper"). What is checked: ratio 0 and a clone without ToMe's key give the
unpatched output bit for bit (the hooks are shared by every clone); merge carries int(r * grid) fewer video tokens
through each block of the range, with the RoPE rows, per-token modulation and key lengths cut alike and the tokens
around the grid whole; kv shortens the self-attention's keys only; VACE's hints land on every token; the error against
the unpatched model equals ToMe's native Wan path's for the same weights and latents (ComfyUIs with Wan); each refusal
names the feature and the fix, before any block runs, and so does a block input the mode does not know (the stand-in
hands its blocks every input of the newest wrapper read, at rest); a compiled block is not recompiled per step; ToMe
leaves one attribute on the transformer and none on its blocks; the node is registered whatever the packs' load order.
"""
from __future__ import annotations

import copy
import logging
import sys
import types

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

import comfy_env
import wanvideo_standin as ws

from tome_core.adapters.wanvideo import OPTIONS_KEY, describe_patch, patch_of, patch_wanvideo, plan_wanvideo
from tome_core.catalogue.wanvideo import call_layout
from tome_core.engine.grid import TokenLayout
from tome_core.engine.config import ToMeConfig
from tome_core.engine.speed_check import forget_verdicts

LATENT = torch.randn(16, 3, 8, 12, generator=torch.Generator().manual_seed(1))  # 3 x 4 x 6 = 72 video tokens
TEXT = torch.randn(5, 32, generator=torch.Generator().manual_seed(2))
GRID = 72


@pytest.fixture(scope="module")
def comfy():
    comfy_dir = comfy_env.require_comfyui("TOME_REQUIRE_COMFY", "use .venv-comfy-next/bin/python")
    comfy_env.import_comfy(comfy_dir)
    import comfy.model_patcher
    return comfy


def make(comfy, compile_args=None, **model):
    return ws.patcher(comfy, ws.seeded(ws.WanModel(**model)), compile_args)


def tome(patcher, **settings):
    return patch_wanvideo(patcher, ToMeConfig(**dict(dict(ratio=0.5, mode="merge"), **settings)))


def rel(a, b) -> float:
    return ((a - b).norm() / b.norm()).item()


class SpySDPA(TorchFunctionMode):
    """Records (queries, keys) of every scaled_dot_product_attention call (outside ToMe's mode: what it hands on)."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, k = (args[0], args[1]) if len(args) > 1 else (kwargs["query"], kwargs["key"])
            self.calls.append((q.shape[-2], k.shape[-2]))
        return func(*args, **kwargs)


def self_attention_lengths(transformer):
    for block in transformer.blocks:
        block.self_attn.seen = []
    return lambda: [[(q, k, int(lens[0])) for q, k, lens in block.self_attn.seen] for block in transformer.blocks]


@pytest.mark.parametrize("mode", ["merge", "kv"])
def test_ratio_0_and_clones_without_tome_are_bit_identical(comfy, mode):
    patcher = make(comfy)
    expected = ws.sample(patcher, LATENT, TEXT)
    assert torch.equal(ws.sample(tome(patcher, ratio=0.0, mode=mode), LATENT, TEXT), expected)
    on = tome(patcher, mode=mode)
    changed = ws.sample(on, LATENT, TEXT)
    assert 0 < rel(changed, expected) < 0.5
    # the hooks now on the shared transformer do nothing for the input patcher and for another node's clone of it
    assert torch.equal(ws.sample(patcher, LATENT, TEXT), expected)
    other = patcher.clone()
    other.model_options["transformer_options"]["attention_mode_override"] = None  # a wrapper node's key
    assert torch.equal(ws.sample(other, LATENT, TEXT), expected)
    assert OPTIONS_KEY not in patcher.model_options["transformer_options"]
    assert torch.equal(ws.sample(on, LATENT, TEXT), changed)  # same settings, same output
    # a clone of the patched model (a wrapper node applied after ToMe) carries the same state
    later = on.clone()
    assert patch_of(later) is patch_of(on) and torch.equal(ws.sample(later, LATENT, TEXT), changed)


def test_merge_carries_fewer_video_tokens_and_cuts_their_inputs(comfy):
    patcher = make(comfy)
    transformer = patcher.model.diffusion_model
    seen = self_attention_lengths(transformer)
    ws.sample(tome(patcher), LATENT, TEXT, steps=1, cfg=False)
    kept = GRID - int(0.5 * GRID)
    assert seen() == [[(kept, kept, kept)]] * 3  # queries, keys and flash-attn's key lengths (seq_lens), each block
    assert patch_of(tome(patcher)).reduced_calls == 0  # a new clone's own count
    # the block range: block i of 3 is reduced iff 0.5 <= (i + 0.5) / 3
    seen = self_attention_lengths(transformer)
    ws.sample(tome(patcher, block_start=0.5), LATENT, TEXT, steps=1, cfg=False)
    assert [calls[0][0] for calls in seen()] == [GRID, kept, kept]


def test_merge_keeps_reference_and_padding_tokens_whole(comfy):
    """Fun's reference image (h*w tokens before the video), Phantom's frames after it and padding to seq_len pass
    whole: each block's self-attention gets prefix + (grid - merged away) + suffix tokens (its RoPE table cut alike:
    the rotation would not broadcast otherwise)."""
    patcher = make(comfy, add_ref_conv=True)
    transformer = patcher.model.diffusion_model
    features = dict(fun_ref=torch.randn(1, 16, 8, 12, generator=torch.Generator().manual_seed(3)),
                    phantom_ref=torch.randn(16, 1, 8, 12, generator=torch.Generator().manual_seed(4)))
    expected = ws.sample(patcher, LATENT, TEXT, steps=1, cfg=False, **features)
    assert torch.equal(ws.sample(tome(patcher, ratio=0.0), LATENT, TEXT, steps=1, cfg=False, **features), expected)
    seen = self_attention_lengths(transformer)
    changed = ws.sample(tome(patcher), LATENT, TEXT, steps=1, cfg=False, **features)
    around = 24 + 24  # the reference image's 4 x 6 tokens before the video, Phantom's one frame after it
    kept = around + GRID - int(0.5 * GRID)
    assert seen() == [[(kept, kept, kept)]] * 3
    assert 0 < rel(changed, expected) < 0.5
    # padding up to seq_len follows the video (the wrapper's sampler sets seq_len to the video's tokens, so none)
    layout = call_layout(transformer, dict(x=[LATENT], seq_len=GRID + 8, **features))
    assert layout == TokenLayout((3, 4, 6), prefix=24, suffix=24 + 8)


def test_merge_cuts_wan22_5b_per_token_modulation(comfy):
    """Wan 2.2 5B's per-frame timesteps make ``e`` [B, 6, L, C]: each block gets the kept tokens' rows."""
    patcher = make(comfy)
    transformer = patcher.model.diffusion_model
    seen = []
    hook = transformer.blocks[1].register_forward_hook(
        lambda module, args, kwargs, out: seen.append(tuple(kwargs["e"].shape)), with_kwargs=True)
    options = copy.deepcopy(tome(patcher).model_options["transformer_options"])
    t = torch.full((1, 3), 700.0)
    with torch.no_grad():
        out = transformer(x=[LATENT], t=t, context=[TEXT], seq_len=GRID, transformer_options=options)[0][0]
        whole = transformer(x=[LATENT], t=t, context=[TEXT], seq_len=GRID, transformer_options={})[0][0]
    hook.remove()
    assert seen == [(1, 6, GRID - 36, 32), (1, 6, GRID, 32)]
    assert 0 < rel(out, whole) < 0.5


def test_kv_shortens_only_the_self_attention_keys(comfy):
    patcher = make(comfy)
    on = tome(patcher, mode="kv")
    spy = SpySDPA()
    with spy:
        ws.sample(on, LATENT, TEXT, steps=1, cfg=False)
    # per block: the self-attention (72 queries, 36 keys: one per 1x1x2 window), then the text cross-attention
    assert spy.calls == [(GRID, GRID // 2), (GRID, 512)] * 3
    assert patch_of(on).reduced_calls == 3


def test_vace_hints_land_on_every_token(comfy):
    """VACE's hints span the whole stream: with blocks whose own update is zero, merge must give the unpatched
    output exactly (each token its own hint, added after the block as the wrapper adds it)."""
    patcher = make(comfy, vace_layers=[0, 2])
    transformer = patcher.model.diffusion_model
    with torch.no_grad():
        for block in transformer.blocks:
            for layer in (block.self_attn.o, block.cross_attn.o, block.ffn[2]):
                layer.weight.zero_()
                layer.bias.zero_()
    control = [torch.randn(16, 3, 8, 12, generator=torch.Generator().manual_seed(5))]
    expected = ws.sample(patcher, LATENT, TEXT, steps=1, cfg=False, vace_data=control)
    merged = ws.sample(tome(patcher), LATENT, TEXT, steps=1, cfg=False, vace_data=control)
    assert torch.allclose(merged, expected, atol=1e-6, rtol=0)
    assert torch.allclose(ws.sample(tome(patcher, mode="kv"), LATENT, TEXT, steps=1, cfg=False, vace_data=control),
                          expected, atol=1e-6, rtol=0)  # kv leaves the stream's length alone: the hints as they were
    assert not torch.equal(expected, ws.sample(patcher, LATENT, TEXT, steps=1, cfg=False))  # the hints did act


def _native_and_wrapper(comfy, native_patcher, wrapper_patcher, context):
    """(native ComfyUI Wan, wrapper stand-in) outputs of the first model call of a 1-step ComfyUI sampling, the
    stand-in given exactly the native model's inputs (latent, timestep, text)."""
    import comfy.sample

    model = native_patcher.model.diffusion_model
    seen = {}

    def inputs(module, args, kwargs):  # forward(x, timestep, context, ...): context is passed by keyword
        found = [args[i] if len(args) > i else kwargs[name] for i, name in enumerate(("x", "timestep", "context"))]
        seen.setdefault("in", tuple(value.clone() for value in found))

    def outputs(module, args, kwargs, out):
        seen.setdefault("out", out.clone())

    hooks = (model.register_forward_pre_hook(inputs, with_kwargs=True),
             model.register_forward_hook(outputs, with_kwargs=True))
    try:
        noise = torch.randn((1,) + tuple(LATENT.shape), generator=torch.Generator().manual_seed(0))
        comfy.sample.sample(native_patcher, noise, 1, 1.0, "euler", "simple", [[context, {}]], [[context, {}]],
                            torch.zeros_like(noise), denoise=1.0, seed=0, disable_pbar=True)
    finally:
        for hook in hooks:
            hook.remove()
    x, t, text = seen["in"]
    options = copy.deepcopy(wrapper_patcher.model_options["transformer_options"])
    with torch.no_grad():
        wrapper = wrapper_patcher.model.diffusion_model(x=[x[0]], t=t, context=[text[0]], seq_len=GRID,
                                                        transformer_options=options)[0][0]
    return seen["out"][0], wrapper


def test_error_equals_the_native_wan_adapters_for_the_same_weights(comfy):
    """The same weights in ComfyUI's own WanModel (the wrapper keeps Wan's checkpoint names) and the same latent,
    timestep and text: the stand-in gives the native model's output, and ToMe's error against each unpatched model
    agrees, merge and kv, within 2 % (centre picks: the same tokens)."""
    import comfy.supported_models

    if not hasattr(comfy.supported_models, "WAN21_T2V"):
        pytest.skip("this ComfyUI has no Wan (the 2024 one)")
    from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher

    native = comfy.supported_models.WAN21_T2V(dict(
        image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), in_dim=16, dim=32, ffn_dim=48, freq_dim=32,
        text_dim=32, out_dim=16, num_heads=2, num_layers=3)).get_model({})
    cpu = torch.device("cpu")
    native_patcher = comfy.model_patcher.ModelPatcher(native, load_device=cpu, offload_device=cpu)
    wrapper_patcher = make(comfy)
    loaded = native.diffusion_model.load_state_dict(wrapper_patcher.model.diffusion_model.state_dict(), strict=False)
    assert not loaded.missing_keys, loaded.missing_keys
    context = torch.cat([TEXT, torch.zeros(512 - TEXT.shape[0], TEXT.shape[1])]).unsqueeze(0)  # the wrapper pads
    plain_native, plain_wrapper = _native_and_wrapper(comfy, native_patcher, wrapper_patcher, context)
    assert rel(plain_wrapper, plain_native) < 1e-4  # the stand-in is Wan's arithmetic
    plain = {"merge_attention": "plain"} if "merge_attention" in ToMeConfig.__dataclass_fields__ else {}
    for mode in ("merge", "kv"):
        config = ToMeConfig(ratio=0.5, mode=mode, use_rand=False, **plain)  # the merge the wrapper's path runs
        on_native, on_wrapper = _native_and_wrapper(comfy, patch_dit_model_patcher(native_patcher, config),
                                                    patch_wanvideo(wrapper_patcher, config), context)
        native_error, wrapper_error = rel(on_native, plain_native), rel(on_wrapper, plain_wrapper)
        assert wrapper_error > 0.002 and abs(wrapper_error - native_error) <= 0.02 * native_error, \
            (mode, wrapper_error, native_error)


REFUSED_AT_THE_NODE = [
    ("radial_sage_attention", "merge", {}, "attention_mode 'radial_sage_attention'.*reads the tokens by position.*"
                                           "use sdpa, sageattn"),
    ("sageattn", "kv", {}, "mode kv does not reach attention_mode 'sageattn'.*use attention_mode sdpa.*mode merge"),
    ("sdpa", "kv", {"attention_mode_override": {"mode": "flash_attn_2"}},
     "attention_mode 'flash_attn_2' \\(WanVideoSetAttentionModeOverride\\)"),
    ("sdpa", "merge", {"ultravico_alpha": 0.9}, "UltraVico.*use another attention_mode, or remove the ToMe node"),
]


@pytest.mark.parametrize("attention, mode, options, message", REFUSED_AT_THE_NODE)
def test_refusals_before_cloning(comfy, attention, mode, options, message):
    patcher = make(comfy)
    patcher.model.diffusion_model.attention_mode = attention
    patcher.model_options["transformer_options"].update(options)
    with pytest.raises(ValueError, match=message):
        plan_wanvideo(patcher, ToMeConfig(ratio=0.5, mode=mode))
    with pytest.raises(ValueError, match=message):
        tome(patcher, mode=mode)


def test_whole_transformer_compile_and_other_models_are_refused(comfy):
    whole = make(comfy, {"compile_transformer_blocks_only": False})
    with pytest.raises(ValueError, match="compile_transformer_blocks_only off.*set compile_transformer_blocks_only on"):
        tome(whole)
    longcat = make(comfy)
    longcat.model.diffusion_model.is_longcat = True
    with pytest.raises(ValueError, match="LongCat-Video is not supported with ToMe's mode merge.*remove it or the ToMe"):
        tome(longcat)
    humo = make(comfy)
    humo.model.diffusion_model.humo_audio = True  # the loader's flag of a HuMo checkpoint
    with pytest.raises(ValueError, match="a HuMo model is not supported with ToMe's mode kv: ToMe has not been run"):
        tome(humo, mode="kv")
    other = make(comfy)
    other.model.diffusion_model = torch.nn.Linear(2, 2)
    with pytest.raises(TypeError, match="expected a ComfyUI-WanVideoWrapper model .*got torch.nn.modules.linear.Linear"
                                        ".*ToMe node \\(TomeCoreToMe\\)"):
        tome(other)


REFUSED_AT_THE_FIRST_CALL = [
    ("merge", dict(enhance_enabled=True), "FETA \\(Enhance-A-Video, feta_args\\) is not supported with ToMe's mode "
                                          "merge.*by frame.*use mode kv"),
    ("merge", dict(multitalk_audio=torch.zeros(1)), "MultiTalk / InfiniteTalk audio.*remove it or the ToMe node"),
    ("kv", dict(multitalk_audio=torch.zeros(1)), "MultiTalk.*mode kv: ToMe has not been run with it yet"),
    ("kv", dict(standin_input={"ip_image_latent": None}), "Stand-In reference"),
    ("merge", dict(context_extra=True), "several prompts .*mode merge.*one prompt"),
]


@pytest.mark.parametrize("mode, features, message", REFUSED_AT_THE_FIRST_CALL)
def test_sampler_features_are_refused_before_any_block_runs(comfy, mode, features, message):
    patcher = make(comfy)
    transformer = patcher.model.diffusion_model
    calls = []
    hook = transformer.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    if features.pop("context_extra", False):  # two prompts over one video: the wrapper's split by frame
        options = copy.deepcopy(tome(patcher, mode=mode).model_options["transformer_options"])
        with pytest.raises(ValueError, match=message):
            transformer(x=[LATENT], t=torch.tensor([900.0]), context=[TEXT, TEXT], seq_len=GRID,
                        transformer_options=options)
    else:
        with pytest.raises(ValueError, match=message):
            ws.sample(tome(patcher, mode=mode), LATENT, TEXT, steps=1, cfg=False, **features)
    hook.remove()
    assert calls == []


def test_default_rope_refused_in_merge_only(comfy):
    patcher = make(comfy)
    patcher.model.diffusion_model.rope_func = "default"  # the sampler's rope_function (set before its first call)
    with pytest.raises(ValueError, match="rope_function 'comfy'.*got 'default'.*set rope_function to comfy, or use "
                                         "mode kv"):
        ws.sample(tome(patcher), LATENT, TEXT, steps=1)
    patcher.model.diffusion_model.rope_func = "comfy"
    ws.sample(tome(patcher, mode="kv"), LATENT, TEXT, steps=1)  # kv picks real, already rotated keys


def test_kv_that_reaches_no_sdpa_stops_at_the_first_call(comfy, monkeypatch):
    """A self-attention that never reaches torch's scaled_dot_product_attention (a kernel of its own, a node that runs
    the blocks itself): no key ToMe could shorten, and the first model call says so instead of an unreduced video."""
    def manual(q, k, v, attention_mode="sdpa", heads=1):
        weights = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / q.shape[-1] ** 0.5, -1)
        return (weights @ v.transpose(1, 2)).transpose(1, 2)

    monkeypatch.setattr(ws, "attention", manual)  # the stand-in's own attention function
    with pytest.raises(RuntimeError, match="mode kv reached no self-attention .*of WanModel's first model call.*"
                                           "Use attention_mode sdpa or ToMe's mode merge"):
        ws.sample(tome(make(comfy), mode="kv"), LATENT, TEXT, steps=1)


def test_kv_under_comfy_attention_needs_comfys_pytorch_attention(comfy, monkeypatch):
    """attention_mode 'comfy' calls ComfyUI's optimized_attention without transformer_options: kv reaches it only where
    that is attention_pytorch (read from the ComfyUI module loaded, before cloning)."""
    def attention_split(*args, **kwargs):
        raise AssertionError("never called")

    def attention_pytorch(*args, **kwargs):
        raise AssertionError("never called")

    patcher = make(comfy)
    patcher.model.diffusion_model.attention_mode = "comfy"
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", types.SimpleNamespace(
        optimized_attention=attention_split))
    with pytest.raises(ValueError, match="mode kv does not reach attention_mode 'comfy'.*this ComfyUI's attention is "
                                         "attention_split.*--use-pytorch-cross-attention"):
        tome(patcher, mode="kv")
    tome(patcher, mode="merge")  # merge runs under any ComfyUI attention
    monkeypatch.setitem(sys.modules, "comfy.ldm.modules.attention", types.SimpleNamespace(
        optimized_attention=attention_pytorch))
    tome(patcher, mode="kv")


@pytest.mark.parametrize("mode", ["merge", "kv"])
def test_compiled_blocks_are_not_recompiled_per_step(comfy, mode):
    """The wrapper's compile_model (compile_transformer_blocks_only): ToMe's hooks run around each compiled block,
    so the graph is traced once (blocks alike share it) and no step adds one; the output equals eager ToMe's."""
    graphs = []

    def backend(gm, inputs):
        graphs.append(len(gm.graph.nodes))
        return gm.forward

    torch._dynamo.reset()
    compiled = make(comfy, {"backend": backend})
    on = tome(compiled, mode=mode)
    ws.sample(on, LATENT, TEXT, steps=1)
    first = len(graphs)
    out = ws.sample(on, LATENT, TEXT, steps=4)
    assert first >= 1 and len(graphs) == first, graphs
    assert torch.allclose(out, ws.sample(tome(make(comfy), mode=mode), LATENT, TEXT, steps=4), atol=1e-5)
    assert not torch.allclose(out, ws.sample(make(comfy), LATENT, TEXT, steps=4), atol=1e-5)


def test_step_window_and_speed_check(comfy, caplog):
    patcher = make(comfy)
    expected = ws.sample(patcher, LATENT, TEXT, steps=2)
    # start_percent 0.6: step 0 (0.0) and step 1 (0.5) are outside the window
    assert torch.equal(ws.sample(tome(patcher, start_percent=0.6), LATENT, TEXT, steps=2), expected)
    forget_verdicts()
    on = tome(patcher, speed_check="on")
    sent = []
    patch_of(on).listeners.append(sent.append)  # what the node sends to the browser (ui_messages.announce_levels)
    with caplog.at_level(logging.WARNING, logger="tome.dit"):
        ws.sample(on, LATENT, TEXT, steps=2)
    assert len(sent) == 1 and sent[0] == patch_of(on).describe_verdicts()  # decided once, at the first call
    lines = describe_patch(on).splitlines()
    assert lines[0].startswith("ToMe merge r=0.5 on Wan 2.x (ComfyUI-WanVideoWrapper)")
    assert any(line.startswith("3x4x6 video tokens, batch 1: ") and "measured" in line for line in lines), lines
    assert "ToMe speed check: 3x4x6 video tokens, batch 1" in caplog.text
    cached = make(comfy)
    cached.model.diffusion_model.enable_teacache = True  # a repeated call would disturb the step cache's state
    forget_verdicts()
    cached_on = tome(cached, speed_check="on")
    ws.sample(cached_on, LATENT, TEXT, steps=1)
    assert "cannot repeat the call" in describe_patch(cached_on)


def test_the_node_describes_the_patch_in_its_ui_message_and_the_log(comfy, tome_package, caplog):
    from importlib import import_module

    nodes = import_module(f"{tome_package.__name__}.nodes.tome_wanvideo")
    patcher = make(comfy)
    with caplog.at_level(logging.INFO, logger="tome"):
        result = nodes.ToMeWanVideo().patch(patcher, ratio=0.5, mode="kv", sx=2, sy=2, use_rand=True, tome_seed=0,
                                            start_percent=0.0, end_percent=1.0)
    info = result["ui"]["tome"][0]
    assert info["family"] == "wan" and info["mode"] == "kv" and info["blocks"] == [3, 3]
    assert info["kv_window"] == [1, 1, 2] and info["model_type"] == "ComfyUI-WanVideoWrapper WanModel"
    assert info["text"][0] in caplog.text and "1 of 2 per 1x1x2 window" in info["text"][0]
    assert patch_of(result["result"][0]).config.mode == "kv"
    with pytest.raises(ValueError, match="ratio 0.9 is above the mergeable fraction"):
        nodes.ToMeWanVideo().patch(patcher, ratio=0.9, mode="merge", sx=2, sy=2, use_rand=True, tome_seed=0,
                                   start_percent=0.0, end_percent=1.0)


def test_the_node_is_registered_whatever_order_the_packs_load_in(tome_package):
    """ComfyUI reads a pack's nodes once, as it loads the pack, in its folders' listing order: the node is registered
    whether the wrapper loaded before this pack, after it or not at all (nothing of the wrapper is looked for then);
    the wrapper is found when the node runs, by its WanModel (test_whole_transformer_compile_and_other_models_...)."""
    from importlib import import_module

    nodes = import_module(f"{tome_package.__name__}.nodes.tome_wanvideo")
    assert tome_package.NODE_CLASS_MAPPINGS["TomeCoreToMeWanVideo"] is nodes.ToMeWanVideo
    assert tome_package.NODE_DISPLAY_NAME_MAPPINGS["TomeCoreToMeWanVideo"] == "ToMe (WanVideoWrapper)"
    assert not [name for name in vars(nodes) if "installed" in name or "FILES" in name]  # no file-name probe left
    spec = nodes.ToMeWanVideo.INPUT_TYPES()
    assert spec["required"]["model"][0] == "WANVIDEOMODEL" and nodes.ToMeWanVideo.RETURN_TYPES == ("WANVIDEOMODEL",)
    assert nodes.ToMeWanVideo.CATEGORY == "model_patches/unet"
    assert all(options.get("tooltip") for _, options in nodes.ToMeWanVideo.spec().values())


LATER_INPUT = torch.zeros(1, GRID, 32)  # what a later wrapper's new feature might hand every block


@pytest.mark.parametrize("mode", ["merge", "kv"])
def test_a_block_input_the_mode_does_not_know_is_refused_before_any_block_runs(comfy, mode):
    """Each mode accepts the block inputs it knows (every one the newest wrapper read hands a plain call's blocks, at
    rest, as the stand-in does in every test here); any other one, not at rest, stops the first model call before a
    block runs, naming the input and the fix."""
    patcher = make(comfy)
    on = tome(patcher, mode=mode)
    calls = []  # after ToMe's pre-hook: a block that ran
    hook = patcher.model.diffusion_model.blocks[0].register_forward_pre_hook(lambda *a: calls.append(1))
    with pytest.raises(ValueError, match=f"hands its blocks motion_tokens_v9 = a tensor \\[1, {GRID}, 32\\], an input "
                                         f"ToMe's mode {mode} does not know.*update tome"):
        ws.sample(on, LATENT, TEXT, steps=1, cfg=False, later_block_inputs={"motion_tokens_v9": LATER_INPUT})
    assert calls == []
    # at rest (None, False, 0, empty) it passes; a clone without ToMe never looks
    at_rest = dict(motion_tokens_v9=None, use_motion_v9=False, motion_frames_v9=0, motion_args_v9={})
    expected = ws.sample(tome(patcher, mode=mode), LATENT, TEXT, steps=1, cfg=False)
    assert torch.equal(ws.sample(tome(patcher, mode=mode), LATENT, TEXT, steps=1, cfg=False,
                                 later_block_inputs=at_rest), expected)
    ws.sample(patcher, LATENT, TEXT, steps=1, cfg=False, later_block_inputs={"motion_tokens_v9": LATER_INPUT})
    hook.remove()


def test_a_setting_at_the_default_its_block_declares_is_at_rest(comfy):
    """A later block input the block's own forward declares, handed at its declared default, is off; another value of
    it is refused."""
    class LaterBlock(ws.WanAttentionBlock):
        def forward(self, x, motion_strength_v9=1.0, **kwargs):
            return super().forward(x, **kwargs)

    patcher = make(comfy)
    for block in patcher.model.diffusion_model.blocks:
        block.__class__ = LaterBlock
    expected = ws.sample(tome(patcher), LATENT, TEXT, steps=1, cfg=False)
    assert torch.equal(ws.sample(tome(patcher), LATENT, TEXT, steps=1, cfg=False,
                                 later_block_inputs={"motion_strength_v9": 1.0}), expected)
    with pytest.raises(ValueError, match="motion_strength_v9 = 0.5, an input ToMe's mode merge does not know"):
        ws.sample(tome(patcher), LATENT, TEXT, steps=1, cfg=False, later_block_inputs={"motion_strength_v9": 0.5})


def test_an_input_kv_carries_is_refused_in_merge_with_mode_kv_as_the_fix(comfy):
    """FETA's block input (enhance_enabled) handed to the blocks without the sampler keyword the named refusal reads:
    merge refuses it by the input's name, pointing to kv, which carries it."""
    patcher = make(comfy)
    with pytest.raises(ValueError, match="enhance_enabled = True, an input ToMe's mode merge does not know.*use "
                                         "ToMe's mode kv, which carries it"):
        ws.sample(tome(patcher), LATENT, TEXT, steps=1, cfg=False, later_block_inputs={"enhance_enabled": True})
    ws.sample(tome(patcher, mode="kv"), LATENT, TEXT, steps=1, cfg=False, later_block_inputs={"enhance_enabled": True})


@pytest.mark.parametrize("mode", ["merge", "kv"])
def test_one_attribute_on_the_transformer_and_nothing_on_its_blocks(comfy, mode):
    """ToMe's hooks are recorded in one attribute of the wrapper's transformer (``_tome_wanvideo``); no module below
    it gets one, also where the sampler compiles each block (the hooks move onto the compiled wrapper, and leave the
    block inside it)."""
    def tome_attributes(module):
        return {(name, key) for name, sub in module.named_modules() for key in vars(sub) if "tome" in key.lower()}

    eager = make(comfy)
    ws.sample(tome(eager, mode=mode), LATENT, TEXT, steps=1)
    assert tome_attributes(eager.model.diffusion_model) == {("", "_tome_wanvideo")}
    torch._dynamo.reset()
    compiled = make(comfy, {"backend": lambda gm, inputs: gm.forward})
    transformer = compiled.model.diffusion_model
    ws.sample(tome(compiled, mode=mode), LATENT, TEXT, steps=1)
    assert tome_attributes(transformer) == {("", "_tome_wanvideo")}
    for block in transformer.blocks:
        inner = block._orig_mod
        assert len(block._forward_pre_hooks) == len(block._forward_hooks) == 1
        assert not inner._forward_pre_hooks and not inner._forward_hooks


def test_merge_variants_of_other_hosts_are_refused(comfy):
    """Only plain merge runs on the wrapper: a config asking for another variant (where this tome_core has them) is
    refused naming the settings, not run as plain."""
    if "merge_attention" not in ToMeConfig.__dataclass_fields__:
        pytest.skip("this tome_core has no merge variants")
    with pytest.raises(ValueError, match="mode merge runs its plain form here.*leave those settings at their defaults"):
        tome(make(comfy), merge_attention="proportional")
