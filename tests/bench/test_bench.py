"""The benchmark: the CLI runs end to end on the tiny setting, and the models are the real
architectures. No timing assertions: benchmarks are measured, not tested."""
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tome_bench import methods
from tome_bench.models import build_unet, make_inputs, peaked_attention, unet_config

REPO = Path(__file__).resolve().parents[2]
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
        assert len(r["times_s"]) == 1 and r["rounds"] == 1 and r["compiled"] is False
        assert r["rank"] == "1 round: unranked"  # no noise estimate from one round
        assert r["attention"] == "flash-cpu"  # torch's default SDPA kernel on CPU
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
    # every column printed is explained in the legend below the table
    header = proc.stdout.splitlines()[0]
    for name in ("x vanilla", "x fastest", "err peaked", "mem x", "attention", "rank"):
        assert name in header and f"{name}: " in proc.stdout, name
    assert set(result["metrics"]) >= {"speedup", "speedup_low", "rank", "attention",
                                      "compile_s", "recompiles"}
    md = (out / "results.md").read_text()
    assert md.count("\n| sd15 ") == len(expected) and "- **x vanilla**:" in md
    png = (out / "speedup_vs_error.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_entry_points(capsys):
    from tome_core.__main__ import main
    from tome_bench.cli import main as console_main  # tome-bench

    assert main([]) == 2 and "bench " in capsys.readouterr().err
    assert main(["nope"]) == 2 and "unknown command 'nope'" in capsys.readouterr().err
    assert main(["--help"]) == 0
    help_text = capsys.readouterr().out
    for needle in ("bench", "apply_patch", "remove_patch", "ComfyUI", "Forge"):
        assert needle in help_text, needle
    with pytest.raises(SystemExit) as exit_:
        console_main(["--help"])
    text = capsys.readouterr().out
    assert exit_.value.code == 0
    assert all(flag in text for flag in ("--tiny", "--full", "--compile", "--gpu-suite"))
    assert console_main(["--families", "sd4"]) == 2
    assert "families: unknown" in capsys.readouterr().err


def test_module_help_in_a_subprocess():
    run = lambda *a: subprocess.run([sys.executable, "-m", *a], cwd=REPO, capture_output=True, text=True,
                                    timeout=120)
    assert run("tome_core", "--help").returncode == 0 and "bench" in run("tome_core", "--help").stdout
    bare = run("tome_core")
    assert bare.returncode == 2 and "python -m tome_core bench --help" in bare.stderr
    own = run("tome_bench", "--help")  # the benchmark package's own entry, the same command
    assert own.returncode == 0 and "usage: python -m tome_core bench" in own.stdout


def test_the_runtime_never_imports_the_benchmark():
    """tome_bench is the lab beside the engine: importing the engine and every host's glue loads none of it."""
    code = ("import sys, tome_core, tome_core.adapters.hooks.api, tome_core.adapters.model_patcher.unet, tome_core.adapters.model_patcher.dit, "
            "tome_core.adapters.hooks.dit, tome_webui.runner; "
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'tome_bench'))")
    shown = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert shown.returncode == 0, shown.stderr[-2000:]
    assert shown.stdout.strip() == "[]"


def test_experiments_are_modules_that_run_only_when_asked():
    """The measurements the README cites (tome_bench/experiments): importing one runs nothing."""
    import importlib
    import pkgutil

    import tome_bench.experiments as experiments

    names = sorted(m.name for m in pkgutil.iter_modules(experiments.__path__))
    assert {"fixed_cost", "kv_vs_tomesd_seeds", "ltx2_audio_keys", "ltx2_ffn_merge", "math_attention_memory",
            "matching_reuse"} <= set(names)
    for name in names:
        module = importlib.import_module(f"tome_bench.experiments.{name}")
        assert callable(module.main) and f"python -m tome_bench.experiments.{name}" in module.__doc__
        assert name in experiments.__doc__
    assert not list((REPO / "docs" / "results").glob("*.py"))  # docs/results keeps only results


