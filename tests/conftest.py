"""Shared fixtures: real diffusers UNet architectures (reduced channels) with seeded weights."""
from __future__ import annotations

from pathlib import Path

import pytest
import inspect

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from tome_bench.models import build_unet, make_inputs

REPO_ROOT = Path(__file__).resolve().parent.parent

torch.set_num_threads(max(1, min(2, torch.get_num_threads())))


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual.float() - expected.float()).norm() / expected.float().norm()).item()


def unet_output(unet, inputs) -> torch.Tensor:
    sample, timestep, context, added = inputs
    with torch.inference_mode():
        return unet(sample, timestep, context, added_cond_kwargs=added).sample


def seed_weights(model: torch.nn.Module, seed: int = 0) -> torch.nn.Module:
    """Every weight random (diffusers zero-initialises some output layers: comparisons would pass trivially)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            fan_in = p.shape[-1] if p.dim() >= 2 else 16
            p.copy_(torch.randn(p.shape, generator=g) / fan_in ** 0.5)
    return model.eval()


class SpyAttention(TorchFunctionMode):
    """Records the real query/key/value of every scaled_dot_product_attention call, as the kernel gets them."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            names = ("query", "key", "value")
            bound = dict(zip(names, args), **{k: v for k, v in kwargs.items() if k in names})
            self.calls.append(tuple(bound[n].clone() for n in names))
        return func(*args, **kwargs)


def check_identity_at_ratio_zero_and_after_removal(model, inputs, run, apply_patch, remove_patch, is_patched,
                                                   state_attr: str, mode: str = "kv", **settings):
    """The DiT families' shared check: ratio 0 is bit-identical, ratio 0.5 changes the output boundedly, removal
    leaves no state; returns the patch state seen at ratio 0.5 (for each file's own count of reduced calls)."""
    expected = run(model, inputs)
    apply_patch(model, ratio=0.0, mode=mode, **settings)
    assert is_patched(model) and torch.equal(run(model, inputs), expected)
    apply_patch(model, ratio=0.5, mode=mode, **settings)
    changed = run(model, inputs)
    assert not torch.equal(changed, expected)
    rel = ((changed - expected).norm() / expected.norm()).item()
    assert 0 < rel < 1.0, rel
    state = model.__dict__[state_attr]
    remove_patch(model)
    assert not is_patched(model) and state_attr not in model.__dict__
    assert hook_count(model) == 0
    assert torch.equal(run(model, inputs), expected)
    return state


def check_reduced_output(model, inputs, run, apply_patch, state_attr: str, ratio: float = 0.75, mode: str = "kv"):
    """An odd size or batch: the reduced output keeps the shape, stays finite and differs; returns the patch state."""
    expected = run(model, inputs)
    apply_patch(model, ratio=ratio, mode=mode)
    out = run(model, inputs)
    assert out.shape == expected.shape and torch.isfinite(out).all() and not torch.equal(out, expected)
    return model.__dict__[state_attr]


class StandInClock:
    """A clock of a device where calls queue (as CUDA's), in virtual seconds: the code under test advances ``now``
    by what each call costs, so a timing's result is known exactly (``tome_core.engine.timing.Clock``)."""

    back_to_back = True

    def __init__(self) -> None:
        self.now = self.t0 = 0.0
        self.spans: list = []

    def start(self) -> None:
        self.t0 = self.now

    def stop(self) -> float:
        self.spans.append(self.now - self.t0)
        return self.now - self.t0


class ForwardSpy:
    """What each of ``modules``' own forward receives: ``record(module, args, kwargs)`` from an instance forward set
    over it (as accelerate's and diffusers' hook registries wrap a module), so ToMe's marked forward, which acts inside
    the module's call, hands it the merged inputs. ``remove()`` restores the modules."""

    def __init__(self, modules, record) -> None:
        self.modules = list(modules)
        for module in self.modules:
            own = module.forward

            def forward(*args, _own=own, _module=module, **kwargs):
                record(_module, args, kwargs)
                return _own(*args, **kwargs)

            module.forward = forward

    def remove(self) -> None:
        for module in self.modules:
            module.__dict__.pop("forward", None)


def bound_inputs(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict:
    """A module call's inputs by name (its class's forward signature)."""
    return dict(inspect.signature(type(module).forward).bind(module, *args, **kwargs).arguments)


def hook_count(module: torch.nn.Module) -> int:
    return sum(
        len(m._forward_pre_hooks) + len(m._forward_hooks) + len(m._forward_pre_hooks_with_kwargs)
        for m in module.modules()
    )


@pytest.fixture(scope="session")
def sd15_unet():
    return build_unet("sd15", "tiny", seed=0)


@pytest.fixture(scope="session")
def sdxl_unet():
    return build_unet("sdxl", "tiny", seed=0)


@pytest.fixture
def sd15_inputs(sd15_unet):
    """A CFG pair (uncond, cond) at 256x256 px: a 32x32 latent, 1024 tokens at the first level."""
    return make_inputs(sd15_unet, "sd15", batch=2, height_px=256, width_px=256, seed=1)
