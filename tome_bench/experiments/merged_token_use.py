"""How a merged token is used and chosen: proportional attention, soft merge/unmerge, diverse
destinations, alone and combined, against today's merge and kv, at equal tokens carried.

Every variant of mode merge here carries the same tokens through the same blocks (the same ``ratio`` of each
call's grid removed; the row's ``removed`` says how many), so only the error moves; what the variant costs is
counted, not timed (``--ops``: ATen ops, MiB moved by gather/scatter/index ops, Python calls into tome_core and
host syncs of one forward, against today's merge). The variants:

- ``merge``: today's (seeded random destination per 2x2 window, hard merge, plain attention).
- ``prop``: proportional attention (``merge_attention="proportional"``): inside a merged block every attention
  whose keys are the merged stream adds ``log`` of each key's size to its logits (ToMe for ViTs' ``prop_attn``).
- ``bal``: balanced attention (``merge_attention="balanced"``): one bias for every merged grid key, ``log`` of the
  grid's tokens over its slots, 0 for the keys carried whole (text): the grid keeps its share of attention against
  the text; an image-only attention is left as it is (one value on every key changes nothing).
- ``soft`` (``soft<T>``: temperature T, default 0.1): each merged-away token is shared among its window's kept
  tokens by a softmax of its similarities (ToMA's soft merge within a tile; ``merge_variants.soften``); an unmerged
  token gets the share-weighted mix of their updates.
- ``medoid``: each window's destination is the token most similar to the window (facility location with one
  facility per window; ``merge_variants.medoid_destinations``) instead of a seeded random one.
- combinations joined by ``+`` (``prop+medoid``), and ``kv`` (mode kv at the same ratio, for reference: it carries
  every token, so its speed differs).

``soft`` and ``medoid`` live in this lab (``merge_variants``), applied to the diffusers hooks' matching; ``prop`` and
``bal`` are the engine's (``token_merge.key_bias``). The error is the bench's ``cfg err peaked`` (peaked x3,
guidance 7.5; Flux and Z-Image-Turbo distilled: the output's) on the bench's seeded full-width models, fp32
(``--dtype``), ``--blocks`` blocks of each kind, on both contents (``content.py``: seeded noise and the astronaut,
scaled to the family's latent statistics). Errors only: the machine's load does not move them.

Run (from the repository root; writes docs/results/merged_token_use_cpu.json, rows of the same family, size,
variant, ratio, content, blocks and dtype replaced):
    python -m tome_bench.experiments.merged_token_use --families flux,qwen_image,z_image,wan,ltx2 --variants merge,bal
    python -m tome_bench.experiments.merged_token_use --quick        # every variant at the smaller sizes
    python -m tome_bench.experiments.merged_token_use --ops          # the op counts (at the smaller sizes)
    python -m tome_bench.experiments.merged_token_use --tables       # the tables from the JSON
    python -m tome_bench.experiments.merged_token_use --docs         # ... written into the docs' marked blocks
"""
from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Dict, List, Optional, Sequence, Tuple

import torch

import tome_core
from tome_core.adapters.hooks import dit_merge
from tome_core.adapters.hooks.api import apply_config
from tome_core.engine.config import ToMeConfig
from tome_bench import dit_models, merge_variants, report
from tome_bench.op_count import count_ops

from . import results_path
from .dit_merge_error import _commit, cfg_err

FAMILIES = ("flux", "qwen_image", "z_image", "wan", "ltx2")
# (height, width, frames): native sizes (the bench's: Wan 33 frames, LTX-2 33), and the smaller ones of --quick and
# --ops (op counts do not depend on the size; moved MiB scale with it)
NATIVE = {"flux": (1024, 1024, 1), "qwen_image": (1328, 1328, 1), "z_image": (1024, 1024, 1),
          "wan": (480, 832, 33), "ltx2": (512, 768, 33)}
QUICK = {"flux": (512, 512, 1), "qwen_image": (512, 512, 1), "z_image": (512, 512, 1), "wan": (320, 480, 13),
         "ltx2": (512, 768, 25), "sd3": (512, 512, 1)}  # sd3: kv only (the frontier's --modes kv)
TINY = {"flux": (64, 64, 1), "qwen_image": (64, 64, 1), "z_image": (64, 64, 1), "wan": (64, 64, 5),
        "ltx2": (128, 128, 9)}
VARIANTS = ("merge", "prop", "bal", "soft", "medoid", "prop+medoid", "bal+medoid", "prop+soft+medoid", "kv")
RATIOS = (0.5,)
DOCS = ("README.md", "docs/TRANSFORMERS.md", "docs/CONTENT.md")  # where --docs writes the tables
BLOCKS = 2