@pytest.mark.parametrize("args, message", [
    (["--device", "cdua"], "unknown device 'cdua': use --device cpu, --device cuda"),
    (["--dtype", "fp16"], "--dtype fp16 is for CUDA only"),
    (["--device", "cuda"] if not torch.cuda.is_available() else ["--device", "cuda:97"],
     "without CUDA" if not torch.cuda.is_available() else "CUDA device(s) here"),
    (["--repeats", "3", "--max-repeats", "9", "--batch", "0"], "batch must be >= 1"),
    (["--families", "sd15,flux"], "sd15 (UNet) and flux (DiT) need separate runs"),
    (["--families", "flux", "--methods", "vanilla,merge,tomesd"],
     "methods: tomesd not available for DiT families (flux)"),
    (["--families", "sd3", "--frames", "33"], "--frames is for the video families wan, ltx2, not sd3"),
    (["--families", "sdxl", "--blocks", "1"], "--blocks is for DiT families"),
    (["--families", "wan", "--frames", "32"], "frames must be 4k + 1"),
    (["--families", "flux", "--res", "1000"], "DiT sizes must be multiples of 16 px"),
    (["--compile-mode", "max-autotune"], "compile modes must be from default, reduce-overhead"),
])
def test_bad_input_is_one_line_and_exit_2(args, message, capsys):
    """What a user sees: one line naming the fix, exit code 2, no traceback. In process (the module's
    own main, as ``python -m tome_core`` calls it); test_bad_input_in_a_real_process runs one case as a
    user's shell does."""
    from tome_core.__main__ import main

    try:
        code = main(["bench", *args])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2, err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and message in lines[0] and "Traceback" not in err


