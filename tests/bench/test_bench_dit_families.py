"""The benchmark's Z-Image, Qwen-Image and LTX-2 families (tome_bench.dit_models / dit_runner / dit_blocks):
the full configurations are the released ones with fewer blocks, the token counts at the native sizes, the
peaked-attention proxy, and vanilla vs kv end to end through the runner and dit_blocks on tiny-width models
(the full width takes minutes). No timing assertions: benchmarks are measured, not tested."""
from __future__ import annotations

import inspect
import json
import math

import pytest
import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

diffusers = pytest.importorskip("diffusers")

from tome_bench import dit_models  # noqa: E402
from tome_bench.dit_models import build_dit, dit_config, make_dit_inputs, peaked_attention  # noqa: E402

NEW = ("z_image", "qwen_image", "ltx2")


def _released_defaults(cls_name: str) -> dict:
    """diffusers' constructor defaults: for these three classes the released checkpoints' configurations."""
    params = inspect.signature(getattr(diffusers, cls_name).__init__).parameters
    return {k: p.default for k, p in params.items() if p.default is not inspect.Parameter.empty}


@pytest.mark.parametrize("family, depth_key", [("z_image", "n_layers"), ("qwen_image", "num_layers"),
                                               ("ltx2", "num_layers")])
def test_full_configs_are_the_released_ones_with_fewer_blocks(family, depth_key):
    """Every width of the full configuration is the released model's (Z-Image 3840 / 30 heads, Qwen-Image
    24 x 128, LTX-2 video 32 x 128 and audio 32 x 64); only the depth differs (no model built: too slow)."""
    cls_name, cfg = dit_config(family, 3)
    released = _released_defaults(cls_name)
    assert cfg[depth_key] == 3
    def plain(value):  # tuples and lists alike
        return list(value) if isinstance(value, (list, tuple)) else value

    differs = {k: (v, released.get(k)) for k, v in cfg.items()
               if k not in (depth_key, "n_refiner_layers") and plain(released.get(k)) != plain(v)}
    assert not differs
    width = {"z_image": cfg.get("dim"), "qwen_image": cfg.get("num_attention_heads", 0) * cfg.get("attention_head_dim", 0),
             "ltx2": cfg.get("num_attention_heads", 0) * cfg.get("attention_head_dim", 0)}[family]
    assert width == {"z_image": 3840, "qwen_image": 3072, "ltx2": 4096}[family]


def test_zimage_keeps_its_refiners_in_the_released_proportion():
    """2 noise + 2 caption refiners per 30 layers: none at the bench's 2 blocks, 1 at 8, 2 at full depth."""
    assert [dit_config("z_image", n)[1]["n_refiner_layers"] for n in (2, 7, 8, 30)] == [0, 0, 1, 2]
    assert dit_config("z_image", 2, "tiny")[1]["n_refiner_layers"] == 1  # tests run the real layout


def test_token_counts_at_the_native_sizes():
    """Z-Image 1024^2 and Qwen-Image 1328^2 (latent / 8 in 2x2 patches), LTX-2 768x512 x 121 frames (latent
    / 32 spatially, / 8 in time: 16 x 16 x 24), and the 2048^2-class sizes of the issue's targets."""
    from tome_bench.dit_runner import DEFAULT_SIZES

    assert {f: DEFAULT_SIZES[f] for f in NEW} == {"z_image": (1024, 1024), "qwen_image": (1328, 1328), "ltx2": (768, 512)}
    token_counts = dit_models.token_counts
    assert token_counts("z_image", 1024, 1024) == (4096, 128)
    assert token_counts("z_image", 2048, 2048) == (16384, 128)
    assert token_counts("qwen_image", 1328, 1328) == (83 * 83, 128)
    assert token_counts("qwen_image", 2656, 2656) == (166 * 166, 128)
    assert token_counts("ltx2", 512, 768, frames=121) == (16 * 16 * 24, 1024)
    assert dit_models.latent_shape("ltx2", 512, 768, frames=121) == (16, 16, 24)
    assert dit_models.latent_shape("wan", 480, 832, frames=33) == (9, 60, 104)  # unchanged
    assert dit_models.audio_tokens(121) == 126  # LTX2Pipeline: 121 / 24 s x 25 audio latents per second


