"""ToMe beside the other speed-ups users put on the same diffusers UNet (issue 20), in both orders.

Each partner either works with ToMe (both act: the output differs from each alone, equals a recomputed
reference where one exists, and removing both restores the vanilla output bit for bit) or is refused
before it could give a wrong image, with a message naming it and what works. Real diffusers 0.42.1
hooks, processors, accelerate and peft on a tiny SD1.5 UNet with seeded weights (the README's
"Composition with other speed-ups" table is this file's summary).
"""
from __future__ import annotations

import copy

import pytest
import torch

import tome_core
from tome_bench.models import build_unet, make_inputs

from conftest import hook_count, relative_error

diffusers = pytest.importorskip("diffusers")
from diffusers import hooks as dhooks  # noqa: E402
from diffusers.models.attention_processor import AttnProcessor, AttnProcessor2_0  # noqa: E402

STEPS = (999.0, 800.0, 600.0)  # three sampler steps: a cache computes, reuses, computes
ORDERS = ("tome_first", "partner_first")
MODES = ("merge", "kv")


@pytest.fixture(scope="module")
def base():
    """Never mutated: every test works on its own deep copy."""
    return build_unet("sd15", "tiny", seed=0)


@pytest.fixture(scope="module")
def inputs(base):
    sample, _, context, _ = make_inputs(base, "sd15", batch=2, height_px=64, width_px=64, seed=1)
    return sample, context


def forward(unet, inputs, t: float = STEPS[0]) -> torch.Tensor:
    sample, context = inputs
    with torch.no_grad():  # not inference_mode: accelerate's offload hooks make parameters during the call
        return unet(sample, torch.full((2,), t), context, return_dict=False)[0]


def run_steps(unet, inputs, clock=None) -> list:
    """One call per step; ``clock`` is what the cache's current_timestep_callback reads."""
    outs = []
    for t in STEPS:
        if clock is not None:
            clock["t"] = t
        outs.append(forward(unet, inputs, t))
    return outs


@pytest.fixture(scope="module")
def memo():
    """Outputs shared by the parametrized cases (both orders compare with the same references)."""
    return {}


def remembered(memo, key, compute):
    if key not in memo:
        memo[key] = compute()
    return memo[key]


def with_tome(unet, mode: str):
    return tome_core.apply_patch(unet, ratio=0.5, mode=mode, seed=1)


def compose(base, order: str, mode: str, add_partner):
    """A copy of ``base`` with ToMe and the partner applied in ``order``."""
    unet = copy.deepcopy(base)
    if order == "tome_first":
        with_tome(unet, mode)
        add_partner(unet)
    else:
        add_partner(unet)
        with_tome(unet, mode)
    return unet


def _applied(base, apply):
    unet = copy.deepcopy(base)
    apply(unet)
    return unet


def differs(a: torch.Tensor, b: torch.Tensor) -> bool:
    return relative_error(a, b) > 1e-3


# --- 1. fused QKV projections -------------------------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("order", ["fuse_then_patch", "patch_then_fuse"])
def test_fused_qkv_projections(base, inputs, order, mode):
    """kv hands attn1 its reduced keys/values as encoder_hidden_states, which the fused processor
    takes for cross-attention (``attn.to_kv``): ToMe gives self-attention a to_kv over to_k/to_v, so
    fused kv equals unfused kv exactly; merge (to_qkv on merged tokens) within float tolerance."""
    unet = copy.deepcopy(base)
    vanilla = forward(unet, inputs)
    with_tome(unet, mode)
    unfused_tome = forward(unet, inputs)
    tome_core.remove_patch(unet)
    fused_alone = forward(_fused(base), inputs)

    if order == "fuse_then_patch":
        unet.fuse_qkv_projections()
        with_tome(unet, mode)
    else:
        with_tome(unet, mode)
        unet.fuse_qkv_projections()
    out = forward(unet, inputs)
    assert differs(out, fused_alone)
    if mode == "kv":
        assert torch.equal(out, unfused_tome)
    else:
        assert relative_error(out, unfused_tome) < 1e-5

    tome_core.remove_patch(unet)
    assert not any("to_kv" in m.__dict__ for m in unet.modules())
    assert torch.equal(forward(unet, inputs), fused_alone)
    unet.unfuse_qkv_projections()
    assert torch.equal(forward(unet, inputs), vanilla)