def test_bad_input_in_a_real_process():
    """The same refusal from ``python -m tome_core bench`` in a subprocess: exit code 2, one line."""
    proc = subprocess.run([sys.executable, "-m", "tome_core", "bench", "--families", "sd15,flux"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "sd15 (UNet) and flux (DiT) need separate runs" in lines[0] and "Traceback" not in proc.stderr


def test_cuda_checks_on_a_cuda_torch(monkeypatch):
    """cuda:N that does not exist and bf16 on a GPU without it (torch.cuda faked: no GPU here)."""
    from tome_bench.device import check_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda: False)
    assert "only 2 CUDA device(s) here (cuda:0..cuda:1)" in check_device("cuda:7", "fp16")
    assert check_device("cuda:1", "fp16") is None and check_device("cuda", "fp32") is None
    assert "use --dtype fp16" in check_device("cuda", "bf16")
    assert "not supported by the benchmark" in check_device("meta", "fp32")


def test_sdpa_kernel_names_from_profiler_events():
    from tome_bench.device import NO_SDPA, kernels_used
    from tome_bench.measure import warm_up

    assert kernels_used(["aten::_scaled_dot_product_flash_attention", "aten::mm"]) == "flash"
    assert kernels_used(["aten::_scaled_dot_product_efficient_attention",
                         "aten::_scaled_dot_product_attention_math"]) == "math+mem-efficient"
    assert kernels_used(["aten::_scaled_dot_product_cudnn_attention"]) == "cudnn"
    assert kernels_used(["aten::bmm", "aten::softmax"]) == NO_SDPA
    # the real dispatch on this machine: torch's default on CPU, and the forced math kernel
    from torch.nn.attention import SDPBackend, sdpa_kernel
    q = torch.randn(2, 4, 64, 16)
    sdpa = lambda: torch.nn.functional.scaled_dot_product_attention(q, q, q)
    assert warm_up(sdpa, torch.device("cpu")).attention == "flash-cpu"
    with sdpa_kernel([SDPBackend.MATH]):
        assert warm_up(sdpa, torch.device("cpu")).attention == "math"


def _ratio(median, half, n=5):
    from tome_bench.stats import Ratio
    return Ratio(median, median - half, median + half, n)


def test_paired_ratios_cancel_load_that_drifts_between_rounds():
    from tome_bench.stats import paired_speedups, ratio_stats

    # the machine gets 3x busier over the run; the method is 1.5x faster in every round
    vanilla = [1.0, 2.0, 3.0, 1.5, 2.5]
    method = [t / 1.5 for t in vanilla]
    r = ratio_stats(paired_speedups(vanilla, method))
    assert r.median == pytest.approx(1.5) and r.half_width == pytest.approx(0, abs=1e-12)
    # unpaired medians would have mixed rounds; the paired band is exact here
    with pytest.raises(ValueError, match="same non-zero number of rounds"):
        paired_speedups([1.0, 2.0], [1.0])


def test_noise_band_narrows_with_rounds_and_uses_the_mad():
    from tome_bench.stats import ratio_stats, t_quantile

    few = ratio_stats([1.2, 1.4, 1.3])
    many = ratio_stats([1.2, 1.4, 1.3] * 4)
    assert few.median == many.median == pytest.approx(1.3)
    # Student-t factor for n - 1 degrees of freedom (was a fixed 2, too narrow for few rounds)
    assert few.half_width == pytest.approx(4.303 * 1.4826 * 0.1 / 3 ** 0.5)
    assert many.half_width == pytest.approx(t_quantile(12) * 1.4826 * 0.1 / 12 ** 0.5)
    one = ratio_stats([1.7])
    assert (one.low, one.high, one.n) == (1.7, 1.7, 1)
    # one outlier round barely moves a median/MAD band
    assert ratio_stats([1.3, 1.31, 1.29, 1.3, 0.4]).low > 1.2


def test_ranking_separated_methods_get_ranks():
    from tome_bench.stats import ranking, unsettled, vanilla_ratio

    ratios = {"vanilla": vanilla_ratio(5), "merge": _ratio(1.4, 0.05), "kv": _ratio(1.7, 0.05),
              "tomesd": _ratio(1.2, 0.05)}
    assert ranking(ratios) == {"kv": "1", "merge": "2", "tomesd": "3", "vanilla": "4"}
    assert unsettled(ratios) == []


def test_band_crossing_one_is_too_noisy_to_rank_against_vanilla():
    from tome_bench.stats import ranking, unsettled, vanilla_ratio

    # overlapping bands share their places (was 'too noisy to rank' beside a numbered rank)
    ratios = {"vanilla": vanilla_ratio(4), "merge": _ratio(1.05, 0.1), "kv": _ratio(1.6, 0.05)}
    assert ranking(ratios) == {"kv": "1", "merge": "2-3 (tied)", "vanilla": "2-3 (tied)"}
    assert sorted(unsettled(ratios)) == ["merge", "vanilla"]


def test_spread_large_against_the_differences_is_too_noisy_and_chains():
    from tome_bench.stats import ranking, unsettled, vanilla_ratio

    # merge and tomesd differ by 0.04 but each band is +-0.1: no order between them; kv's band
    # touches tomesd's, so the tier chains to it; places count methods (was: vanilla "2")
    ratios = {"vanilla": vanilla_ratio(6), "merge": _ratio(1.40, 0.1), "tomesd": _ratio(1.36, 0.1),
              "kv": _ratio(1.20, 0.07), "kv-avg": _ratio(0.5, 0.01)}
    tied = "1-3 (tied)"
    assert ranking(ratios) == {"merge": tied, "tomesd": tied, "kv": tied,
                               "vanilla": "4", "kv-avg": "5"}
    assert sorted(unsettled(ratios)) == ["kv", "merge", "tomesd"]


def test_one_round_is_never_ranked():
    from tome_bench.stats import ONE_ROUND, ranking, summarize

    ratios = summarize({"vanilla": [2.0], "merge": [1.0]})
    assert ratios["merge"].median == 2.0 and set(ranking(ratios).values()) == {ONE_ROUND}


def test_more_rounds_while_rounds_disagree_up_to_the_cap(monkeypatch):
    """The runner's stopping rule on synthetic timings: a clear winner stops at the minimum,
    a method indistinguishable from vanilla runs to the cap and ends 'too noisy to rank'."""
    import contextlib

    from tome_bench import runner
    from tome_bench.methods import Variant

    def fake_run(times: dict[str, list[float]]):
        current = []

        @contextlib.contextmanager
        def patched(unet, variant, **options):
            current.append(variant.method)
            yield unet

        def steady(fn, device, clock=None):  # the next synthetic time of the patched variant
            return runner.measure.timing.Timing(times[current[-1]].pop(0), torch.zeros(2, 4, 1, 1))

        w = runner.measure.WarmUp(torch.zeros(2, 4, 1, 1), 1.0, "flash-cpu", 0.01)
        monkeypatch.setattr(runner, "patched", patched)
        monkeypatch.setattr(runner.measure, "steady", steady)
        monkeypatch.setattr(runner.measure, "warm_up", lambda fn, device: w)
        variants = [Variant("vanilla"), Variant("kv", 0.5)]
        cfg = runner.BenchConfig(repeats=2, max_repeats=5, scale="tiny", peaked=1.0,
                                 methods=("vanilla", "kv"))
        clock = runner.Clock(cfg, 2, lambda _: None)
        m = runner._measure(torch.nn.Identity(), None, variants, cfg, lambda _: None, clock)
        ratios = runner.stats.summarize({v: m.times[v] for v in variants}, vanilla=variants[0])
        return m.times[variants[0]], runner.stats.ranking(ratios)[variants[1]]

    # first vanilla time: the run after the warm-up (drift check), not a round
    clear, rank = fake_run({"vanilla": [0.1, 1.0, 2.0, 1.0, 1.0, 1.0, 1.0],
                            "kv": [0.5, 1.0, 0.5, 0.5, 0.5]})
    assert len(clear) == 2 and rank == "1"  # settled at the minimum, load doubling cancels
    noisy, rank = fake_run({"vanilla": [0.1] + [1.0] * 5, "kv": [0.8, 1.2, 1.0, 0.7, 1.3]})
    assert len(noisy) == 5 and rank == "too noisy to rank"  # ran to the cap
    # disagreeing rounds, then agreeing ones: stops as soon as the bands separate (the band's
    # Student-t factor for few rounds needs less disagreement than before: ratios 1.43, 1.33, 2)
    settles, rank = fake_run({"vanilla": [0.1] + [1.0] * 5,
                              "kv": [0.7, 0.75, 0.5, 0.5, 0.5]})
    assert 2 < len(settles) < 5 and rank == "1"


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
    from tome_bench.measure import peak_memory

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
    from tome_bench.methods import Variant

    assert Variant.parse("kv", (0.5, 0.75)) == [Variant("kv", 0.5), Variant("kv", 0.75)]
    assert Variant.parse("kv@0.88:3x3", (0.5,)) == [Variant("kv", 0.88, (3, 3))]
    assert Variant.parse("kv@0.88:3x3", (0.5,))[0].label == "kv r=0.88 3x3"
    with pytest.raises(ValueError, match="use SXxSY"):
        Variant.parse("kv@0.5:3", (0.5,))
    assert Variant.parse("kv@0.75+b0.34", (0.5,)) == [Variant("kv", 0.75, None, (0.34, 1.0))]
    assert Variant.parse("kv@0.75+b0.34", (0.5,))[0].label == "kv r=0.75 b0.34-1"
    assert Variant.parse("kv@0.5:3x3+b0.2-0.8", (0.5,)) == [Variant("kv", 0.5, (3, 3), (0.2, 0.8))]
    assert Variant.parse("kv@0.5+b0", (0.5,))[0].label == "kv r=0.5 b0-1"
    with pytest.raises(ValueError, match=r"use \+bSTART or \+bSTART-END"):
        Variant.parse("kv@0.5+bx", (0.5,))


def test_math_attention_shows_the_memory_saving_of_fewer_tokens():
    """With attention that materialises N x N scores, fewer tokens means a lower peak (the published
    ToMe memory figures); the default (flash) backend never builds the scores."""
    from tome_bench.runner import BenchConfig, run_benchmark

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


def test_compile_a_patched_tiny_unet():
    """--compile's path for one method: kv patched, then torch.compile(unet) (inductor) on the
    tiny SD1.5 at 64 px, fp32. One variant only: inductor's C++ compilation of even the tiny UNet
    took ~13 min for one variant on the 2 shared, busy cores where this was written."""
    pytest.importorskip("diffusers")
    from tome_bench import measure
    from tome_bench.methods import Variant, patched
    from tome_bench.runner import BenchConfig, _compile_variant, case_inputs

    cfg = BenchConfig(families=("sd15",), resolutions=((64, 64),), scale="tiny", dtype="fp32",
                      methods=("vanilla", "kv"), repeats=2, compile=True)
    unet = build_unet("sd15", "tiny", seed=0)
    inputs = case_inputs(unet, "sd15", (64, 64), cfg)
    kv = Variant("kv", 0.5)
    with patched(unet, kv, **cfg.patch_options()):
        eager = measure.forward(unet, inputs)
    plain = measure.forward(unet, inputs)
    c = _compile_variant(unet, inputs, kv, cfg)
    assert "error" not in c, c.get("error")
    assert c["first_s"] > 0 and len(c["times"]) == 2 and all(t > 0 for t in c["times"])
    assert c["recompiles"] == 0  # the timed calls reuse the first call's graphs
    assert measure.rel_l2(c["out"], eager) < 1e-4  # compiled kv == eager kv
    assert measure.rel_l2(c["out"], plain) > 1e-3  # and the patch really was compiled in
    assert torch.equal(measure.forward(unet, inputs), plain)  # patch removed afterwards


def test_table_with_compiled_rows_and_a_compile_failure():
    from tome_bench.report import format_markdown, format_table

    base = dict(family="sd15", width=512, height=512, method="kv", ratio=0.5, label="kv r=0.5")
    rows = [dict(base, compiled=False, time_s=1.0, speedup=1.5, speedup_low=1.4,
                 speedup_high=1.6, rank="1", attention="flash"),
            dict(base, compiled=True, time_s=0.5, speedup=1.4, speedup_vs_eager=3.0,
                 compile_s=42.0, attention="inductor"),
            dict(base, label="tomesd r=0.5", method="tomesd", compiled=True,
                 attention="inductor", compile_error="Unsupported: boom")]
    table = format_table(rows)
    head = table.splitlines()[0]
    assert all(h in head for h in ("run", "x eager van", "compile s", "+-", "attention"))
    assert "compile failed" in table and "tomesd r=0.5: Unsupported: boom" in table
    assert "compile s: compiled rows: seconds of the first" in table
    assert "| compiled |" in format_markdown(rows) and "`Unsupported: boom`" in format_markdown(rows)


def test_op_counts_show_what_each_patch_adds_along_the_gpus_code_path():
    """--ops: the ATen ops and gathered/scattered MiB each patch adds to one forward, counted along the
    GPU's matching (every token scored) on any device, and the step's first forward counted apart."""
    from tome_core.engine import merge
    from tome_bench.runner import BenchConfig, run_benchmark

    cfg = BenchConfig(families=("sd15",), resolutions=((64, 64),), scale="tiny", dtype="fp32", repeats=1,
                      methods=("vanilla", "merge", "merge-level", "kv"), peaked=1.0, ops=True)
    rows = {r["label"]: r for r in run_benchmark(cfg, progress_bar=False)["rows"]}
    vanilla, block, level, kv = (rows[k] for k in ("vanilla", "merge r=0.5", "merge-level r=0.5", "kv r=0.5"))
    assert vanilla["aten_ops_added"] == 0 and vanilla["moved_mib"] == 0 and vanilla["aten_ops"] > 500
    assert 0 < kv["aten_ops_added"] < level["aten_ops_added"] < block["aten_ops_added"]
    assert 0 < level["moved_mib_added"] < block["moved_mib_added"]
    # the tiny SD1.5 has 5 blocks on level 1: block matching runs 5 matchings, level matching 1
    assert block["ops_added_by_name"]["topk"] == 5 and level["ops_added_by_name"]["topk"] == 1
    assert "index_copy_" not in block["ops_added_by_name"]  # the GPU's path: no source gather
    assert block["step_table_ops"] > 0 and kv["step_table_ops"] > 0
    assert merge.GATHER_SOURCES_ON == ("cpu",)  # restored after counting


def test_presets_and_gpu_suite_configs():
    from tome_bench.cli import _configs, build_parser

    def configs(*argv):
        return _configs(build_parser().parse_args(list(argv)))

    (default,) = configs()
    assert (default.families, default.resolutions, default.repeats, default.max_repeats,
            default.budget_s, default.compile) == (("sd15",), ((512, 512),), 2, 5, 170.0, False)
    (full,) = configs("--full")
    assert full.resolutions == ((512, 512), (768, 768)) and (full.repeats, full.budget_s) == (3, None)
    # the GPU plan, built here on CPU (device/dtype given, so the CUDA check passes)
    suite = configs("--gpu-suite", "--device", "cpu", "--dtype", "bf16")
    assert [(c.families, c.resolutions, c.compile, c.compile_modes, c.trace) for c in suite] == [
        (("sd15",), ((512, 512),), False, ("default",), True),
        (("sd15",), ((1024, 1024), (2048, 2048)), False, ("default",), True),
        (("sdxl",), ((1024, 1024), (2048, 2048)), False, ("default",), True),
        (("sd15",), ((1024, 1024),), True, ("default", "reduce-overhead"), False),
        (("sdxl",), ((1024, 1024),), True, ("default", "reduce-overhead"), False)]
    assert all((c.repeats, c.max_repeats, c.batch) == (3, 6, 2) for c in suite)
    assert "merge-auto" in suite[0].methods and "merge-reuse" in suite[0].methods  # the hosts' default; reuse
    assert suite[3].methods == ("vanilla", "merge-level", "kv@0.75")
    assert all(c.trace_dir.endswith("traces") for c in suite[:3])
    assert [c.families for c in configs("--gpu-suite", "--families", "sdxl", "--device", "cpu",
                                        "--dtype", "bf16")] == [("sdxl",), ("sdxl",)]
    assert [c.compile for c in configs("--gpu-suite", "unet", "--device", "cpu", "--dtype", "bf16")] == [False] * 3
    assert [c.compile for c in configs("--gpu-suite", "compile", "--device", "cpu", "--dtype", "bf16")] == [True] * 2
    from tome_bench.cli import _profiled
    assert _profiled(build_parser().parse_args(["--gpu-suite"])) == [True, True, True, False, False]
    (graphs,) = configs("--compile-mode", "default,reduce-overhead")
    assert graphs.compile and graphs.compile_modes == ("default", "reduce-overhead")


def test_clock_estimates_from_measured_forwards():
    from tome_bench.methods import Variant
    from tome_bench.runner import BenchConfig, Clock

    cfg = BenchConfig(resolutions=((512, 512), (1024, 1024)), repeats=2, max_repeats=4)
    clock = Clock(cfg, 2, lambda _: None)
    clock.warmed({Variant("vanilla"): 3.0, Variant("kv", 0.5): 1.0})  # one round: 4 s
    low, high, rough = clock.estimate()
    # this case: 2 rounds of 4 s (4 more if rounds disagree); the 1024 case: 4x the pixels,
    # 2 x (1 + 2) + 1 forwards of 2 s on average
    assert rough and low == pytest.approx(8 + 4 * 7 * 2) and high == pytest.approx(low + 8 + 4 * 8)
    clock.round_done(5.0)
    assert clock.estimate()[0] == pytest.approx(5 + 4 * 7 * 2.5)


@pytest.mark.parametrize("mode", ["kv", "merge", "merge-level"])
def test_compiled_patched_unet_over_a_sampling_loop(mode):
    """torch.compile(unet) after apply_patch, 12 steps with a new timestep each (the per-step random
    partitions/picks change): each step equals the eager patched UNet within 1e-4 relative L2 (fp32,
    inductor on CPU), the whole UNet is one graph as unpatched (no graph break inside it: the step
    read and the seeded tables run once per call in the UNet's pre-hook, outside the graph), and no
    graph is compiled after the first call."""
    pytest.importorskip("diffusers")
    import dataclasses

    import torch._dynamo

    from tome_bench import measure
    from tome_bench.methods import Variant, patched
    from tome_bench.runner import BenchConfig, case_inputs

    cfg = BenchConfig(families=("sd15",), resolutions=((64, 64),), scale="tiny", dtype="fp32",
                      methods=("vanilla", mode), repeats=1, compile=True)
    unet = build_unet("sd15", "tiny", seed=0)
    inputs = case_inputs(unet, "sd15", (64, 64), cfg)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    graphs = torch._dynamo.utils.counters["stats"]  # after clear(): counters is a defaultdict, clear() detaches
    counts, errors = [], []
    try:
        with patched(unet, Variant(mode, 0.5), **cfg.patch_options()):
            compiled = torch.compile(unet)
            for t in (999, 950, 800, 700, 500, 400, 300, 200, 100, 50, 10, 1):
                step = dataclasses.replace(inputs, timestep=torch.full_like(inputs.timestep, t))
                out = measure.forward(compiled, step)
                counts.append(graphs["unique_graphs"])
                errors.append(measure.rel_l2(out, measure.forward(unet, step)))
    finally:
        torch._dynamo.reset()
    assert max(errors) < 1e-4, errors
    assert counts == [1] * len(counts), counts  # one graph, compiled once
    assert not torch._dynamo.utils.counters["graph_break"]


# --- DiT families (flux, sd3, wan): vanilla vs mode kv ---------------------------------------------

def test_dit_families_and_options_parse():
    from tome_bench.cli import _configs, build_parser

    def config(*argv):
        (cfg,) = _configs(build_parser().parse_args(list(argv)))
        return cfg

    cfg = config("--families", "flux,sd3,wan")
    assert cfg.dit and cfg.methods == ("vanilla", "kv") and set(cfg.skipped) == {"merge", "tomesd"}
    assert [cfg.sizes_for(f) for f in cfg.families] == [((1024, 1024),), ((1024, 1024),), ((832, 480),)]
    assert [cfg.batch_for(f) for f in cfg.families] == [1, 2, 2]  # Flux is guidance-distilled
    assert (cfg.blocks, cfg.frames, cfg.scale, cfg.ratios) == (2, 33, "full", (0.5,))
    cfg = config("--families", "wan", "--frames", "81", "--blocks", "1", "--res", "832x480,480",
                 "--batch", "1", "--ratios", "0.5,0.75", "--methods", "vanilla,kv")
    assert (cfg.frames, cfg.blocks, cfg.batch_for("wan"), cfg.ratios) == (81, 1, 1, (0.5, 0.75))
    assert cfg.sizes_for("wan") == ((832, 480), (480, 480)) and not cfg.skipped
    assert [v.label for v in cfg.resolve()] == ["vanilla", "kv r=0.5", "kv r=0.75"]
    tiny = config("--tiny", "--families", "flux")
    assert (tiny.scale, tiny.resolutions, tiny.blocks) == ("tiny", ((64, 64),), 1)
    unet = config()  # UNet runs are unchanged
    assert not unet.dit and unet.batch == 2 and unet.methods == methods.DEFAULT_METHODS


def test_dit_full_configs_and_token_counts():
    """The released widths (no model built: a full-width block is too slow for a test) and the tokens
    the issue's sizes give: Flux 1024/2048 -> 4096/16384 + 512, Wan 832x480x33f -> 14040 + 512."""
    from tome_bench.dit_models import dit_config, token_counts

    assert dit_config("flux", 1)[1]["num_attention_heads"] * dit_config("flux", 1)[1]["attention_head_dim"] == 3072
    assert (dit_config("flux", 3)[1]["num_layers"], dit_config("flux", 3)[1]["num_single_layers"]) == (3, 6)
    assert dit_config("sd3", 2)[1]["num_attention_heads"] * dit_config("sd3", 2)[1]["attention_head_dim"] == 1536
    assert dit_config("wan", 2)[1]["ffn_dim"] == 8960
    assert token_counts("flux", 1024, 1024) == (4096, 512)
    assert token_counts("flux", 2048, 2048) == (16384, 512)
    assert token_counts("sd3", 1024, 1024) == (4096, 333)
    assert token_counts("wan", 480, 832, frames=33) == (9 * 30 * 52, 512)


def _logit_spread(model, inputs):
    """Std of the attention logits of the first self/joint attention call (all keys, 64 queries)."""
    import torch.nn.functional as F
    from torch.overrides import TorchFunctionMode

    from tome_bench.dit_models import forward

    class Spy(TorchFunctionMode):
        std = None

        def __torch_function__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func is F.scaled_dot_product_attention and self.std is None:
                bound = dict(zip(("query", "key"), args), **kwargs)
                q, k = bound["query"].float(), bound["key"].float()
                self.std = (q[..., :64, :] @ k.transpose(-1, -2) / q.shape[-1] ** 0.5).std().item()
            return func(*args, **kwargs)

    with Spy() as spy:
        out = forward(model, inputs)
    return spy.std, out


@pytest.mark.parametrize("family", ["flux", "sd3", "wan"])
def test_dit_peaked_scales_the_qk_norms_and_restores(family):
    """All three families RMS-normalise q and k after their projections, so scaling the projections
    would change nothing: peaked scales the q/k norm weights. Unpeaked logits spread as in the UNet
    bench's seeded UNets (std ~0.33), peaked 3 by 9x; the weights come back bit-identical."""
    pytest.importorskip("diffusers")
    from tome_bench.dit_models import build_dit, make_dit_inputs, peaked_attention

    model = build_dit(family, 1, seed=0, scale="tiny")
    inputs = make_dit_inputs(model, family, 2, 128, 128, frames=5, text_tokens=16)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    plain, out = _logit_spread(model, inputs)
    with peaked_attention(model, 3.0):
        peaked, out_peaked = _logit_spread(model, inputs)
    assert 0.2 < plain < 0.5 and peaked == pytest.approx(9 * plain, rel=0.05), (plain, peaked)
    assert not torch.equal(out, out_peaked)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert torch.equal(_logit_spread(model, inputs)[1], out)


def test_dit_tiny_run_end_to_end(tmp_path):
    """The DiT path of the CLI on tiny-width models (the full width takes minutes): rows for vanilla
    and kv at two ratios, two interleaved rounds, token counts, attention share and its ceiling."""
    pytest.importorskip("diffusers")
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "tome_core", "bench", "--tiny", "--families", "flux,sd3,wan",
         "--frames", "9", "--ratios", "0.5,0.75", "--repeats", "2", "--no-progress", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "skipped merge:" in proc.stderr and "skipped tomesd:" in proc.stderr
    header = proc.stdout.splitlines()[0]
    for name in ("tokens", "blocks", "attn %", "ceiling", "err peaked", "cfg err peaked"):
        assert name in header and f"{name}: " in proc.stdout, name
    result = json.loads((out / "results.json").read_text())
    assert result["complete"] and result["config"]["blocks"] == 1 and result["config"]["frames"] == 9
    rows = result["rows"]
    assert [(r["family"], r["label"]) for r in rows] == [
        (f, m) for f in ("flux", "sd3", "wan") for m in ("vanilla", "kv r=0.5", "kv r=0.75")]
    tokens = {"flux": (16, 512, 1, "1+2", "distilled"), "sd3": (16, 333, 2, "1", "cfg"),
              "wan": (3 * 16, 512, 2, "1", "cfg")}  # 9 frames: 3 latent frames of 4x4 patches
    for r in rows:
        assert (r["image_tokens"], r["text_tokens"], r["batch"], r["blocks"], r["guided"]) == tokens[r["family"]]
        assert r["rounds"] == 2 and len(r["times_s"]) == 2 and r["scale"] == "tiny"
        assert math.isfinite(r["speedup"]) and r["speedup"] > 0 and r["speedup_low"] <= r["speedup_high"]
        assert 0 < r["attn_share"] < 1 and r["speedup_ceiling"] == pytest.approx(1 / (1 - r["attn_share"]))
        errors = [r[k] for k in ("rel_err", "cfg_err", "rel_err_peaked", "cfg_err_peaked")]
        if r["method"] == "vanilla":
            assert errors == [0.0] * 4 and r["speedup"] == 1.0 and r["vanilla_drift"] == 0.0
        else:
            assert all(math.isfinite(e) and e > 0 for e in errors), (r["label"], errors)
        if r["family"] == "flux":  # guidance-distilled: the guided error is the output's
            assert r["cfg_err"] == r["rel_err"]
        if r["family"] == "wan":
            assert r["frames"] == 9 and r["latent"] == "3x8x8" and "64x64x9f" in proc.stdout
    md = (out / "results.md").read_text()
    assert md.count("\n| flux ") == 3 and "- **ceiling**:" in md


def test_dit_bench_variant_with_a_block_range_reduces_only_those_blocks(tmp_path):
    """kv@R+bSTART in the DiT bench: the variant patches only its blocks (a tiny Flux, 1 double + 2 single
    blocks). +b0 is every block; plain kv is Flux's default range, its single blocks, the same as +b0.34."""
    pytest.importorskip("diffusers")
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "tome_core", "bench", "--tiny", "--families", "flux", "--methods",
         "vanilla,kv@0.75+b0,kv@0.75,kv@0.75+b0.34", "--repeats", "1", "--no-progress", "--out", str(out)],
        cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {r["label"]: r for r in json.loads((out / "results.json").read_text())["rows"]}
    assert list(rows) == ["vanilla", "kv r=0.75 b0-1", "kv r=0.75", "kv r=0.75 b0.34-1"]
    every, default, singles = rows["kv r=0.75 b0-1"], rows["kv r=0.75"], rows["kv r=0.75 b0.34-1"]
    assert 0 < singles["rel_err_peaked"] and singles["rel_err_peaked"] != every["rel_err_peaked"]
    assert default["rel_err_peaked"] == singles["rel_err_peaked"]


