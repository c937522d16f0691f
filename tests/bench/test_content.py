"""The benchmark's image-like content (tome_bench.content, --content): photographs that scikit-image ships,
carried into each family's latents through the hosts' latent-to-RGB preview factors and noised to the
bench's step. Deterministic, a least-squares inverse of the published factors, packed as the diffusers
pipelines pack their latents, identity at ratio 0, and the photo's errors in the rows beside noise's."""
from __future__ import annotations

import json

import pytest
import torch

diffusers = pytest.importorskip("diffusers")
pytest.importorskip("skimage")

from tome_bench import content  # noqa: E402
from tome_bench.dit_models import build_dit, forward, make_dit_inputs, peaked_attention  # noqa: E402
from tome_bench.latent_rgb import FAMILY_FORMAT, FORMATS, LATENT_STD  # noqa: E402
from tome_bench.methods import Variant, patched  # noqa: E402
from tome_bench.models import build_unet, make_inputs  # noqa: E402

IMAGE_DITS = ("flux", "qwen_image", "sd3", "z_image")


def _tiny_inputs(family: str, content_: str, photo: str = "astronaut", seed: int = 0, size=(64, 48),
                 model=None, frames: int = 1):
    model = model or build_dit(family, 1, seed=0, scale="tiny")
    width, height = size
    return make_dit_inputs(model, family, 2, height, width, frames, seed, content=content_, photo=photo)


def _latent(inputs: dict) -> torch.Tensor:
    value = inputs.get("hidden_states", inputs.get("x"))
    return torch.stack(value) if isinstance(value, list) else value


def test_the_photos_ship_in_the_wheel():
    """Every photo loads from the installed package (no download) as RGB in the preview's range [-1, 1]."""
    for name in content.PHOTOS:
        rgb = content.photo_rgb(name)
        assert rgb.shape[0] == 3 and min(rgb.shape[1:]) >= 300
        assert -1.0 <= rgb.min() < -0.5 and 0.5 < rgb.max() <= 1.0


@pytest.mark.parametrize("family", ("flux", "qwen_image", "wan", "ltx2", "sd15", "sdxl"))
def test_the_latent_previews_as_the_photo(family):
    """The least-squares latent, through the host's preview map (rgb = latent @ factors + bias), gives back the
    photo's pixels at latent resolution: the inverse of the published factors, exactly (float64)."""
    rgb = content.photo_frames("coffee", 3, 12, 20)
    latent = content.rgb_to_latent(rgb, family)
    fmt = FORMATS[FAMILY_FORMAT[family]]
    assert latent.shape == (len(fmt.factors), 3, 12, 20)
    factors = torch.tensor(fmt.factors, dtype=torch.float64)
    bias = torch.tensor(fmt.bias or (0.0, 0.0, 0.0), dtype=torch.float64)
    preview = torch.einsum("cr,cfhw->rfhw", factors, latent) + bias[:, None, None, None]
    assert torch.allclose(preview, rgb, atol=1e-9)


def test_the_factor_table_matches_the_hosts_shapes():
    """Channels per latent space as the models take them: SD 4, SD3/Flux/Wan 2.1 16, LTX-2 128; families map
    to the format ComfyUI gives them (Qwen-Image: Wan 2.1's VAE, Z-Image: Flux's)."""
    assert {k: len(v.factors) for k, v in FORMATS.items()} == {
        "SD15": 4, "SDXL": 4, "SD3": 16, "Flux": 16, "Wan21": 16, "LTXAV": 128}
    assert all(len(row) == 3 for v in FORMATS.values() for row in v.factors)
    assert FAMILY_FORMAT["qwen_image"] == "Wan21" and FAMILY_FORMAT["z_image"] == "Flux"
    assert FORMATS["Flux"].factors[0] == (-0.0346, 0.0244, 0.0681)  # comfy/latent_formats.py, Flux, row 0
    assert FORMATS["LTXAV"].bias == (-0.347892, -0.363814, -0.370287)


