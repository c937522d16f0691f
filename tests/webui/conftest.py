"""Fixtures for the WebUI extension tests: WebUI module doubles, the script loaded the WebUI's way,
and a real (tiny) LDM SD1.5-config UNet (see webui_helpers)."""
from __future__ import annotations

import copy
import os
import sys

import pytest
import torch

_HERE = os.path.dirname(os.path.abspath(__file__))
_REPO = os.path.dirname(os.path.dirname(_HERE))
for _path in (_HERE, _REPO):  # the tests' own imports of webui_*, tome_core and tome_webui
    if _path not in sys.path:
        sys.path.insert(0, _path)
import webui_doubles  # noqa: E402
from webui_helpers import SCRIPT_PATH, LatentDiffusion, build_sd15_unet, require  # noqa: E402

torch.set_num_threads(1)  # tiny models; the CI machine's 2 cores are shared


@pytest.fixture
def gr():
    return require("gradio")


@pytest.fixture
def host(monkeypatch, gr):
    """The ``modules`` doubles in sys.modules (see webui_doubles for what each stands in for)."""
    return webui_doubles.install(monkeypatch, gr)


@pytest.fixture
def script_module(host):
    """scripts/tome.py loaded as the WebUI loads it; the repo is on sys.path only during the import."""
    syspath = list(sys.path)
    module = webui_doubles.load_script_file(SCRIPT_PATH, host.scripts.scripts_data)
    assert sys.path == syspath
    return module


@pytest.fixture
def script(script_module, host, gr):
    """The Script instance with its UI built (txt2img), its arg range set as ScriptRunner does."""
    s = script_module.ToMeScript()
    with gr.Blocks():
        s.controls = s.ui(False)
    s.args_from, s.args_to = 0, len(s.controls)
    return s


@pytest.fixture(scope="session")
def sd15_model():
    """A seeded LatentDiffusion-like model around a real ldm SD1.5-config UNet; tests deep-copy it."""
    return LatentDiffusion(build_sd15_unet())


@pytest.fixture
def sd_model(sd15_model):
    return copy.deepcopy(sd15_model)


@pytest.fixture
def reference(sd15_model):
    """An untouched copy of the same model, for torch.equal comparisons."""
    return copy.deepcopy(sd15_model)


def pytest_configure(config):
    # ldm's checkpoint helper calls a deprecated torch API at every transformer block
    config.addinivalue_line("filterwarnings", "ignore:.*get_autocast_gpu_dtype.*:DeprecationWarning")
    config.addinivalue_line("filterwarnings", "ignore:.*get_autocast_cpu_dtype.*:DeprecationWarning")
