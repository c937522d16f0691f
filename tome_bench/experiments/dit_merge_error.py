"""What lowers DiT merge's error at the same speed? Four measurements at equal token counts.

Mode merge's speed is set by how many tokens it removes from how many blocks; its error by which tokens and
where. Every comparison here keeps the removed tokens (``ratio``) and the reduced blocks equal, or reports
``removed x blocks`` where they differ, so only the error moves. The error is the bench's ``cfg err peaked``
(``measure.errors`` under ``dit_models.peaked_attention(3)``, guidance 7.5, Flux distilled: its output) on the
bench's seeded full-width models (bf16), on both contents (``content.py``: seeded noise, and the astronaut
noised to the step), at reduced sizes and depth so that it runs on a CPU:

- ``features``: what the matching compares. Today's: the first reduced block's input hidden states. Against:
  those tokens layer-normed (``normed``), and normed and modulated by the block's AdaLN shift/scale
  (``modulated``: what the block's attention and feed-forward see). Flux, Qwen-Image, Wan.
- ``windows`` (video): today's 1 x 2 x 2 window (one frame) against windows spanning two frames:
  2 x 2 x 1, 2 x 1 x 2 (four tokens, as today) and 2 x 2 x 2 (eight). Same ratio, same tokens removed. Wan, LTX-2.
- ``blocks``: which blocks merge covers: all, the first, middle and last thirds, all but the first and last,
  at r=0.5, and every block at the ratio that removes as many tokens x blocks as a third or the inner blocks
  (the equal-speed reference). Flux (2 double + 4 single), Qwen-Image and Wan (6 blocks).
- ``noise_levels``: the error at sigma 0.9 ... 0.1 (flow matching, the photo noised to each level, the model
  told that timestep), to tell whether merging only the high-noise steps (start_percent/end_percent) costs less.

Implemented inside this process: the matching features by a pre-hook on the first reduced block and
``match_grid`` wrapped in the engine's call plan (``tome_core.engine.call_plan``, where every host's merge matches);
the windows by wrapping ``merge_window`` there. Errors only (no timing), so it runs on a busy machine.

Run (from the repository root; writes docs/results/dit_merge_error_cpu.json, each experiment's key replaced):
    python -m tome_bench.experiments.dit_merge_error --experiments features,windows,blocks,noise_levels
"""
from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

import tome_core
from tome_core.adapters.hooks import dit_merge
from tome_core.engine import call_plan
from tome_core.catalogue.diffusers_lookup import family_of
from tome_bench import content, dit_models, measure, report

from . import results_path

EXPERIMENTS = ("features", "windows", "blocks", "noise_levels")
FAMILIES = {"features": ("flux", "qwen_image", "wan"), "windows": ("wan", "ltx2", "flux", "qwen_image"),
            "blocks": ("flux", "qwen_image", "wan"), "noise_levels": ("flux", "qwen_image", "wan")}
# (height, width, frames): reduced from the native sizes so the CPU runs every variant; video keeps an even
# number of latent frames (Wan 13 -> 4, LTX-2 25 -> 4) so two-frame windows tile it
SIZES = {"flux": (512, 512, 1), "qwen_image": (512, 512, 1), "wan": (320, 480, 13), "ltx2": (512, 768, 25)}
TINY_SIZES = {"flux": (64, 64, 1), "qwen_image": (64, 64, 1), "wan": (64, 64, 5), "ltx2": (128, 128, 9)}
DEPTH = {"flux": 2, "qwen_image": 2, "wan": 2, "ltx2": 2}  # blocks of each kind (Flux: 2 double + 4 single)
RANGE_DEPTH = {"flux": 2, "qwen_image": 6, "wan": 6}  # six blocks, so a third is two
RATIOS = (0.25, 0.5, 0.75)
FEATURES = ("input", "normed", "modulated")
# video: frames x rows x columns (1x2x4: eight tokens in one frame, against 2x2x2's eight in two)
WINDOWS = {"1x2x2": None, "1x2x4": (1, 2, 4), "2x2x1": (2, 2, 1), "2x1x2": (2, 1, 2), "2x2x2": (2, 2, 2)}
IMAGE_WINDOWS = {"2x2": (2, 2), "2x4": (2, 4), "4x4": (4, 4)}  # images: rows x columns, the config's sy x sx
SIGMAS = (0.9, 0.7, 0.5, 0.3, 0.1)
PEAKED = 3.0
GUIDANCE = 7.5  # the bench's --guidance
_TIMESTEP_SCALE = {"flux": 1.0, "qwen_image": 1.0, "wan": 1000.0, "ltx2": 1000.0}  # the bench's 0.5 or 500


