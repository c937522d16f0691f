"""DiTs at their released depth and width (``--depth released``): built where they run, and sized without building.

A released transformer has 6-20 billion parameters: seeded on the CPU in fp32 it would take minutes and 24-80 GB
before the copy to the GPU. :func:`build` instead constructs the model with its parameters on the ``meta`` device
(shapes only; buffers and other tensors the constructor makes stay real, e.g. Wan's rotary tables), then allocates
each parameter once, on the device and in the run's dtype, and draws it there from a seeded generator
(``dit_models.seed_parameters``): seconds, one copy of the weights, nothing on the host.

:func:`meta_model` and :func:`activation_peak` size a model without any weights: its parameter count and bytes, and
the peak of the tensors one forward at a given size keeps alive, from a forward on the ``meta`` device (shapes
only) with attention counted as the fused kernels a GPU runs it with (output and log-sum-exp, never N x N scores).
The CPU tests check with them that every released model fits an 80 GB card with its activations at its native size.
"""
from __future__ import annotations

import contextlib
import weakref
from typing import Iterator

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

from . import dit_models

CARD_BYTES = 80 * 10 ** 9  # the card a released model must fit, with one forward's activations (an H100 80GB)


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Inside: every parameter a module registers is replaced by a ``meta`` tensor of its shape and dtype (the
    constructor's own initialisation then runs on shapes only); buffers and plain tensors stay where they are made."""
    register = torch.nn.Module.register_parameter

    def on_meta(module: torch.nn.Module, name: str, param) -> None:
        if param is not None and param.device.type != "meta":
            param = torch.nn.Parameter(param.to("meta"), requires_grad=False)
        register(module, name, param)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def _construct(family: str, scale: str, blocks: int | None = None) -> torch.nn.Module:
    import diffusers  # the bench is host glue: diffusers only when a DiT bench runs

    cls_name, config = dit_models.dit_config(family, blocks, scale, released=True)
    with parameters_on_meta():
        return getattr(diffusers, cls_name)(**config)


def parameter_bytes(model: torch.nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``model``'s parameters in ``dtype`` (integer parameters in their own)."""
    return sum(p.numel() * (dtype.itemsize if p.is_floating_point() else p.element_size())
               for p in model.parameters())


def _fits(family: str, need: int, device: torch.device) -> None:
    if device.type != "cuda":
        return
    free, _ = torch.cuda.mem_get_info(device)
    if need > free:
        raise ValueError(f"ToMe bench: {family} at its released depth needs {need / 1e9:.1f} GB for its weights; "
                         f"{device} has {free / 1e9:.1f} GB free (one model at a time: is another process on it?)")


def materialise(model: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Each ``meta`` parameter of ``model`` allocated on ``device`` in ``dtype`` (uninitialised; a parameter shared by
    two modules stays shared), then the buffers moved there (floating ones cast, as ``Module.to`` does)."""
    made: dict = {}
    for module in model.modules():
        for name, param in list(module._parameters.items()):
            if param is None or param.device.type != "meta":
                continue
            if id(param) not in made:
                kind = dtype if param.is_floating_point() else param.dtype
                made[id(param)] = torch.nn.Parameter(torch.empty(param.shape, dtype=kind, device=device),
                                                     requires_grad=False)
            module._parameters[name] = made[id(param)]
    return torch.nn.Module.to(model, device, dtype)  # torch's own: diffusers' warns about fp32-kept modules


def build(family: str, device: torch.device | str, dtype: torch.dtype, seed: int = 0, scale: str = "full",
          blocks: int | None = None) -> torch.nn.Module:
    """The released ``family`` DiT (``dit_models.RELEASED``; ``blocks``: that many of each kind at its width), its
    weights allocated and seeded on ``device`` in ``dtype`` (see the module); refused before any allocation when its
    weights do not fit the GPU's free memory."""
    device = torch.device(device)
    model = _construct(family, scale, blocks)
    _fits(family, parameter_bytes(model, dtype), device)
    model = materialise(model, device, dtype)
    generator = torch.Generator(device=device).manual_seed(seed + 1)
    dit_models.seed_parameters(model, generator)
    return model.eval().requires_grad_(False)


def meta_model(family: str, dtype: torch.dtype = torch.bfloat16, blocks: int | None = None,
               scale: str = "full") -> torch.nn.Module:
    """The released ``family`` DiT (``blocks`` of each kind at its width; None: its depth) entirely on the ``meta``
    device (shapes only; nothing allocated): its structure, its parameter count and a forward's shapes and live
    bytes (:func:`activation_peak`)."""
    import diffusers

    cls_name, config = dit_models.dit_config(family, blocks, scale, released=True)
    with torch.device("meta"):
        model = getattr(diffusers, cls_name)(**config)
    return torch.nn.Module.to(model, dtype).eval().requires_grad_(False)


class _FusedAttention(TorchFunctionMode):
    """SDPA as the fused kernels run it on a GPU: the output's shape only (the meta device would otherwise take the
    math path and count the N x N scores, which flash and memory-efficient attention never hold)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func is F.scaled_dot_product_attention:
            q, _, v = (args[i] if i < len(args) else kwargs[name] for i, name in enumerate(("query", "key", "value")))
            return q.new_empty(q.shape[:-1] + v.shape[-1:])
        return func(*args, **kwargs)


class _LiveBytes(TorchDispatchMode):
    """The bytes of the tensors ops make (not views, not in-place results) that are still referenced, and their
    peak: each new tensor counted when made and uncounted when freed."""

    def __init__(self) -> None:
        super().__init__()
        self.live = self.peak = 0

    def _free(self, nbytes: int) -> None:
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        for returned, tensor in zip(func._schema.returns, outs):
            if isinstance(tensor, torch.Tensor) and returned.alias_info is None:
                nbytes = tensor.untyped_storage().nbytes()
                self.live += nbytes
                self.peak = max(self.peak, self.live)
                weakref.finalize(tensor, self._free, nbytes)
        return out


def activation_peak(model: torch.nn.Module, inputs: dict) -> tuple[int, object]:
    """(peak bytes of the tensors alive during one forward beyond the weights and inputs, the output) of a
    ``meta`` model (:func:`meta_model`) on ``meta`` inputs. In inference mode each block's tensors are freed before
    the next block runs, so the peak does not grow with the depth: one block gives the released model's."""
    counter = _LiveBytes()
    with torch.inference_mode(), _FusedAttention(), counter:
        out = model(**inputs, return_dict=False)[0]
    return counter.peak, out
