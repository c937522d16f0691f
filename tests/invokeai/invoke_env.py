"""Set-up for running tome inside a real InvokeAI server, headless (CPU, no network).

The InvokeAI is the PyPI one in ``.venv-invoke`` (tests/invokeai/setup_env.sh; ``TOME_INVOKE_PYTHON`` names another
python). ``InvokeServer`` starts ``invokeai-web`` (through invoke_launch.py, which guards PyPI's CUDA torchvision) in
a subprocess with a temporary ``INVOKEAI_ROOT``: an ``invokeai.yaml`` (CPU, float32, random "hashes" so big files are
not hashed, an in-memory database) and this repository linked as the custom node pack ``$INVOKEAI_ROOT/nodes/tome``.
Tests talk to it over its REST API only, as the web UI does: install a model (``POST /api/v2/models/install``),
enqueue a graph (``POST /api/v1/queue/default/enqueue_batch``), poll its queue item, fetch the image.

The tiny models and the offline Hugging Face config cache (``HF_HOME``, with ``HF_HUB_OFFLINE=1``) live under
``cache_dir()`` (``TOME_INVOKE_CACHE``, default ``<repo>/.cache/invoke``) and are built once (tiny_models.py).
"""
from __future__ import annotations

import io
import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.parse
import urllib.request
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, List, Optional

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LAUNCHER = HERE / "invoke_launch.py"
NODE_PACK_NAME = "tome"  # the folder name under $INVOKEAI_ROOT/nodes, i.e. the module name InvokeAI imports
TOME_DENOISE = "tome_denoise_latents"


def invoke_python() -> Path:
    """The python of the InvokeAI environment (``TOME_INVOKE_PYTHON``, default ``<repo>/.venv-invoke/bin/python``)."""
    return Path(os.environ.get("TOME_INVOKE_PYTHON") or REPO / ".venv-invoke" / "bin" / "python")


def cache_dir() -> Path:
    path = Path(os.environ.get("TOME_INVOKE_CACHE") or REPO / ".cache" / "invoke").resolve()
    path.mkdir(parents=True, exist_ok=True)
    return path


def find_invokeai() -> Optional[str]:
    """None when ``invoke_python()`` can import InvokeAI's server, else why not."""
    python = invoke_python()
    if not python.exists():
        return f"{python} does not exist"
    probe = subprocess.run([str(python), "-c", "import importlib.util as u; "
                            "assert u.find_spec('invokeai.app.run_app'), 'invokeai is not installed'"],
                           capture_output=True, text=True, timeout=120)
    if probe.returncode != 0:
        return f"{python} cannot import invokeai: {probe.stderr.strip()[-500:]}"
    return None


def require_invokeai(required_flag: str = "TOME_REQUIRE_INVOKE") -> Path:
    """The InvokeAI python; skips the test when InvokeAI is not importable there, or fails when the environment
    variable ``required_flag`` is "1" (so a broken test environment fails loudly)."""
    import pytest

    problem = find_invokeai()
    if problem is not None:
        message = f"no InvokeAI to test against ({problem}): run bash tests/invokeai/setup_env.sh"
        if os.environ.get(required_flag) == "1":
            pytest.fail(message)
        pytest.skip(message)
    return invoke_python()


