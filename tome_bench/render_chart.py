"""``python -m tome_bench.render_chart OUT.png RESULTS.json [...]``: the bench's chart from committed results.

The README's charts are drawn this way from the JSONs in docs/results (see docs/BENCHMARK.md); the chart's title
names each JSON's device and commit.
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

from .chart import one_per_case, rows_of, write_chart


def main(argv: list[str] | None = None) -> int:
    """``python -m tome_bench.render_chart OUT.png RESULTS.json [...]``: the chart of one or more results JSONs."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) < 2:
        print("usage: python -m tome_bench.render_chart OUT.png RESULTS.json [RESULTS.json ...]", file=sys.stderr)
        return 2
    results = [json.loads(Path(name).read_text(encoding="utf-8")) for name in argv[1:]]
    commits: dict[str, list[str]] = {}  # device -> the commits measured on it
    for r in results:
        commits.setdefault(str(r.get("device", "device not recorded")), []).append(str(r.get("commit", "?")))
    title = "; ".join(f"{device}, commit{'s' if len(c) > 1 else ''} {', '.join(dict.fromkeys(c))}"
                      for device, c in commits.items())
    written = write_chart(one_per_case([row for r in results for row in rows_of(r)]), Path(argv[0]), title=title)
    print(f"wrote {written}" if written else "no chart: no row has a speed-up and an error", file=sys.stderr)
    return 0 if written else 1


if __name__ == "__main__":
    sys.exit(main())
