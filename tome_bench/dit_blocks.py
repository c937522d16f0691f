"""Which blocks of a DiT tolerate mode "kv" best: the peaked-attention error of each block range.

    python -m tome_bench.dit_blocks --families flux,sd3,wan --blocks 4
    python -m tome_bench.dit_blocks --families z_image,qwen_image,ltx2 --blocks 4
    python -m tome_bench.dit_blocks --families flux --blocks 2 --size 1024x1024 --ratio 0.5,0.75 \
        --ranges 0-1,0.34-1 --seeds 0,1,2

For each family (the real architecture at full width, ``--blocks`` blocks of each kind, seeded
weights, q/k norms scaled as in the bench's peaked-attention proxy), mode kv is applied to one
block range at a time (thirds, halves, all) and the relative L2 error of the output (Flux,
Z-Image-Turbo: distilled; LTX-2: its video) or of the CFG-combined prediction (SD3, Wan, Qwen-Image,
LTX-2) against the unpatched model is measured. Every attention of
a family has the same token count and width, so the attention time a range saves is proportional to
the blocks it reduces: ``err / block`` is the error per unit of speed-up, the measure the defaults
are chosen by. Errors only: no timing, so it runs on a busy machine too.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from tome_core.engine.config import ToMeConfig
from tome_core.adapters.hooks import dit as diffusers_dit
from tome_core.catalogue.diffusers_lookup import family_of
from . import dit_models

RANGES: Tuple[Tuple[float, float], ...] = ((0.0, 1.0), (0.0, 0.5), (0.5, 1.0), (0.0, 1 / 3), (1 / 3, 2 / 3),
                                          (2 / 3, 1.0))
# height, width, frames: smaller than native (errors of every range at full width take minutes per family)
SIZES = {"flux": (512, 512, 1), "sd3": (512, 512, 1), "wan": (480, 832, 9), "z_image": (512, 512, 1),
         "qwen_image": (512, 512, 1), "ltx2": (512, 768, 25)}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def range_errors(family: str, blocks: int, ratio: float, peaked: float, dtype: torch.dtype,
                 ranges: Sequence[Tuple[float, float]] = RANGES, seed: int = 0, scale: str = "full",
                 size: Optional[Tuple[int, int, int]] = None) -> List[Dict[str, float]]:
    """One row per block range: blocks reduced of all, and the error of reducing exactly those.

    scale "tiny" and a small ``size`` (height, width, frames) are for tests.
    """
    model = dit_models.build_dit(family, blocks, seed=seed, dtype=dtype, scale=scale)
    height, width, frames = size or SIZES[family]
    batch = dit_models.DEFAULT_BATCH.get(family, 2)
    inputs = dit_models.make_dit_inputs(model, family, batch, height, width, frames=frames, seed=seed, dtype=dtype)
    order = list(dict.fromkeys(name.rsplit(".", 1)[0] for name, _, _ in family_of(model).attentions(model)))
    rows = []
    with dit_models.peaked_attention(model, peaked):
        expected = dit_models.guided(dit_models.forward(model, inputs), family)
        for start, end in ranges:
            config = ToMeConfig(ratio=ratio, mode="kv", seed=seed, block_start=start, block_end=end)
            reduced = sum(config.block_on(i, len(order)) for i in range(len(order)))
            diffusers_dit.install(model, config)
            try:
                actual = dit_models.guided(dit_models.forward(model, inputs), family)
            finally:
                diffusers_dit.uninstall(model)
            error = dit_models.relative_error(actual, expected)
            rows.append(dict(family=family, block_start=round(start, 3), block_end=round(end, 3),
                             blocks_reduced=reduced, blocks=len(order), err_peaked=error,
                             err_per_block=error / reduced))
    return rows


def format_rows(rows: List[Dict[str, float]]) -> str:
    lines = [f"{'family':6}  {'blocks':>11}  {'reduced':>7}  {'err peaked':>10}  {'err / block':>11}"]
    for row in rows:
        span = f"{row['block_start']:.2f}-{row['block_end']:.2f}"
        lines.append(f"{row['family']:6}  {span:>11}  {row['blocks_reduced']:>3} of {row['blocks']:<2}"
                     f"  {row['err_peaked']:10.4f}  {row['err_per_block']:11.4f}")
    return "\n".join(lines)


def _floats(text: str) -> List[float]:
    return [float(v) for v in text.split(",") if v.strip()]


def _ranges(text: str) -> List[Tuple[float, float]]:
    pairs = [part.split("-") for part in text.split(",") if part.strip()]
    if any(len(pair) != 2 for pair in pairs):
        raise ValueError(f"--ranges takes START-END pairs, e.g. 0-1,0.34-1; got {text!r}")
    return [(float(a), float(b)) for a, b in pairs]


def _size(text: str) -> Tuple[int, int, int]:
    parts = [int(v) for v in text.lower().split("x")]
    if len(parts) not in (2, 3):
        raise ValueError(f"--size takes HxW or HxWxFRAMES, e.g. 1024x1024; got {text!r}")
    return parts[0], parts[1], parts[2] if len(parts) == 3 else 1


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_bench.dit_blocks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default="flux,sd3,wan", help=f"comma list of {', '.join(SIZES)}")
    parser.add_argument("--blocks", type=int, default=4, help="blocks of each kind (Flux: N double + 2N single; "
                        "Z-Image: N layers and its refiners, 2 per 30 layers)")
    parser.add_argument("--ratio", default="0.5", help="kv ratio, or a comma list (default 0.5)")
    parser.add_argument("--ranges", default=None, help="comma list of START-END block ranges "
                        "(default: all, halves, thirds)")
    parser.add_argument("--size", default=None, help="HxW or HxWxFRAMES (default: Flux, SD3, Z-Image, Qwen-Image "
                        "512x512, Wan 480x832x9, LTX-2 512x768x25)")
    parser.add_argument("--peaked", type=float, default=3.0, help="q/k norm scale of the proxy (default 3)")
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="bf16")
    parser.add_argument("--seeds", default="0", help="comma list of seeds (weights, inputs, picks)")
    parser.add_argument("--out", default=None, help="write the rows as JSON here")
    parser.add_argument("--tiny", action="store_true", help="tests only: tiny-width models (the layout, not the "
                        "real errors)")
    args = parser.parse_args(argv)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(SIZES))
    try:
        ratios, seeds = _floats(args.ratio), [int(v) for v in _floats(args.seeds)]
        ranges = _ranges(args.ranges) if args.ranges else RANGES
        size = _size(args.size) if args.size else None
    except ValueError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    if unknown or args.blocks < 1:
        print(f"error: families must be among {', '.join(SIZES)} and --blocks >= 1 (got {args.families!r}, "
              f"{args.blocks})", file=sys.stderr)
        return 2
    rows = []
    for family in families:
        for seed in seeds:
            for ratio in ratios:
                found = range_errors(family, args.blocks, ratio, args.peaked, DTYPES[args.dtype], ranges=ranges,
                                     seed=seed, scale="tiny" if args.tiny else "full", size=size)
                for row in found:
                    row.update(seed=seed, ratio=ratio)
                rows += found
                print(f"seed {seed}, ratio {ratio:g}\n{format_rows(found)}", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(dict(args=vars(args), rows=rows), indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
