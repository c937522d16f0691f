"""Each family's ratio at tomesd's quality (``python -m tome_bench.experiments.frontier``) from a tiny CPU run.

The run is the bench's own (tiny widths, 1 block, 64 px): the yardstick (tomesd r=0.5 on the tiny SD1.5) and two
merging families at the four ratios, errors on noise and on the photo. The selection is checked on those real
rows: against a rule written out here, and against yardsticks placed between the rows' own errors."""
from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("diffusers")
pytest.importorskip("tomesd")

from tome_bench.experiments import frontier  # noqa: E402


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny forwards: threads would only wait on each other
    out = tmp_path_factory.mktemp("frontier")
    try:
        assert frontier.main(["--tiny", "--families", "flux,wan", "--modes", "merge,kv", "--quiet", "--no-progress",
                              "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "frontier.json").read_text()), out


def _largest(rows, family, limits, mode="merge"):
    """The rule, written out: the largest ratio of the family's merge rows whose error is at most the limit on every
    content named."""
    fit = [r["ratio"] for r in rows if r["family"] == family and r["method"] == mode
           and all(r[frontier.ERRORS[c]] <= limit for c, limit in limits.items())]
    return max(fit, default=None)


def test_the_run_writes_every_ratio_and_the_yardstick(run):
    result, out = run
    assert result["complete"] and result["device"].startswith("cpu") and (out / "frontier.md").exists()
    assert [(r["family"], r["label"]) for r in result["rows"]] == [
        (f, label) for f in ("flux", "wan") for label in ("vanilla", *(f"merge r={r:g}" for r in frontier.RATIOS),
                                                          *(f"kv r={r:g}" for r in frontier.KV_RATIOS))]
    assert [(e["family"], e["mode"]) for e in result["frontier"]] == [
        ("flux", "merge"), ("flux", "kv"), ("wan", "merge"), ("wan", "kv")]
    yard = result["yardstick"]
    assert yard["source"] == "this run" and yard["what"].startswith("tomesd r=0.5 on sd15 64x64, fp32")
    tomesd = [r for r in result["yardstick_rows"] if r["method"] == "tomesd"][0]
    assert (yard["noise"], yard["photo"]) == (tomesd["cfg_err_peaked"], tomesd["cfg_err_peaked_photo"]) and yard["noise"] > 0
    assert all(r["cfg_err_peaked"] > 0 and r["cfg_err_peaked_photo"] > 0 for r in result["rows"] if r["method"] != "vanilla")


def _g(value):
    return "none" if value is None else f"{value:g}"


def test_the_largest_ratio_at_the_yardstick_on_the_runs_rows(run):
    result, _ = run
    rows, yard = result["rows"], result["yardstick"]
    for entry in result["frontier"]:
        family, mode = entry["family"], entry["mode"]
        assert entry["largest"] == {"noise": _largest(rows, family, {"noise": yard["noise"]}, mode),
                                    "photo": _largest(rows, family, {"photo": yard["photo"]}, mode),
                                    "both": _largest(rows, family, {"noise": yard["noise"], "photo": yard["photo"]},
                                                     mode)}
    # yardsticks placed at each row's own errors: that row's ratio is the largest at most them wherever the errors grow
    # with the ratio, and a yardstick under every row selects none
    for family in ("flux", "wan"):
        merged = sorted((r for r in rows if r["family"] == family and r["method"] == "merge"), key=lambda r: r["ratio"])
        for row in merged:
            limit = {"noise": row["cfg_err_peaked"], "photo": row["cfg_err_peaked_photo"]}
            (entry,) = frontier.frontier(merged, limit)
            assert entry["largest"]["both"] == _largest(merged, family, limit) >= row["ratio"]
            chosen = next(r for r in merged if r["ratio"] == entry["largest"]["both"])
            assert entry["speedup"] == chosen["speedup"] and entry["errors"] == frontier.errors_of(chosen)
        (entry,) = frontier.frontier(merged, {"noise": 0.0, "photo": 0.0})
        assert entry["largest"] == {"noise": None, "photo": None, "both": None} and entry["speedup"] is None


def test_the_tables_and_the_docs_block(run, tmp_path):
    result, out = run
    table = frontier.summary_table(result)
    first = result["frontier"][0]
    assert f"| Flux 64x64, 1+2 | merge | {_g(first['largest']['noise'])} / " in table
    assert "largest r at or under the yardstick" in table and table.count("\n") == 5
    assert frontier.rows_table(result).count("| Wan 64x64x33, 1 | merge ") == len(frontier.RATIOS)
    assert frontier.rows_table(result).count("| Wan 64x64x33, 1 | kv ") == len(frontier.KV_RATIOS)
    doc = tmp_path / "DOC.md"
    doc.write_text("before\n<!-- frontier: old.json -->\nstale\n<!-- /frontier -->\nafter\n")
    frontier.write_docs(out / "frontier.json", [doc], root=out.parent)
    expected = f"before\n<!-- frontier: {out.name}/frontier.json -->\n{table}\n<!-- /frontier -->\nafter\n"
    assert doc.read_text() == expected and frontier.rewrite(expected, out.parent) == expected


def test_a_yardstick_from_an_earlier_run_and_bad_input(run, tmp_path, capsys):
    result, _ = run
    assert frontier.yardstick_from(result["yardstick_rows"], "x.json")["noise"] == result["yardstick"]["noise"]
    with pytest.raises(ValueError, match="no tomesd r=0.5 row of sd15 1024x1024 in x.json"):
        frontier.yardstick_from(result["rows"], "x.json")
    assert frontier.main(["--families", "sd3", "--out", str(tmp_path)]) == 2  # mode merge does not reach SD3
    assert "sd3: choose families from flux" in capsys.readouterr().err
    assert frontier.main(["--modes", "merge,fast", "--out", str(tmp_path)]) == 2
    assert "merge,fast: choose families" in capsys.readouterr().err
    assert frontier.main(["--depth", "released", "--out", str(tmp_path)]) == 2  # full width on the CPU: refused
    assert "needs a GPU" in capsys.readouterr().err and not (tmp_path / "frontier.json").exists()


def _row(method, ratio, noise, photo, speedup, family="z_image"):
    return {"family": family, "width": 64, "height": 64, "frames": None, "blocks": "8", "method": method,
            "ratio": ratio, "cfg_err_peaked": noise, "cfg_err_peaked_photo": photo, "speedup": speedup}


def test_the_default_rule():
    """The fastest setting at or under the yardstick that saves work; else the closest under it, marked; else none."""
    yard = {"noise": 0.2, "photo": 0.2}
    rows = [_row("vanilla", 0.0, 0.0, 0.0, 1.0), _row("merge", 0.1, 0.1, 0.12, 1.05), _row("merge", 0.3, 0.19, 0.2, 1.3),
            _row("merge", 0.5, 0.3, 0.2, 1.6), _row("kv", 0.5, 0.05, 0.04, 1.2), _row("kv", 0.75, 0.08, 0.1, 1.35)]
    assert frontier.default_setting(rows, yard) == {"mode": "kv", "ratio": 0.75, "errors": {"noise": 0.08, "photo": 0.1},
                                                    "speedup": 1.35, "work_speedup": None, "holds_and_saves": True}
    # counted work, where the run has it, decides before the timed speed-up
    counted = [dict(r, work_speedup={0.3: 1.5, 0.75: 1.2}.get(r["ratio"], 1.0)) for r in rows]
    assert frontier.default_setting(counted, yard)["ratio"] == 0.3
    slow = [dict(r, speedup=min(r["speedup"], 1.05)) for r in rows]  # nothing saves work: the closest under it
    chosen = frontier.default_setting(slow, yard)
    assert (chosen["mode"], chosen["ratio"], chosen["holds_and_saves"]) == ("merge", 0.3, False)
    assert frontier.default_setting(rows, {"noise": 0.01, "photo": 0.01}) is None
    entries = frontier.frontier(rows, yard)
    assert [e["mode"] for e in entries] == ["merge", "kv"] and [e["largest"]["both"] for e in entries] == [0.3, 0.75]
    assert all(e["default"] == frontier.default_setting(rows, yard) for e in entries)


def test_errors_only_depths_combine_and_the_quality_summary(run, tmp_path):
    """--errors-only at two depths (no timed rounds: 2 forwards a setting), combined with the timed run, and the
    quality summary written from the combined JSON: each family's deepest run, its default by the rule."""
    result, out = run
    deep = tmp_path / "deep"
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert frontier.main(["--tiny", "--families", "wan", "--modes", "merge,kv", "--errors-only", "--flops", "--blocks", "1,2",
                              "--yardstick", str(out / "frontier.json"), "--quiet", "--no-progress", "--out",
                              str(deep)]) == 0
    finally:
        torch.set_num_threads(threads)
    errors_only = json.loads((deep / "frontier.json").read_text())
    assert {r["blocks"] for r in errors_only["rows"]} == {"1", "2"}
    assert all(r["timing"] == "warm-up" and "cfg_err" not in r and r["cfg_err_peaked_photo"] >= 0
               for r in errors_only["rows"])
    assert errors_only["yardstick"]["noise"] == result["yardstick"]["noise"]
    # the work each setting saves, counted: vanilla's own is 1, merge's grows with the ratio, kv's too
    for blocks in ("1", "2"):
        rows = {(r["method"], r["ratio"]): r for r in errors_only["rows"] if r["blocks"] == blocks}
        assert rows[("vanilla", 0.0)]["work_speedup"] == 1.0 and rows[("vanilla", 0.0)]["flops"] > 0
        merged = [rows[("merge", r)]["work_speedup"] for r in frontier.RATIOS]
        assert all(1.0 < a <= b for a, b in zip(merged, merged[1:]))
        assert 1.0 < rows[("kv", 0.5)]["work_speedup"] <= rows[("kv", 0.75)]["work_speedup"]
    combined = frontier.combine(tmp_path / "all.json", [out / "frontier.json", deep / "frontier.json"])
    assert len(combined["rows"]) == len(result["rows"]) + len(errors_only["rows"]) and len(combined["runs"]) == 2
    summary = frontier.quality_summary(combined, "all.json")
    assert summary["families"]["wan"]["blocks"] == "2"  # the deepest run of Wan
    deepest_wan = [r for r in errors_only["rows"] if r["blocks"] == "2"]
    assert summary["families"]["wan"]["default"] == frontier.default_setting(deepest_wan, combined["yardstick"])
    assert len(summary["families"]["wan"]["settings"]) == len(frontier.RATIOS) + len(frontier.KV_RATIOS)
