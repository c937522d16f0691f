"""Each merging family's ratio at tomesd's quality: how much faster at the quality users already accept.

For each family mode merge reaches (its diffusers classes, which the bench builds) at its native size, the bench's
own run (``runner.run_benchmark``: the same models, inputs, warm-up, steady timing, and on CUDA traces) of vanilla
and mode merge (the family's merge attention) at ratios 0.25 / 0.375 / 0.5 / 0.625, timed on noise, its errors
on noise and on the photo (``--content both``: ``tome_bench/content.py``). In the same run the yardstick: tomesd
r=0.5 on SD1.5 1024², the quality tomesd users accept, measured the same way (as ``merged_token_use``'s yardstick,
``docs/results/sd15_1024_content_fp32_cpu.json``). Every error is the bench's ``cfg err peaked`` (peaked x3, guidance
7.5; Flux and Z-Image-Turbo distilled: the output's).

The table gives, per family, the largest ratio whose error is at most the yardstick's, on noise, on the photo and
on both, and at the ratio that holds on both its wall and GPU-time speed-ups (GPU time: CUDA only). Each family's
default ratio and mode is chosen from it (``tome_core/catalogue/families.py``); the README shows it (its
``<!-- frontier: JSON -->`` block, written by ``--docs`` and checked by tests/test_docs.py).

Run (writes OUT/frontier.json after the yardstick and after each family, and OUT/frontier.md at the end):
    python -m tome_bench.experiments.frontier --device cuda --depth released   # a GPU: the released models, bf16
    python -m tome_bench.experiments.frontier --blocks 2                      # CPU, fp32: 2 blocks of each kind
    python -m tome_bench.experiments.frontier --tiny                          # the path only (tests)
    python -m tome_bench.experiments.frontier --tables OUT/frontier.json      # print its tables
    python -m tome_bench.experiments.frontier --docs OUT/frontier.json README.md   # write the README's block
A CPU run takes the yardstick from an earlier run of the same dtype (``--yardstick JSON``): SD1.5 1024² takes
minutes a forward there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from pathlib import Path
from typing import Dict, List, Optional, Sequence

import torch

from tome_bench import report
from tome_bench.chart import rows_of
from tome_bench.dit_models import DIT_FAMILIES
from tome_bench.dit_runner import methods_for
from tome_bench.runner import BenchConfig, run_benchmark

from .merged_token_use import QUICK

RATIOS = (0.25, 0.375, 0.5, 0.625)
YARDSTICK = ("sd15", (1024, 1024), "tomesd", 0.5)  # family, size, method, ratio
CONTENTS = ("noise", "photo")
ERRORS = {"noise": "cfg_err_peaked", "photo": "cfg_err_peaked_photo"}  # the bench's columns for each content
TINY_SIZE = (64, 64)
NAMES = {"flux": "Flux", "qwen_image": "Qwen-Image", "z_image": "Z-Image", "wan": "Wan", "ltx2": "LTX-2",
         "sd3": "SD3"}
BLOCK = re.compile(r"(<!-- frontier: ([^>]*?) -->\n)(.*?)(<!-- /frontier -->)", re.S)


def merging_families() -> tuple[str, ...]:
    """The bench's DiT families that mode merge reaches (the catalogue's diffusers classes)."""
    return tuple(f for f in DIT_FAMILIES if "merge" in methods_for(f))


def errors_of(row: dict) -> Dict[str, Optional[float]]:
    """A bench row's ``cfg err peaked`` on noise and on the photo (None where not measured)."""
    return {content: row.get(key) for content, key in ERRORS.items()}


def _dtype(args: argparse.Namespace) -> str:
    return args.dtype or ("bf16" if torch.device(args.device).type == "cuda" else "fp32")


def _config(args: argparse.Namespace, family: str, **fields) -> BenchConfig:
    cuda = torch.device(args.device).type == "cuda"
    if args.quick and family in QUICK:
        height, width, frames = QUICK[family]
        fields.setdefault("resolutions", ((width, height),))
        fields.setdefault("frames", frames if frames > 1 else 33)
    fields.setdefault("resolutions", (TINY_SIZE,) if args.tiny else None)
    return BenchConfig(families=(family,), dtype=_dtype(args), repeats=args.repeats,
                       max_repeats=max(args.repeats, args.max_repeats), scale="tiny" if args.tiny else "full",
                       device=args.device, seed=args.seed, trace_dir=str(args.out / "traces") if cuda else None,
                       **fields)


