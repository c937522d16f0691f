"""The bench's chart (tome_bench.chart): one panel per family and size, drawn from rows or committed JSONs."""
from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("matplotlib")

from tome_bench.chart import _case, rows_of, write_chart  # noqa: E402
from tome_bench.render_chart import main as render  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
GPU = REPO / "docs" / "results" / "gpu_h100_cacab79.json"


def _row(family, method, ratio, speedup, err, rank="1"):
    label = "vanilla" if method == "vanilla" else f"{method} r={ratio:g}"
    return dict(family=family, width=64, height=64, method=method, ratio=ratio, label=label, speedup=speedup,
                speedup_low=speedup - 0.05, speedup_high=speedup + 0.05, cfg_err_peaked=err, rank=rank)


def test_a_panel_per_family_and_size_and_a_png(tmp_path):
    rows = [_row(f, "vanilla", 0, 1.0, 0.0) for f in ("flux", "wan")]
    rows += [_row(f, m, r, 1 + r, r / 2, rank="1-2 (tied)") for f in ("flux", "wan") for m in ("kv", "merge")
             for r in (0.25, 0.5, 0.75)]
    path = write_chart(rows, tmp_path / "c.png", title="test")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert len({_case(r) for r in rows}) == 2
    assert write_chart([_row("flux", "vanilla", 0, 1.0, None)], tmp_path / "none.png") is None


def test_the_committed_gpu_json_renders(tmp_path):
    result = json.loads(GPU.read_text(encoding="utf-8"))
    assert {_case(r) for r in rows_of(result)} and len({_case(r)[0] for r in rows_of(result)}) == 7
    assert render([str(tmp_path / "gpu.png"), str(GPU)]) == 0 and (tmp_path / "gpu.png").stat().st_size > 10_000
    assert render([str(tmp_path / "x.png")]) == 2
