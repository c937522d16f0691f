"""Helpers shared by the WebUI tests: paths, the script's args, a processing object, and tiny real
LDM models built from Stability's ``ldm`` package (PyPI ``stable-diffusion-sdkit``)."""
from __future__ import annotations

import importlib
import os

import pytest
import torch

import webui_doubles as wd
from tome_webui.options import FIELDS

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SCRIPT_PATH = os.path.join(REPO, "scripts", "tome.py")


def require(module: str):
    """Import ``module``; skip when it is missing (another test env), unless TOME_REQUIRE_WEBUI=1
    (set when running in .venv-webui) makes a broken test environment fail loudly."""
    if os.environ.get("TOME_REQUIRE_WEBUI") == "1":
        return importlib.import_module(module)
    return pytest.importorskip(module)


def script_args(**values):
    """The script's args in FIELDS order: engine defaults, enabled, plus ``values``."""
    defaults = {"enabled": True, "ratio": 0.5, "hr_ratio": 0.5, "max_downsample": "1", "sx": 2, "sy": 2,
                "use_rand": True, "seed": 0, "mode": "default", "merge_attn": True, "merge_crossattn": False,
                "merge_mlp": False, "start_percent": 0.0, "end_percent": 1.0, "min_tokens": 0,
                "kv_downsample": "nearest", "matching": "level", "speed_check": "auto",
                "match_every": 1}
    defaults.update(values)
    return [defaults[f.name] for f in FIELDS]


def make_p(model, host, script, args, **kwargs):
    """A txt2img processing double running ``script`` (None = no scripts) with ``args``."""
    p = wd.Processing(model, host.opts, **kwargs)
    p.scripts = wd.ScriptRunner([script] if script is not None else [])
    p.script_args = args
    return p


class DiffusionWrapper(torch.nn.Module):
    """Stands in for ldm.models.diffusion.ddpm.DiffusionWrapper (pytorch-lightning is not installed)."""

    def __init__(self, diffusion_model):
        super().__init__()
        self.diffusion_model = diffusion_model


class LatentDiffusion(torch.nn.Module):
    """Stands in for the WebUI's shared.sd_model (ldm LatentDiffusion): only ``.model.diffusion_model``."""

    def __init__(self, diffusion_model):
        super().__init__()
        self.model = DiffusionWrapper(diffusion_model)


def reinit_zero_layers(module: torch.nn.Module, seed: int) -> None:
    """LDM zero-initialises proj_out, each ResBlock's last conv and the output conv; give them
    PyTorch's default init so a skipped block could not pass a comparison trivially."""
    torch.manual_seed(seed + 1)
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)) and not weight.any():
            m.reset_parameters()


def build_sd15_unet(seed: int = 0):
    """SD1.5's v1-inference.yaml UNet config with channels/context reduced (320->32, 768->32)."""
    UNetModel = require("ldm.modules.diffusionmodules.openaimodel").UNetModel

    torch.manual_seed(seed)
    unet = UNetModel(
        image_size=32, in_channels=4, out_channels=4, model_channels=32, attention_resolutions=[4, 2, 1],
        num_res_blocks=2, channel_mult=[1, 2, 4, 4], num_heads=4, use_spatial_transformer=True,
        transformer_depth=1, context_dim=32, use_checkpoint=True, legacy=False,
    )
    reinit_zero_layers(unet, seed)
    return unet.eval()