ATTENTIONS = {"prop": "proportional", "bal": "balanced"}


def settings(variant: str) -> Tuple[dict, dict]:
    """(ToMeConfig fields, ``merge_variants.applied`` settings) of a variant name: ``prop``, ``bal``, ``soft`` /
    ``soft0.2``, ``medoid``, joined by ``+``; ``kv``."""
    if variant == "kv":
        return dict(mode="kv"), {}
    config, lab = dict(mode="merge", merge_attention="plain"), {}
    for part in variant.split("+"):
        if part == "merge":
            continue
        if part in ATTENTIONS:
            config["merge_attention"] = ATTENTIONS[part]
        elif part.startswith("soft"):
            lab["temperature"] = float(part[4:]) if part[4:] else 0.1
        elif part == "medoid":
            lab["medoid"] = True
        else:
            raise ValueError(f"unknown variant part {part!r} in {variant!r}: use merge, prop, bal, soft[T], medoid, "
                             "kv")
    return config, lab


def patched_forward(model: torch.nn.Module, inputs: dict, variant: str, ratio: float) -> Tuple[torch.Tensor, int]:
    """(output, grid tokens removed per reduced block) of one forward under ``variant`` at ``ratio``."""
    config, lab = settings(variant)
    apply_config(model, ToMeConfig(ratio=ratio, **config))
    try:
        with merge_variants.applied(**lab):
            out = dit_models.forward(model, inputs)
        state = model.__dict__[dit_merge.STATE_ATTR]
        call = getattr(state, "current", None)
        match = getattr(call, "match", None)
        return out, (match.removed if match is not None else 0)
    finally:
        tome_core.remove_patch(model)


DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def build(family: str, blocks: int, tiny: bool, dtype: torch.dtype) -> torch.nn.Module:
    return dit_models.build_dit(family, blocks, dtype=dtype, scale="tiny" if tiny else "full")


def inputs_for(model: torch.nn.Module, family: str, size: Tuple[int, int, int], kind: str,
               dtype: torch.dtype) -> dict:
    """The bench's inputs (seed 0, the family's batch) on content ``kind``: "noise" or "photo"."""
    height, width, frames = size
    return dit_models.make_dit_inputs(model, family, dit_models.DEFAULT_BATCH.get(family, 2), height, width,
                                      frames=frames, dtype=dtype, content=kind)


def error_rows(family: str, size: Tuple[int, int, int], variants: Sequence[str], ratios: Sequence[float],
               contents: Sequence[str], blocks: int, tiny: bool = False,
               dtype: torch.dtype = torch.float32) -> List[dict]:
    model = build(family, blocks, tiny, dtype)
    rows = []
    if tiny and family == "ltx2":  # the tiny LTX-2 is narrower than its VAE's latents: no photo
        contents = [c for c in contents if c != "photo"]
    with dit_models.peaked_attention(model, 3.0):
        for kind in contents:
            inputs = inputs_for(model, family, size, kind, dtype)
            reference = dit_models.forward(model, inputs)
            for ratio in ratios:
                for variant in variants:
                    out, removed = patched_forward(model, inputs, variant, ratio)
                    rows.append(dict(family=family, size=_size(size), content=kind, variant=variant, ratio=ratio,
                                     err=round(cfg_err(family, out, reference), 4), removed=removed,
                                     blocks=blocks, dtype=str(dtype).replace("torch.", "")))
                    print(rows[-1], flush=True)
    return rows


def ops_rows(family: str, size: Tuple[int, int, int], variants: Sequence[str], ratio: float, blocks: int,
             tiny: bool = False, dtype: torch.dtype = torch.float32) -> List[dict]:
    """ATen ops, moved MiB, Python calls into tome_core and host syncs of one forward (the second after the patch,
    as every later model call of a step), per variant, and each against today's merge."""
    model = build(family, blocks, tiny, dtype)
    inputs = inputs_for(model, family, size, "noise", dtype)
    counted = {}
    for variant in variants:
        config, lab = settings(variant)
        apply_config(model, ToMeConfig(ratio=ratio, **config))
        try:
            with merge_variants.applied(**lab):
                dit_models.forward(model, inputs)
                counted[variant], _ = count_ops(lambda: dit_models.forward(model, inputs))
        finally:
            tome_core.remove_patch(model)
        print(variant, counted[variant].total, flush=True)
    base = counted.get("merge")
    rows = []
    for variant, count in counted.items():
        row = dict(family=family, size=_size(size), variant=variant, ratio=ratio, blocks=blocks,
                   aten_ops=count.total, moved_mib=round(count.moved_mib, 2), tome_calls=count.tome_calls,
                   host_syncs=count.syncs)
        if base is not None:
            row.update(aten_ops_vs_merge=count.total - base.total,
                       moved_mib_vs_merge=round(count.moved_mib - base.moved_mib, 2),
                       tome_calls_vs_merge=count.tome_calls - base.tome_calls,
                       ops_added_by_name=count.added_over(base))
        rows.append(row)
    return rows