# ---- the model, its inputs and the error -------------------------------------------------------------------------

def build(family: str, blocks: int, tiny: bool) -> torch.nn.Module:
    return dit_models.build_dit(family, blocks, dtype=torch.bfloat16, scale="tiny" if tiny else "full")


def inputs_for(model: torch.nn.Module, family: str, size: Tuple[int, int, int], kind: str) -> dict:
    """The bench's inputs (seed 0, the family's batch) on content ``kind``: "noise" or "photo"."""
    height, width, frames = size
    return dit_models.make_dit_inputs(model, family, dit_models.DEFAULT_BATCH.get(family, 2), height, width,
                                      frames=frames, dtype=torch.bfloat16, content=kind)


def inputs_at(model: torch.nn.Module, family: str, size: Tuple[int, int, int], sigma: float) -> dict:
    """The photo noised to ``sigma`` (x = (1 - sigma) x0 + sigma noise, the bench's noise) and the timestep told
    so; sigma 0.5 is the bench's photo content exactly."""
    height, width, frames = size
    inputs = dit_models.make_dit_inputs(model, family, dit_models.DEFAULT_BATCH.get(family, 2), height, width,
                                        frames=frames, dtype=torch.float32)
    f, h, w = dit_models.latent_shape(family, height, width, frames)
    x0 = content.pack(family, content.photo_latent(family, f, h, w))
    inputs["hidden_states"] = (1 - sigma) * x0 + sigma * inputs["hidden_states"]
    inputs["timestep"] = torch.full_like(inputs["timestep"], sigma * _TIMESTEP_SCALE[family])
    return dit_models._cast(inputs, torch.bfloat16)


def cfg_err(family: str, actual: torch.Tensor, expected: torch.Tensor) -> float:
    """The bench's ``cfg err peaked`` (the caller holds peaked attention): CFG-combined at guidance 7.5, a
    distilled model's (Flux's) output itself."""
    raw, guided = measure.errors(actual, expected, GUIDANCE)
    return raw if guided is None or dit_models.distilled(family, actual.shape[0]) else guided


# ---- the variants, applied in-process ------------------------------------------------------------------------------

def _block_features(block: torch.nn.Module, named: dict, kind: str) -> torch.Tensor:
    """[B, N, C] what ``block`` computes from its image stream before attention: layer-normed ("normed") or
    normed and AdaLN-modulated ("modulated"). Flux's double and single blocks, Qwen-Image's, Wan's."""
    x, temb = named["hidden_states"], named.get("temb")
    name = type(block).__name__
    if name == "FluxSingleTransformerBlock":
        return block.norm.norm(x) if kind == "normed" else block.norm(x, emb=temb)[0]
    if name == "FluxTransformerBlock":
        return block.norm1.norm(x) if kind == "normed" else block.norm1(x, emb=temb)[0]
    if name == "QwenImageTransformerBlock":
        normed = block.img_norm1(x)
        if kind == "normed":
            return normed
        return block._modulate(normed, block.img_mod(temb).chunk(2, dim=-1)[0], named.get("modulate_index"))[0]
    if name == "WanTransformerBlock":
        normed = block.norm1(x.float())
        if kind == "normed":
            return normed
        shift, scale = (block.scale_shift_table + temb.float()).chunk(6, dim=1)[:2]
        return normed * (1 + scale) + shift
    raise ValueError(f"matching features {kind!r}: no rule for {name}; known: Flux, Qwen-Image, Wan blocks")


@contextlib.contextmanager
def matched_on(model: torch.nn.Module, kind: str) -> Iterator[None]:
    """Under a merge patch: plan the matching on ``kind`` features of the first reduced block ("input": today's)."""
    if kind == "input":
        yield
        return
    if kind not in FEATURES:
        raise ValueError(f"features must be one of {FEATURES}, got {kind!r}")
    state = model.__dict__[dit_merge.STATE_ATTR]
    block = state.blocks[0][1]
    held: Dict[str, torch.Tensor] = {}

    def before(module: torch.nn.Module, args: tuple, kwargs: dict) -> None:
        named = dit_merge.block_keywords(module, args, kwargs)
        held["features"] = _block_features(module, named, kind)

    original = call_plan.match_grid

    def match(tokens: torch.Tensor, grid, ratio, destinations, window):
        features = held.pop("features")
        if features.shape[:2] != tokens.shape[:2]:  # these families' reduced blocks see the image stream alone
            raise RuntimeError(f"features {tuple(features.shape)} do not cover the grid's tokens {tuple(tokens.shape)}")
        return original(features, grid, ratio, destinations, window)

    # a pre-hook runs before ToMe's work on the block, which its marked forward does inside the block's call
    handle = block.register_forward_pre_hook(before, with_kwargs=True)
    call_plan.match_grid = match
    try:
        yield
    finally:
        call_plan.match_grid = original
        handle.remove()