def build_tiny_sd15(python: Optional[Path] = None) -> tuple:
    """(checkpoint path, HF_HOME) of the tiny SD1.5 model, built once under ``cache_dir()`` in a subprocess of the
    InvokeAI python (so the test process needs no torch)."""
    cache = cache_dir()
    code = ("import sys, json; sys.path.insert(0, sys.argv[1]); import tiny_models; "
            "print(json.dumps([str(p) for p in tiny_models.write_tiny_sd15(sys.argv[2])]))")
    done = subprocess.run([str(python or invoke_python()), "-c", code, str(HERE), str(cache)],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny SD1.5 model failed:\n{done.stderr[-4000:]}")
    checkpoint, hf_home = json.loads(done.stdout.strip().splitlines()[-1])
    return Path(checkpoint), Path(hf_home)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


class InvokeError(RuntimeError):
    """The server answered an HTTP error."""

    def __init__(self, method: str, path: str, status: int, body: bytes) -> None:
        super().__init__(f"{method} {path}: HTTP {status}: {body[:2000].decode(errors='replace')}")
        self.status, self.body = status, body


@dataclass
class QueueResult:
    """A finished queue item: status ("completed" | "failed" | "canceled"), its error fields, and the raw item."""

    status: str
    error_type: Optional[str]
    error_message: Optional[str]
    error_traceback: Optional[str]
    item: Dict[str, Any] = field(repr=False, default_factory=dict)

    @property
    def ok(self) -> bool:
        return self.status == "completed"

    def describe(self) -> str:
        return (f"queue item {self.item.get('item_id')}: {self.status}: {self.error_type}: {self.error_message}\n"
                f"{self.error_traceback or ''}")

    def output(self, node_id: str) -> Dict[str, Any]:
        """The output of the graph node ``node_id`` (its source id, as in the graph that was enqueued)."""
        session = self.item["session"]
        prepared = session["source_prepared_mapping"][node_id]
        return session["results"][sorted(prepared)[0]]

    def image_name(self, node_id: str = "l2i") -> str:
        return self.output(node_id)["image"]["image_name"]


class InvokeServer:
    """A real ``invokeai-web`` in a subprocess, its root in ``root``; stop() ends it."""

    def __init__(self, root: Path, hf_home: Optional[Path] = None, python: Optional[Path] = None,
                 timeout: float = 240, extra_config: str = "") -> None:
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)
        nodes = self.root / "nodes"
        nodes.mkdir(exist_ok=True)
        link = nodes / NODE_PACK_NAME
        if not link.exists():
            link.symlink_to(REPO, target_is_directory=True)
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        (self.root / "invokeai.yaml").write_text(
            "# Internal metadata - do not edit:\nschema_version: 4.0.3\n\n# Put user settings here:\n"
            f"host: 127.0.0.1\nport: {self.port}\ndevice: cpu\nprecision: float32\nhashing_algorithm: random\n"
            "use_memory_db: true\npatchmatch: false\nlog_level: info\n" + extra_config)
        env = dict(os.environ, INVOKEAI_ROOT=str(self.root), PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", HF_HUB_DISABLE_TELEMETRY="1", TOKENIZERS_PARALLELISM="false")
        if hf_home is not None:
            env["HF_HOME"] = str(hf_home)
        self.log_path = self.root / "server.log"
        self._log = open(self.log_path, "w")
        self.process = subprocess.Popen([str(python or invoke_python()), str(LAUNCHER), "--root", str(self.root)],
                                        cwd=self.root, env=env, stdout=self._log, stderr=subprocess.STDOUT)
        self.startup_seconds = None
        self._wait_ready(timeout)

    # ------------------------------------------------------------ process

    def _wait_ready(self, timeout: float) -> None:
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if self.process.poll() is not None:
                raise RuntimeError(f"invokeai-web exited with code {self.process.returncode}:\n{self.log_tail()}")
            try:
                self.get_json("/api/v1/app/version")
                self.startup_seconds = time.monotonic() - start
                return
            except (OSError, ValueError, InvokeError):
                time.sleep(0.5)
        self.stop()
        raise RuntimeError(f"invokeai-web did not answer within {timeout:.0f} s:\n{self.log_tail()}")

    def log_tail(self, lines: int = 80) -> str:
        if not self._log.closed:
            self._log.flush()
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(30)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        if not self._log.closed:
            self._log.close()

    # ------------------------------------------------------------ HTTP

    def request(self, method: str, path: str, body: Any = None, timeout: float = 120) -> bytes:
        """The raw body of one request; InvokeError on an HTTP error status."""
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, method=method,
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=timeout) as response:
                return response.read()
        except urllib.error.HTTPError as error:
            raise InvokeError(method, path, error.code, error.read()) from None

    def get_json(self, path: str) -> Any:
        return json.loads(self.request("GET", path))

    def post_json(self, path: str, body: Any = None) -> Any:
        return json.loads(self.request("POST", path, {} if body is None else body))

    def openapi(self) -> Dict[str, Any]:
        return self.get_json("/openapi.json")

    def invocation_schema(self, invocation_type: str) -> Optional[Dict[str, Any]]:
        """The OpenAPI schema of the invocation whose ``type`` is ``invocation_type``, or None if not listed."""
        for schema in self.openapi()["components"]["schemas"].values():
            kind = schema.get("properties", {}).get("type", {})
            if kind.get("default") == invocation_type and "output" in schema:
                return schema
        for schema in self.openapi()["components"]["schemas"].values():
            if schema.get("properties", {}).get("type", {}).get("default") == invocation_type:
                return schema
        return None

    def invocation_types(self) -> List[str]:
        """The ``type`` of every invocation the server offers (core and custom nodes)."""
        types = set()
        for schema in self.openapi()["components"]["schemas"].values():
            kind = schema.get("properties", {}).get("type", {})
            if schema.get("class") == "invocation" and isinstance(kind.get("default"), str):
                types.add(kind["default"])
        return sorted(types)

    # ------------------------------------------------------------ models

    def install_model(self, source: Path, config: Optional[Dict[str, Any]] = None, inplace: bool = True,
                      timeout: float = 300) -> Dict[str, Any]:
        """Install the model at the local path ``source`` (``config``: fields the prober may not guess, e.g.
        {"name": ..., "variant": ...}) and wait for the job; its model config (key, base, type, format...)."""
        query = urllib.parse.urlencode({"source": str(source), "inplace": str(inplace).lower()})
        job = self.post_json(f"/api/v2/models/install?{query}", config or {})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            job = self.get_json(f"/api/v2/models/install/{job['id']}")
            if job["status"] == "completed":
                return job["config_out"]
            if job["status"] in ("error", "cancelled"):
                raise RuntimeError(f"installing {source}: {job['status']}: {job.get('error_reason')}: "
                                   f"{job.get('error')}\n{job.get('error_traceback')}\n{self.log_tail(30)}")
            time.sleep(0.3)
        raise TimeoutError(f"installing {source} did not finish in {timeout:.0f} s:\n{self.log_tail()}")

    def models(self) -> List[Dict[str, Any]]:
        return self.get_json("/api/v2/models/")["models"]

    # ------------------------------------------------------------ queue

    def enqueue(self, graph: Dict[str, Any], runs: int = 1) -> List[int]:
        """Enqueue ``graph`` as a batch on the default queue; the queue item ids."""
        result = self.post_json("/api/v1/queue/default/enqueue_batch", {
            "prepend": False,
            "batch": {"graph": graph, "runs": runs, "origin": "tome-tests", "destination": "gallery"}})
        return result["item_ids"]

    def wait_item(self, item_id: int, timeout: float = 600) -> QueueResult:
        """Poll the queue item until it completed, failed or was canceled."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            item = self.get_json(f"/api/v1/queue/default/i/{item_id}")
            if item["status"] in ("completed", "failed", "canceled"):
                return QueueResult(item["status"], item.get("error_type"), item.get("error_message"),
                                   item.get("error_traceback"), item)
            if self.process.poll() is not None:
                raise RuntimeError(f"invokeai-web exited while running item {item_id}:\n{self.log_tail()}")
            time.sleep(0.2)
        raise TimeoutError(f"queue item {item_id} did not finish in {timeout:.0f} s:\n{self.log_tail()}")

    def run(self, graph: Dict[str, Any], timeout: float = 600) -> QueueResult:
        """Enqueue ``graph`` once and wait for its queue item."""
        (item_id,) = self.enqueue(graph)
        return self.wait_item(item_id, timeout)

    # ------------------------------------------------------------ images

    def image_bytes(self, image_name: str) -> bytes:
        """The full image file (PNG) as stored by the server."""
        return self.request("GET", f"/api/v1/images/i/{urllib.parse.quote(image_name)}/full")

    def image(self, image_name: str):
        """The image as an RGB uint8 numpy array (H, W, 3)."""
        import numpy as np
        from PIL import Image

        return np.asarray(Image.open(io.BytesIO(self.image_bytes(image_name))).convert("RGB"))

    def run_image(self, graph: Dict[str, Any], output_node: str = "l2i"):
        """Run ``graph``, assert it completed, and return its image (numpy RGB uint8)."""
        result = self.run(graph)
        assert result.ok, result.describe() + "\n" + self.log_tail(40)
        return self.image(result.image_name(output_node))


# ---------------------------------------------------------------- graphs


def model_identifier(config: Dict[str, Any], submodel_type: Optional[str] = None) -> Dict[str, Any]:
    """The ModelIdentifierField of an installed model's config (what the UI puts in a model loader node)."""
    ident = {key: config[key] for key in ("key", "hash", "name", "base", "type")}
    if submodel_type:
        ident["submodel_type"] = submodel_type
    return ident