def _run(cfg: BenchConfig, args: argparse.Namespace) -> List[dict]:
    log = (lambda text: None) if args.quiet else (lambda text: print(text, file=sys.stderr, flush=True))
    return run_benchmark(cfg, progress_bar=not args.no_progress and not args.quiet, log=log)["rows"]


def yardstick_from(rows: Sequence[dict], source: str) -> dict:
    """The yardstick's figures from bench rows holding tomesd r=0.5 on SD1.5 at 1024² (any scale with --tiny)."""
    family, size, method, ratio = YARDSTICK
    found = [r for r in rows if r.get("family") == family and r.get("method") == method and r.get("ratio") == ratio
             and not r.get("compiled") and (r.get("scale") == "tiny" or (r["width"], r["height"]) == size)]
    if not found:
        raise ValueError(f"no {method} r={ratio} row of {family} {size[0]}x{size[1]} in {source}")
    row = found[0]
    return {**errors_of(row), "speedup": row.get("speedup"), "gpu_speedup": row.get("gpu_speedup"),
            "what": f"{method} r={ratio} on {family} {row['width']}x{row['height']}, {row['dtype']}",
            "source": source}


def measure_yardstick(args: argparse.Namespace) -> tuple[dict, List[dict]]:
    family, size, method, ratio = YARDSTICK
    cfg = _config(args, family, resolutions=(TINY_SIZE if args.tiny else size,), methods=("vanilla", method),
                  ratios=(ratio,), content="both")
    rows = _run(cfg, args)
    return yardstick_from(rows, "this run"), rows


def family_config(args: argparse.Namespace, family: str, ratios: Sequence[float]) -> BenchConfig:
    """The bench run of ``family``: vanilla and mode merge at ``ratios``, errors on noise and the photo."""
    # the tiny LTX-2 is narrower than its VAE's latents: no photo there (tome_bench/content.py)
    content = "noise" if args.tiny and family == "ltx2" else "both"
    return _config(args, family, methods=("vanilla", *(f"merge@{r:g}" for r in ratios)), content=content,
                   depth=args.depth, blocks=args.blocks if args.blocks is not None else (1 if args.tiny else 2))


def within(row: dict, yardstick: dict, contents: Sequence[str]) -> bool:
    """Whether the row's error is at most the yardstick's on every one of ``contents`` (False where unmeasured)."""
    errors = errors_of(row)
    return all(errors[c] is not None and yardstick.get(c) is not None and errors[c] <= yardstick[c] for c in contents)


def largest_within(rows: Sequence[dict], yardstick: dict, contents: Sequence[str]) -> Optional[dict]:
    """The merge row of the largest ratio whose error is at most the yardstick's on ``contents``; None if none is."""
    fit = [r for r in rows if r["method"] != "vanilla" and within(r, yardstick, contents)]
    return max(fit, key=lambda r: r["ratio"], default=None)


def frontier(rows: Sequence[dict], yardstick: dict) -> List[dict]:
    """Per family and size of ``rows`` (bench rows of merging families): the largest ratio at the yardstick on noise,
    on the photo and on both, and at the one on both its errors and its wall and GPU-time speed-ups."""
    out = []
    cases = dict.fromkeys((r["family"], r["width"], r["height"], r.get("frames")) for r in rows)
    for family, width, height, frames in cases:
        case = [r for r in rows if (r["family"], r["width"], r["height"], r.get("frames")) == (family, width, height,
                                                                                                 frames)]
        best = {name: largest_within(case, yardstick, contents)
                for name, contents in (("noise", ("noise",)), ("photo", ("photo",)), ("both", CONTENTS))}
        chosen = best["both"]
        out.append({"family": family, "size": f"{width}x{height}" + (f"x{frames}" if frames else ""),
                    "blocks": case[0].get("blocks"), "depth": case[0].get("depth"),
                    "ratios": sorted(r["ratio"] for r in case if r["method"] != "vanilla"),
                    "largest": {name: None if row is None else row["ratio"] for name, row in best.items()},
                    "errors": None if chosen is None else errors_of(chosen),
                    "speedup": None if chosen is None else chosen.get("speedup"),
                    "gpu_speedup": None if chosen is None else chosen.get("gpu_speedup")})
    return out


