"""GPU time beside wall time, and the rows whose steady forward waits on the host more than vanilla's, read from the
Kineto trace fixture (``fixtures/kineto_cuda_two_forwards.json``: see test_trace_summary) on the CPU.

The fixture's forwards make one host sync (an ``.item()``) and one host-to-device copy in two forwards; its "vanilla"
here is the same trace without them and with every kernel twice as long. The runner's rows carry the GPU time per
forward, its ratio to vanilla's and the host waits (every CUDA row is traced), results.json defines them, and the
printed table and results.md show them with a legend entry and a visible mark."""
from __future__ import annotations

import copy
import json

import pytest

from conftest import REPO_ROOT
from test_bench_dit_families import one_thread  # noqa: F401 - autouse: tiny forwards on one thread
from tome_bench import report, trace_summary

FIXTURE = REPO_ROOT / "tests" / "bench" / "fixtures" / "kineto_cuda_two_forwards.json"



def _vanilla_trace() -> dict:
    """The fixture without its sync and its copies, each kernel twice as long."""
    trace = copy.deepcopy(trace_summary.load(FIXTURE))
    drop = {e["args"]["correlation"] for e in trace["traceEvents"]
            if e.get("name") in ("cudaStreamSynchronize", "cudaMemcpyAsync")}
    events = []
    for e in trace["traceEvents"]:
        if e.get("args", {}).get("correlation") in drop and e.get("ph") == "X":
            continue
        if e.get("cat") == "kernel":
            e["dur"] *= 2
        events.append(e)
    return {**trace, "traceEvents": events}


@pytest.fixture(scope="module")
def summaries():
    return (trace_summary.summarize(trace_summary.load(FIXTURE), forwards=2),
            trace_summary.summarize(_vanilla_trace(), forwards=2))


def test_host_syncs_and_uploads_are_counted_per_forward_inside_the_forwards(summaries):
    method, vanilla = summaries
    # one cudaStreamSynchronize and one HtoD copy in two forwards; the block's own final cudaDeviceSynchronize not
    assert (method["forward_syncs"], method["forward_htod"]) == (0.5, 0.5)
    assert (vanilla["forward_syncs"], vanilla["forward_htod"]) == (0.0, 0.0)
    # a summary written before these fields: its window's calls, less the device synchronisation ending the block
    old = {"calls": {"cudaDeviceSynchronize": 0.5, "cudaStreamSynchronize": 2.0, "cudaMemcpy HtoD": 2.0,
                     "cudaMemcpy DtoD": 6.0}}
    assert trace_summary.host_waits(old) == (2.0, 2.0)


def test_gpu_time_and_its_ratio_to_vanillas(summaries):
    method, vanilla = summaries
    fields = trace_summary.versus_vanilla(method, vanilla)
    assert fields["gpu_ms"] == method["gpu_busy_ms"] == pytest.approx(0.4225)
    # vanilla: no copies, each kernel twice as long from the same start, so they overlap: the union of 1050-1560 us
    # and 2050-2650 us over two forwards
    assert vanilla["gpu_busy_ms"] == pytest.approx((510 + 600) / 2 / 1000)
    assert fields["gpu_speedup"] == pytest.approx(vanilla["gpu_busy_ms"] / method["gpu_busy_ms"], abs=1e-4)
    assert (fields["syncs_added"], fields["htod_added"], fields["syncs_over_vanilla"]) == (0.5, 0.5, True)
    same = trace_summary.versus_vanilla(vanilla, vanilla)
    assert same["gpu_speedup"] == 1.0 and not same["syncs_over_vanilla"]
    cpu = dict(vanilla, gpu_busy_ms=None)  # a CPU trace: no device events, no GPU figures
    assert trace_summary.versus_vanilla(cpu, cpu) == {}


def test_the_runners_rows_tables_and_json_carry_them(summaries, monkeypatch, tmp_path):
    """A tiny run whose profiled forwards read as the fixture (vanilla first, then the patch): every row has the GPU
    time, its ratio and the host waits; the flagged row is marked in both tables and warned about."""
    from tome_bench import profiling
    from tome_bench.runner import BenchConfig, run_benchmark

    method, vanilla = summaries
    calls = []

    def traced(fn, device, forwards=2, keep=None):
        fn()
        calls.append(1)
        return vanilla if len(calls) == 1 else method

    monkeypatch.setattr(profiling, "trace_forwards", traced)
    cfg = BenchConfig(families=("sd15",), resolutions=((64, 64),), scale="tiny", repeats=1, dtype="fp32",
                      methods=("vanilla", "kv@0.5"), trace=True, peaked=1.0)
    rows = run_benchmark(cfg, progress_bar=False, log=lambda text: None)["rows"]
    assert [r["gpu_ms"] for r in rows] == [vanilla["gpu_busy_ms"], method["gpu_busy_ms"]]
    assert rows[0]["gpu_speedup"] == 1.0 and rows[1]["gpu_speedup"] == pytest.approx(
        vanilla["gpu_busy_ms"] / method["gpu_busy_ms"], abs=1e-4)
    assert [r["syncs_over_vanilla"] for r in rows] == [False, True]
    table = report.format_table(rows)
    header = table.splitlines()[0]
    assert header.index("x vanilla") < header.index("GPU ms") < header.index("x GPU") < header.index("busy %")
    assert "0.5/0.5 !" in table and "0/0" in table
    assert "x GPU: CUDA: vanilla's GPU ms / GPU ms" in table and "sync/HtoD:" in table
    assert "! more host waits than vanilla: sd15 64x64 kv r=0.5: +0.5 host syncs, +0.5 host-to-device copies" in table
    md = report.format_markdown(rows)
    assert "| x GPU |" in md.replace(" | ", " | ") and "0.5/0.5 !" in md and "- **x GPU**:" in md
    for key in ("gpu_ms", "gpu_speedup", "syncs", "htod", "syncs_over_vanilla"):
        assert key in report.METRICS
    path = report.write_json({"metrics": report.METRICS, "rows": rows}, tmp_path / "results.json")
    written = json.loads(path.read_text())["rows"][1]
    assert written["syncs_over_vanilla"] is True and written["gpu_speedup"] == rows[1]["gpu_speedup"]
