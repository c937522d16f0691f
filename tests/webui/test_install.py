"""install.py: the WebUI's install hook: idempotent, installs only what is missing, never torch; nothing elsewhere.

The WebUI's ``launch`` module is stood in by a module with ``run_pip(command, desc)`` (its real
signature in modules/launch_utils.py); pip itself is never run: the calls are recorded."""
from __future__ import annotations

import importlib.util
import subprocess
import sys
import types

import pytest

from webui_helpers import REPO


@pytest.fixture
def install(monkeypatch):
    spec = importlib.util.spec_from_file_location("tome_install", f"{REPO}/install.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    calls = []
    monkeypatch.setattr(subprocess, "check_call", lambda cmd: calls.append(cmd))  # pip must never run by itself
    module.calls = calls
    return module


REQUIREMENTS = """\
# runtime requirements
torch>=2.0          # the host's: never installed here
pytest
tome-test-not-installed-package[extra]>=1.0 ; python_version >= "3.8"
-r other.txt
"""


def test_outside_the_webui_it_installs_nothing_and_says_so(install, tmp_path, monkeypatch, capsys):
    """ComfyUI-Manager runs install.py with plain Python: a missing requirement is left to Manager, which installs
    requirements.txt itself (the registry's standards: no pip from a pack)."""
    monkeypatch.setitem(sys.modules, "launch", None)  # `import launch` raises ImportError
    path = tmp_path / "requirements.txt"
    path.write_text(REQUIREMENTS)
    assert install.main(path) == [] and install.calls == []
    assert "not run by the WebUI, so nothing to install" in capsys.readouterr().out


def test_uses_the_webuis_pip_when_launch_is_importable(install, tmp_path, monkeypatch):
    pips = []
    monkeypatch.setitem(sys.modules, "launch", types.SimpleNamespace(run_pip=lambda cmd, desc: pips.append(cmd)))
    path = tmp_path / "requirements.txt"
    path.write_text(REQUIREMENTS + "torchvision\nxformers\n")
    wanted = 'tome-test-not-installed-package[extra]>=1.0 ; python_version >= "3.8"'
    assert install.main(path) == [wanted]
    assert pips == [f'install "{wanted}"'] and install.calls == []


def test_nothing_to_do_when_everything_is_there(install, tmp_path, monkeypatch, capsys):
    monkeypatch.setitem(sys.modules, "launch", types.SimpleNamespace(run_pip=lambda cmd, desc: None))
    path = tmp_path / "requirements.txt"
    path.write_text("torch\npytest\n")
    assert install.main(path) == [] and install.main(tmp_path / "missing.txt") == []
    assert install.calls == []
    assert capsys.readouterr().out.count("nothing to install") == 2


def test_runs_as_a_script_the_way_both_hosts_run_it(install):
    if install.missing_requirements(install.requirement_lines()):
        pytest.skip("requirements.txt lists packages missing here; this test must not install them")
    result = subprocess.run([sys.executable, "install.py"], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith("[ToMe] install.py:")