@contextlib.contextmanager
def video_window(window: Optional[Tuple[int, int, int]]) -> Iterator[None]:
    """Merge windows of ``window`` (frames, rows, columns) on 3-D grids instead of today's 1 x sy x sx."""
    if window is None:
        yield
        return
    original = call_plan.merge_window

    def spanning(grid, sx, sy):
        return tuple(min(w, n) for w, n in zip(window, grid)) if len(grid) == 3 else original(grid, sx, sy)

    call_plan.merge_window = spanning
    try:
        yield
    finally:
        call_plan.merge_window = original


def merged(model: torch.nn.Module, inputs: dict, ratio: float, features: str = "input",
           window: Optional[Tuple[int, int, int]] = None, **options) -> Tuple[torch.Tensor, int, int]:
    """(output, grid tokens removed, blocks reduced) of one forward under mode merge at ``ratio``."""
    tome_core.apply_patch(model, ratio=ratio, mode="merge", **options)
    try:
        state = model.__dict__[dit_merge.STATE_ATTR]
        with video_window(window), matched_on(model, features):
            out = dit_models.forward(model, inputs)
        call = state.current
        removed = call.match.removed if call is not None and call.match is not None else 0
        return out, removed, len(state.blocks)
    finally:
        tome_core.remove_patch(model)


# ---- the four experiments ------------------------------------------------------------------------------------------

def _row(family: str, kind: str, variant: str, ratio: float, err: float, removed: int, blocks: int,
         tokens: int, **more) -> dict:
    return dict(family=family, content=kind, variant=variant, ratio=ratio, err=round(err, 4), removed=removed,
                blocks_reduced=blocks, removed_x_blocks=removed * blocks, grid_tokens=tokens, **more)


def _tokens(family: str, size: Tuple[int, int, int]) -> int:
    return dit_models.token_counts(family, size[0], size[1], size[2])[0]


def _each_content(model, family, size, contents, run: Callable[[str, dict, torch.Tensor], List[dict]]) -> List[dict]:
    rows = []
    with dit_models.peaked_attention(model, PEAKED):
        for kind in contents:
            inputs = inputs_for(model, family, size, kind)
            reference = dit_models.forward(model, inputs)
            rows += run(kind, inputs, reference)
    return rows


def features_rows(family: str, size, tiny: bool, ratios: Sequence[float], contents: Sequence[str]) -> List[dict]:
    model = build(family, DEPTH[family], tiny)

    def run(kind, inputs, reference):
        rows = []
        for ratio in ratios:
            for feature in FEATURES:
                out, removed, blocks = merged(model, inputs, ratio, features=feature)
                rows.append(_row(family, kind, feature, ratio, cfg_err(family, out, reference), removed, blocks,
                                 _tokens(family, size)))
                print(rows[-1], flush=True)
        return rows
    return _each_content(model, family, size, contents, run)


def windows_rows(family: str, size, tiny: bool, ratios: Sequence[float], contents: Sequence[str],
                 only: Optional[Sequence[str]] = None) -> List[dict]:
    """Video: today's window against frame-spanning ones (``WINDOWS``); images: larger spatial windows."""
    model = build(family, DEPTH[family], tiny)
    variants = WINDOWS if family in dit_models.VIDEO_FAMILIES else IMAGE_WINDOWS
    variants = {k: v for k, v in variants.items() if only is None or k in only}

    def run(kind, inputs, reference):
        rows = []
        for ratio in ratios:
            for name, window in variants.items():
                options = (dict(window=window) if family in dit_models.VIDEO_FAMILIES else
                           dict(sy=window[0], sx=window[1]))
                out, removed, blocks = merged(model, inputs, ratio, **options)
                rows.append(_row(family, kind, name, ratio, cfg_err(family, out, reference), removed, blocks,
                                 _tokens(family, size)))
                print(rows[-1], flush=True)
        return rows
    return _each_content(model, family, size, contents, run)