def test_dit_block_ranges_report_the_error_of_exactly_the_blocks_reduced():
    """tome_bench.dit_blocks on a tiny Flux (2 double + 4 single blocks): each range reduces the
    blocks whose centre it holds, a reduced range has a non-zero error, all blocks the largest error."""
    pytest.importorskip("diffusers")
    from tome_bench.dit_blocks import format_rows, range_errors

    rows = range_errors("flux", 2, ratio=0.75, peaked=3.0, dtype=torch.float32, scale="tiny", size=(64, 64, 1))
    reduced = {(row["block_start"], row["block_end"]): row["blocks_reduced"] for row in rows}
    assert reduced == {(0.0, 1.0): 6, (0.0, 0.5): 3, (0.5, 1.0): 3, (0.0, 0.333): 2, (0.333, 0.667): 2,
                       (0.667, 1.0): 2}
    errors = {(row["block_start"], row["block_end"]): row["err_peaked"] for row in rows}
    assert all(error > 0 for error in errors.values())
    assert errors[(0.0, 1.0)] == max(errors.values())
    assert "0.00-0.50    3 of 6" in format_rows(rows)


@pytest.mark.parametrize("argv, message", [
    (["--ranges", "0.3"], "--ranges takes START-END pairs"),
    (["--size", "1024"], "--size takes HxW or HxWxFRAMES"),
    (["--families", "pixart"], "families must be among flux, sd3, wan"),
])
def test_dit_blocks_cli_refuses_bad_arguments_with_one_line(capsys, argv, message):
    from tome_bench.dit_blocks import main

    assert main(argv) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("mode", ["default", "reduce-overhead"])
