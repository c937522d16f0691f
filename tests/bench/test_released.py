"""The released-depth DiTs (``--depth released``, tome_bench.released) checked on the CPU without their weights.

On the ``meta`` device (shapes only, nothing allocated): each released model's block counts and width are the
released checkpoint's, its parameters' bf16 bytes with one forward's activations at its native size (estimated from
a meta forward, attention counted as the fused kernels run it) fit an 80 GB card, and its tokens at the native size
are the ones the bench reports. The device build (parameters made on the device, seeded there) runs at tiny width
on the CPU; full width needs a GPU and is refused on the CPU."""
from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("diffusers")

from test_bench_dit_families import one_thread  # noqa: E402,F401 - autouse: tiny forwards on one thread
from tome_bench import dit_models, released  # noqa: E402
from tome_core.catalogue.diffusers_lookup import family_of  # noqa: E402
from tome_core.catalogue.families import BY_NAME  # noqa: E402

# (block counts per block list in run order, width, parameters in billions: diffusers' count of the released models)
RELEASED = {"flux": ((19, 38), 3072, 11.90), "sd3": ((24,), 1536, 2.24), "wan": ((40,), 5120, 14.29),
            "z_image": ((30,), 3840, 6.15), "qwen_image": ((60,), 3072, 20.43), "ltx2": ((48,), 4096, 18.88)}



def _width(config: dict) -> int:
    return config.get("dim") or config["num_attention_heads"] * config["attention_head_dim"]


@pytest.mark.parametrize("family", dit_models.DIT_FAMILIES)
def test_the_released_model_has_the_released_depth_width_and_size(family):
    blocks, width, billions = RELEASED[family]
    model = released.meta_model(family)
    assert all(p.device.type == "meta" for p in model.parameters())
    binding = family_of(model)
    assert tuple(len(getattr(model, b.attr)) for b in binding.blocks) == blocks
    assert _width(dit_models.dit_config(family, scale="full", released=True)[1]) == width
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(billions, abs=0.01)
    if family == "z_image":  # 2 noise and 2 caption refiners beside its 30 layers, as released
        assert (len(model.noise_refiner), len(model.context_refiner)) == (2, 2)
    assert dit_models.dit_config(family, 3, released=True)[1] == {  # blocks given: that depth at the released width
        **dit_models.dit_config(family, 3)[1], **dict(dit_models.RELEASED[family].width)}


@pytest.mark.parametrize("family", dit_models.DIT_FAMILIES)
def test_it_fits_an_80_gb_card_with_its_activations_at_its_native_size(family):
    """bf16 weights of the released depth + one forward's live tensors at the native size (1 block at the released
    width: in inference mode the peak does not grow with depth) + inputs, under 80 GB; and the tokens reaching the
    first block, the grid ToMe reads and the output are the native size's."""
    weights = released.parameter_bytes(released.meta_model(family), torch.bfloat16)
    model = released.meta_model(family, blocks=1)
    width, height = BY_NAME[family].native_px
    batch = dit_models.DEFAULT_BATCH.get(family, 2)
    on_cpu = dit_models.make_dit_inputs(model, family, batch, height, width, 33, dtype=torch.bfloat16)
    inputs = dit_models.to_device(on_cpu, torch.device("meta"))
    seen = {}

    def first_block(module, args, kwargs):  # its token stream: the image (Z-Image: image and caption joined)
        seen["tokens"] = (args[0] if args else kwargs["hidden_states"]).shape[1]

    first = getattr(model, family_of(model).blocks[0].attr)[0]
    handle = first.register_forward_pre_hook(first_block, with_kwargs=True)
    try:
        peak, out = released.activation_peak(model, inputs)
    finally:
        handle.remove()
    image, text = dit_models.token_counts(family, height, width, 33)
    assert seen["tokens"] == (image + text if family == "z_image" else image)  # Z-Image: one joint sequence
    assert math.prod(family_of(model).read(model, {"args": (), "kwargs": on_cpu}).grid) == image  # what ToMe reads
    latent = inputs["x"][0].shape if family == "z_image" else inputs["hidden_states"].shape[1:]
    assert tuple((out[0] if isinstance(out, list) else out[0]).shape) == tuple(latent)
    assert 0 < peak < 8e9, peak  # flash-style attention: no N x N scores
    assert weights + peak < 0.9 * released.CARD_BYTES, (weights / 1e9, peak / 1e9)