def block_ranges(blocks: int) -> List[Tuple[str, float, float, float]]:
    """(name, block_start, block_end, ratio): the ranges at r=0.5 and every block at the ratio that removes as
    many tokens x blocks as a third and as the inner blocks (the equal-speed references)."""
    inner = (blocks - 2) / blocks
    return [("all", 0.0, 1.0, 0.5), ("first third", 0.0, 1 / 3, 0.5), ("middle third", 1 / 3, 2 / 3, 0.5),
            ("last third", 2 / 3, 1.0, 0.5), ("all but first and last", 1 / blocks, 1 - 1 / blocks, 0.5),
            (f"all at r={0.5 / 3:.3f}", 0.0, 1.0, 0.5 / 3), (f"all at r={0.5 * inner:.3f}", 0.0, 1.0, 0.5 * inner)]


def blocks_rows(family: str, size, tiny: bool, ratios: Sequence[float], contents: Sequence[str]) -> List[dict]:
    model = build(family, RANGE_DEPTH[family], tiny)
    order = len(dit_merge.block_names(model, family_of(model).attentions(model)))

    def run(kind, inputs, reference):
        rows = []
        for name, start, end, ratio in block_ranges(order):
            out, removed, blocks = merged(model, inputs, ratio, block_start=start, block_end=end)
            rows.append(_row(family, kind, name, round(ratio, 4), cfg_err(family, out, reference), removed, blocks,
                             _tokens(family, size), model_blocks=order, block_start=round(start, 4),
                             block_end=round(end, 4)))
            print(rows[-1], flush=True)
        return rows
    return _each_content(model, family, size, contents, run)


def noise_level_rows(family: str, size, tiny: bool, ratios: Sequence[float], contents: Sequence[str]) -> List[dict]:
    model = build(family, DEPTH[family], tiny)
    rows = []
    with dit_models.peaked_attention(model, PEAKED):
        for sigma in SIGMAS:
            inputs = inputs_at(model, family, size, sigma)
            reference = dit_models.forward(model, inputs)
            for ratio in ratios:
                out, removed, blocks = merged(model, inputs, ratio)
                rows.append(_row(family, "photo", f"sigma {sigma}", ratio, cfg_err(family, out, reference),
                                 removed, blocks, _tokens(family, size), sigma=sigma))
                print(rows[-1], flush=True)
    return rows


RUNS = {"features": features_rows, "windows": windows_rows, "blocks": blocks_rows, "noise_levels": noise_level_rows}


def run(experiment: str, families: Sequence[str], tiny: bool = False, ratios: Sequence[float] = RATIOS,
        contents: Sequence[str] = ("noise", "photo"), windows: Optional[Sequence[str]] = None) -> List[dict]:
    rows = []
    for family in families:
        size = (TINY_SIZES if tiny else SIZES)[family]
        extra = dict(only=windows) if experiment == "windows" else {}
        found = RUNS[experiment](family, size, tiny, ratios, contents, **extra)
        for row in found:
            row.update(size=f"{size[1]}x{size[0]}" + (f"x{size[2]}" if size[2] > 1 else ""))
        rows += found
    return rows


_NAMES = {"flux": "Flux", "qwen_image": "Qwen-Image", "wan": "Wan", "ltx2": "LTX-2"}


def _cells(rows: List[dict], key: Callable[[dict], tuple]) -> Dict[tuple, Dict[str, float]]:
    cells: Dict[tuple, Dict[str, float]] = {}
    for row in rows:
        cells.setdefault(key(row), {})[row["content"]] = row["err"]
    return cells


def _pair(cell: Dict[str, float]) -> str:
    return " / ".join(f"{cell[c]:.3f}" if c in cell else "-" for c in ("noise", "photo"))


