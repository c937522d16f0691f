"""The docs' result tables, written from the JSON they cite: ``python -m tome_bench.doc_tables README.md docs/*.md``.

A table in a Markdown file between ``<!-- results: A.json [B.json ...] -->`` and ``<!-- /results -->`` is rewritten
from those JSONs (paths from the repository root): its header names the columns (``vanilla ms``, or a method label
as the bench writes it, e.g. ``kv r=0.75``), its first column the cases (``sd15 1024x1024``, ``wan 832x480 x 33
frames``); each method cell is ``speed-up× (cfg err peaked)`` of the eager row of that case and label. ``--check``
only reports the tables that differ from their JSON (tests/test_docs.py runs it).
"""
from __future__ import annotations

import json
import re
import sys
from pathlib import Path

from .chart import _case, _case_title, rows_of

REPO = Path(__file__).resolve().parent.parent
BLOCK = re.compile(r"(<!-- results: ([^>]*?) -->\n)(.*?)(<!-- /results -->)", re.S)


def load(paths: list[str]) -> dict[tuple[str, str], dict]:
    """(case title, label) -> the eager row, over the JSONs in order (the first one holding a case wins)."""
    table: dict[tuple[str, str], dict] = {}
    for path in paths:
        result = json.loads((REPO / path).read_text(encoding="utf-8"))
        for row in rows_of(result):
            if not row.get("compiled"):
                table.setdefault((_case_title(_case(row)), row["label"]), row)
    return table


def cell(rows: dict[tuple[str, str], dict], case: str, column: str) -> str:
    """One cell: vanilla's ms, or a method's ``1.14× (0.274)``; empty where the JSON has no such row."""
    if column == "vanilla ms":
        row = rows.get((case, "vanilla"))
        return "" if row is None else f"{row['time_s'] * 1000:.0f}"
    row = rows.get((case, column))
    if row is None or row.get("speedup") is None:
        return ""
    err = row.get("cfg_err_peaked")
    return f"{row['speedup']:.2f}×" + ("" if err is None else f" ({err:.3f})")


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