def _size(size: Tuple[int, int, int]) -> str:
    return f"{size[1]}x{size[0]}" + (f"x{size[2]}" if size[2] > 1 else "")


_NAMES = {"flux": "Flux", "qwen_image": "Qwen-Image", "z_image": "Z-Image", "wan": "Wan", "ltx2": "LTX-2"}


def errors_table(result: dict) -> str:
    """Markdown: per family, size and ratio, each variant's error as noise / photo."""
    rows = result.get("errors", [])
    present = list(dict.fromkeys(r["variant"] for r in rows))
    variants = [v for v in VARIANTS if v in present] + [v for v in present if v not in VARIANTS]
    cells: Dict[tuple, Dict[str, float]] = {}
    for r in rows:
        cells.setdefault((r["family"], r["size"], r["ratio"], r["variant"]), {})[r["content"]] = r["err"]
    out = ["| family, size, ratio | " + " | ".join(variants) + " |", "| --- |" + " ---: |" * len(variants)]
    for family, size, ratio in dict.fromkeys((r["family"], r["size"], r["ratio"]) for r in rows):
        out.append(f"| {_NAMES[family]} {size} r={ratio:g} | " + " | ".join(
            " / ".join(f"{c[k]:.3f}" if k in c else "-" for k in ("noise", "photo"))
            for c in (cells.get((family, size, ratio, v), {}) for v in variants)) + " |")
    return "\n".join(out)


def ops_table(result: dict) -> str:
    """Markdown: ATen ops, moved MiB, Python calls into tome_core and host syncs per forward, against merge's."""
    out = ["| family, size | variant | ATen ops (vs merge) | moved MiB (vs merge) | tome_core calls (vs merge) "
           "| host syncs |", "| --- | --- | ---: | ---: | ---: | ---: |"]
    for r in result.get("ops", []):
        out.append(f"| {_NAMES[r['family']]} {r['size']} | {r['variant']} | {r['aten_ops']} "
                   f"({r.get('aten_ops_vs_merge', 0):+d}) | {r['moved_mib']} ({r.get('moved_mib_vs_merge', 0):+.2f}) "
                   f"| {r['tome_calls']} ({r.get('tome_calls_vs_merge', 0):+d}) | {r['host_syncs']} |")
    return "\n".join(out)


def default_variant(family: str) -> str:
    """The variant a family runs where nothing is asked for: mode merge with its catalogue merge attention."""
    from tome_core.catalogue.families import BY_NAME

    return {"plain": "merge", "balanced": "bal", "proportional": "prop"}[BY_NAME[family].merge_attention]


def defaults_table(result: dict) -> str:
    """Markdown: each family's mode merge r=0.5 with its merge attention (its default where the family's default mode
    is merge) at its native size against the yardstick (tomesd r=0.5 on SD1.5 1024², ``result["yardstick"]``), on
    noise / on the photo."""
    yard = result["yardstick"]
    cells: Dict[tuple, Dict[str, float]] = {}
    for r in result.get("errors", []):
        cells.setdefault((r["family"], r["size"], r["ratio"], r["variant"]), {})[r["content"]] = r["err"]
    from tome_core.catalogue.families import BY_NAME

    out = ["| family, native size | mode merge as the family runs it | noise / photo | yardstick noise / photo "
           "| at or under it? |", "| --- | --- | ---: | ---: | --- |"]
    for family in FAMILIES:
        variant, size = default_variant(family), _size(NATIVE[family])
        cell = cells.get((family, size, 0.5, variant), {})
        if set(cell) != {"noise", "photo"}:
            continue
        verdict = " / ".join("yes" if cell[k] <= yard[k] else f"no (+{cell[k] - yard[k]:.2f})" for k in ("noise", "photo"))
        name = {"merge": "merge r=0.5", "bal": "merge r=0.5, balanced", "prop": "merge r=0.5, proportional"}[variant]
        default = BY_NAME[family]
        if (default.default_mode, default.default_ratio) != ("merge", 0.5):  # the catalogue's (the frontier's rule)
            name += f" (its default: {default.default_mode} {default.default_ratio:g})"
        out.append(f"| {_NAMES[family]} {size} | {name} | {cell['noise']:.3f} / {cell['photo']:.3f} | "
                   f"{yard['noise']:.3f} / {yard['photo']:.3f} | {verdict} |")
    return "\n".join(out)


