"""Fixtures for the ComfyUI tests: the package loaded as ComfyUI loads it, and a real in-process ComfyUI.

The real-ComfyUI fixtures skip when no ComfyUI is installed (see comfy_env.find_comfyui) unless
TOME_REQUIRE_COMFY=1, which CI sets so that a broken test environment fails loudly.
"""
from __future__ import annotations

import importlib.util
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
    """The repository root imported as a package, the way ComfyUI's load_custom_node does it."""
    name = "tome_custom_node_under_test"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, comfy_env.REPO / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="session")
def comfy(tmp_path_factory):
    """A ComfyUI started in this process with our package in its custom_nodes folder."""
    comfy_dir = comfy_env.require_comfyui(
        "TOME_REQUIRE_COMFY", "run tests/comfyui/setup_env.sh and use .venv-comfy/bin/python")
    return comfy_env.ComfyHarness(comfy_dir, tmp_path_factory.mktemp("comfyui"))


@pytest.fixture(scope="session")
def checkpoint(comfy):
    """The tiny SD1.5 checkpoint in the harness' checkpoint folder (reused from TOME_COMFY_CACHE if set)."""
    target = comfy.checkpoint_dir / comfy_env.CHECKPOINT_NAME
    cache = os.environ.get("TOME_COMFY_CACHE")
    source = Path(cache).resolve() / comfy_env.CHECKPOINT_NAME if cache else target
    if not source.exists():
        comfy_env.write_tiny_sd15_checkpoint(source)
    if source != target and not target.exists():
        target.symlink_to(source)
    return comfy_env.CHECKPOINT_NAME
