"""ToMe's transformer denoise nodes in a real InvokeAI, family by family, through each family's own graph.

Each family's tiny seeded model is a diffusers folder written by tiny_models.py and installed through the
model-install API (InvokeAI probes it offline); its text-to-image graph is the web UI's (invoke_env.py). For each
family: the plain graph renders, deterministically; the same graph with its denoise node swapped for the node
pack's ``tome_<core type>`` at the model's defaults (ratio -1, mode "default") renders another image and says in
the server log what it ran; at ratio 0 it renders the plain image bit for bit; a later plain job renders what the
plain job rendered before any ToMe job (the model in InvokeAI's cache left as it was); mode kv renders another
image, and where the family's class takes both modes mode merge renders a third; where it takes kv only, mode merge
fails the job with ToMe's message and the server serves on.

Families: SD3 (kv only: default kv 0.5), FLUX.2 Klein (default merge 0.2), Z-Image and Qwen-Image (default merge
0.025: at 128 px, 8x8 image tokens, so int(64 * 0.025) = 1 token merges; at 64 px none would).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Dict, Tuple

import numpy as np
import pytest

import invoke_env
from invoke_env import dit_tome_fields


@dataclass(frozen=True)
class Family:
    name: str  # tiny_models.write_tiny_<name>
    denoise: str  # the core denoise invocation's type
    graph: Callable[..., Dict[str, Any]]  # invoke_env's graph builder: (model, seed=, width=, height=, ...)
    installs_as: Tuple[str, str, str]  # (base, type, format) InvokeAI's prober gives the folder
    default_log: str  # what the server log says at ratio -1 / mode "default"
    both_modes: bool  # the class takes mode merge as well as kv
    size: int = 64  # image side (px)

    @property
    def tome_type(self) -> str:
        return f"tome_{self.denoise}"


FAMILIES = {
    "sd3": Family("sd3", "sd3_denoise", invoke_env.sd3_txt2img_graph, ("sd-3", "main", "diffusers"),
                  "ToMe kv r=0.5 on SD3Transformer2DModel", both_modes=False),
    "flux2_klein": Family("flux2_klein", "flux2_denoise", invoke_env.flux2_klein_txt2img_graph,
                          ("flux2", "main", "diffusers"), "ToMe merge r=0.2 on Flux2Transformer2DModel",
                          both_modes=True),
    # 128 px: 8x8 image tokens, so the default merge 0.025 merges int(64 * 0.025) = 1 token (at 64 px: none)
    "z_image": Family("z_image", "z_image_denoise", invoke_env.z_image_txt2img_graph, ("z-image", "main", "diffusers"),
                      "ToMe merge r=0.025 on ZImageTransformer2DModel", both_modes=True, size=128),
    "qwen_image": Family("qwen_image", "qwen_image_denoise", invoke_env.qwen_image_txt2img_graph,
                         ("qwen-image", "main", "diffusers"), "ToMe merge r=0.025 on QwenImageTransformer2DModel",
                         both_modes=True, size=128),
}


def _differs(a, b) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


class _Installed:
    """One family's tiny model installed in the server, and its plain image for a seed (rendered once)."""

    def __init__(self, server: invoke_env.InvokeServer, family: Family, config: Dict[str, Any]) -> None:
        self.server, self.family, self.config = server, family, config
        self._plain: Dict[int, np.ndarray] = {}

    def graph(self, seed: int, **tome: Any) -> Dict[str, Any]:
        extra = {} if not tome else {"denoise_type": self.family.tome_type, "denoise_fields": dit_tome_fields(**tome)}
        size = self.family.size
        return self.family.graph(self.config, seed=seed, width=size, height=size, **extra)

    def render(self, seed: int, **tome: Any) -> np.ndarray:
        return self.server.run_image(self.graph(seed, **tome))

    def plain(self, seed: int) -> np.ndarray:
        if seed not in self._plain:
            self._plain[seed] = self.render(seed)
        return self._plain[seed]

    def render_logged(self, seed: int, **tome: Any) -> Tuple[np.ndarray, str]:
        """The image, and what the server logged while it rendered."""
        start = self.server.log_path.stat().st_size
        image = self.render(seed, **tome)
        self.server._log.flush()
        with open(self.server.log_path, "rb") as log:
            log.seek(start)
            return image, log.read().decode(errors="replace")


