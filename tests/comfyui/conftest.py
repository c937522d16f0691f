"""Fixtures for the ComfyUI tests: the package loaded as ComfyUI loads it, and a real ComfyUI server.

The real-ComfyUI fixtures skip when no ComfyUI is installed (see comfy_env.find_comfyui) unless
TOME_REQUIRE_COMFY=1, which CI sets so that a broken test environment fails loudly.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import comfy_env  # noqa: E402


@pytest.fixture(scope="session")
def tome_package():
    """The repository root imported as a package, the way ComfyUI's load_custom_node does it, as a
    ComfyUI without the V3 API sees it (V1 mappings): in-process tests may have put a ComfyUI with
    ``comfy_api`` on sys.path before this runs; the server tests check the V3 export for real."""
    name = "tome_custom_node_under_test"
    if name not in sys.modules:
        hidden = {key: sys.modules.get(key) for key in ("comfy_api", "comfy_api.latest")}
        sys.modules.update(dict.fromkeys(hidden))  # None: "import comfy_api.latest" raises ImportError
        try:
            comfy_env.import_repo_package(name)
        finally:
            for key, value in hidden.items():
                if value is None:
                    sys.modules.pop(key, None)
                else:
                    sys.modules[key] = value
    return sys.modules[name]


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """A real ComfyUI server (its main.py, in a subprocess) with our package in its custom_nodes path
    and the tiny SD1.5 checkpoint in its checkpoints folder; stopped at the end of the session."""
    comfy_dir = comfy_env.require_comfyui(
        "TOME_REQUIRE_COMFY", "run tests/comfyui/setup_env.sh and use .venv-comfy/bin/python")
    workdir = tmp_path_factory.mktemp("comfyui")
    target = workdir / "checkpoints" / comfy_env.CHECKPOINT_NAME
    cache = os.environ.get("TOME_COMFY_CACHE")
    source = Path(cache).resolve() / comfy_env.CHECKPOINT_NAME if cache else target
    if not source.exists():
        comfy_env.import_comfy(comfy_dir)
        comfy_env.write_tiny_sd15_checkpoint(source)
    target.parent.mkdir(parents=True, exist_ok=True)
    if source != target:
        target.symlink_to(source)
    server = comfy_env.ComfyServer(comfy_dir, workdir)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def checkpoint(comfy):
    """The name of the tiny SD1.5 checkpoint the server sees."""
    return comfy_env.CHECKPOINT_NAME


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the ComfyUI server's log tail to a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    server = item.funcargs.get("comfy") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(server, comfy_env.ComfyServer):
        report.sections.append(("ComfyUI server log (tail)", server.log_tail()))
