"""The GPU run's trace summary (``tome_bench.trace_summary``), read on the CPU.

``fixtures/kineto_cuda_two_forwards.json`` is a small trace in the Chrome-trace format torch.profiler writes on
CUDA (Kineto's event categories, names and fields as torch 2.x exports them: ``cpu_op``, ``user_annotation``,
``cuda_runtime``, ``cuda_driver``, ``kernel``, ``gpu_memcpy``, ``ac2g`` flows, process metadata), written by hand
so that every figure it should give is known: two forwards of a GEMM, a flash SDPA and a gather; the first also
allocates and reads one value to the host (``.item()``: a DtoH copy and a stream synchronisation), the second runs
a cuDNN SDPA launched through the driver API and uploads a table; then the profiled block's own final
synchronisation. The CPU side is also checked on a real trace exported by this torch."""
from __future__ import annotations

import torch
import pytest

from tome_bench import profiling, trace_summary
from conftest import REPO_ROOT

FIXTURE = REPO_ROOT / "tests" / "bench" / "fixtures" / "kineto_cuda_two_forwards.json"


@pytest.fixture(scope="module")
def summary():
    return trace_summary.summarize(trace_summary.load(FIXTURE), forwards=2)


def test_kernels_and_gpu_busy_against_wall_per_forward(summary):
    assert summary["forwards"] == 2
    assert summary["kernels"] == 3.5  # 3 + 4 kernels (copies are not kernels)
    # busy: kernels and copies, 372 us + 473 us; wall: 1000 us (first range) to 2555 us (the last copy's end)
    assert summary["gpu_busy_ms"] == pytest.approx(0.4225)
    assert summary["wall_ms"] == pytest.approx(0.7775, abs=1e-3)
    assert summary["busy_share"] == pytest.approx(845 / 1555, abs=1e-3)


def test_synchronising_allocating_and_copying_calls_by_direction(summary):
    # the block's final cudaDeviceSynchronize falls after the forwards: the bench's, not the model's
    assert summary["calls"] == {"cudaMalloc": 0.5, "cudaMemcpy DtoH": 0.5, "cudaMemcpy HtoD": 0.5,
                                "cudaStreamSynchronize": 0.5}


def test_each_sdpa_backend_with_the_kernels_it_ran(summary):
    flash = trace_summary.SDPA_OPS["aten::_scaled_dot_product_flash_attention"]
    assert summary["sdpa"][flash]["calls"] == 1.0
    assert [name.split("<")[0] for name in summary["sdpa"][flash]["kernels"]] == ["void pytorch_flash::flash_fwd_kernel"]
    cudnn = summary["sdpa"]["cudnn"]
    assert cudnn["calls"] == 0.5 and list(cudnn["kernels"].values()) == [0.5]  # launched with cuLaunchKernelEx
    assert next(iter(cudnn["kernels"])).startswith("cudnn_generated_fort_native_sdpa")


def test_the_top_kernels_by_time(summary):
    top = summary["top_kernels"]
    assert [k["ms"] for k in top] == [0.2, 0.15, 0.05, 0.02]
    assert top[0]["name"].startswith("sm90_xmma_gemm") and top[0]["launches"] == 1.0
    assert top[2]["launches"] == 0.5


def test_difference_and_text(summary):
    vanilla = dict(summary, kernels=3.0, gpu_busy_ms=0.4, wall_ms=0.7, calls={"cudaMalloc": 0.5})
    diff = trace_summary.difference(summary, vanilla)
    assert diff["kernels"] == 0.5 and diff["gpu_busy_ms"] == pytest.approx(0.0225, abs=1e-3)
    assert diff["calls"]["cudaStreamSynchronize"] == 0.5 and diff["calls"]["cudaMalloc"] == 0.0
    line = trace_summary.text(summary)
    assert line.startswith("3.5 kernels, wall 0.78 ms, GPU busy 0.42 ms (54 %)")
    assert "cudaStreamSynchronize 0.5" in line and "SDPA cudnn x0.5, flash x1" in line


def test_a_real_cpu_trace_from_this_torch(tmp_path):
    """torch's own export on the CPU: the forward ranges, the SDPA backend, no device events."""
    q = torch.randn(1, 2, 16, 8)

    def forward():
        return torch.nn.functional.scaled_dot_product_attention(q, q, q) + 1

    kept = tmp_path / "trace.json.gz"
    summary = profiling.trace_forwards(forward, torch.device("cpu"), forwards=3, keep=kept)
    assert summary["forwards"] == 3 and summary["kernels"] == 0 and summary["gpu_busy_ms"] is None
    assert summary["busy_share"] is None and summary["calls"] == {} and summary["wall_ms"] > 0
    assert summary["sdpa"] == {"flash-cpu": {"calls": 1.0, "kernels": {}}}
    again = trace_summary.summarize(trace_summary.load(kept), forwards=3)
    assert again["sdpa"] == summary["sdpa"]


def test_a_trace_without_ranges_is_read_whole():
    events = [{"ph": "X", "cat": "cpu_op", "name": "aten::add", "pid": 1, "tid": 1, "ts": 10.0, "dur": 5.0, "args": {}},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mul", "pid": 1, "tid": 1, "ts": 30.0, "dur": 10.0, "args": {}}]
    summary = trace_summary.summarize({"traceEvents": events})
    assert summary["wall_ms"] == 0.03 and summary["kernels"] == 0 and summary["sdpa"] == {}