def _fused(base):
    unet = copy.deepcopy(base)
    unet.fuse_qkv_projections()
    return unet


def test_torch_compile_of_a_fused_kv_model_matches_eager(base, inputs):
    """One small case: the first Transformer2DModel (its attn1 kv hook, the fused processor and the
    to_kv ToMe gives it) compiled in place, aot_eager backend (inductor's C++ build would take
    minutes on CI's CPUs); the UNet's output equals eager within 1e-5, with no graph break."""
    import torch._dynamo

    unet = _fused(base)
    with_tome(unet, "kv")
    eager = forward(unet, inputs)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        unet.down_blocks[0].attentions[0].compile(backend="aot_eager")
        compiled = forward(unet, inputs)
        breaks = dict(torch._dynamo.utils.counters["graph_break"])
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    finally:
        torch._dynamo.reset()
    assert frames >= 1 and not breaks, breaks
    assert relative_error(compiled, eager) < 1e-5
    assert differs(compiled, forward(_fused(base), inputs))


# --- 2. diffusers' cache hooks --------------------------------------------------------------------

def _pab(clock, cross_only=False):
    config = dhooks.PyramidAttentionBroadcastConfig(
        spatial_attention_block_skip_range=None if cross_only else 2, cross_attention_block_skip_range=2,
        spatial_attention_timestep_skip_range=(0, 1000), cross_attention_timestep_skip_range=(0, 1000),
        current_timestep_callback=lambda: clock["t"])
    return lambda unet: dhooks.apply_pyramid_attention_broadcast(unet, config)


def _taylorseer(pattern):
    config = dhooks.TaylorSeerCacheConfig(cache_interval=2, disable_cache_before_step=1, cache_identifiers=[pattern],
                                          taylor_factors_dtype=torch.float32)
    return lambda unet: dhooks.apply_taylorseer_cache(unet, config)


ATTN1 = r".*transformer_blocks\.\d+\.attn1"
# (partner, builder(clock) -> apply(unet), modes that work; the others are refused)
CACHES = {
    "PyramidAttentionBroadcast": (lambda clock: _pab(clock), ("kv",)),
    "PyramidAttentionBroadcast, cross-attention only": (lambda clock: _pab(clock, cross_only=True), ("merge", "kv")),
    # kv beside TaylorSeer is not run here: its hooks need a cache_context, which a UNet has none of
    # in diffusers 0.42.1 (ValueError "No cache context is set" by itself); the refusal needs no call.
    "TaylorSeerCache on attn1": (lambda clock: _taylorseer(ATTN1), ("kv",)),
}
CACHE_CASES = [(p, m) for p in CACHES for m in MODES if not (p.startswith("TaylorSeer") and m == "kv")]


