"""``python -m tome_core bench --context-parallel ulysses:N``: the DiT rows under diffusers' context parallelism, N
processes (torchrun, gloo on the CPU), vanilla-CP against ToMe-CP with the all-to-all bytes beside; bad input refused
before any process starts."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("diffusers")

from tome_bench import cli  # noqa: E402


@pytest.mark.parametrize("argv, message", [
    (["--context-parallel", "ring:2", "--methods", "vanilla,kv"], "ToMe refuses mode kv under Ring attention"),
    (["--context-parallel", "ulysses:1"], "use ulysses:N or ring:N with N >= 2"),
    (["--context-parallel", "ulysses"], "use ulysses:N or ring:N with N >= 2"),
    (["--context-parallel", "ulysses:2", "--families", "sd15"], "sd15 not measured under context parallelism"),
    (["--context-parallel", "ulysses:2", "--methods", "vanilla,tomesd"], "ToMe-CP runs modes kv and merge"),
    (["--context-parallel", "ulysses:2", "--res", "256x128"], "square sizes only"),
    (["--context-parallel", "ulysses:4"], "model has 2 attention heads"),
    (["--context-parallel", "ulysses:2", "--res", "272"], "sides 272 px: their token rows (side / 16) do not split"),
])
def test_bad_settings_are_refused_before_any_process_starts(argv, message, capsys, tmp_path):
    assert cli.main([*argv, "--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err and not list(tmp_path.iterdir())


def test_ring_needs_a_gpu_and_says_so(capsys, tmp_path, monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.main(["--context-parallel", "ring:2", "--out", str(tmp_path)]) == 2
    assert "diffusers has for CUDA only; on the CPU use ulysses:N" in capsys.readouterr().err


def test_two_processes_measure_vanilla_cp_against_tome_cp(tmp_path):
    """A real two-process run (Wan, one size, one round): ToMe-CP changes the output a little in both modes; kv moves
    the same all-to-all bytes (it cuts after the all-to-all), merge fewer (fewer tokens on each process); every side
    is timed."""
    assert cli.main(["--context-parallel", "ulysses:2", "--families", "wan", "--res", "128", "--repeats", "1",
                     "--out", str(tmp_path)]) == 0
    result = json.loads((tmp_path / "context_parallel_cpu.json").read_text())
    assert result["processes"] == 2 and result["backend"] == "gloo" and result["attention"] == "ulysses"
    (row,) = result["families"].values()
    assert all(row["median_s"][side] > 0 for side in ("vanilla", "kv", "merge"))
    assert all(0 < row["tome_vs_vanilla_rel"][mode] < 0.5 for mode in ("kv", "merge"))
    bytes_ = row["all_to_all_bytes_per_forward"]
    assert bytes_["vanilla"] == bytes_["kv"] > bytes_["merge"] > 0
