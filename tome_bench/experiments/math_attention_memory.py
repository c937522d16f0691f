"""Peak tensor memory of one SD1.5 UNet forward under PyTorch's math attention, without vanilla.

At 1024x1024 (batch 2, bf16) vanilla's N x N attention scores alone need more than this 24 GB
machine has, so the benchmark (which always runs vanilla as its baseline) cannot measure it there;
this measures the patched models only. Run: python -m tome_bench.experiments.math_attention_memory [PX]
"""
import json
import sys

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

import tome_core
from tome_bench.measure import Inputs, forward, peak_memory
from tome_bench.models import build_unet, make_inputs

from . import results_path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv

    px = int(argv[0]) if len(argv) > 0 else 1024
    unet = build_unet("sd15", "full", dtype=torch.bfloat16)
    inputs = Inputs(*make_inputs(unet, "sd15", 2, px, px, dtype=torch.bfloat16))
    variants = [("merge r=0.5", tome_core, dict(ratio=0.5)), ("kv r=0.75", tome_core, dict(ratio=0.75, mode="kv"))]
    try:
        import tomesd
        variants.append(("tomesd r=0.5", tomesd, dict(ratio=0.5)))
    except ImportError:
        pass
    peaks = {}
    with sdpa_kernel([SDPBackend.MATH]):
        for label, package, options in variants:
            package.apply_patch(unet, **options)
            peak, _ = peak_memory(lambda: forward(unet, inputs), torch.device("cpu"))
            package.remove_patch(unet)
            peaks[label] = round(peak / 2**20, 1)
            print(f"{label}: {peaks[label]} MB", flush=True)
    print(json.dumps({"px": px, "peak_mem_mb": peaks}))


if __name__ == "__main__":
    main()
