"""Spread over ToMe's own random choices: kv 3x3 (ratio 0.88) vs tomesd (ratio 0.5), peaked SD1.5.

Same seeded model and inputs as the benchmark; only the random destinations (tomesd, forked from
the global RNG) and the random key picks (tome_core's ``seed``) change between rounds.
Run: python -m tome_bench.experiments.kv_vs_tomesd_seeds [PX] [ROUNDS]   (README: 1024, 4)
"""
import statistics
import sys

import tomesd
import torch

import tome_core
from tome_bench.measure import Inputs, errors, forward
from tome_bench.models import build_unet, make_inputs

from . import results_path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv

    px = int(argv[0]) if len(argv) > 0 else 1024
    rounds = int(argv[1]) if len(argv) > 1 else 4
    unet = build_unet("sd15", "full", dtype=torch.bfloat16, peaked=3.0)
    inputs = Inputs(*make_inputs(unet, "sd15", 2, px, px, dtype=torch.bfloat16))
    reference = forward(unet, inputs)
    measured = {"tomesd r=0.5": [], "kv r=0.88 3x3": []}
    for k in range(rounds):
        torch.manual_seed(1000 + k)
        tomesd.apply_patch(unet, ratio=0.5)
        measured["tomesd r=0.5"].append(errors(forward(unet, inputs), reference, 7.5))
        tomesd.remove_patch(unet)
        tome_core.apply_patch(unet, ratio=0.88, sx=3, sy=3, mode="kv", seed=k)
        measured["kv r=0.88 3x3"].append(errors(forward(unet, inputs), reference, 7.5))
        tome_core.remove_patch(unet)
    for label, values in measured.items():
        raw = [r for r, _ in values]
        cfg = [c for _, c in values]
        print(f"{label}: peaked error mean {statistics.mean(raw):.4f} (min {min(raw):.4f}, max {max(raw):.4f}), "
              f"peaked CFG error mean {statistics.mean(cfg):.4f}")


if __name__ == "__main__":
    main()
