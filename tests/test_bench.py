"""The benchmark: the CLI runs end to end on the tiny setting, and the models are the real
architectures. No timing assertions: benchmarks are measured, not tested."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tome_core.bench import methods
from tome_core.bench.models import build_unet, make_inputs, peaked_attention, unet_config

REPO = Path(__file__).resolve().parents[1]
FAMILIES = ("sd15", "sd2", "sdxl")


def _attention_layout(unet):
    """Transformer blocks per down level, in the mid block, and per up level."""
    def count(block):
        return sum(1 for m in block.modules() if type(m).__name__ == "BasicTransformerBlock")
    return ([count(b) for b in unet.down_blocks], count(unet.mid_block),
            [count(b) for b in unet.up_blocks])


def test_cli_tiny_writes_json_and_chart(tmp_path):
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "tome_core", "bench", "--tiny", "--profile", "--no-progress",
         "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "speedup" in proc.stdout  # the printed table

    result = json.loads((out / "results.json").read_text())
    assert result["complete"] is True and result["config"]["scale"] == "tiny"
    env = result["environment"]
    assert env["torch"] == torch.__version__ and env["torch_threads"] == 1 and env["cpu"]

    expected = ["vanilla"] + [m for m in ("merge", "kv", "tomesd")
                              if methods.availability(m) is None]
    assert set(result["skipped"]) == {"merge", "kv", "tomesd"} - set(expected)
    rows = result["rows"]
    assert [(r["family"], r["method"]) for r in rows] == [
        (f, m) for f in FAMILIES for m in expected]
    for r in rows:
        assert (r["width"], r["height"], r["batch"], r["ratio"] > 0) == (
            64, 64, 2, r["method"] != "vanilla")
        for key in ("time_s", "speedup", "speedup_best", "rel_err", "cfg_err", "rel_err_peaked",
                    "cfg_err_peaked", "peak_mem_mb", "mem_vs_vanilla"):
            assert math.isfinite(r[key]), (r["label"], key, r[key])
        assert r["speedup"] > 0 and r["speedup_best"] > 0 and r["time_s"] > 0
        assert r["peak_mem_mb"] > 0
        assert len(r["times_s"]) == 1
        if r["method"] == "vanilla":
            assert r["rel_err"] == r["cfg_err"] == r["rel_err_peaked"] == 0.0
            assert r["speedup"] == 1.0 and r["mem_vs_vanilla"] == 1.0
            assert r["vanilla_drift"] == 0.0  # remove_patch restored the model exactly
        elif r["family"] == "sd15":  # the patch really changed the output
            assert r["rel_err"] > 0 and r["cfg_err_peaked"] > 0
    prof = result["profile"]
    assert (prof["family"], prof["width"]) == ("sd15", 64)
    assert [p["label"] for p in prof["variants"]] == [r["label"] for r in rows[:len(expected)]]
    for p in prof["variants"]:
        groups = p["groups_ms"]
        assert set(groups) == set(prof["groups"])
        assert groups["self_attention"] > 0 and groups["rest_of_unet"] > 0
        assert sum(groups.values()) == pytest.approx(p["total_ms"])
        assert p["top_ops"] and all(op["self_ms"] >= 0 for op in p["top_ops"])
    assert "time per group" in proc.stdout
    png = (out / "speedup_vs_error.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_entry_points(capsys):
    from tome_core.__main__ import main
    from tome_core.bench.cli import main as console_main  # tome-bench

    assert main([]) == 2 and main(["nope"]) == 2
    with pytest.raises(SystemExit) as exit_:
        console_main(["--help"])
    assert exit_.value.code == 0 and "--tiny" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="families: unknown"):
        console_main(["--families", "sd3"])


@pytest.mark.parametrize("family, expected", [
    # blocks per down level, mid, up level (tiny SDXL: 2 layers per transformer at levels 1-2,
    # where the real one has 2 and 10; the levels with and without attention are the real ones)
    ("sd15", ([2, 2, 2, 0], 1, [0, 3, 3, 3])),
    ("sd2", ([2, 2, 2, 0], 1, [0, 3, 3, 3])),
    ("sdxl", ([0, 4, 4], 2, [6, 6, 0])),
])
def test_tiny_unet_keeps_the_real_level_layout(family, expected):
    unet = build_unet(family, "tiny", seed=0)
    assert _attention_layout(unet) == expected


@pytest.mark.parametrize("family, params", [
    ("sd15", 859_520_964), ("sd2", 865_910_724), ("sdxl", 2_567_463_684)])
def test_full_configs_are_the_published_architectures(family, params):
    diffusers = pytest.importorskip("diffusers")
    with torch.device("meta"):  # shapes only, no memory
        unet = diffusers.UNet2DConditionModel(**unet_config(family, "full"))
    assert sum(p.numel() for p in unet.parameters()) == params
    assert _attention_layout(unet) == (([2, 2, 2, 0], 1, [0, 3, 3, 3]) if family != "sdxl"
                                       else ([0, 4, 20], 10, [30, 6, 0]))


def test_build_unet_is_seeded_and_has_no_zero_layers():
    a, b = build_unet("sd15", "tiny", seed=3), build_unet("sd15", "tiny", seed=3)
    c = build_unet("sd15", "tiny", seed=4)
    pa, pb, pc = (dict(m.named_parameters()) for m in (a, b, c))
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert not torch.equal(pa["conv_out.weight"], pc["conv_out.weight"])
    assert all(p.any() for p in a.parameters() if p.ndim >= 2)
    assert not a.training


def test_peaked_scales_self_attention_qk_only_and_restores():
    plain = build_unet("sd15", "tiny", seed=0)
    peaked = build_unet("sd15", "tiny", seed=0, peaked=3.0)
    p0, p1 = dict(plain.named_parameters()), dict(peaked.named_parameters())
    scaled = {k for k in p0 if ".attn1.to_q." in k or ".attn1.to_k." in k}
    assert scaled
    for k in p0:
        assert torch.equal(p1[k], p0[k] * 3.0 if k in scaled else p0[k]), k
    before = {k: v.clone() for k, v in p0.items()}
    with peaked_attention(plain, 3.0):
        assert all(torch.equal(p0[k], p1[k]) for k in p0)
    assert all(torch.equal(p0[k], before[k]) for k in p0)


def test_make_inputs_shapes_and_cfg_halves():
    unet = build_unet("sdxl", "tiny", seed=0, dtype=torch.bfloat16)
    sample, t, ctx, added = make_inputs(unet, "sdxl", 2, 96, 64, seed=0, dtype=torch.bfloat16)
    assert sample.shape == (2, 4, 12, 8) and sample.dtype == torch.bfloat16
    assert torch.equal(sample[0], sample[1]) and torch.equal(t[0], t[1])  # uncond/cond share x_t
    assert ctx.shape == (2, 77, unet.config.cross_attention_dim)
    assert not torch.equal(ctx[0], ctx[1])
    assert added["time_ids"].shape == (2, 6) and added["text_embeds"].shape == (2, 32)
    with torch.inference_mode():
        out = unet(sample, t, encoder_hidden_states=ctx, added_cond_kwargs=added).sample
    assert out.shape == sample.shape and torch.isfinite(out.float()).all()
    # full SDXL: pooled text embeddings are 1280 wide
    full = type("U", (), {"config": type(unet.config)(**unet_config("sdxl", "full"))})()
    assert make_inputs(full, "sdxl", 1, 64, 64)[3]["text_embeds"].shape == (1, 1280)
    assert make_inputs(unet, "sd15", 3, 64, 64)[3] is None


def test_missing_diffusers_names_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "diffusers", None)
    with pytest.raises(ImportError, match="pip install diffusers"):
        build_unet("sd15", "tiny")


def test_peak_memory_counts_tensor_allocations_during_the_call():
    from tome_core.bench.measure import peak_memory

    kept = torch.ones(1024, 1024)  # live before the call: not counted

    def fn():
        a = torch.ones(1024, 1024)  # 4 MiB
        b = a + kept                # 4 MiB more, both live
        del a
        return b.sum()

    peak, out = peak_memory(fn, torch.device("cpu"))
    assert out.item() == 2 * 1024 * 1024
    assert 8 * 2**20 <= peak < 9 * 2**20


def test_variant_specs_set_ratio_and_cell():
    from tome_core.bench.methods import Variant

    assert Variant.parse("kv", (0.5, 0.75)) == [Variant("kv", 0.5), Variant("kv", 0.75)]
    assert Variant.parse("kv@0.88:3x3", (0.5,)) == [Variant("kv", 0.88, (3, 3))]
    assert Variant.parse("kv@0.88:3x3", (0.5,))[0].label == "kv r=0.88 3x3"
    with pytest.raises(ValueError, match="use SXxSY"):
        Variant.parse("kv@0.5:3", (0.5,))


def test_math_attention_shows_the_memory_saving_of_fewer_tokens():
    """With attention that materialises N x N scores, fewer tokens means a lower peak (the published
    ToMe memory figures); the default (flash) backend never builds the scores."""
    from tome_core.bench.runner import BenchConfig, run_benchmark

    def peaks(attention):
        cfg = BenchConfig(families=("sd15",), resolutions=((256, 256),), scale="tiny", dtype="fp32",
                          methods=("vanilla", "merge", "kv@0.75", "kv-avg@0.75"), repeats=1,
                          attention=attention)
        return {r["label"]: r for r in run_benchmark(cfg, progress_bar=False)["rows"]}

    math_rows, flash_rows = peaks("math"), peaks("default")
    scores_mb = 2 * 1024 * 1024 * 4 / 2**20  # one head's fp32 scores, batch 2, 32x32 latent: 8 MiB
    assert math_rows["vanilla"]["peak_mem_mb"] > scores_mb > flash_rows["vanilla"]["peak_mem_mb"]
    for label in ("merge r=0.5", "kv r=0.75", "kv-avg r=0.75"):
        assert math_rows[label]["mem_vs_vanilla"] < 0.6, (label, math_rows[label])
    with pytest.raises(ValueError, match="attention must be one of default, math"):
        BenchConfig(attention="flash")
