"""Test-only ComfyUI nodes, loaded only by the tests' ComfyUI server (its custom_nodes search path).

They let a test observe, through the server's HTTP API, what it could otherwise see only inside
ComfyUI's executor: a model ToMe cannot patch, which patches a MODEL carries, and a MODEL used
again after another branch has run.
"""
from __future__ import annotations


class TomeTestDiTLoader:
    """A real ModelPatcher around a model named like ComfyUI's Flux class, without UNet blocks
    (a transformer-only model small enough for CPU tests)."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {}}

    def load(self):
        import torch
        from comfy.model_patcher import ModelPatcher

        class Flux(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.diffusion_model = torch.nn.Sequential(torch.nn.Linear(4, 4))

        return (ModelPatcher(Flux(), torch.device("cpu"), torch.device("cpu")),)


class TomeTestModelReport:
    """Reports the attention patches registered on the MODEL it receives, in its UI output."""

    RETURN_TYPES = ()
    FUNCTION = "report"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "label": ("STRING", {"default": ""})}}

    def report(self, model, label):
        patches = model.model_options.get("transformer_options", {}).get("patches", {})
        names = {kind: [getattr(f, "__name__", type(f).__name__) for f in fs] for kind, fs in patches.items()}
        return {"ui": {"patches": [{"label": label, "patches": names}]}}


class TomeTestAfter:
    """Passes its MODEL on as the same object, once ``after`` has been computed: it orders a branch
    after another one (ComfyUI otherwise picks the order of independent branches itself)."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "after"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "after": ("IMAGE",)}}

    def after(self, model, after):
        return (model,)


# dict(...), not a literal: ComfyUI-Manager's scanner reads literal mappings in every .py of the repository,
# and these test nodes are not the pack's (tests/test_registry.py).
NODE_CLASS_MAPPINGS = dict(TomeTestDiTLoader=TomeTestDiTLoader, TomeTestModelReport=TomeTestModelReport,
                           TomeTestAfter=TomeTestAfter)

from .compose_nodes import NODE_CLASS_MAPPINGS as _COMPOSE_NODES  # noqa: E402

NODE_CLASS_MAPPINGS.update(_COMPOSE_NODES)

from .v1_twin import NODE_CLASS_MAPPINGS as _V1_TWIN_NODES  # noqa: E402

NODE_CLASS_MAPPINGS.update(_V1_TWIN_NODES)

from .fault_nodes import NODE_CLASS_MAPPINGS as _FAULT_NODES  # noqa: E402

NODE_CLASS_MAPPINGS.update(_FAULT_NODES)

from .speed_nodes import NODE_CLASS_MAPPINGS as _SPEED_NODES  # noqa: E402

NODE_CLASS_MAPPINGS.update(_SPEED_NODES)

from .dit_nodes import NODE_CLASS_MAPPINGS as _DIT_NODES  # noqa: E402

NODE_CLASS_MAPPINGS.update(_DIT_NODES)