@pytest.mark.parametrize("family", ["flux", "wan"])
def test_the_device_build_makes_each_weight_once_there_seeded(family):
    """released.build at tiny width on the CPU: every parameter real and on the device, the constructor's buffers
    (Wan's rotary tables) real, norms at 1 and the q/k norms at QK_NORM_INIT, the same seed the same weights."""
    constructed = released._construct(family, "tiny")  # the released depth, parameters on meta
    assert tuple(len(getattr(constructed, b.attr)) for b in family_of(constructed).blocks) == RELEASED[family][0]
    model = released.build(family, "cpu", torch.float32, seed=3, scale="tiny", blocks=1)
    assert all(p.device.type == "cpu" and not p.requires_grad for p in model.parameters())
    assert all(b.device.type == "cpu" for b in model.buffers())
    if family == "wan":
        assert model.rope.freqs_cos.abs().sum() > 0
    norms = [m.weight for n, m in model.named_modules() if dit_models._is_norm_weight(m)
             and n.rsplit(".", 1)[-1] in dit_models._QK_NORMS]
    assert norms and all(torch.all(w == dit_models.QK_NORM_INIT) for w in norms)
    again, other = (released.build(family, "cpu", torch.float32, seed=s, scale="tiny", blocks=1) for s in (3, 4))
    first = next(iter(model.state_dict()))
    assert all(torch.equal(v, again.state_dict()[k]) for k, v in model.state_dict().items())
    assert not torch.equal(model.state_dict()[first], other.state_dict()[first])
    inputs = dit_models.make_dit_inputs(model, family, 2, 64, 64, 9)
    assert torch.isfinite(dit_models.forward(model, inputs)).all()


def test_construction_puts_only_the_parameters_on_meta():
    """The full-width released Qwen-Image (20B parameters) is constructed with nothing allocated for its weights."""
    model = released._construct("qwen_image", "full")
    assert all(p.device.type == "meta" for p in model.parameters())
    assert released.parameter_bytes(model, torch.bfloat16) / 1e9 == pytest.approx(40.9, abs=0.1)
    assert torch.nn.Module.register_parameter.__name__ == "register_parameter"  # restored


def test_weights_that_do_not_fit_the_gpu_are_refused_before_any_allocation(monkeypatch):
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * 10 ** 9, 80 * 10 ** 9))
    with pytest.raises(ValueError, match=r"qwen_image at its released depth needs 40\.9 GB .* 10\.0 GB free"):
        released._fits("qwen_image", int(40.9e9), torch.device("cuda"))


def test_a_tiny_released_run_through_the_runner():
    from tome_bench.runner import BenchConfig, run_benchmark

    cfg = BenchConfig(families=("wan",), resolutions=((64, 64),), scale="tiny", depth="released", repeats=1,
                      methods=("vanilla", "merge"), frames=5, peaked=1.0)
    rows = run_benchmark(cfg, progress_bar=False, log=lambda text: None)["rows"]
    assert [(r["label"], r["blocks"], r["real_blocks"], r["depth"]) for r in rows] == [
        ("vanilla", "40", "40", "released"), ("merge r=0.5", "40", "40", "released")]
    tiny_wan = released.parameter_bytes(released._construct("wan", "tiny"), torch.bfloat16) / 1e9
    assert rows[0]["weights_gb"] == pytest.approx(tiny_wan, abs=1e-3) and rows[1]["cfg_err"] > 0


@pytest.mark.parametrize("argv, message", [
    (["--families", "flux", "--depth", "released"], "that needs a GPU"),
    (["--families", "sd15", "--depth", "released"], "--depth is for DiT families"),
    (["--families", "flux", "--depth", "released", "--blocks", "3"], "--depth released builds the released depth"),
])
def test_released_depth_is_refused_where_it_cannot_run(argv, message, capsys):
    from tome_bench.cli import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err