def _f(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def summary_table(result: dict) -> str:
    """Markdown: per family, the largest ratio at the yardstick (noise / photo / both), its errors and speed-ups."""
    yard = result["yardstick"]
    out = [f"| family, size, blocks | largest r at or under the yardstick ({_f(yard['noise'], '.3f')} / "
           f"{_f(yard['photo'], '.3f')}): noise / photo / both | its error noise / photo | wall × | GPU × |",
           "| --- | --- | --- | ---: | ---: |"]
    for entry in result["frontier"]:
        largest = " / ".join(_f(entry["largest"][k], "g", "none") for k in ("noise", "photo", "both"))
        errors = entry["errors"] or {}
        out.append(f"| {NAMES.get(entry['family'], entry['family'])} {entry['size']}, {entry['blocks']} | {largest} | "
                   + " / ".join(_f(errors.get(c), ".3f") for c in CONTENTS)
                   + f" | {_f(entry['speedup'], '.2f')} | {_f(entry['gpu_speedup'], '.2f')} |")
    return "\n".join(out)


def rows_table(result: dict) -> str:
    """Markdown: every merge row, its errors against the yardstick's, its wall and GPU-time speed-ups."""
    yard = result["yardstick"]
    out = ["| family, size | r | err noise | err photo | at or under the yardstick | wall × | GPU × |",
           "| --- | ---: | ---: | ---: | --- | ---: | ---: |"]
    for r in result["rows"]:
        if r["method"] == "vanilla":
            continue
        errors = errors_of(r)
        at = " / ".join(("yes" if within(r, yard, (c,)) else "no") if errors[c] is not None else "-" for c in CONTENTS)
        size = f"{r['width']}x{r['height']}" + (f"x{r['frames']}" if r.get("frames") else "")
        out.append(f"| {NAMES.get(r['family'], r['family'])} {size} | {r['ratio']:g} | "
                   f"{_f(errors['noise'], '.3f')} | {_f(errors['photo'], '.3f')} | {at} | {_f(r.get('speedup'), '.2f')} "
                   f"| {_f(r.get('gpu_speedup'), '.2f')} |")
    return "\n".join(out)


def markdown(result: dict) -> str:
    yard = result["yardstick"]
    return (f"# Each family's ratio at tomesd's quality ({result['device']}, {result['settings']['dtype']}, "
            f"commit {result.get('commit')})\n\nYardstick: {yard['what']} ({yard['source']}): cfg err peaked "
            f"{_f(yard['noise'], '.3f')} on noise, {_f(yard['photo'], '.3f')} on the photo.\n\n"
            f"{summary_table(result)}\n\n{rows_table(result)}\n")


REPO = Path(__file__).resolve().parents[2]


def rewrite(text: str, root: Path = REPO) -> str:
    """``text`` with every ``<!-- frontier: JSON -->`` block written again from its JSON (a path from ``root``, the
    repository)."""
    def block(match: re.Match) -> str:
        result = json.loads((root / match.group(2).strip()).read_text(encoding="utf-8"))
        return match.group(1) + summary_table(result) + "\n" + match.group(4)
    return BLOCK.sub(block, text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tome_bench.experiments.frontier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--depth", choices=("blocks", "released"), default="blocks",
                   help="the bench's --depth: 'released' builds each family at its released depth and width on the "
                        "GPU (default: blocks)")
    p.add_argument("--blocks", type=int, default=None, help="--depth blocks: blocks of each kind (default: 2; "
                                                            "--tiny: 1)")
    p.add_argument("--tiny", action="store_true", help="tiny-width models at 64 px (the path, not the figures)")
    p.add_argument("--quick", action="store_true",
                   help="the smaller sizes of merged_token_use --quick (images 512², Wan 480x320 x 13 frames, LTX-2 "
                        "768x512 x 25) instead of the native ones: a CPU's run (the errors are those sizes')"),
    p.add_argument("--families", default=None, help="comma list of merging families (default: every one: "
                                                    f"{', '.join(merging_families())})")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS), help="comma list (default: %(default)s)")
    p.add_argument("--dtype", choices=("fp32", "bf16", "fp16"), default=None,
                   help="default: bf16 on CUDA, fp32 on the CPU (CPUs without bf16 units run it hundreds of times "
                        "slower); the yardstick runs in the same dtype")
    p.add_argument("--repeats", type=int, default=1, help="timed rounds at least (default: 1)")
    p.add_argument("--max-repeats", type=int, default=2, help="timed rounds at most (default: 2)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--yardstick", type=Path, default=None,
                   help="take the yardstick from this bench or frontier JSON (tomesd r=0.5 on SD1.5 1024², "
                        "--content both, the same dtype) instead of measuring it")
    p.add_argument("--out", type=Path, default=Path("frontier_out"), help="folder for frontier.json and frontier.md "
                                                                          "(default: ./frontier_out)")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--no-progress", action="store_true", help="hide the progress bars")
    p.add_argument("--quiet", action="store_true", help="print only the tables (tests)")
    p.add_argument("--tables", type=Path, default=None, metavar="JSON", help="print JSON's tables and exit")
    p.add_argument("--docs", nargs="+", type=Path, default=None, metavar=("JSON", "MD"),
                   help="point the <!-- frontier: ... --> blocks of the MD files at JSON (a path in the repository), "
                        "write them from it, and exit")
    return p