def _edge(source: str, source_field: str, destination: str, destination_field: str) -> Dict[str, Any]:
    return {"source": {"node_id": source, "field": source_field},
            "destination": {"node_id": destination, "field": destination_field}}


def sd15_txt2img_graph(model: Dict[str, Any], *, seed: int = 0, width: int = 64, height: int = 64, steps: int = 2,
                       cfg: float = 5.0, scheduler: str = "euler", positive: str = "a photo of a cat",
                       negative: str = "blurry", clip_skip: int = 0, denoise_type: str = "denoise_latents",
                       denoise_fields: Optional[Dict[str, Any]] = None, use_cache: bool = False) -> Dict[str, Any]:
    """The SD1.5 text-to-image graph of the web UI's SD1 builder: main_model_loader -> clip_skip -> compel x2,
    noise -> denoise -> l2i (node ids: model_loader, clip_skip, positive, negative, noise, denoise, l2i).

    model: an installed model's config (or its ModelIdentifierField). denoise_type replaces the denoise node's type
    (e.g. "tome_denoise_latents"); denoise_fields are added to it. use_cache False on every node, so a repeated graph
    runs again instead of coming back from InvokeAI's node cache.
    """
    ident = model_identifier(model) if "submodel_type" not in model else model
    nodes = {
        "model_loader": {"type": "main_model_loader", "model": ident},
        "clip_skip": {"type": "clip_skip", "skipped_layers": clip_skip},
        "positive": {"type": "compel", "prompt": positive},
        "negative": {"type": "compel", "prompt": negative},
        "noise": {"type": "noise", "seed": seed, "width": width, "height": height, "use_cpu": True},
        "denoise": dict({"type": denoise_type, "steps": steps, "cfg_scale": cfg, "scheduler": scheduler,
                         "denoising_start": 0.0, "denoising_end": 1.0, "cfg_rescale_multiplier": 0.0},
                        **(denoise_fields or {})),
        "l2i": {"type": "l2i", "fp32": True, "is_intermediate": False},
    }
    for node_id, node in nodes.items():
        node.update(id=node_id, use_cache=use_cache)
    edges = [
        _edge("model_loader", "clip", "clip_skip", "clip"),
        _edge("clip_skip", "clip", "positive", "clip"),
        _edge("clip_skip", "clip", "negative", "clip"),
        _edge("positive", "conditioning", "denoise", "positive_conditioning"),
        _edge("negative", "conditioning", "denoise", "negative_conditioning"),
        _edge("noise", "noise", "denoise", "noise"),
        _edge("model_loader", "unet", "denoise", "unet"),
        _edge("denoise", "latents", "l2i", "latents"),
        _edge("model_loader", "vae", "l2i", "vae"),
    ]
    return {"id": f"tome-test-{uuid.uuid4().hex[:12]}", "nodes": nodes, "edges": edges}


