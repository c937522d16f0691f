"""The rules CUDA graphs (``torch.compile(mode="reduce-overhead")``) need, checked where the CPU can check them.

A captured graph replays the same kernels on the same shapes, and nothing in it may read from the host: so after
the first call of a size, a patched forward uploads no host table (ToMe builds its seeded tables on the host once
per size and device, then picks among them on the device) and dispatches the same ops on the same shapes at every
step. Run on the ``meta`` device, where every upload is a visible CPU-to-device copy and no data is read; the
host-sync rule has its own tests (test_host_sync.py). Flux is left out: its reader copies the position ids to the
host once per ids tensor by design (remembered across calls, call_memo.py), which a meta tensor cannot give."""
from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tome_core
from tome_bench import dit_models
from tome_bench.models import build_unet, make_inputs
from tome_core.catalogue.diffusers_lookup import family_of

META = torch.device("meta")


class Recorder(TorchDispatchMode):
    """Every op with its output shapes, and the ops that copy a host tensor to the device."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list = []
        self.uploads: list = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = [a for a in tree_flatten((args, kwargs))[0] if isinstance(a, torch.Tensor)]
        outputs = [o for o in tree_flatten(out)[0] if isinstance(o, torch.Tensor)]
        if any(a.device.type == "cpu" for a in inputs) and any(o.device.type != "cpu" for o in outputs):
            self.uploads.append(str(func))
        self.ops.append((str(func), tuple(tuple(o.shape) for o in outputs)))
        return out


def recorded(call) -> Recorder:
    with torch.no_grad(), Recorder() as recorder:
        call()
    return recorder


UNET_PATCHES = [dict(ratio=0.5, matching="level", speed_check="auto"), dict(ratio=0.5),
                dict(ratio=0.5, mode="kv"), dict(ratio=0.5, max_downsample=2, matching="level")]


@pytest.mark.parametrize("options", UNET_PATCHES, ids=lambda o: ",".join(f"{k}={v}" for k, v in o.items()))
def test_a_patched_unet_uploads_once_per_size_and_repeats_its_shapes_at_every_step(options):
    unet = build_unet("sd15", "tiny", seed=0)
    sample, _, context, _ = make_inputs(unet, "sd15", 2, 128, 128, seed=1)
    unet, sample, context = unet.to(META), sample.to(META), context.to(META)

    def call(step: float):
        return lambda: unet(sample, torch.full((2,), step, device=META), encoder_hidden_states=context)

    tome_core.apply_patch(unet, **options)
    try:
        first, *later = [recorded(call(step)) for step in (900.0, 900.0, 500.0, 100.0)]
    finally:
        tome_core.remove_patch(unet)
    assert first.uploads, "the first call of a size uploads the seeded tables"
    assert [r.uploads for r in later] == [[], [], []]
    assert later[0].ops == later[1].ops == later[2].ops  # steps 900, 500, 100: the same ops on the same shapes
    vanilla = recorded(call(500.0))
    assert vanilla.uploads == [] and len(later[0].ops) != len(vanilla.ops)  # it does act


@pytest.mark.parametrize("family,mode", [(f, m) for f in ("qwen_image", "z_image", "wan", "ltx2") for m in ("kv", "merge")])
def test_a_patched_transformer_uploads_once_per_size_and_repeats_its_shapes(family, mode):
    model = dit_models.build_dit(family, 1, 0, scale="tiny").to(META)
    inputs = dit_models.to_device(dit_models.make_dit_inputs(model, family, 2, 64, 64, 9, 1, torch.float32), META)
    name = family_of(model).timestep.name
    steps = [dict(inputs, **{name: torch.full_like(inputs[name], value, device=META)}) for value in (0.9, 0.5, 0.1)]
    tome_core.apply_patch(model, ratio=0.5, mode=mode)
    try:
        first = recorded(lambda: dit_models.forward(model, inputs))  # its own step tensor: each call below has a new one
        later = [recorded(lambda s=s: dit_models.forward(model, s)) for s in steps]
    finally:
        tome_core.remove_patch(model)
    assert first.uploads
    assert [r.uploads for r in later] == [[], [], []]
    assert later[0].ops == later[1].ops == later[2].ops