@pytest.mark.parametrize("family", NEW)
def test_inputs_match_the_model_and_the_cfg_pair_shares_latents(family):
    """The inputs run the tiny model and give the grid the token counts say; an even batch is a
    [uncond; cond] pair over the same latents (Z-Image's per-sample list too)."""
    model = build_dit(family, 1, seed=0, scale="tiny")
    inputs = make_dit_inputs(model, family, 2, 128, 256, frames=17, text_tokens=16)
    latents = inputs["x"] if family == "z_image" else list(inputs["hidden_states"])
    assert torch.equal(latents[0], latents[1])
    image, _ = dit_models.token_counts(family, 128, 256, frames=17)
    grid = {"z_image": lambda: math.prod(latents[0].shape[1:]) // 4, "qwen_image": lambda: latents[0].shape[0],
            "ltx2": lambda: latents[0].shape[0]}[family]()
    assert grid == image == {"z_image": 8 * 16, "qwen_image": 8 * 16, "ltx2": 3 * 4 * 8}[family]
    out = dit_models.forward(model, inputs)
    assert out.shape[0] == 2 and torch.isfinite(out).all()


class _SelfAttentionLogits(TorchFunctionMode):
    """Std of the logits of the SDPA calls whose queries and keys both number ``length`` (the reduced attention)."""

    def __init__(self, length: int):
        super().__init__()
        self.length, self.stds = length, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            bound = dict(zip(("query", "key"), args), **kwargs)
            q, k = bound["query"].float(), bound["key"].float()
            if q.shape[-2] == k.shape[-2] == self.length:
                self.stds.append((q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).std().item())
        return func(*args, **kwargs)


# tokens of the reduced attention at 128 px, 16 text tokens, 9 frames: Z-Image 64 image + 16 caption padded to 32;
# Qwen-Image 16 text + 64 image; LTX-2's video self-attention 2 latent frames x 4 x 4 (audio 9, text 16)
_REDUCED_LENGTH = {"z_image": 96, "qwen_image": 80, "ltx2": 32}


@pytest.mark.parametrize("family", NEW)
def test_peaked_scales_the_reduced_attentions_qk_norms_and_restores(family):
    """All three RMS-normalise q and k after their projections: peaked scales those norms' weights in the
    attentions kv reduces (Z-Image's refiners, LTX-2's audio and cross-attentions untouched). The reduced
    attention's logits spread as in the UNet bench (std ~0.33), by 9x when peaked 3; restored bit-identical."""
    model = build_dit(family, 1, seed=0, scale="tiny")
    inputs = make_dit_inputs(model, family, 2, 128, 128, frames=9, text_tokens=16)
    scaled = {id(p) for p in dit_models._qk_parameters(model)}
    assert len(scaled) == {"z_image": 2, "qwen_image": 4, "ltx2": 2}[family]  # norm_q/k (+ Qwen's text side)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with _SelfAttentionLogits(_REDUCED_LENGTH[family]) as spy:
        out = dit_models.forward(model, inputs)
    with peaked_attention(model, 3.0):
        for name, p in model.named_parameters():
            expected = before[name] * 3.0 if id(p) in scaled else before[name]
            assert torch.equal(p, expected), name
        with _SelfAttentionLogits(_REDUCED_LENGTH[family]) as peaked_spy:
            out_peaked = dit_models.forward(model, inputs)
    assert len(spy.stds) == len(peaked_spy.stds) == 1  # one reduced attention per block, one block
    plain, peaked = spy.stds[0], peaked_spy.stds[0]
    assert 0.2 < plain < 0.5 and peaked == pytest.approx(9 * plain, rel=0.05), (plain, peaked)
    assert not torch.equal(out, out_peaked)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(dit_models.forward(model, inputs), out)