def tables(result: dict) -> str:
    """Markdown tables of a result (``--tables``): errors as noise / photo (noise levels: photo)."""
    out = []
    video = [r for r in result.get("windows", []) if r["family"] in dit_models.VIDEO_FAMILIES]
    image = [r for r in result.get("windows", []) if r["family"] not in dit_models.VIDEO_FAMILIES]
    for experiment, variants, rows in (("features", FEATURES, result.get("features", [])),
                                       ("video windows", tuple(WINDOWS), video),
                                       ("image windows", tuple(IMAGE_WINDOWS), image)):
        if not rows:
            continue
        cells = _cells(rows, lambda r: (r["family"], r["ratio"], r["variant"]))
        out += [f"| {experiment}: family, ratio | " + " | ".join(variants) + " |",
                "| --- |" + " ---: |" * len(variants)]
        for family, ratio in dict.fromkeys((r["family"], r["ratio"]) for r in rows):
            out.append(f"| {_NAMES[family]} r={ratio:g} | "
                       + " | ".join(_pair(cells.get((family, ratio, v), {})) for v in variants) + " |")
        out.append("")
    rows = result.get("blocks", [])
    if rows:
        cells = _cells(rows, lambda r: (r["family"], r["variant"]))
        out += ["| blocks: family, range | blocks reduced | removed x blocks | err noise / photo |",
                "| --- | ---: | ---: | ---: |"]
        for row in [r for r in rows if r["content"] == rows[0]["content"]]:
            out.append(f"| {_NAMES[row['family']]} {row['variant']} | {row['blocks_reduced']} of "
                       f"{row['model_blocks']} | {row['removed_x_blocks']} | "
                       f"{_pair(cells[row['family'], row['variant']])} |")
        out.append("")
    rows = result.get("noise_levels", [])
    if rows:
        out += ["| noise levels (photo): family, ratio | " + " | ".join(f"sigma {s}" for s in SIGMAS) + " |",
                "| --- |" + " ---: |" * len(SIGMAS)]
        errs = {(r["family"], r["ratio"], r["sigma"]): r["err"] for r in rows}
        for family, ratio in dict.fromkeys((r["family"], r["ratio"]) for r in rows):
            out.append(f"| {_NAMES[family]} r={ratio:g} | "
                       + " | ".join(f"{errs[family, ratio, s]:.3f}" if (family, ratio, s) in errs else "-"
                                    for s in SIGMAS) + " |")
    return "\n".join(out)


def _commit() -> Optional[str]:
    return report.source_commit()


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_bench.experiments.dit_merge_error", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experiments", default=",".join(EXPERIMENTS), help=f"comma list of {', '.join(EXPERIMENTS)}")
    parser.add_argument("--families", default=None, help="comma list: only these of each experiment's families")
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=None, help="JSON to write (default docs/results/dit_merge_error_cpu.json); "
                        "an existing file keeps the experiments not run")
    parser.add_argument("--tiny", action="store_true", help="tests only: tiny-width models (the plumbing, not the errors)")
    parser.add_argument("--windows", default=None, help="comma list: only these windows (video "
                        f"{', '.join(WINDOWS)}; images {', '.join(IMAGE_WINDOWS)})")
    parser.add_argument("--tables", action="store_true", help="print the Markdown tables of --out and exit")
    args = parser.parse_args(argv)
    path = Path(args.out) if args.out else results_path("dit_merge_error_cpu.json")
    if args.tables:
        print(tables(json.loads(path.read_text())))
        return 0
    torch.set_num_threads(args.threads)
    experiments = [e.strip() for e in args.experiments.split(",") if e.strip()]
    if set(experiments) - set(EXPERIMENTS):
        print(f"error: experiments must be among {', '.join(EXPERIMENTS)}, got {args.experiments!r}", file=sys.stderr)
        return 2
    only = None if args.families is None else {f.strip() for f in args.families.split(",")}
    ratios = tuple(float(r) for r in args.ratios.split(","))
    env = report.environment("cpu")
    result = json.loads(path.read_text()) if path.exists() else {}
    result.update(device=f"cpu ({env['cpu']}, {env['cpu_count']} cores)", commit=_commit())
    result.setdefault("settings", dict(dtype="bf16", peaked=PEAKED, guidance=GUIDANCE, seed=0, photo="astronaut",
                                       sizes={f: list(s) for f, s in SIZES.items()}, depth=DEPTH,
                                       range_depth=RANGE_DEPTH, tiny=args.tiny))
    result.setdefault("environment", env)
    for experiment in experiments:
        for family in [f for f in FAMILIES[experiment] if only is None or f in only]:  # written family by family
            rows = run(experiment, [family], tiny=args.tiny, ratios=ratios,
                       windows=None if args.windows is None else args.windows.split(","))
            result[experiment] = [r for r in result.get(experiment, []) if r["family"] != family] + rows
            report.write_json(result, path)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