_installed: Dict[str, _Installed] = {}


def _install(invoke: invoke_env.InvokeServer, invoke_python, name: str) -> _Installed:
    """The family's tiny model, built (once, cached) and installed (once per server) through the REST API."""
    if name not in _installed or _installed[name].server is not invoke:
        folder = invoke_env.build_tiny_model(name, invoke_python)
        _installed[name] = _Installed(invoke, FAMILIES[name], invoke.install_model(folder))
    return _installed[name]


@pytest.fixture(params=sorted(FAMILIES), ids=lambda name: name)
def family(request, invoke, invoke_python) -> _Installed:
    return _install(invoke, invoke_python, request.param)


def test_the_tiny_model_installs_as_its_family(family, invoke):
    config = family.config
    assert (config["base"], config["type"], config["format"]) == family.family.installs_as, config
    assert family.family.tome_type in invoke.invocation_types()


def test_the_plain_graph_renders_deterministically(family):
    size = family.family.size
    first = family.plain(21)
    assert first.shape == (size, size, 3) and first.dtype == np.uint8
    assert first.std() > 2.0  # an image, not a flat colour
    assert np.array_equal(first, family.render(21))


def test_the_tome_node_at_the_models_defaults_changes_the_image_and_says_what_ran(family):
    plain = family.plain(21)
    tome, log = family.render_logged(21, ratio=-1.0, mode="default")
    assert tome.shape == plain.shape
    assert _differs(plain, tome) > 0.0, "ToMe at the model's defaults rendered the plain image"
    assert family.family.default_log in log, log[-3000:]


def test_the_tome_node_at_ratio_zero_renders_the_plain_image_bit_for_bit(family):
    plain = family.plain(21)
    zero = family.render(21, ratio=0.0, mode="default")
    assert np.array_equal(plain, zero), _differs(plain, zero)


def test_mode_kv_renders_another_image(family):
    plain = family.plain(21)
    kv, log = family.render_logged(21, ratio=0.5, mode="kv")
    assert _differs(plain, kv) > 0.0, "ToMe kv rendered the plain image"
    assert "ToMe kv r=0.5 on" in log, log[-3000:]
    if family.family.both_modes:
        merge = family.render(21, ratio=0.5, mode="merge")
        assert _differs(plain, merge) > 0.0 and not np.array_equal(merge, kv)


def test_a_later_plain_job_renders_what_it_rendered_before_any_tome_job(family):
    before = family.plain(21)
    family.render(21, ratio=0.5, mode="kv")
    after = family.render(21)
    assert np.array_equal(before, after), _differs(before, after)


@pytest.mark.parametrize("name", [name for name, family in sorted(FAMILIES.items()) if not family.both_modes])
def test_mode_merge_where_the_class_takes_only_kv_fails_with_tomes_message_and_the_server_serves_on(
        name, invoke, invoke_python):
    family = _install(invoke, invoke_python, name)
    plain = family.plain(21)
    failed = family.server.run(family.graph(21, ratio=0.5, mode="merge"))
    assert failed.status == "failed", failed.describe()
    assert "use mode='kv'" in (failed.error_message or ""), failed.describe()
    assert np.array_equal(plain, family.render(21))


def test_flux2_default_merge_takes_the_diffusers_bindings_block_range(invoke, invoke_python):
    """InvokeAI loads FLUX.2 as diffusers' Flux2Transformer2DModel, so its default is the diffusers binding's: merge
    0.2 over every block (the catalogue's ``flux2``: its double and single blocks; ComfyUI's Flux class, which also
    runs Flux.2, leaves the double blocks out). On the tiny model's 1 double and 2 single blocks: 3 blocks."""
    family = _install(invoke, invoke_python, "flux2_klein")
    _, log = family.render_logged(22, ratio=-1.0, mode="default")
    said = [line for line in log.splitlines() if "ToMe merge r=0.2 on Flux2Transformer2DModel" in line]
    assert said, log[-3000:]
    assert ": 3 blocks carry merged image tokens" in said[-1], said[-1]
