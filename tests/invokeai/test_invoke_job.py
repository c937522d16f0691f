"""The ToMe nodes' job patch on InvokeAI's own classes, in process: models held in InvokeAI's real model cache
(``ModelCache``) and handed out as its real ``LoadedModel``, through the nodes' view of a job's context.

FLUX.1 runs on InvokeAI's own BFL-derived ``Flux`` (its blocks' parts called by ``custom_block_processor``), which
no tiny checkpoint reaches through the REST API (InvokeAI's FLUX loader builds the full-size model): here it is
InvokeAI's class with seeded small sizes, driven with the arguments InvokeAI's ``flux/denoise.py`` passes. Also
Qwen-Image, Wan and Krea-2 (diffusers classes InvokeAI loads), and CogView4 (a family InvokeAI runs that ToMe does not
reduce: refused by name). The promises: the model is patched only while the job holds it (also when the job raises),
at the model's defaults it reduces, at ratio 0 and after the job it is bit-identical, refusals name the class.
"""
from __future__ import annotations

import os

import pytest

import invoke_env
import torchvision_guard

if invoke_env.find_invokeai() is None and os.environ.get("TOME_REQUIRE_INVOKE") != "1":
    pytest.skip("InvokeAI is not importable here (use .venv-invoke/bin/python)", allow_module_level=True)
torchvision_guard.install()

import diffusers  # noqa: E402
import torch  # noqa: E402
from invokeai.backend.flux.model import Flux, FluxParams  # noqa: E402
from invokeai.backend.model_manager.load.load_base import LoadedModel  # noqa: E402
from invokeai.backend.model_manager.load.model_cache.model_cache import ModelCache  # noqa: E402

from tome_core.adapters.hooks.api import is_patched, patch_config  # noqa: E402
from tome_invokeai.job import ToMeJob  # noqa: E402


def _seeded(model: torch.nn.Module) -> torch.nn.Module:
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    return model.eval()


class _Regions:
    """The two calls InvokeAI's FLUX blocks make of its regional prompting extension, with no regions."""

    def get_double_stream_attn_mask(self, block_index: int) -> None:
        return None

    def get_single_stream_attn_mask(self, block_index: int) -> None:
        return None


def invoke_flux(h: int = 12, w: int = 10, text: int = 7):
    model = _seeded(Flux(FluxParams(in_channels=16, vec_in_dim=8, context_in_dim=12, hidden_size=64, mlp_ratio=2.0,
                                    num_heads=4, depth=2, depth_single_blocks=2, axes_dim=[4, 6, 6], theta=10000,
                                    qkv_bias=True, guidance_embed=True)))
    g = torch.Generator().manual_seed(1)
    ids = torch.zeros(1, h * w, 3)
    ids[0, :, 1] = torch.arange(h).repeat_interleave(w)
    ids[0, :, 2] = torch.arange(w).repeat(h)
    inputs = dict(img=torch.randn(1, h * w, 16, generator=g), img_ids=ids, txt=torch.randn(1, text, 12, generator=g),
                  txt_ids=torch.zeros(1, text, 3), y=torch.randn(1, 8, generator=g), timesteps=torch.tensor([0.7]),
                  guidance=torch.tensor([3.5]), timestep_index=0, total_num_timesteps=4,
                  controlnet_double_block_residuals=None, controlnet_single_block_residuals=None,
                  ip_adapter_extensions=[], regional_prompting_extension=_Regions())
    return model, inputs


def qwen_image(h: int = 8, w: int = 10, text: int = 5):
    model = _seeded(diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=16, out_channels=4, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, h * w, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, text, 32, generator=g),
                  encoder_hidden_states_mask=torch.ones(1, text, dtype=torch.long),
                  timestep=torch.full((1,), 0.6), img_shapes=[[(1, h, w)]])
    return model, inputs


def wan(frames: int = 3, h: int = 10, w: int = 8):
    model = _seeded(diffusers.WanTransformer3DModel(
        patch_size=(1, 2, 2), num_attention_heads=2, attention_head_dim=12, in_channels=4, out_channels=4,
        text_dim=16, freq_dim=32, ffn_dim=32, num_layers=2, rope_max_seq_len=32))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, 4, frames, h, w, generator=g),
                  encoder_hidden_states=torch.randn(1, 7, 16, generator=g), timestep=torch.full((1,), 600.0))
    return model, inputs


