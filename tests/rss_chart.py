"""A small SVG line chart of a server's resident memory over a long session (no plotting library needed).

Shared by the soak tools of both hosts (tests/comfyui/soak.py, tests/webui/real_webui.py), which run in
environments without matplotlib.
"""
from __future__ import annotations

from pathlib import Path
from typing import List


def write_rss_svg(path: Path, rss: List[float], warmup: int, title: str) -> None:
    """The RSS curve (MB per prompt) with the end of the warm-up marked, under ``title``."""
    width, height, pad = 640, 240, 40
    low, high = min(rss) - 5, max(rss) + 5
    x = lambda i: pad + (width - 2 * pad) * i / max(1, len(rss) - 1)  # noqa: E731
    y = lambda v: height - pad - (height - 2 * pad) * (v - low) / (high - low)  # noqa: E731
    points = " ".join(f"{x(i):.1f},{y(v):.1f}" for i, v in enumerate(rss))
    path.write_text(
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" font-family="sans-serif" '
        f'font-size="11">\n<rect width="100%" height="100%" fill="white"/>\n'
        f'<line x1="{x(warmup - 1):.1f}" y1="{pad}" x2="{x(warmup - 1):.1f}" y2="{height - pad}" stroke="#bbb" '
        f'stroke-dasharray="4"/>\n<text x="{x(warmup - 1) + 4:.1f}" y="{pad + 10}" fill="#777">end of warm-up</text>\n'
        f'<polyline fill="none" stroke="#1f77b4" stroke-width="1.5" points="{points}"/>\n'
        f'<text x="{pad}" y="{pad - 12}">{title}</text>\n'
        f'<text x="4" y="{y(high - 5) + 4:.1f}">{high - 5:.0f}</text>\n'
        f'<text x="4" y="{y(low + 5) + 4:.1f}">{low + 5:.0f}</text>\n'
        f'<text x="{width / 2 - 20:.0f}" y="{height - 10}">prompt</text>\n</svg>\n')
