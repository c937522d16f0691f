"""The docs' result tables, written from the JSON they cite: ``python -m tome_bench.doc_tables README.md docs/*.md``.

A table in a Markdown file between ``<!-- results: A.json [B.json ...] -->`` and ``<!-- /results -->`` is rewritten
from those JSONs (paths from the repository root): its header names the columns (``vanilla ms``, ``vanilla GPU ms``,
or a method label as the bench writes it, e.g. ``kv r=0.75``), its first column the cases (``sd15 1024x1024``,
``wan 832x480 x 33 frames``); each method cell is ``speed-up× (cfg err peaked)`` of the eager row of that case and
label, and where the row was traced on a GPU ``wall speed-up× / GPU-time speed-up× (cfg err peaked)``, the GPU time's
ratio taken from the row (``gpu_speedup``) or, in a JSON written before rows carried it, from the trace summaries of
the row and of vanilla in the same run (``trace_summary.versus_vanilla``); `` !`` follows a cell whose steady forward
made more host syncs or uploads than vanilla's. ``--check`` only reports the tables that differ from their JSON
(tests/test_docs.py runs it).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from .chart import _case, _case_title, one_per_case, runs_of
from .trace_summary import versus_vanilla

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: ([^>]*?) -->\n)(.*?)(<!-- /results -->)", re.S)


def _with_gpu_time(run: list[dict]) -> list[dict]:
    """The eager rows of one run, each traced one with its GPU time against vanilla's of the same case and run."""
    vanilla = {_case(r): r for r in run if r["label"] == "vanilla" and not r.get("compiled")}
    out = []
    for row in run:
        base = vanilla.get(_case(row))
        if row.get("compiled"):
            continue
        if "gpu_speedup" not in row and row.get("trace") and base is not None and base.get("trace"):
            row = dict(row, **versus_vanilla(row["trace"], base["trace"]))
        out.append(row)
    return out


def load(paths: list[str]) -> dict[tuple[str, str], dict]:
    """(case title, label) -> the eager row, over the JSONs and their runs in order: the first one holding a case
    wins, except that a row with a GPU time wins over one without (a run's untraced repeat of a traced case)."""
    rows = [row for path in paths for run in runs_of(json.loads((REPO / path).read_text(encoding="utf-8")))
            for row in _with_gpu_time(run)]
    return {(_case_title(_case(row)), row["label"]): row for row in one_per_case(rows)}


def cell(rows: dict[tuple[str, str], dict], case: str, column: str) -> str:
    """One cell: vanilla's ms or GPU ms, or a method's ``1.14× (0.274)``, traced ``1.11× / 1.32× (0.274)`` (wall /
    GPU time), `` !`` where it waits on the host more than vanilla; empty where the JSON has no such row."""
    if column in ("vanilla ms", "vanilla GPU ms"):
        row = rows.get((case, "vanilla"))
        value = None if row is None else (row["time_s"] * 1000 if column == "vanilla ms" else row.get("gpu_ms"))
        return "" if value is None else f"{value:.{0 if column == 'vanilla ms' else 1}f}"
    row = rows.get((case, column))
    if row is None or row.get("speedup") is None:
        return ""
    err = row.get("cfg_err_peaked")
    gpu = row.get("gpu_speedup")
    return (f"{row['speedup']:.2f}×" + ("" if gpu is None else f" / {gpu:.2f}×") + ("" if err is None else f" ({err:.3f})")
            + (" !" if row.get("syncs_over_vanilla") else ""))


def _cells(line: str) -> list[str]:
    return [c.strip() for c in line.strip().strip("|").split("|")]


def render(paths: list[str], body: str) -> str:
    """The table ``body`` (header, rule, rows) with every figure written again from ``paths``."""
    lines = [line for line in body.splitlines() if line.strip()]
    header, rule, cases = _cells(lines[0]), lines[1], [_cells(line)[0] for line in lines[2:]]
    rows = load(paths)
    out = [lines[0], rule]
    for case in cases:
        if not any(key[0] == case for key in rows):
            raise ValueError(f"no row of {case!r} in {', '.join(paths)}")
        out.append("| " + " | ".join([case] + [cell(rows, case, column) for column in header[1:]]) + " |")
    return "\n".join(out) + "\n"


def rewrite(text: str) -> str:
    """``text`` with every marked table written again from its JSONs."""
    return BLOCK.sub(lambda m: m.group(1) + render(m.group(2).split(), m.group(3)) + m.group(4), text)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    check = "--check" in argv
    stale = []
    for name in (a for a in argv if a != "--check"):
        path = Path(name)
        text = path.read_text(encoding="utf-8")
        new = rewrite(text)
        if new != text:
            stale.append(name)
            if not check:
                path.write_text(new, encoding="utf-8")
    if stale:
        print(("differ from their JSON: " if check else "rewrote: ") + ", ".join(stale), file=sys.stderr)
    return 1 if check and stale else 0


if __name__ == "__main__":
    sys.exit(main())
