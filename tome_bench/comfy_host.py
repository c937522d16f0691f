"""``bench --host comfyui``: each family in ComfyUI's own classes, patched by the ToMe node through ``ModelPatcher``,
timed at the model call ComfyUI's sampler makes, through the runner's rounds, statistics and rows.

The models are ``comfy_host_models``'s (ComfyUI's config classes and model detection configs, seeded weights made on
the device). A variant is applied as a ComfyUI graph applies it: the node's own ``patch`` (``nodes/tome_nodes.py``,
"ToMe" (token merging) with its defaults for ``node``, "ToMe (advanced)" in mode merge or kv with the speed check off
for ``merge`` and ``kv``) returns a patched clone of the model's ``ModelPatcher``; with a compile mode, the clone then goes
through the ComfyUI's own core ``TorchCompileModel`` node (``comfy_extras/nodes_torch_compile.py``), so the rows
follow each version: 0.3.75 compiles with ``set_torch_compile_wrapper(model=clone, backend=backend)``, the 2026
ComfyUI adds a guard filter that drops every guard on ``transformer_options``. The node's module imports
``comfy_api.latest``, which needs PyAV (``av``); where it cannot be imported, the compile rows are skipped, naming
why.

What is timed: one sampling step's model calls, exactly as ``comfy.samplers`` makes them. :func:`capture` runs
ComfyUI's sampler (``comfy.sample.sample_custom``: model loading, the ModelPatcher's wrappers and callbacks copied
into ``transformer_options``, the conds processed and batched, cond and uncond in one call where memory allows) for
one step with a sampler function that records the ``BaseModel.apply_model`` calls ``calc_cond_batch`` makes instead
of running them. A timed forward (:class:`ModelCall`) replays them: ``apply_model(x, t, **c)`` through the patcher's
APPLY_MODEL wrappers, each call with a fresh copy of its ``transformer_options`` as ``calc_cond_batch`` builds one per
call, the patcher marked as the running one (``pre_run``) as during sampling. Its output, for the errors, is
``x - denoised`` (sigma times the model's own prediction), uncond before cond.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch

from . import comfy_host_models as models
from . import measure
from .family import Case
from .methods import Variant

COMFY_METHODS = ("vanilla", "node", "merge", "kv")
COMPILE_BACKENDS = ("inductor", "cudagraphs")  # TorchCompileModel's backend widget
SKIPPED = {"tomesd": "patches diffusers UNets only; --host comfyui runs ComfyUI's models and the ToMe node"}


class ComfyModel:
    """One family built in ComfyUI: the unpatched ``ModelPatcher`` (vanilla), its architecture and the node module."""

    def __init__(self, comfy: Any, family: str, arch: models.Arch, patcher: Any, nodes: Any) -> None:
        self.comfy, self.family, self.arch, self.patcher, self.nodes = comfy, family, arch, patcher, nodes

    @property
    def diffusion_model(self) -> torch.nn.Module:
        return self.patcher.model.diffusion_model

    @property
    def unet(self) -> bool:
        return self.family in models.UNET_FAMILIES


class ModelCall:
    """The ``BaseModel.apply_model`` calls of one sampler step, recorded by :func:`capture`, replayed per call."""

    def __init__(self, comfy: Any, patcher: Any, calls: list) -> None:
        if not calls:
            raise RuntimeError("--host comfyui: ComfyUI's sampler made no model call")
        self.copy = comfy.patcher_extension.copy_nested_dicts
        self.model, self.calls = patcher.model, calls

    def __call__(self) -> torch.Tensor:
        by_index: dict = {}
        for x, t, c in self.calls:
            options = self.copy(c["transformer_options"])  # calc_cond_batch builds a fresh one for every call
            denoised = self.model.apply_model(x, t, **dict(c, transformer_options=options))
            order = options.get("cond_or_uncond") or [0]
            for index, chunk in zip(order, (x - denoised).float().chunk(len(order))):
                by_index.setdefault(index, []).append(chunk)
        return torch.cat([torch.cat(by_index[i]) for i in sorted(by_index, reverse=True)])  # uncond (1), cond (0)


def capture(comfy: Any, patcher: Any, inputs: models.Inputs) -> ModelCall:
    """The model calls ComfyUI's sampler makes for one step of ``inputs`` with ``patcher``, recorded (not run)."""
    base = patcher.model
    sigma = float(base.model_sampling.percent_to_sigma(inputs.percent))
    calls: list = []

    def record(x, t, **c):  # in place of BaseModel.apply_model, as calc_cond_batch calls it
        calls.append((x, t, c))
        return x

    def one_step(model_k, x, sigmas, extra_args=None, callback=None, disable=None):
        base.apply_model = record
        try:
            model_k(x, sigmas[0] * x.new_ones([x.shape[0]]), **(extra_args or {}))
        finally:
            del base.apply_model
        return x

    comfy.sample.sample_custom(patcher, inputs.noise, inputs.cfg, comfy.samplers.KSAMPLER(one_step),
                               torch.tensor([sigma, 0.0]), inputs.positive, inputs.negative, inputs.latent,
                               disable_pbar=True, seed=0)
    return ModelCall(comfy, patcher, calls)