def krea2(h: int = 8, w: int = 10, text: int = 5):
    """Krea-2, as InvokeAI's krea2_denoise loads it (diffusers' class; position ids as diffusers' pipeline makes)."""
    model = _seeded(diffusers.Krea2Transformer2DModel(
        in_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2, num_key_value_heads=1,
        intermediate_size=32, timestep_embed_dim=16, text_hidden_dim=32, num_text_layers=2, text_num_attention_heads=2,
        text_num_key_value_heads=2, text_intermediate_size=32, num_layerwise_text_blocks=1, num_refiner_text_blocks=1,
        axes_dims_rope=(4, 6, 6)))
    g = torch.Generator().manual_seed(1)
    inputs = dict(hidden_states=torch.randn(1, h * w, 16, generator=g),
                  encoder_hidden_states=torch.randn(1, text, 2, 32, generator=g), timestep=torch.full((1,), 0.6),
                  position_ids=diffusers.Krea2Pipeline.prepare_position_ids(text, h, w, "cpu"))
    return model, inputs


FAMILIES = {"flux": invoke_flux, "qwen_image": qwen_image, "wan": wan, "krea2": krea2}
# the mode and ratio each class runs at when both are left to the model
DEFAULTS = {"flux": ("kv", 0.5), "qwen_image": ("merge", 0.025), "wan": ("merge", 0.625), "krea2": ("kv", 0.5)}


class _Models:
    """The one call of InvokeAI's ``ModelsInterface`` the nodes' view wraps: ``load`` from the real cache."""

    def __init__(self, cache: ModelCache) -> None:
        self.cache = cache

    def load(self, identifier, submodel_type=None):
        return LoadedModel(config=None, cache_record=self.cache.get(identifier.key), cache=self.cache)


class _Identifier:
    def __init__(self, key: str, submodel_type: str) -> None:
        self.key, self.submodel_type = key, submodel_type


class _Context:
    def __init__(self, cache: ModelCache) -> None:
        self.models = _Models(cache)


def _cached(model: torch.nn.Module, key: str) -> ModelCache:
    cache = ModelCache(execution_device_working_mem_gb=0.1, enable_partial_loading=False,
                       keep_ram_copy_of_weights=True, execution_device="cpu", storage_device="cpu",
                       shared_cpu_weights=None)
    cache.put(key, model)
    return cache


