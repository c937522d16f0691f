"""ToMe under diffusers' context parallelism: vanilla-CP against ToMe-CP (modes kv and merge), interleaved, per family.

Run from the repository root; it starts ``--processes`` copies of itself under torchrun (one process per chunk, gloo on
the CPU, nccl on GPUs):

    python -m tome_bench.experiments.context_parallel --processes 2 --families flux,qwen_image,wan \\
        --sizes 256,768 --repeats 5

Each family's model (``dit_models.build_dit``: tiny on the CPU; on GPUs the released width, 2 blocks of each kind,
bf16; batch 2, Wan 5 frames on the CPU, 33 on GPUs) is made parallel with
``ContextParallelConfig(ulysses_degree=N)`` (``--attention ring``: ``ring_degree=N`` on diffusers' cuDNN backend, CUDA
only); its forward is timed whole-call on every process (a barrier before each call, the slowest process's time
kept), vanilla and ``apply_patch(mode=...)`` for each of ``--modes`` alternated, medians reported with their ratios.
Beside the time: the bytes Ulysses' all-to-alls move per forward on one process (diffusers'
``attention_dispatch._all_to_all_single``, counted by wrapping it for the run), and ToMe-CP's relative output change
against vanilla-CP. Mode kv picks the kept keys after the all-to-all, so it moves as many bytes as vanilla: its gain
is the attention's work on each process; mode merge carries fewer tokens through its blocks on each process, so its
all-to-alls move fewer bytes too. Rank 0 writes ``docs/results/context_parallel_<device>.json`` (Ring:
``context_parallel_ring_cuda.json``).
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Dict, List

import torch
import torch.distributed as dist

import tome_core
from tome_bench.dit_models import build_dit, forward, make_dit_inputs
from tome_bench.report import source_commit

REPO = Path(__file__).resolve().parents[2]


class AllToAllBytes:
    """Bytes handed to diffusers' Ulysses all-to-all while counting (the module function, wrapped for the run)."""

    def __init__(self) -> None:
        import diffusers.models.attention_dispatch as dispatch

        self.dispatch, self.original, self.bytes = dispatch, dispatch._all_to_all_single, 0

        def counted(x: torch.Tensor, group: object) -> torch.Tensor:
            self.bytes += x.numel() * x.element_size()
            return self.original(x, group)

        dispatch._all_to_all_single = counted

    def close(self) -> None:
        self.dispatch._all_to_all_single = self.original


def timed(model: torch.nn.Module, inputs: dict) -> float:
    """One forward's wall time, the slowest process's (every process waits for the others before and after)."""
    dist.barrier()
    start = time.perf_counter()
    with torch.no_grad():
        forward(model, inputs)
    elapsed = torch.tensor([time.perf_counter() - start])
    dist.all_reduce(elapsed, op=dist.ReduceOp.MAX)
    return float(elapsed)


