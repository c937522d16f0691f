"""What one UNet forward pays for a ToMe patch on a GPU's terms, counted on any device: host syncs, ATen ops added
over vanilla and Python calls into ``tome_core`` (each paid as launch time on a fast GPU), for patches that reduce
nothing (ratio 0, every level left whole by ``min_tokens``, a call outside the step window) and for the reduced
paths (the hosts' default, tomesd's defaults, kv). Counted on the second forward after ``apply_patch``, as
``bench --ops`` counts (``tome_bench.op_count``).
Run: python -m tome_bench.experiments.fixed_cost [PX]   (default 256: the counts do not depend on the size)
"""
import json
import platform
import subprocess
import sys

import torch

import tome_core
from tome_bench.models import build_unet, make_inputs
from tome_bench.op_count import count_ops

from . import results_path

HOST_DEFAULTS = dict(matching="level", speed_check="auto")
CASES = (
    ("ratio 0", dict(ratio=0.0, **HOST_DEFAULTS)),
    ("every level whole (min_tokens)", dict(min_tokens=1 << 20, **HOST_DEFAULTS)),
    ("outside the step window (start_percent 0.6 at t=500)", dict(start_percent=0.6, **HOST_DEFAULTS)),
    ("hosts' default (merge, level matching, speed check auto: not timed on the CPU)", dict(HOST_DEFAULTS)),
    ("tomesd's defaults (merge, block matching)", dict()),
    ("kv r=0.5", dict(mode="kv")),
)


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    px = int(argv[0]) if argv else 256
    unet = build_unet("sd15")
    sample, _, context, _ = make_inputs(unet, "sd15", 2, px, px)
    timestep = torch.full((2,), 500.0)

    def forward():
        with torch.no_grad():
            return unet(sample, timestep, encoder_hidden_states=context).sample

    vanilla, _ = count_ops(forward)
    rows = []
    for label, options in CASES:
        tome_core.apply_patch(unet, **options)
        try:
            forward()
            count, _ = count_ops(forward)
        finally:
            tome_core.remove_patch(unet)
        rows.append({"case": label, "options": options, "host_syncs": count.syncs,
                     "aten_ops_added": count.total - vanilla.total, "tome_calls": count.tome_calls})
        print(f"{label}: syncs {count.syncs}, ATen ops +{count.total - vanilla.total}, "
              f"Python calls into tome_core {count.tome_calls}", flush=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    out = {"experiment": "fixed_cost", "command": f"python -m tome_bench.experiments.fixed_cost {px}",
           "device": "cpu", "cpu": platform.processor() or platform.machine(), "torch": torch.__version__,
           "commit": commit, "model": f"SD1.5 UNet (full width, seeded weights), batch 2, {px}x{px} px, fp32",
           "vanilla": {"host_syncs": vanilla.syncs, "aten_ops": vanilla.total}, "rows": rows}
    path = results_path("fixed_cost_sd15_cpu.json")
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