def write_docs(path: Path, docs: Sequence[Path], root: Path = REPO) -> None:
    """Point every ``<!-- frontier: ... -->`` block of ``docs`` at ``path`` (a JSON under ``root``) and write it."""
    relative = path.resolve().relative_to(root.resolve()).as_posix()
    for doc in docs:
        text = doc.read_text(encoding="utf-8")
        text = BLOCK.sub(lambda m: f"<!-- frontier: {relative} -->\n{m.group(3)}{m.group(4)}", text)
        doc.write_text(rewrite(text, root), encoding="utf-8")


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.tables:
        print(markdown(json.loads(args.tables.read_text())))
        return 0
    if args.docs:
        write_docs(args.docs[0], args.docs[1:])
        return 0
    families = merging_families() if args.families is None else tuple(args.families.split(","))
    unknown = [f for f in families if f not in merging_families()]
    if unknown:
        print(f"error: {', '.join(unknown)}: not a merging family; choose from {', '.join(merging_families())}",
              file=sys.stderr)
        return 2
    ratios = tuple(float(r) for r in args.ratios.split(","))
    try:  # every run's settings checked before the first forward
        configs = [family_config(args, family, ratios) for family in families]
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if args.threads:
        torch.set_num_threads(args.threads)
    os.environ.setdefault("KINETO_LOG_LEVEL", "99")  # kineto's per-session lines (the bench's memory uses it)
    env = report.environment(args.device)
    command = " ".join(["python -m tome_bench.experiments.frontier", *(sys.argv[1:] if argv is None else argv)])
    result: dict = {"experiment": "frontier", "device": report.device_name(env), "commit": report.source_commit(),
                    "command": command,
                    "environment": env, "settings": dict(ratios=list(ratios), depth=args.depth, blocks=args.blocks,
                                                         tiny=args.tiny, quick=args.quick, dtype=_dtype(args),
                                                         peaked=3.0, guidance=7.5, seed=args.seed),
                    "complete": False, "rows": [], "frontier": []}
    path, t0 = args.out / "frontier.json", time.perf_counter()
    if args.yardstick:
        result["yardstick"] = yardstick_from(rows_of(json.loads(args.yardstick.read_text())), str(args.yardstick))
    else:
        result["yardstick"], result["yardstick_rows"] = measure_yardstick(args)
    report.write_json(result, path)
    for cfg in configs:  # written family by family: a run stopped early keeps what it measured
        result["rows"] += _run(cfg, args)
        result["frontier"] = frontier(result["rows"], result["yardstick"])
        report.write_json(result, path)
    env["wall_s"] = round(time.perf_counter() - t0, 1)
    result["complete"] = True
    report.write_json(result, path)
    text = markdown(result)
    (args.out / "frontier.md").write_text(text, encoding="utf-8")
    print(text)
    print(f"wrote {path} and {args.out / 'frontier.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
