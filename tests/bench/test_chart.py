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


def test_the_panels_bars_and_labels(tmp_path, monkeypatch):
    """A panel per family and size; each point's noise band as its bar; vanilla at (0, 1); no two labels overlap."""
    import matplotlib.pyplot as plt
    from matplotlib.container import ErrorbarContainer

    from tome_bench.stats import BUSY

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    rows = [_row(f, "vanilla", 0, 1.0, 0.0) for f in ("flux", "wan", "z_image", "qwen_image", "ltx2")]
    rows += [_row(f, m, r, 1 + r + (m == "merge"), r / 3 + (m == "merge") * 0.01)
             for f in ("flux", "wan", "z_image", "qwen_image", "ltx2")
             for m in ("kv", "merge", "merge-level", "merge-auto", "kv-avg", "tomesd") for r in (0.25, 0.5, 0.75)]
    rows[-1] = dict(rows[-1], rank=BUSY)
    write_chart(rows, tmp_path / "c.png")
    (fig,) = figures
    panels = [ax for ax in fig.axes if ax.get_visible()]
    assert sorted(ax.get_title() for ax in panels) == sorted(
        ["flux 64x64", "wan 64x64", "z_image 64x64", "qwen_image 64x64", "ltx2 64x64 (machine busy)"])
    flux = next(ax for ax in panels if ax.get_title() == "flux 64x64")
    bars = [[tuple(p) for p in c.lines[2][0].get_segments()[0]] for c in flux.containers
            if isinstance(c, ErrorbarContainer)]
    assert any(abs(b[0][0] - 0.25 / 3) < 1e-9 and abs(b[0][1] - 1.2) < 1e-9 and abs(b[1][1] - 1.3) < 1e-9
               for b in bars)  # kv r=0.25: speed-up 1.25, band 1.2..1.3, at its error
    assert any(list(line.get_xdata()) == [0] and list(line.get_ydata()) == [1.0] for line in flux.lines)
    fig.canvas.draw()
    for ax in panels:
        boxes = [t.get_window_extent() for t in ax.texts]
        assert len(boxes) > 5
        assert not any(a.overlaps(b) for i, a in enumerate(boxes) for b in boxes[i + 1:]), ax.get_title()