class Session:
    """A variant's ``ModelPatcher`` while it is the one sampling: called with a case's inputs, the model calls of one
    step (captured once per inputs object)."""

    def __init__(self, comfy: Any, patcher: Any) -> None:
        self.comfy, self.patcher, self.calls = comfy, patcher, {}

    def prepare(self, inputs: models.Inputs) -> ModelCall:
        call = capture(self.comfy, self.patcher, inputs)
        self.patcher.pre_run()  # as outer_sample does around the sampling (the capture's run ended with cleanup)
        self.calls[id(inputs)] = (inputs, call)
        return call

    def __call__(self, inputs: models.Inputs) -> torch.Tensor:
        held = self.calls.get(id(inputs))
        return (held[1] if held else self.prepare(inputs))()

    def close(self) -> None:
        self.calls.clear()
        self.patcher.cleanup()


def node_options(variant: Variant, max_downsample: int = 1, use_rand: bool = True, seed: int = 0) -> dict:
    """The ToMe (advanced) node's widget values of ``variant`` (its own defaults elsewhere, the speed check off)."""
    values = dict(ratio=variant.ratio, max_downsample=max_downsample, sx=2, sy=2, use_rand=use_rand, tome_seed=seed,
                  mode=variant.method, merge_crossattn=False, start_percent=0.0, end_percent=1.0, min_tokens=0,
                  speed_check="off")
    if variant.cell is not None:
        values.update(sx=variant.cell[0], sy=variant.cell[1])
    if variant.blocks is not None:
        values.update(block_start=variant.blocks[0], block_end=variant.blocks[1])
    return values


def apply_node(model: ComfyModel, variant: Variant, **options) -> Any:
    """The patched clone the ToMe node returns for ``variant`` (vanilla: the model's own patcher)."""
    if variant.method == "vanilla":
        return model.patcher
    if variant.method == "node":
        node = model.nodes.ToMe()
        return node.patch(model.patcher, ratio=variant.ratio, max_downsample=options.get("max_downsample", 1))[
            "result"][0]
    return model.nodes.ToMeAdvanced().patch(model.patcher, **node_options(variant, **options))["result"][0]


def compile_node() -> Any:
    """The ComfyUI's TorchCompileModel node class (see the module)."""
    from comfy_extras.nodes_torch_compile import TorchCompileModel

    return TorchCompileModel


def compile_node_missing() -> Optional[str]:
    """Why this ComfyUI's TorchCompileModel cannot run here, else None."""
    try:
        compile_node()
    except ImportError as error:
        return (f"ComfyUI's TorchCompileModel (comfy_extras/nodes_torch_compile.py) does not import here: {error} "
                "(its comfy_api.latest needs PyAV: pip install av)")
    return None


def apply_compile(patcher: Any, backend: str) -> Any:
    """What ComfyUI's TorchCompileModel node returns for ``patcher``: a clone with its compile wrapper."""
    return compile_node().execute(model=patcher, backend=backend).result[0]


@contextlib.contextmanager
def session(model: ComfyModel, variant: Variant, inputs: models.Inputs, backend: Optional[str] = None,
            **options) -> Iterator[Session]:
    """``variant`` applied by the node (then compiled with ``backend``, as TorchCompileModel does), its sampler step
    captured for ``inputs``; the patcher's run ended on exit."""
    patcher = apply_node(model, variant, **options)
    if backend is not None:
        patcher = apply_compile(patcher, backend)
    held = Session(model.comfy, patcher)
    held.prepare(inputs)
    try:
        yield held
    finally:
        held.close()


def forward(held: Session, inputs: models.Inputs) -> torch.Tensor:
    return held(inputs)


@contextlib.contextmanager
def peaked_attention(model: ComfyModel, factor: float) -> Iterator[ComfyModel]:
    """q/k of every self-attention scaled by ``factor`` (``comfy_host_models.qk_parameters``), restored on exit."""
    from .models import scaled_parameters

    with scaled_parameters(models.qk_parameters(model.diffusion_model, model.unet), factor):
        yield model


