"""Fixtures for the InvokeAI tests: a real invokeai-web server with this repository as a node pack, and tiny models
installed in it through its REST API (see invoke_env.py, tiny_models.py).

The fixtures skip when .venv-invoke (or TOME_INVOKE_PYTHON) cannot import InvokeAI, unless TOME_REQUIRE_INVOKE=1,
which makes a broken test environment fail loudly. Run:
    TOME_REQUIRE_INVOKE=1 .venv-invoke/bin/python -m pytest -q tests/invokeai --confcutdir=tests/invokeai
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import invoke_env  # noqa: E402


@pytest.fixture(scope="session")
def invoke_python():
    """The python of the InvokeAI environment (skip or fail as the module docstring says)."""
    return invoke_env.require_invokeai("TOME_REQUIRE_INVOKE")


@pytest.fixture(scope="session")
def tiny_sd15_files(invoke_python):
    """(single-file checkpoint, HF_HOME of its offline config cache), built once under invoke_env.cache_dir()."""
    return invoke_env.build_tiny_sd15(invoke_python)


@pytest.fixture(scope="session")
def invoke(invoke_python, tiny_sd15_files, tmp_path_factory):
    """A real invokeai-web (a subprocess, temporary INVOKEAI_ROOT, offline HF_HOME); stopped after the session."""
    server = invoke_env.InvokeServer(tmp_path_factory.mktemp("invokeai_root"), hf_home=tiny_sd15_files[1],
                                     python=invoke_python)
    yield server
    server.stop()


@pytest.fixture(scope="session")
def sd15_model(invoke, tiny_sd15_files):
    """The tiny SD1.5 checkpoint installed in the server (in place): its model config (key, base, type...)."""
    return invoke.install_model(tiny_sd15_files[0])


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Attach the InvokeAI server's log tail to a failing test's report."""
    outcome = yield
    report = outcome.get_result()
    server = item.funcargs.get("invoke") if hasattr(item, "funcargs") else None
    if report.failed and isinstance(server, invoke_env.InvokeServer):
        report.sections.append(("invokeai-web log (tail)", server.log_tail()))
