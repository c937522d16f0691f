"""Duck-typed parts of tome_core.adapters.model_patcher.unet that need no ComfyUI (the real ModelPatcher path is
tested in tests/comfyui and tests/webui/test_forge_path.py)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

from tome_core import ToMeConfig
from tome_core.adapters.model_patcher.unet import SigmaWindow, UnsupportedModelError, sigma_window


class _Sampling:
    """Stands in for ComfyUI's ModelSamplingDiscrete / Forge's predictor: only percent_to_sigma."""

    def percent_to_sigma(self, percent: float) -> float:
        return 14.6 * (1.0 - percent)


def _patcher(**model_objects):
    return SimpleNamespace(model=SimpleNamespace(**model_objects))


@pytest.mark.parametrize("holder", ["model_sampling", "predictor"], ids=["comfy-reforge", "forge"])
def test_schedule_window_comes_from_the_models_own_percent_to_sigma(holder):
    config = ToMeConfig(start_percent=0.25, end_percent=0.75)
    window = sigma_window(_patcher(**{holder: _Sampling()}), config)
    assert window == SigmaWindow(high=14.6 * 0.75, low=14.6 * 0.25)
    assert window.contains(7.3) and not window.contains(14.0) and not window.contains(1.0)


def test_schedule_window_without_percent_to_sigma_names_the_fix():
    with pytest.raises(UnsupportedModelError, match="use start_percent=0 and end_percent=1"):
        sigma_window(_patcher(), ToMeConfig(start_percent=0.5))
    assert sigma_window(_patcher(), ToMeConfig()) == SigmaWindow()  # the full schedule needs nothing