@pytest.fixture(autouse=True)
def one_thread():
    """One thread, as the bench's --tiny sets (tiny forwards are too short for threads to pay, and on a busy
    machine they wait on each other); restored for the tests after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("family", NEW)
def test_tiny_run_end_to_end_through_the_runner(family):
    """vanilla vs kv at two ratios through the runner's rounds (tiny width, 64 px, as --tiny; the CLI and its
    chart around it are test_bench's flux case): two interleaved rounds per variant, the tokens, the batch
    and what the guided error compares (Z-Image-Turbo distilled, batch 1; Qwen-Image and LTX-2 a CFG
    pair), errors only where kv ran."""
    from tome_bench.runner import BenchConfig, run_benchmark

    cfg = BenchConfig(families=(family,), resolutions=((64, 64),), ratios=(0.5, 0.75), repeats=2, scale="tiny",
                      blocks=1, frames=17 if family == "ltx2" else 33)
    assert cfg.dit and cfg.methods == ("vanilla", "kv")
    rows = run_benchmark(cfg, progress_bar=False, log=lambda text: None)["rows"]
    assert [r["label"] for r in rows] == ["vanilla", "kv r=0.5", "kv r=0.75"]
    expected = {"z_image": (16, 128, 1, "1+1+1", "distilled"), "qwen_image": (16, 128, 2, "1", "cfg"),
                "ltx2": (3 * 2 * 2, 1024, 2, "1", "cfg")}[family]  # 64 px; LTX-2: 3 latent frames of 2x2
    for r in rows:
        assert (r["image_tokens"], r["text_tokens"], r["batch"], r["blocks"], r["guided"]) == expected
        assert r["rounds"] == 2 and r["scale"] == "tiny" and r["real_blocks"] == dit_models.REAL_DEPTH[family]
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0 and 0 < r["attn_share"] < 1
        errors = [r[k] for k in ("rel_err", "cfg_err", "rel_err_peaked", "cfg_err_peaked")]
        if r["method"] == "vanilla":
            assert errors == [0.0] * 4 and r["vanilla_drift"] == 0.0
        else:
            assert all(math.isfinite(e) and e > 0 for e in errors), (r["label"], errors)
        if family == "z_image":
            assert r["cfg_err"] == r["rel_err"]  # distilled: the guided error is the output's
        if family == "ltx2":
            assert (r["frames"], r["latent"], r["audio_tokens"]) == (17, "3x2x2", 18)


@pytest.mark.parametrize("argv, message", [
    (["--families", "ltx2", "--frames", "29"], "frames must be 8k + 1 for ltx2"),
    (["--families", "ltx2", "--res", "784x512"], "ltx2 sizes must be multiples of 32 px"),
    (["--families", "qwen_image", "--frames", "33"], "--frames is for the video families wan, ltx2, not qwen_image"),
])
def test_bad_ltx2_and_frames_input_is_refused(argv, message, capsys):
    from tome_core.__main__ import main

    try:
        code = main(["bench", *argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and message in err and "Traceback" not in err, err


def test_defaults_parse_for_the_new_families():
    from tome_bench.cli import _configs, build_parser

    (cfg,) = _configs(build_parser().parse_args(["--families", "zimage,qwen,ltx2", "--frames", "121"]))
    assert cfg.families == NEW  # the catalogue's names; the README's commands still say zimage and qwen
    assert cfg.dit and cfg.methods == ("vanilla", "kv") and cfg.frames == 121
    assert [cfg.sizes_for(f) for f in NEW] == [((1024, 1024),), ((1328, 1328),), ((768, 512),)]
    assert [cfg.batch_for(f) for f in NEW] == [1, 2, 2]


def test_dit_blocks_runs_on_tiny_configs(tmp_path, capsys):
    """python -m tome_bench.dit_blocks on the tiny width: every range reduces the blocks whose centre it
    holds, each reduced range has an error, err / block is the error over the blocks reduced, JSON written."""
    from tome_bench.dit_blocks import main

    path = tmp_path / "ranges.json"
    assert main(["--families", ",".join(NEW), "--tiny", "--blocks", "2", "--size", "128x128x9", "--dtype", "fp32",
                 "--ranges", "0-1,0-0.5,0.5-1", "--out", str(path)]) == 0
    rows = json.loads(path.read_text())["rows"]
    assert [(r["family"], r["blocks_reduced"], r["blocks"]) for r in rows] == [
        (f, n, 2) for f in NEW for n in (2, 1, 1)]
    assert all(r["err_peaked"] > 0 and r["err_per_block"] == pytest.approx(r["err_peaked"] / r["blocks_reduced"])
               for r in rows)
    assert "ltx2      0.50-1.00    1 of 2" in capsys.readouterr().out


@pytest.mark.parametrize("family", ["flux", "qwen_image", "wan"])
def test_merge_rows_beside_kv_on_the_families_it_reaches(family):
    """--methods vanilla,kv,merge on a family mode merge reaches: merge rows at each ratio beside kv's, with errors
    growing with the ratio; a family it does not reach is refused naming it."""
    from tome_bench.runner import BenchConfig, run_benchmark

    cfg = BenchConfig(families=(family,), resolutions=((128, 128),), ratios=(0.5, 0.75), repeats=1, scale="tiny",
                      blocks=1, methods=("vanilla", "kv@0.75", "merge"))
    rows = run_benchmark(cfg, progress_bar=False, log=lambda text: None)["rows"]
    assert [r["label"] for r in rows] == ["vanilla", "kv r=0.75", "merge r=0.5", "merge r=0.75"]
    merged = [r for r in rows if r["method"] == "merge"]
    assert all(math.isfinite(r["cfg_err_peaked"]) and r["cfg_err_peaked"] > 0 for r in merged)
    assert merged[1]["rel_err"] > merged[0]["rel_err"]  # more merged, further from vanilla
    with pytest.raises(ValueError, match="merge does not reach sd3 yet .*flux, flux2, qwen_image, lumina2, z_image, "
                                         "wan, wan_vace, wan_animate, ltx2"):
        BenchConfig(families=("sd3",), methods=("vanilla", "merge"), scale="tiny", blocks=1)