def tome_fields(ratio: float = -1.0, mode: str = "default", max_downsample: int = 1, start: float = 0.0,
                end: float = 1.0, speed_check: str = "off") -> Dict[str, Any]:
    """The extra fields of the ToMe node pack's ``tome_denoise_latents`` (denoise_latents' inputs plus these)."""
    return {"tome_ratio": ratio, "tome_mode": mode, "tome_max_downsample": max_downsample, "tome_start": start,
            "tome_end": end, "tome_speed_check": speed_check}


# ---------------------------------------------------------------- transformer families


def build_tiny_model(family: str, python: Optional[Path] = None) -> Path:
    """The folder of the tiny ``family`` model (tiny_models.write_tiny_<family>: "sd3", "flux2_klein", "z_image",
    "qwen_image"),
    built once under ``cache_dir()`` in a subprocess of the InvokeAI python."""
    code = ("import sys; sys.path.insert(0, sys.argv[1]); import tiny_models; "
            f"print(tiny_models.write_tiny_{family}(sys.argv[2]))")
    done = subprocess.run([str(python or invoke_python()), "-c", code, str(HERE), str(cache_dir())],
                          capture_output=True, text=True, timeout=600)
    if done.returncode != 0:
        raise RuntimeError(f"building the tiny {family} model failed:\n{done.stderr[-4000:]}")
    return Path(done.stdout.strip().splitlines()[-1])