def _remove_diffusers_hooks(unet):
    registry = dhooks.HookRegistry.check_if_exists_or_initialize(unet)
    for module in unet.modules():
        sub = module.__dict__.get("_diffusers_hook")
        for name in list(getattr(sub, "hooks", {})):
            registry.remove_hook(name, recurse=True)


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("partner,mode", CACHE_CASES)
def test_cache_hooks_act_beside_tome_or_are_refused(base, inputs, memo, partner, mode, order):
    build, works_in = CACHES[partner]
    clock = {"t": STEPS[0]}
    technique = partner.split(",")[0].split(" ")[0]
    if mode not in works_in:
        unet = copy.deepcopy(base)
        if order == "partner_first":
            build(clock)(unet)
            hooks_before = hook_count(unet)
            with pytest.raises(RuntimeError) as refused:
                with_tome(unet, mode)
            assert hook_count(unet) == hooks_before and not tome_core.is_patched(unet)  # nothing patched
        else:
            with_tome(unet, mode)
            build(clock)(unet)
            with pytest.raises(RuntimeError) as refused:
                forward(unet, inputs)  # refused at the first call, before any block ran
            _remove_diffusers_hooks(unet)  # the patch stayed consistent: ToMe alone again
            assert torch.equal(forward(unet, inputs), forward(with_tome(copy.deepcopy(base), mode), inputs))
        message = str(refused.value)
        assert f"diffusers' {technique} caches" in message and "attn1" in message and "use mode='kv'" in message
        return

    vanilla = remembered(memo, "vanilla steps", lambda: run_steps(base, inputs))
    tome_alone = remembered(memo, ("tome steps", mode), lambda: run_steps(with_tome(copy.deepcopy(base), mode), inputs))

    def partner_only():
        partner_unet = copy.deepcopy(base)
        build(clock)(partner_unet)
        return run_steps(partner_unet, inputs, clock)

    partner_alone = remembered(memo, partner, partner_only)
    unet = compose(base, order, mode, build(clock))
    both = run_steps(unet, inputs, clock)

    assert torch.equal(both[0], tome_alone[0])  # the cache's first step computes: ToMe acts on it
    assert differs(both[0], partner_alone[0])
    reused = [i for i in range(len(STEPS)) if not torch.equal(partner_alone[i], vanilla[i])]
    assert reused, "the cache never acted"
    assert all(differs(both[i], tome_alone[i]) and differs(both[i], partner_alone[i]) for i in reused)
    first = remembered(memo, (partner, mode, "both"), lambda: both)
    assert all(torch.equal(a, b) for a, b in zip(both, first))  # both orders give the same outputs

    tome_core.remove_patch(unet)
    _remove_diffusers_hooks(unet)
    assert all(torch.equal(a, b) for a, b in zip(run_steps(unet, inputs), vanilla))


def test_cache_hooks_that_do_not_apply_to_a_unet_behave_the_same_with_tome(base, inputs):
    """diffusers 0.42.1 on a UNet, with ToMe (merge) applied first: FirstBlockCache and SeaCache refuse by
    themselves (they look for a top-level ModuleList of blocks), LayerSkip needs an explicit fqn, MagCache and
    TaylorSeer (default identifiers, anchored at the top level) hook nothing, and FasterCache hooks only the
    denoiser (its attention identifiers are anchored at the top level); ToMe is left as it was."""
    unet = with_tome(copy.deepcopy(base), "merge")
    tome_alone = forward(unet, inputs)
    with pytest.raises(IndexError):
        dhooks.apply_first_block_cache(unet, dhooks.FirstBlockCacheConfig(threshold=0.5))
    with pytest.raises(ValueError, match="SeaCache found no repeated transformer blocks"):
        dhooks.apply_sea_cache(unet, dhooks.SeaCacheConfig())
    with pytest.raises(ValueError, match="provide a valid `fqn`"):
        dhooks.apply_layer_skip(unet, dhooks.LayerSkipConfig(indices=[0]))
    dhooks.apply_mag_cache(unet, dhooks.MagCacheConfig(num_inference_steps=3, mag_ratios=[1.0] * 3))
    dhooks.apply_taylorseer_cache(unet, dhooks.TaylorSeerCacheConfig())
    assert not any(getattr(m.__dict__.get("_diffusers_hook"), "hooks", None) for m in unet.modules())
    assert torch.equal(forward(unet, inputs), tome_alone)

    dhooks.apply_faster_cache(unet, dhooks.FasterCacheConfig(current_timestep_callback=lambda: 500,
                                                             tensor_format="BCHW"))
    assert torch.equal(forward(unet, inputs), tome_alone)  # its first call computes everything: ToMe acts
    _remove_diffusers_hooks(unet)
    assert torch.equal(forward(unet, inputs), tome_alone)


# --- 3. partners that change the computation: FreeU, layerwise casting, LoRA ---------------------

def _freeu(unet):
    unet.enable_freeu(s1=0.9, s2=0.2, b1=1.5, b2=1.6)


def _layerwise_casting(unet):
    dhooks.apply_layerwise_casting(unet, storage_dtype=torch.bfloat16, compute_dtype=torch.float32)


