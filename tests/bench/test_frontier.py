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
        assert frontier.main(["--tiny", "--families", "flux,wan", "--quiet", "--no-progress", "--out", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    return json.loads((out / "frontier.json").read_text()), out


def _largest(rows, family, limits):
    """The rule, written out: the largest ratio of the family's merge rows whose error is at most the limit on every
    content named."""
    fit = [r["ratio"] for r in rows if r["family"] == family and r["method"] == "merge"
           and all(r[frontier.ERRORS[c]] <= limit for c, limit in limits.items())]
    return max(fit, default=None)


def test_the_run_writes_every_ratio_and_the_yardstick(run):
    result, out = run
    assert result["complete"] and result["device"].startswith("cpu") and (out / "frontier.md").exists()
    assert [(r["family"], r["label"]) for r in result["rows"]] == [
        (f, label) for f in ("flux", "wan") for label in ("vanilla", *(f"merge r={r:g}" for r in frontier.RATIOS))]
    yard = result["yardstick"]
    assert yard["source"] == "this run" and yard["what"].startswith("tomesd r=0.5 on sd15 64x64, fp32")
    tomesd = [r for r in result["yardstick_rows"] if r["method"] == "tomesd"][0]
    assert (yard["noise"], yard["photo"]) == (tomesd["cfg_err_peaked"], tomesd["cfg_err_peaked_photo"]) and yard["noise"] > 0
    assert all(r["cfg_err_peaked"] > 0 and r["cfg_err_peaked_photo"] > 0 for r in result["rows"] if r["method"] != "vanilla")


def test_the_largest_ratio_at_the_yardstick_on_the_runs_rows(run):
    result, _ = run
    rows, yard = result["rows"], result["yardstick"]
    for entry in result["frontier"]:
        family = entry["family"]
        assert entry["largest"] == {"noise": _largest(rows, family, {"noise": yard["noise"]}),
                                    "photo": _largest(rows, family, {"photo": yard["photo"]}),
                                    "both": _largest(rows, family, {"noise": yard["noise"], "photo": yard["photo"]})}
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
    assert f"| Flux 64x64, 1+2 | {first['largest']['noise']:g} / " in table
    assert "largest r at or under the yardstick" in table and table.count("\n") == 3
    assert frontier.rows_table(result).count("| Wan 64x64x33 |") == len(frontier.RATIOS)
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
    assert frontier.main(["--families", "sd3", "--out", str(tmp_path)]) == 2
    assert "sd3: not a merging family" in capsys.readouterr().err
    assert frontier.main(["--depth", "released", "--out", str(tmp_path)]) == 2  # full width on the CPU: refused
    assert "needs a GPU" in capsys.readouterr().err and not (tmp_path / "frontier.json").exists()