def _graph(nodes: Dict[str, Dict[str, Any]], edges: List[Dict[str, Any]], use_cache: bool) -> Dict[str, Any]:
    for node_id, node in nodes.items():
        node.update(id=node_id, use_cache=use_cache)
    return {"id": f"tome-test-{uuid.uuid4().hex[:12]}", "nodes": nodes, "edges": edges}


def sd3_txt2img_graph(model: Dict[str, Any], *, seed: int = 0, width: int = 64, height: int = 64, steps: int = 2,
                      cfg: float = 3.5, positive: str = "a photo of a cat", negative: str = "blurry",
                      denoise_type: str = "sd3_denoise", denoise_fields: Optional[Dict[str, Any]] = None,
                      use_cache: bool = False) -> Dict[str, Any]:
    """The SD3 text-to-image graph of the web UI's buildSD3Graph: sd3_model_loader -> sd3_text_encoder x2 (CLIP-L,
    CLIP-G and T5 of the main model) -> sd3_denoise -> sd3_l2i (node ids: model_loader, positive, negative,
    denoise, l2i; the prompts and seed set on the nodes instead of through string/integer nodes)."""
    nodes = {
        "model_loader": {"type": "sd3_model_loader", "model": model_identifier(model)},
        "positive": {"type": "sd3_text_encoder", "prompt": positive},
        "negative": {"type": "sd3_text_encoder", "prompt": negative},
        "denoise": dict({"type": denoise_type, "cfg_scale": cfg, "steps": steps, "width": width, "height": height,
                         "seed": seed, "denoising_start": 0.0, "denoising_end": 1.0}, **(denoise_fields or {})),
        "l2i": {"type": "sd3_l2i", "is_intermediate": False},
    }
    edges = [_edge("model_loader", "transformer", "denoise", "transformer")]
    for prompt in ("positive", "negative"):
        edges += [_edge("model_loader", name, prompt, name) for name in ("clip_l", "clip_g", "t5_encoder")]
        edges.append(_edge(prompt, "conditioning", "denoise", f"{prompt}_conditioning"))
    edges += [_edge("model_loader", "vae", "l2i", "vae"), _edge("denoise", "latents", "l2i", "latents")]
    return _graph(nodes, edges, use_cache)


def dit_tome_fields(ratio: float = -1.0, mode: str = "default", start: float = 0.0, end: float = 1.0,
                    speed_check: str = "off") -> Dict[str, Any]:
    """The extra fields of the ToMe node pack's transformer denoise nodes (``tome_<core type>``: no
    max_downsample)."""
    return {"tome_ratio": ratio, "tome_mode": mode, "tome_start": start, "tome_end": end,
            "tome_speed_check": speed_check}


def flux2_klein_txt2img_graph(model: Dict[str, Any], *, seed: int = 0, width: int = 64, height: int = 64,
                              steps: int = 2, scheduler: str = "euler", positive: str = "a photo of a cat",
                              max_seq_len: int = 256, denoise_type: str = "flux2_denoise",
                              denoise_fields: Optional[Dict[str, Any]] = None,
                              use_cache: bool = False) -> Dict[str, Any]:
    """The FLUX.2 Klein text-to-image graph of the web UI's buildFLUXGraph (a diffusers Klein main model, its own
    Qwen3 encoder and VAE): flux2_klein_model_loader -> flux2_klein_text_encoder -> collect -> flux2_denoise (CFG
    1, no negative prompt) -> flux2_vae_decode (node ids: model_loader, positive, pos_cond_collect, denoise, l2i).
    max_seq_len 256: the smaller of the two the loader offers."""
    nodes = {
        "model_loader": {"type": "flux2_klein_model_loader", "model": model_identifier(model),
                         "max_seq_len": max_seq_len},
        "positive": {"type": "flux2_klein_text_encoder", "prompt": positive},
        "pos_cond_collect": {"type": "collect"},
        "denoise": dict({"type": denoise_type, "num_steps": steps, "scheduler": scheduler, "width": width,
                         "height": height, "seed": seed, "cfg_scale": 1.0, "denoising_start": 0.0,
                         "denoising_end": 1.0}, **(denoise_fields or {})),
        "l2i": {"type": "flux2_vae_decode", "is_intermediate": False},
    }
    edges = [
        _edge("model_loader", "qwen3_encoder", "positive", "qwen3_encoder"),
        _edge("model_loader", "max_seq_len", "positive", "max_seq_len"),
        _edge("model_loader", "transformer", "denoise", "transformer"),
        _edge("model_loader", "vae", "denoise", "vae"),
        _edge("model_loader", "vae", "l2i", "vae"),
        _edge("positive", "conditioning", "pos_cond_collect", "item"),
        _edge("pos_cond_collect", "collection", "denoise", "positive_text_conditioning"),
        _edge("denoise", "latents", "l2i", "latents"),
    ]
    return _graph(nodes, edges, use_cache)