@pytest.mark.parametrize("family", IMAGE_DITS)
def test_content_is_deterministic(family):
    """Same photo, seed and family: the same latents, bit for bit; another photo or seed changes them; the
    photo replaces only the latents (text, timestep, ids: as with noise)."""
    model = build_dit(family, 1, seed=0, scale="tiny")
    a = _tiny_inputs(family, "photo", model=model)
    b = _tiny_inputs(family, "photo", model=model)
    assert torch.equal(_latent(a), _latent(b))
    assert not torch.equal(_latent(a), _latent(_tiny_inputs(family, "photo", photo="rocket", model=model)))
    assert not torch.equal(_latent(a), _latent(_tiny_inputs(family, "photo", seed=1, model=model)))
    noise = _tiny_inputs(family, "noise", model=model)
    assert not torch.equal(_latent(a), _latent(noise))
    for key, value in noise.items():
        if key not in ("hidden_states", "x"):
            assert _same(value, a[key]), key


def _same(x, y) -> bool:
    if isinstance(x, torch.Tensor):
        return torch.equal(x, y)
    if isinstance(x, (list, tuple)):
        return len(x) == len(y) and all(_same(u, v) for u, v in zip(x, y))
    return x == y


def test_the_photo_is_noised_with_the_benchs_own_noise():
    """x_t = a * x0 + s * noise, with the noise content's latent as the noise: flow families at sigma 0.5; the
    UNets at timestep 500 of SD's scaled-linear DDPM schedule (alpha_bar 0.2763)."""
    model = build_dit("flux", 1, seed=0, scale="tiny")
    noise = _latent(_tiny_inputs("flux", "noise", model=model))
    photo = _latent(_tiny_inputs("flux", "photo", model=model))
    x0 = content.pack("flux", content.photo_latent("flux", 1, 6, 8))
    assert torch.allclose(photo, 0.5 * x0 + 0.5 * noise, atol=1e-6)
    a, s = content.signal_and_noise("sd15")
    assert a ** 2 == pytest.approx(0.2763, abs=1e-3) and a ** 2 + s ** 2 == pytest.approx(1.0)
    unet = build_unet("sd15", "tiny", seed=0)
    plain, photo_sample = make_inputs(unet, "sd15", 2, 64, 96)[0], make_inputs(unet, "sd15", 2, 64, 96, content="photo")[0]
    x0 = content.photo_latent("sd15", 1, 8, 12)[:, 0]
    assert torch.allclose(photo_sample, a * x0 + s * plain, atol=1e-6)
    assert torch.equal(photo_sample[0], photo_sample[1])  # the CFG pair shares its latent


def test_packing_is_the_pipelines():
    """Flux and Qwen-Image pack 2x2 latent cells per token, LTX-2 one cell per token, as their diffusers
    pipelines' _pack_latents do (the reference implementation, on the same latent)."""
    x0 = content.photo_latent("flux", 1, 6, 8)  # [16, 1, 6, 8]
    reference = diffusers.FluxPipeline._pack_latents(x0[:, 0][None], 1, 16, 6, 8)[0]
    assert torch.equal(content.pack("flux", x0), reference)
    reference = diffusers.QwenImagePipeline._pack_latents(x0[:, 0][None], 1, 16, 6, 8)[0]
    assert torch.equal(content.pack("qwen_image", x0), reference)
    x0 = content.photo_latent("ltx2", 3, 4, 6)  # [128, 3, 4, 6]
    reference = diffusers.LTX2Pipeline._pack_latents(x0[None], 1, 1)[0]
    assert torch.equal(content.pack("ltx2", x0), reference)


def test_video_pans_across_the_photo():
    """Video: one crop per latent frame, sliding left to right; frame k+1 is frame k moved, not another
    picture (neighbouring frames are closer than the first and last); one frame is the centred crop."""
    frames = content.photo_frames("astronaut", 5, 16, 24)
    assert frames.shape == (3, 5, 16, 24)
    step = (frames[:, 1] - frames[:, 0]).abs().mean()
    span = (frames[:, 4] - frames[:, 0]).abs().mean()
    assert 0 < step < span
    assert not torch.equal(content.photo_frames("astronaut", 1, 16, 24)[:, 0], frames[:, 2])
    model = build_dit("wan", 1, seed=0, scale="tiny")
    latent = _latent(_tiny_inputs("wan", "photo", model=model, size=(32, 32), frames=9))
    assert latent.shape[2] == 3  # 1 + (9 - 1) / 4 latent frames