def test_compile_a_patched_tiny_dit_in_mode_merge(mode):
    """--compile on a DiT: merge patched, then torch.compile (inductor) on the tiny diffusers Flux at 64 px; equal to
    eager merge, and no graph compiled during the timed calls (the per-call rotary cut was keyed by the table's id,
    a guard that failed at every call). Mode reduce-overhead takes the same path (on the CPU without CUDA graphs,
    which only a GPU captures: what the CPU can check of them is in tests/adapters/test_cuda_graph_rules.py)."""
    pytest.importorskip("diffusers")
    from tome_bench import dit_models, measure
    from tome_bench.methods import Variant, patched
    from tome_bench.runner import BenchConfig, _compile_variant

    cfg = BenchConfig(families=("flux",), resolutions=((64, 64),), scale="tiny", dtype="fp32",
                      methods=("vanilla", "merge"), repeats=2, compile=True, blocks=1)
    model = dit_models.build_dit("flux", 1, scale="tiny")
    inputs = dit_models.make_dit_inputs(model, "flux", 1, 64, 64)
    forward = lambda m, i: dit_models.forward(m, i).float()  # noqa: E731 - the DiT case's forward
    merge = Variant("merge", 0.5)
    with patched(model, merge, **cfg.patch_options()):
        eager = forward(model, inputs)
    plain = forward(model, inputs)
    c = _compile_variant(model, inputs, merge, cfg, forward, mode)
    assert "error" not in c, c.get("error")
    assert c["recompiles"] == 0 and len(c["times"]) == 2 and c["first_s"] > 0 and c["graphs"] >= 1
    assert measure.rel_l2(c["out"], eager) < 1e-4 and measure.rel_l2(c["out"], plain) > 1e-3
    assert torch.equal(forward(model, inputs), plain)  # patch removed afterwards