class ComfyHost:
    """The benchmark's ComfyUI host (``runner.HOSTS["comfyui"]``): every family in ComfyUI's classes, the node's
    variants, TorchCompileModel's backends as compile modes."""

    kind = "ComfyUI"
    names = models.COMFY_FAMILIES
    methods = COMFY_METHODS
    method_names = COMFY_METHODS
    compile_modes = COMPILE_BACKENDS
    skipped = SKIPPED
    compiles = False  # no diffusers module profile (--profile's traces still run)
    defaults_in_config = False

    def availability(self, method: str) -> Optional[str]:
        return None if method in COMFY_METHODS else f"not a --host comfyui method ({', '.join(COMFY_METHODS)})"

    def check(self, cfg: Any, method_names: tuple) -> None:
        """Refuse what ComfyUI's path cannot run, naming the fix."""
        from .dit_runner import check_config

        problem = models.missing()
        if problem:
            raise ValueError(problem)
        unmerged = [f for f in cfg.families if f not in models.UNET_FAMILIES and "merge" not in comfy_modes(f)]
        if "merge" in method_names and unmerged:
            raise ValueError(f"methods: mode merge does not reach {', '.join(unmerged)} in ComfyUI")
        if any(f not in models.UNET_FAMILIES for f in cfg.families):
            check_config(cfg, ("vanilla",))  # the DiTs' blocks, depth, frames and sizes, as the diffusers bench
        if torch.device(cfg.device).type == "cuda" and torch.device(cfg.device).index not in (None, 0):
            raise ValueError("--host comfyui runs on ComfyUI's device, cuda:0: choose the GPU with "
                             "CUDA_VISIBLE_DEVICES")

    def compile_skip(self, mode: str, device: str) -> Optional[str]:
        if mode == "cudagraphs" and torch.device(device).type != "cuda":
            return "the cudagraphs backend captures CUDA graphs: it needs --device cuda"
        return compile_node_missing()

    def default_sizes(self, name: str) -> tuple:
        return _diffusers_kind(name).default_sizes(name)

    def default_batch(self, name: str) -> int:
        return _diffusers_kind(name).default_batch(name)

    def build(self, name: str, cfg: Any) -> ComfyModel:
        device = torch.device(cfg.device)
        comfy = models.import_comfy(device)
        comfy.model_management.unload_all_models()  # the previous family's: one model on the device at a time
        comfy.model_management.soft_empty_cache()
        arch = models.arch(name, "tiny" if cfg.scale == "tiny" else "full", cfg.blocks, getattr(cfg, "depth", "blocks"))
        patcher = models.build_model(comfy, arch, device, measure.DTYPES[cfg.dtype], cfg.seed)
        return ComfyModel(comfy, name, arch, patcher, models.load_nodes())

    def case(self, model: ComfyModel, name: str, size: tuple, cfg: Any) -> Case:
        def inputs_of(content: str) -> models.Inputs:
            return models.make_inputs(model.patcher, name, model.arch, cfg.batch_for(name), size, cfg.frames,
                                      cfg.seed, content, cfg.photo)

        inputs = inputs_of(cfg.inputs_content)

        def patch(held: ComfyModel, variant: Variant, **options):
            return session(held, variant, inputs, **options)

        def compiled(held: ComfyModel, variant: Variant, mode: str, **options):
            return session(held, variant, inputs, backend=mode, **options)

        return Case(inputs, forward, peaked_attention, errors=_errors(model),
                    extra=lambda: self._extra(model, size, cfg), patched=patch, compiled=compiled,
                    photo_inputs=inputs_of("photo") if cfg.content == "both" else None,
                    compile_skip=lambda mode: self.compile_skip(mode, cfg.device))

    @staticmethod
    def _extra(model: ComfyModel, size: tuple, cfg: Any) -> dict:
        fields = dict(host="comfyui", comfy_class=type(model.patcher.model).__name__,
                      attention_impl=_attention_name())
        if not model.unet:
            from . import dit_models

            image, text = dit_models.token_counts(model.family, size[1], size[0], cfg.frames)
            fields.update(image_tokens=image, text_tokens=text, blocks=model.arch.blocks, depth=cfg.depth,
                          guided="distilled" if model.arch.cfg == 1.0 else "cfg")
            if model.family == "wan":
                fields.update(frames=cfg.frames)
        return fields


def _diffusers_kind(name: str) -> Any:
    from .dit_runner import DIT
    from .unet_family import UNET

    return UNET if name in models.UNET_FAMILIES else DIT


def comfy_modes(family: str) -> tuple:
    """The modes the catalogue gives ``family``'s ComfyUI classes."""
    from tome_core.catalogue.families import BY_NAME, modes_of

    return modes_of(BY_NAME[family], "comfy")


def _attention_name() -> Optional[str]:
    import sys

    attention = sys.modules.get("comfy.ldm.modules.attention")
    return getattr(getattr(attention, "optimized_attention", None), "__name__", None)


def _errors(model: ComfyModel):
    """measure.errors, the guided error of a one-pass model (cfg 1: Flux, Z-Image-Turbo) being its output's."""
    def errors(y: torch.Tensor, ref: torch.Tensor, guidance: float):
        raw, guided = measure.errors(y, ref, guidance)
        return raw, raw if model.arch.cfg == 1.0 else guided
    return errors


COMFY = ComfyHost()