def z_image_txt2img_graph(model: Dict[str, Any], *, seed: int = 0, width: int = 128, height: int = 128,
                          steps: int = 2, scheduler: str = "euler", positive: str = "a photo of a cat",
                          denoise_type: str = "z_image_denoise", denoise_fields: Optional[Dict[str, Any]] = None,
                          use_cache: bool = False) -> Dict[str, Any]:
    """The Z-Image (Turbo) text-to-image graph of the web UI's buildZImageGraph (guidance 1, so no negative prompt):
    z_image_model_loader -> z_image_text_encoder -> collect -> z_image_denoise -> z_image_l2i (node ids:
    model_loader, positive, pos_cond_collect, denoise, l2i). The loader takes a diffusers main model's VAE and Qwen3
    encoder only from its "Qwen3 Source" (the UI's Qwen3 source selection; without it: "No VAE source provided"),
    here the same model."""
    ident = model_identifier(model)
    nodes = {
        "model_loader": {"type": "z_image_model_loader", "model": ident, "qwen3_source_model": ident},
        "positive": {"type": "z_image_text_encoder", "prompt": positive},
        "pos_cond_collect": {"type": "collect"},
        "denoise": dict({"type": denoise_type, "guidance_scale": 1.0, "steps": steps, "scheduler": scheduler,
                         "width": width, "height": height, "seed": seed, "denoising_start": 0.0,
                         "denoising_end": 1.0}, **(denoise_fields or {})),
        "l2i": {"type": "z_image_l2i", "is_intermediate": False},
    }
    edges = [
        _edge("model_loader", "transformer", "denoise", "transformer"),
        _edge("model_loader", "qwen3_encoder", "positive", "qwen3_encoder"),
        _edge("model_loader", "vae", "l2i", "vae"),
        _edge("model_loader", "vae", "denoise", "vae"),
        _edge("positive", "conditioning", "pos_cond_collect", "item"),
        _edge("pos_cond_collect", "collection", "denoise", "positive_conditioning"),
        _edge("denoise", "latents", "l2i", "latents"),
    ]
    return _graph(nodes, edges, use_cache)


def qwen_image_txt2img_graph(model: Dict[str, Any], *, seed: int = 0, width: int = 128, height: int = 128,
                             steps: int = 2, positive: str = "a photo of a cat",
                             denoise_type: str = "qwen_image_denoise", denoise_fields: Optional[Dict[str, Any]] = None,
                             use_cache: bool = False) -> Dict[str, Any]:
    """The Qwen-Image text-to-image graph of the web UI's buildQwenImageGraph (a diffusers main model: its own VAE
    and Qwen2.5-VL encoder; CFG 1, so no negative prompt node): qwen_image_model_loader -> qwen_image_text_encoder
    -> qwen_image_denoise -> qwen_image_l2i (node ids: model_loader, positive, denoise, l2i)."""
    nodes = {
        "model_loader": {"type": "qwen_image_model_loader", "model": model_identifier(model)},
        "positive": {"type": "qwen_image_text_encoder", "prompt": positive},
        "denoise": dict({"type": denoise_type, "cfg_scale": 1.0, "steps": steps, "width": width, "height": height,
                         "seed": seed, "denoising_start": 0.0, "denoising_end": 1.0}, **(denoise_fields or {})),
        "l2i": {"type": "qwen_image_l2i", "is_intermediate": False},
    }
    edges = [
        _edge("model_loader", "transformer", "denoise", "transformer"),
        _edge("model_loader", "qwen_vl_encoder", "positive", "qwen_vl_encoder"),
        _edge("model_loader", "vae", "l2i", "vae"),
        _edge("positive", "conditioning", "denoise", "positive_conditioning"),
        _edge("denoise", "latents", "l2i", "latents"),
    ]
    return _graph(nodes, edges, use_cache)