def _run(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    with torch.no_grad():
        out = model(**inputs)
    return (out[0] if isinstance(out, tuple) else getattr(out, "sample", out)).clone()


def _job_run(family: str, **asked):
    """(plain output, the job's output, the output after the job, the job, the model), the job's model taken
    through the nodes' view of a context as InvokeAI's denoise invocations take it (``model_on_device``)."""
    model, inputs = FAMILIES[family]()
    plain = _run(model, inputs)
    cache = _cached(model, family)
    job = ToMeJob(dict({"ratio": -1.0, "mode": "default", "speed_check": "off"}, **asked))
    context = job.context(_Context(cache))
    loaded = context.models.load(_Identifier(family, "transformer"))
    with loaded.model_on_device() as (_, held):
        # patched while held; at ratio 0 not at all (a patch that does nothing costs nothing)
        assert held is model and is_patched(held) == (asked.get("ratio") != 0.0)
        config = patch_config(held)
        during = _run(held, inputs)
    return plain, during, _run(model, inputs), config, model


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_the_models_default_reduces_while_the_job_holds_it_and_is_gone_after(family):
    plain, during, after, config, model = _job_run(family)
    assert (config.mode, config.ratio) == DEFAULTS[family]
    assert not torch.equal(plain, during) and torch.isfinite(during).all()
    assert torch.equal(plain, after) and not is_patched(model)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_ratio_zero_is_bit_identical(family):
    plain, during, after, _, _ = _job_run(family, ratio=0.0)
    assert torch.equal(plain, during) and torch.equal(plain, after)


@pytest.mark.parametrize("family", ["qwen_image", "wan"])
def test_the_other_mode_reduces_too(family):
    plain, during, _, config, _ = _job_run(family, mode="kv", ratio=0.5)
    assert config.mode == "kv" and not torch.equal(plain, during)


def test_invokeais_flux_kontext_reference_tokens_keep_their_keys_and_the_grid_is_reduced():
    """Kontext's reference image: tokens after the grid with first id 1 (``kontext_extension.py``), every key kept."""
    model, inputs = invoke_flux()
    g = torch.Generator().manual_seed(2)
    refs = torch.zeros(1, 12, 3)
    refs[0, :, 0] = 1.0
    refs[0, :, 1] = torch.arange(3).repeat_interleave(4)
    refs[0, :, 2] = torch.arange(4).repeat(3)
    inputs = dict(inputs, img=torch.cat([inputs["img"], torch.randn(1, 12, 16, generator=g)], 1),
                  img_ids=torch.cat([inputs["img_ids"], refs], 1))
    plain = _run(model, inputs)
    job = ToMeJob({"ratio": 0.5, "mode": "kv", "speed_check": "off"})
    context = job.context(_Context(_cached(model, "kontext")))
    with context.models.load(_Identifier("kontext", "transformer")).model_on_device() as (_, held):
        reduced = _run(held, inputs)
        state = held._tome_dit
        layout = state.current.layout
    assert state.reduced_calls == 2 and layout.suffix == 12 and layout.prefix == 7  # the single blocks; refs after
    assert not torch.equal(plain, reduced) and torch.isfinite(reduced).all()


def test_invokeais_flux_takes_kv_and_refuses_merge_naming_its_class():
    with pytest.raises(ValueError, match=r"Flux \(invokeai\.backend\.flux\.model\.Flux\).*use mode='kv'"):
        _job_run("flux", mode="merge")


def test_the_patch_goes_when_the_job_raises_and_on_the_older_with_api():
    model, inputs = invoke_flux()
    plain = _run(model, inputs)
    job = ToMeJob({"ratio": 0.5, "mode": "kv", "speed_check": "off"})
    context = job.context(_Context(_cached(model, "flux")))
    with pytest.raises(RuntimeError, match="cancelled"):
        with context.models.load(_Identifier("flux", "transformer")).model_on_device() as (_, held):
            assert is_patched(held)
            raise RuntimeError("cancelled")  # what InvokeAI's cancel raises inside the step loop
    assert not is_patched(model) and torch.equal(plain, _run(model, inputs))
    with context.models.load(_Identifier("flux", "transformer")) as held:  # LoadedModel's older context-manager API
        assert is_patched(held) and not torch.equal(plain, _run(held, inputs))
    assert not is_patched(model) and torch.equal(plain, _run(model, inputs))


def test_a_text_encoder_or_vae_load_is_left_alone():
    model, _ = qwen_image()
    job = ToMeJob({"ratio": 0.5, "mode": "kv"})
    context = job.context(_Context(_cached(model, "te")))
    with context.models.load(_Identifier("te", "text_encoder")).model_on_device() as (_, held):
        assert not is_patched(held)


def test_a_family_tome_does_not_reduce_is_refused_by_name_before_a_step():
    model = _seeded(diffusers.CogView4Transformer2DModel(
        patch_size=2, in_channels=4, num_layers=1, attention_head_dim=8, num_attention_heads=2, out_channels=4,
        text_embed_dim=16, time_embed_dim=16, condition_dim=8, pos_embed_max_size=16, sample_size=16))
    job = ToMeJob({"ratio": -1.0, "mode": "default"})
    context = job.context(_Context(_cached(model, "cogview4")))
    with pytest.raises(TypeError, match="CogView4Transformer2DModel"):
        with context.models.load(_Identifier("cogview4", "transformer")).model_on_device():
            pytest.fail("the job's body ran on a model ToMe does not reduce")
    assert not is_patched(model)


@pytest.mark.parametrize("asked, words", [
    ({"ratio": -0.3}, "use -1 for the model's default ratio"),
    ({"ratio": 0.5, "start_percent": 0.9, "end_percent": 0.1}, "start_percent"),
    ({"ratio": 0.5, "mode": "avg"}, "mode"),
])
def test_settings_no_model_takes_are_refused_before_anything_loads(asked, words):
    with pytest.raises(ValueError, match=words):
        ToMeJob(asked)


def test_options_tome_cannot_run_beside_are_refused_by_name_unless_tome_is_off():
    """HiDiffusion (SD) and Krea-2's style reference, read from the node's own fields before anything runs."""
    from types import SimpleNamespace

    from tome_invokeai.invocations import refuse_partners

    style = SimpleNamespace(style_strength=0.8)
    with pytest.raises(ValueError, match=r"Krea-2's style reference .*remove the style reference, or set tome_ratio 0"):
        refuse_partners(SimpleNamespace(tome_ratio=-1.0, style_reference=style))
    with pytest.raises(ValueError, match="HiDiffusion"):
        refuse_partners(SimpleNamespace(tome_ratio=0.5, hidiffusion=True))
    refuse_partners(SimpleNamespace(tome_ratio=0.0, hidiffusion=True, style_reference=style))  # ToMe off: both run
    refuse_partners(SimpleNamespace(tome_ratio=0.5, style_reference=SimpleNamespace(style_strength=0.0)))