def _lora(unet):
    from peft import LoraConfig

    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(3)  # init_lora_weights=False: a random B too, so the adapter changes the output
        unet.add_adapter(LoraConfig(r=4, lora_alpha=4, init_lora_weights=False,
                                    target_modules=["to_q", "to_k", "to_v", "to_out.0"]))


def _lora_merged(unet):
    """The reference: the same adapter merged into the base weights (peft's own merge)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    _lora(unet)
    for module in unet.modules():
        if isinstance(module, BaseTunerLayer):
            module.merge()


def _bf16_rounded(unet):
    """The reference for layerwise casting: the weights it stores in bf16, rounded once, computed in fp32."""
    cast = copy.deepcopy(unet)
    _layerwise_casting(cast)
    for name, module in cast.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            if param.dtype == torch.bfloat16:
                getattr(unet.get_submodule(name), pname).data = param.data.float()


COMPUTE_PARTNERS = {  # partner -> (apply, reference builder or None)
    "FreeU": (_freeu, None),
    "layerwise casting (bf16 storage)": (_layerwise_casting, _bf16_rounded),
    "peft LoRA": (_lora, _lora_merged),
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("partner", list(COMPUTE_PARTNERS))
def test_partners_that_change_the_computation(base, inputs, memo, partner, mode, order):
    if partner == "peft LoRA":
        pytest.importorskip("peft")
    apply, reference = COMPUTE_PARTNERS[partner]
    partner_alone = remembered(memo, partner, lambda: forward(_applied(base, apply), inputs))
    tome_alone = remembered(memo, ("tome", mode), lambda: forward(with_tome(copy.deepcopy(base), mode), inputs))
    unet = compose(base, order, mode, apply)
    both = forward(unet, inputs)
    assert differs(both, partner_alone) and differs(both, tome_alone)
    if reference is not None:
        ref_unet = copy.deepcopy(base)
        reference(ref_unet)
        assert relative_error(both, forward(with_tome(ref_unet, mode), inputs)) < 1e-5
    tome_core.remove_patch(unet)
    assert torch.equal(forward(unet, inputs), partner_alone)


# --- 4. partners that must not change the result: processors, backends, offloading ---------------

def _sliced(unet):
    unet.set_attention_slice(1)


def _group_offload(offload_type):
    def apply(unet):
        kwargs = dict(num_blocks_per_group=1) if offload_type == "block_level" else {}
        dhooks.apply_group_offloading(unet, onload_device=torch.device("cpu"), offload_type=offload_type, **kwargs)
    return apply


def _accelerate_cpu_offload(unet):
    import accelerate

    accelerate.cpu_offload(unet, execution_device=torch.device("cpu"))  # what enable_sequential_cpu_offload installs


NEUTRAL_PARTNERS = {
    "AttnProcessor (classic)": lambda unet: unet.set_attn_processor(AttnProcessor()),
    "AttnProcessor2_0": lambda unet: unet.set_attn_processor(AttnProcessor2_0()),
    "sliced attention": _sliced,
    "set_attention_backend('_native_math')": lambda unet: unet.set_attention_backend("_native_math"),
    "group offloading, block level": _group_offload("block_level"),
    "group offloading, leaf level": _group_offload("leaf_level"),
    "accelerate cpu_offload (sequential)": _accelerate_cpu_offload,
}


@pytest.mark.parametrize("order", ORDERS)
@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("partner", list(NEUTRAL_PARTNERS))
def test_partners_that_keep_the_result(base, inputs, memo, partner, mode, order):
    """Equivalent attention processors and CPU offloading: ToMe acts, and the output equals ToMe alone
    (within float tolerance where the processor computes attention differently)."""
    if "offload" in partner:
        pytest.importorskip("accelerate")
    apply = NEUTRAL_PARTNERS[partner]
    tome_alone = remembered(memo, ("tome", mode), lambda: forward(with_tome(copy.deepcopy(base), mode), inputs))
    partner_alone = remembered(memo, partner, lambda: forward(_applied(base, apply), inputs))
    unet = compose(base, order, mode, apply)
    both = forward(unet, inputs)
    assert differs(both, partner_alone)
    assert relative_error(both, tome_alone) < 1e-5
    tome_core.remove_patch(unet)
    assert torch.equal(forward(unet, inputs), partner_alone)


def test_set_attention_backend_does_not_reach_a_unet(base, inputs):
    """diffusers 0.42.1: backends act through AttentionModuleMixin; a UNet's classic Attention keeps its
    processor, so the backend changes nothing with or without ToMe (the row above is ToMe alone)."""
    unet = copy.deepcopy(base)
    vanilla = forward(unet, inputs)
    unet.set_attention_backend("_native_math")
    assert torch.equal(forward(unet, inputs), vanilla)


# --- 5. an exception inside the UNet mid-forward ------------------------------------------------

@pytest.mark.parametrize("mode", MODES)
def test_an_exception_mid_forward_leaves_the_patch_consistent(base, inputs, mode):
    """A fault in the middle of the UNet (after ToMe's blocks of the first level ran, before the rest):
    the next call equals a fresh patch's, and remove_patch restores the vanilla output and hooks."""
    unet = copy.deepcopy(base)
    vanilla, hooks_before = forward(unet, inputs), hook_count(unet)
    fresh = forward(with_tome(copy.deepcopy(base), mode), inputs)
    with_tome(unet, mode)

    def fail(module, args):
        raise RuntimeError("injected fault")

    handle = unet.down_blocks[1].attentions[0].transformer_blocks[0].attn1.register_forward_pre_hook(fail)
    with pytest.raises(RuntimeError, match="injected fault"):
        forward(unet, inputs)
    handle.remove()
    assert torch.equal(forward(unet, inputs), fresh)
    tome_core.remove_patch(unet)
    assert torch.equal(forward(unet, inputs), vanilla) and hook_count(unet) == hooks_before


# --- 6. a pipeline's model CPU offload (accelerate hooks on each component) ----------------------

def test_enable_model_cpu_offload_on_a_tiny_pipeline(base, tmp_path_factory):
    """A real StableDiffusionPipeline from tiny seeded components (as in test_diffusers_pipeline.py):
    model CPU offload before or after ToMe gives ToMe's image exactly; removal the offloaded vanilla one."""
    pytest.importorskip("accelerate")
    import numpy as np

    import transformers
    from test_diffusers_pipeline import _tokenizer

    tokenizer = _tokenizer(tmp_path_factory)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
            hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=len(tokenizer),
            max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
        vae = diffusers.AutoencoderKL(block_out_channels=(8, 8), norm_num_groups=4, latent_channels=4,
                                      down_block_types=("DownEncoderBlock2D",) * 2,
                                      up_block_types=("UpDecoderBlock2D",) * 2).eval()
    components = dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=copy.deepcopy(base),
                      scheduler=diffusers.DDIMScheduler(clip_sample=False, steps_offset=1), safety_checker=None,
                      feature_extractor=None, requires_safety_checker=False)

    def generate(pipe):
        return pipe("a cat", num_inference_steps=2, height=64, width=64, guidance_scale=7.5, output_type="np",
                    generator=torch.Generator().manual_seed(0)).images

    def pipeline():
        pipe = diffusers.StableDiffusionPipeline(**copy.deepcopy(components))
        pipe.set_progress_bar_config(disable=True)
        return pipe

    plain = pipeline()
    vanilla = generate(plain)
    tome_core.apply_patch(plain, ratio=0.5)
    tome_image = generate(plain)
    assert not np.array_equal(tome_image, vanilla)
    for order in ORDERS:
        pipe = pipeline()
        if order == "tome_first":
            tome_core.apply_patch(pipe, ratio=0.5)
            pipe.enable_model_cpu_offload(device="cpu")
        else:
            pipe.enable_model_cpu_offload(device="cpu")
            tome_core.apply_patch(pipe, ratio=0.5)
        assert type(getattr(pipe.unet, "_hf_hook", None)).__name__ == "CpuOffload"
        assert np.array_equal(generate(pipe), tome_image), order
        tome_core.remove_patch(pipe)
        assert np.array_equal(generate(pipe), vanilla), order