TABLES = {"errors": errors_table, "ops": ops_table, "defaults": defaults_table}
BLOCK = re.compile(r"(<!-- merged-token-use (\w+) -->\n)(.*?)(<!-- /merged-token-use -->)", re.S)


def rewrite(text: str, result: dict) -> str:
    """``text`` with every ``<!-- merged-token-use NAME -->`` block written again from ``result`` (``TABLES``)."""
    return BLOCK.sub(lambda m: m.group(1) + TABLES[m.group(2)](result) + "\n" + m.group(4), text)


def _replace(old: List[dict], new: List[dict], key: Tuple[str, ...]) -> List[dict]:
    fresh = {tuple(r[k] for k in key) for r in new}
    return [r for r in old if tuple(r[k] for k in key) not in fresh] + new


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tome_bench.experiments.merged_token_use", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--ratios", default=",".join(map(str, RATIOS)))
    parser.add_argument("--contents", default="noise,photo")
    parser.add_argument("--blocks", type=int, default=BLOCKS, help="blocks of each kind (Flux: double; 2x single)")
    parser.add_argument("--quick", action="store_true", help="the smaller sizes (QUICK) instead of the native ones")
    parser.add_argument("--ops", action="store_true", help="count ops per variant (at the QUICK sizes) instead")
    parser.add_argument("--tiny", action="store_true", help="tests only: tiny-width models (the plumbing, not the errors)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--dtype", choices=tuple(DTYPES), default="fp32",
                        help="fp32 (default: CPUs without bf16 matrix units run bf16 hundreds of times slower) or bf16")
    parser.add_argument("--out", default=None, help="JSON (default docs/results/merged_token_use_cpu.json)")
    parser.add_argument("--tables", action="store_true", help="print the Markdown tables of --out and exit")
    parser.add_argument("--docs", nargs="*", default=None, metavar="MD",
                        help="write the tables of --out into these files' <!-- merged-token-use NAME --> blocks "
                             "(default: README.md docs/TRANSFORMERS.md docs/CONTENT.md) and exit")
    args = parser.parse_args(argv)
    path = Path(args.out) if args.out else results_path("merged_token_use_cpu.json")
    if args.tables:
        result = json.loads(path.read_text())
        print("\n\n".join(table(result) for name, table in TABLES.items() if name != "defaults" or "yardstick" in result))
        return 0
    if args.docs is not None:
        result = json.loads(path.read_text())
        for name in args.docs or DOCS:
            doc = Path(name)
            doc.write_text(rewrite(doc.read_text(encoding="utf-8"), result), encoding="utf-8")
        return 0
    torch.set_num_threads(args.threads)
    families = [f.strip() for f in args.families.split(",") if f.strip()]
    unknown = sorted(set(families) - set(FAMILIES))
    if unknown:
        print(f"error: families must be among {', '.join(FAMILIES)}, got {unknown}", file=sys.stderr)
        return 2
    variants = [v.strip() for v in args.variants.split(",") if v.strip()]
    for variant in variants:
        settings(variant)  # refuses unknown names before anything runs
    ratios = tuple(float(r) for r in args.ratios.split(","))
    sizes = TINY if args.tiny else QUICK if (args.quick or args.ops) else NATIVE
    env = report.environment("cpu")
    result = json.loads(path.read_text()) if path.exists() else {}
    dtype = DTYPES[args.dtype]
    result.update(device=f"cpu ({env['cpu']}, {env['cpu_count']} cores)", commit=_commit(), environment=env,
                  settings=dict(peaked=3.0, guidance=7.5, seed=0, photo="astronaut", tiny=args.tiny))
    for family in families:  # written family by family
        if args.ops:
            rows = [r for ratio in ratios for r in ops_rows(family, sizes[family], variants, ratio, args.blocks,
                                                              args.tiny, dtype)]
            result["ops"] = _replace(result.get("ops", []), rows, ("family", "size", "variant", "ratio", "blocks"))
        else:
            rows = error_rows(family, sizes[family], variants, ratios, args.contents.split(","), args.blocks,
                              args.tiny, dtype)
            result["errors"] = _replace(result.get("errors", []), rows,
                                        ("family", "size", "variant", "ratio", "content", "blocks", "dtype"))
        report.write_json(result, path)
    print("wrote", path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