def test_photo_needs_the_familys_real_latent_channels():
    """The tiny LTX-2 has 8 latent channels, LTX-2's VAE 128: refused with both numbers, not cut to fit."""
    model = build_dit("ltx2", 1, seed=0, scale="tiny")
    with pytest.raises(ValueError, match=r"^--content photo: ltx2's latent is \(8, 8\) here but its VAE's \(128 "
                                         r"channels\) gives \(8, 128\); photo content needs the family's real"):
        make_dit_inputs(model, "ltx2", 2, 64, 64, 9, 0, content="photo")


def test_bad_content_and_photo_are_refused():
    from tome_bench.runner import BenchConfig

    with pytest.raises(ValueError, match="content must be one of noise, photo, both, got 'photos'"):
        BenchConfig(families=("flux",), content="photos")
    with pytest.raises(ValueError, match=r"photo must be one of astronaut, .* \(skimage.data\), got 'moon'"):
        BenchConfig(families=("flux",), content="photo", photo="moon")


@pytest.mark.parametrize("family", ("flux", "qwen_image"))
@pytest.mark.parametrize("method", ("merge", "kv"))
def test_identity_at_ratio_0_on_photo_content(family, method):
    """On the photo's latents, ratio 0 gives vanilla's output exactly (peaked attention, the bench's patch
    path); ratio 0.5 does not (the comparison is not trivial)."""
    model = build_dit(family, 1, seed=0, scale="tiny")
    inputs = _tiny_inputs(family, "photo", model=model, size=(64, 64))
    with peaked_attention(model, 3.0):
        expected = forward(model, inputs)
        with patched(model, Variant(method, 0.0), seed=0):
            same = forward(model, inputs)
        with patched(model, Variant(method, 0.5), seed=0):
            reduced = forward(model, inputs)
    assert torch.equal(same, expected)
    assert not torch.equal(reduced, expected)


def test_content_both_puts_the_photos_errors_beside_noises(tmp_path):
    """--content both: every row has the noise errors and the photo's (cfg err peaked (photo)); vanilla's are 0;
    merge's differ between the contents; the JSON records the content, the command and the commit."""
    from tome_bench.cli import main

    out = tmp_path / "bench"
    argv = ["--tiny", "--families", "flux,qwen_image", "--methods", "vanilla,merge@0.5", "--content", "both",
            "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    result = json.loads((out / "results.json").read_text())
    rows = result["rows"]
    assert [r["family"] for r in rows] == ["flux", "flux", "qwen_image", "qwen_image"]
    for r in rows:
        assert r["content"] == "both"
        if r["method"] == "vanilla":
            assert r["cfg_err_peaked_photo"] == 0 and r["cfg_err_peaked"] == 0
        else:
            assert r["cfg_err_peaked_photo"] > 0 and r["cfg_err_peaked"] > 0
            assert r["cfg_err_peaked_photo"] != r["cfg_err_peaked"]
    assert result["environment"]["command"] == "python -m tome_core bench " + " ".join(argv)
    assert result["environment"]["commit"] is None or len(result["environment"]["commit"].split("+")[0]) == 40
    assert "cfg err peaked (photo)" in (out / "results.md").read_text()


@pytest.mark.parametrize("family", ("flux", "z_image", "qwen_image", "wan", "ltx2", "sd15", "sdxl"))
def test_the_photo_latent_has_the_familys_latent_scale(family):
    """The photo latent is the least-squares one scaled to the standard deviation of the family's real latents (unit
    for every host's normalised latents), so the photo weighs as much against the noise in every family: Qwen-Image's
    and Wan's (std 0.36 as inverted) and Flux's (0.85) alike."""
    frames = 3 if family in ("wan", "ltx2") else 1
    latent = content.photo_latent(family, frames, 12, 16)
    least_squares = content.rgb_to_latent(content.photo_frames("astronaut", frames, 12, 16), family)
    assert latent.std().item() == pytest.approx(LATENT_STD[FAMILY_FORMAT[family]], rel=1e-5)
    assert torch.allclose(latent.double(), least_squares * (latent.std().double() / least_squares.std()), atol=1e-5)