def run_family(family: str, size: int, repeats: int, ratio: float, modes: List[str], attention: str,
               model_kind: dict) -> dict:
    from diffusers import ContextParallelConfig

    world = dist.get_world_size()
    device, dtype, frames = model_kind["device"], model_kind["dtype"], model_kind["frames"] if family == "wan" else 1
    model = build_dit(family, blocks=model_kind["blocks"], scale=model_kind["scale"], dtype=dtype).to(device)
    inputs = {key: value.to(device) if isinstance(value, torch.Tensor) else value
              for key, value in make_dit_inputs(model, family, 2, size, size, frames=frames, dtype=dtype).items()}
    if attention == "ring":  # the ring needs each step's log-sum-exp: a CUDA backend of diffusers' that returns it
        model.set_attention_backend("_native_cudnn")
    model.enable_parallelism(config=ContextParallelConfig(**{f"{attention}_degree": world}))
    counter = AllToAllBytes()
    volume: Dict[str, int] = {}
    change: Dict[str, float] = {}
    try:
        with torch.no_grad():
            vanilla = forward(model, inputs)
            volume["vanilla"] = counter.bytes
            for mode in modes:
                tome_core.apply_patch(model, ratio=ratio, mode=mode)
                counter.bytes = 0
                reduced = forward(model, inputs)
                volume[mode] = counter.bytes
                change[mode] = float((reduced - vanilla).norm() / vanilla.norm())
                tome_core.remove_patch(model)
        times: Dict[str, List[float]] = {side: [] for side in ["vanilla", *modes]}
        for _ in range(repeats):  # interleaved: the machine's drift falls on every side alike
            times["vanilla"].append(timed(model, inputs))
            for mode in modes:
                tome_core.apply_patch(model, ratio=ratio, mode=mode)
                times[mode].append(timed(model, inputs))
                tome_core.remove_patch(model)
    finally:
        counter.close()
    median = {side: statistics.median(values) for side, values in times.items()}
    return {"size": size, "frames": frames, f"{attention}_degree": world, "ratio": ratio,
            "median_s": {side: round(value, 4) for side, value in median.items()},
            "speedup": {mode: round(median["vanilla"] / median[mode], 3) for mode in modes},
            "all_to_all_bytes_per_forward": volume, "tome_vs_vanilla_rel": change}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--families", default="flux,qwen_image,wan")
    parser.add_argument("--sizes", default="256,768", help="image sides in pixels, each a row per family")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--ratio", type=float, default=0.5)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    parser.add_argument("--processes", type=int, default=2, help="processes (GPUs) the sequence is split over")
    parser.add_argument("--scale", choices=("tiny", "full"), default=None,
                        help="the models' width: tiny (2 small heads), full (the released width, 2 blocks of each "
                             "kind); default tiny on the CPU, full on GPUs (bf16)")
    parser.add_argument("--frames", type=int, default=None, help="Wan's frames (default 5 on the CPU, 33 on GPUs)")
    parser.add_argument("--modes", default="kv,merge", help="ToMe's modes, each a side beside vanilla-CP")
    parser.add_argument("--attention", choices=("ulysses", "ring"), default="ulysses",
                        help="diffusers' context-parallel attention (ring: CUDA only, mode merge only)")
    args = parser.parse_args()
    if "LOCAL_RANK" not in os.environ:  # not started by torchrun yet: start the processes, each running this module
        os.execv(sys.executable, [sys.executable, "-m", "torch.distributed.run", "--standalone",
                                  f"--nproc_per_node={args.processes}", "-m", __spec__.name, *sys.argv[1:]])
    cuda = torch.cuda.is_available()
    dist.init_process_group("nccl" if cuda else "gloo", timeout=datetime.timedelta(seconds=120))
    if cuda:
        torch.cuda.set_device(dist.get_rank() % torch.cuda.device_count())
    else:
        torch.accelerator.device_count = lambda: 1  # diffusers' _resolve_parallel_config divides by it: 0 on a CPU
    modes = args.modes.split(",")
    model_kind = {"scale": args.scale or ("full" if cuda else "tiny"), "blocks": 2,
                  "device": torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu"),
                  "dtype": torch.bfloat16 if cuda else torch.float32, "frames": args.frames or (33 if cuda else 5)}
    rows = {f"{family} {size}": run_family(family, size, args.repeats, args.ratio, modes, args.attention, model_kind)
            for family in args.families.split(",") for size in (int(side) for side in args.sizes.split(","))}
    if dist.get_rank() == 0:
        device = torch.cuda.get_device_name() if cuda else "cpu"
        report = {"experiment": "context_parallel", "device": device, "processes": dist.get_world_size(),
                  "attention": args.attention, "backend": dist.get_backend(), "scale": model_kind["scale"],
                  "dtype": str(model_kind["dtype"]).replace("torch.", ""),
                  "commit": (source_commit() or "").split("+")[0][:12],
                  "dirty": "+dirty" in (source_commit() or ""), "torch": torch.__version__, "families": rows}
        args.out.mkdir(parents=True, exist_ok=True)
        ring = "_ring" if args.attention == "ring" else ""
        path = args.out / f"context_parallel{ring}_{'cuda' if cuda else 'cpu'}.json"
        path.write_text(json.dumps(report, indent=1) + "\n")
        for family, row in rows.items():
            sides = ", ".join(f"{mode} {row['median_s'][mode]:.4f} s ({row['speedup'][mode]}x, rel "
                              f"{row['tome_vs_vanilla_rel'][mode]:.3g})" for mode in modes)
            print(f"{family}: vanilla-CP {row['median_s']['vanilla']:.4f} s; ToMe-CP {sides}; all-to-all bytes per "
                  f"forward {row['all_to_all_bytes_per_forward']}")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
