"""Both hosts carry the same result for the same model: Qwen-Image with the same weights and inputs in ComfyUI's
class (through ToMe's ModelPatcher adapter) and in diffusers' (through its hooks), unpatched and in mode merge with
each merge attention, agree within the float tolerance of the two implementations themselves.

The diffusers half runs in the core test environment (.venv-test, which tests/run.sh builds first; the ComfyUI
environments have no diffusers), as a subprocess on the weights and inputs this half saves
(host_parity_diffusers.py). Destinations are the windows' centres (use_rand=False): each host seeds its random
picks from its own step signal (diffusers' timestep, ComfyUI's sigma)."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
import torch

from test_comfy_dit import comfy  # noqa: F401
from test_comfy_families import _patcher, _require

from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
from tome_core.engine.config import ToMeConfig

HERE = Path(__file__).resolve().parent
CORE_PYTHON = HERE.parent.parent / ".venv-test" / "bin" / "python"
CONFIG = dict(patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16,
              num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
SETTINGS = {how: dict(ratio=0.5, mode="merge", use_rand=False, merge_attention=how)
            for how in ("plain", "balanced", "proportional")}


def comfy_forward(patcher, x, context, timestep, config=None) -> torch.Tensor:
    """One call of the diffusion model through ToMe's APPLY_MODEL wrapper (what a sampler's model call runs), or
    unpatched."""
    base = patcher.model
    options = dict(patcher.model_options.get("transformer_options", {}))

    def executor(x, t, c_concat, c_crossattn, control, transformer_options, **kwargs):
        return base.diffusion_model(x, timestep, c_crossattn, transformer_options=transformer_options)

    with torch.no_grad():
        if config is None:
            return executor(x, None, None, context, None, options)
        patched = patch_dit_model_patcher(patcher, config)
        state = patched.wrappers["apply_model"]["tome_dit_kv"][0].__self__
        options = dict(patched.model_options["transformer_options"])
        return state.apply_model_wrapper(_Executor(executor, base), x, timestep, None, context, None, options)


class _Executor:
    """ComfyUI's wrapper executor as ToMe's wrapper sees it: callable, with the base model as ``class_obj``."""

    def __init__(self, run, base) -> None:
        self.run, self.class_obj = run, base

    def __call__(self, *args, **kwargs):
        return self.run(*args, **kwargs)


def test_comfyui_and_diffusers_carry_the_same_merge(comfy, tmp_path):
    if not CORE_PYTHON.is_file():
        message = f"the diffusers half needs the core test environment ({CORE_PYTHON}); tests/run.sh builds it first"
        if os.environ.get("CI") == "true":  # CI builds it first; a local run against another ComfyUI may not
            pytest.fail(message)
        pytest.skip(message)
    _require("comfy.ldm.qwen_image.model", "QwenImageTransformer2DModel")  # none in the 2024 ComfyUI: skips
    patcher = _patcher(comfy, comfy.supported_models.QwenImage, dict(image_model="qwen_image", **CONFIG))
    model = patcher.model.diffusion_model
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    x = torch.randn(2, 16, 1, 12, 14, generator=g)  # a 6 x 7 token grid, batch 2
    context = torch.randn(2, 6, 32, generator=g)
    timestep = torch.full((2,), 0.6)
    source, target = tmp_path / "in.pt", tmp_path / "out.pt"
    torch.save(dict(config=CONFIG, weights=model.state_dict(), x=x, context=context, timestep=timestep,
                    settings=SETTINGS), source)
    root = HERE.parent.parent
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    done = subprocess.run([str(CORE_PYTHON), str(HERE / "host_parity_diffusers.py"), str(source), str(target)],
                          cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    diffusers_out = torch.load(target)
    ours = {"vanilla": comfy_forward(patcher, x, context, timestep)}
    for name, settings in SETTINGS.items():
        ours[name] = comfy_forward(patcher, x, context, timestep, ToMeConfig(**settings))

    def rel(a, b):
        return ((a - b).norm() / b.norm()).item()

    floor = rel(ours["vanilla"], diffusers_out["vanilla"])  # the two implementations' own difference
    assert floor < 5e-3, floor
    for name in SETTINGS:
        effect = rel(ours[name], ours["vanilla"])
        across = rel(ours[name], diffusers_out[name])
        print(f"{name}: merge changes the output by {effect:.3f}; the hosts differ by {across:.2e} (vanilla {floor:.2e})")
        assert effect > 0.01 and across < max(4 * floor, 1e-3) and effect > 20 * across, (name, effect, across, floor)
    assert rel(ours["balanced"], ours["plain"]) > 1e-3 and rel(ours["proportional"], ours["balanced"]) > 1e-4
