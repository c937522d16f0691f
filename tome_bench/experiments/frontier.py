"""Each family's ratio at tomesd's quality, and its default: how much faster at the quality users already accept.

For each family (mode merge where its diffusers classes take it, which the bench builds; mode kv on every family with
``--modes merge,kv``) at its native size (``--quick``: smaller), the bench's own run (``runner.run_benchmark``: the
same models, inputs, warm-up, steady timing, and on CUDA traces) of vanilla, mode merge at ``--ratios`` and kv at
``--kv-ratios``, timed on noise, its errors on noise and on the photo (``--content both``: ``tome_bench/content.py``).
In the same run the yardstick: tomesd r=0.5 on SD1.5 1024², the quality tomesd users accept, measured the same way
(as ``merged_token_use``'s yardstick, ``docs/results/sd15_1024_content_fp32_cpu.json``). Every error is the bench's
``cfg err peaked`` (peaked x3, guidance 7.5; Flux and Z-Image-Turbo distilled: the output's).

The table gives, per family, depth and mode, the largest ratio whose error is at most the yardstick's, on noise, on
the photo and on both, its speed-ups, and the default the rule picks (``default_setting``: the fastest setting at or
under the yardstick on both that saves work, else the closest under it, said to lose quality fast). Each family's
default mode and ratio in the catalogue is the rule's on its deepest run (``tome_core/catalogue/families.py``,
``quality.json`` written by ``--quality``; tests/test_quality.py checks them); the README shows both tables
(``--docs``).

Deep models on the CPU: ``--errors-only`` runs the warm-up round alone (errors from one forward per setting and
content) and ``--flops`` counts each setting's floating-point operations (the work it saves, noise-free: what the rule
reads), ``--blocks 1,2,8`` runs each depth in turn (how the error grows with depth), ``--combine`` joins runs.

Run (writes OUT/frontier.json after the yardstick and after each family, and OUT/frontier.md at the end):
    python -m tome_bench.experiments.frontier --device cuda --depth released   # a GPU: the released models, bf16
    python -m tome_bench.experiments.frontier --quick --errors-only --flops --modes merge,kv --blocks 1,2,8 \
        --yardstick docs/results/sd15_1024_content_fp32_cpu.json          # CPU, fp32: 1, 2 and 8 blocks of each kind
    python -m tome_bench.experiments.frontier --tiny                          # the path only (tests)
    python -m tome_bench.experiments.frontier --tables OUT/frontier.json      # print its tables
    python -m tome_bench.experiments.frontier --combine ALL.json A.json B.json  # one JSON of several runs
    python -m tome_bench.experiments.frontier --quality ALL.json              # tome_core/catalogue/quality.json
    python -m tome_bench.experiments.frontier --docs ALL.json README.md       # write the README's blocks
A CPU run takes the yardstick from an earlier run of the same dtype (``--yardstick JSON``: a bench's or a frontier's):
SD1.5 1024² takes minutes a forward there.
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

RATIOS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.625)  # mode merge's
KV_RATIOS = (0.5, 0.75)  # mode kv's: its windows at the default 2x2 cells (1x2 and 2x2; ratio picks the closest)
MODES = ("merge", "kv")
# A setting "saves work" where vanilla's work over its own is at least this (floating-point operations where the run
# counted them, --flops; else the measured speed-up): a setting that saves less is lost to ToMe's own per-call cost on
# a fast GPU (the H100 run: Z-Image merge r=0.5 cut the GPU's work 1.62x for 1.00x wall time).
SAVES = 1.1


def saving(row: dict) -> Optional[float]:
    """How much less work the row's setting does than vanilla: its ``work_speedup`` (counted), else its speed-up."""
    return row.get("work_speedup") or row.get("speedup")
YARDSTICK = ("sd15", (1024, 1024), "tomesd", 0.5)  # family, size, method, ratio
CONTENTS = ("noise", "photo")
ERRORS = {"noise": "cfg_err_peaked", "photo": "cfg_err_peaked_photo"}  # the bench's columns for each content
TINY_SIZE = (64, 64)
NAMES = {"flux": "Flux", "qwen_image": "Qwen-Image", "z_image": "Z-Image", "wan": "Wan", "ltx2": "LTX-2",
         "sd3": "SD3"}
BLOCK = re.compile(r"(<!-- frontier: ([^>]*?) -->\n)(.*?)(<!-- /frontier -->)", re.S)
# README's defaults table: the catalogue's defaults beside tome_core/catalogue/quality.json (``quality.defaults_table``)
DEFAULTS_BLOCK = re.compile(r"(<!-- defaults: tome_core/catalogue/quality.json -->\n)(.*?)(<!-- /defaults -->)", re.S)


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


def methods_of(family: str, modes: Sequence[str], ratios: Sequence[float], kv_ratios: Sequence[float]) -> tuple:
    """The bench methods of ``family``: vanilla, mode merge at ``ratios`` where the family takes it, kv at
    ``kv_ratios``."""
    merge = [f"merge@{r:g}" for r in ratios] if "merge" in modes and "merge" in methods_for(family) else []
    kv = [f"kv@{r:g}" for r in kv_ratios] if "kv" in modes else []
    return ("vanilla", *merge, *kv)


def family_config(args: argparse.Namespace, family: str, ratios: Sequence[float], blocks: Optional[int] = None,
                  kv_ratios: Sequence[float] = (), modes: Sequence[str] = ("merge",)) -> BenchConfig:
    """The bench run of ``family`` at ``blocks`` of each kind: vanilla, mode merge at ``ratios`` and kv at
    ``kv_ratios``, errors on noise and the photo."""
    # the tiny LTX-2 is narrower than its VAE's latents: no photo there (tome_bench/content.py)
    content = "noise" if args.tiny and family == "ltx2" else "both"
    return _config(args, family, methods=methods_of(family, modes, ratios, kv_ratios), content=content,
                   depth=args.depth, blocks=blocks if blocks is not None else (1 if args.tiny else 2),
                   errors_only=args.errors_only, flops=args.flops)


def within(row: dict, yardstick: dict, contents: Sequence[str]) -> bool:
    """Whether the row's error is at most the yardstick's on every one of ``contents`` (False where unmeasured)."""
    errors = errors_of(row)
    return all(errors[c] is not None and yardstick.get(c) is not None and errors[c] <= yardstick[c] for c in contents)


def largest_within(rows: Sequence[dict], yardstick: dict, contents: Sequence[str]) -> Optional[dict]:
    """The merge row of the largest ratio whose error is at most the yardstick's on ``contents``; None if none is."""
    fit = [r for r in rows if r["method"] != "vanilla" and within(r, yardstick, contents)]
    return max(fit, key=lambda r: r["ratio"], default=None)


def default_setting(rows: Sequence[dict], yardstick: dict) -> Optional[dict]:
    """The rule for a family's default, on one run's rows of it (every mode and ratio): the fastest setting whose
    error is at or under the yardstick on noise and on the photo, where one of them saves work (a speed-up of at least
    ``SAVES``); where none both holds it and saves work, the setting that comes closest to it without passing it
    (the largest error at or under it), marked ``holds_and_saves`` False: this family loses quality fast under ToMe.
    None where no setting holds the yardstick at all."""
    fit = [r for r in rows if r["method"] != "vanilla" and within(r, yardstick, CONTENTS)]
    saves = [r for r in fit if (saving(r) or 0.0) >= SAVES]
    if saves:
        row, holds = max(saves, key=lambda r: (saving(r), -max(errors_of(r).values()))), True
    elif fit:
        row, holds = max(fit, key=lambda r: (max(errors_of(r).values()), r["ratio"])), False
    else:
        return None
    return {"mode": row["method"], "ratio": row["ratio"], "errors": errors_of(row), "speedup": row.get("speedup"),
            "work_speedup": row.get("work_speedup"), "holds_and_saves": holds}


def _case_key(r: dict) -> tuple:
    return r["family"], r["width"], r["height"], r.get("frames"), r.get("blocks")


def frontier(rows: Sequence[dict], yardstick: dict) -> List[dict]:
    """Per family, size and depth of ``rows`` and per mode: the largest ratio at the yardstick on noise, on the photo
    and on both, and at the one on both its errors and its wall and GPU-time speed-ups; ``default``:
    ``default_setting`` over every mode of that family, size and depth."""
    out = []
    for key in dict.fromkeys(_case_key(r) for r in rows):
        family, width, height, frames, _ = key
        case = [r for r in rows if _case_key(r) == key]
        default = default_setting(case, yardstick)
        for mode in dict.fromkeys(r["method"] for r in case if r["method"] != "vanilla"):
            measured = [r for r in case if r["method"] == mode]
            best = {name: largest_within(measured, yardstick, contents)
                    for name, contents in (("noise", ("noise",)), ("photo", ("photo",)), ("both", CONTENTS))}
            chosen = best["both"]
            out.append({"family": family, "mode": mode, "size": f"{width}x{height}" + (f"x{frames}" if frames else ""),
                        "blocks": case[0].get("blocks"), "depth": case[0].get("depth"),
                        "ratios": sorted(r["ratio"] for r in measured),
                        "largest": {name: None if row is None else row["ratio"] for name, row in best.items()},
                        "errors": None if chosen is None else errors_of(chosen),
                        "speedup": None if chosen is None else chosen.get("speedup"),
                        "gpu_speedup": None if chosen is None else chosen.get("gpu_speedup"),
                        "work_speedup": None if chosen is None else chosen.get("work_speedup"),
                        "timing": case[0].get("timing", "steady"), "default": default})
    return out


def deepest(result: dict) -> Dict[str, dict]:
    """Per family, the ``frontier`` entry of its deepest run (its default's evidence): the most blocks measured."""
    def depth(entry: dict) -> int:
        return sum(int(n) for n in str(entry["blocks"]).split("+")) if entry["blocks"] else 0
    out: Dict[str, dict] = {}
    for entry in result["frontier"]:
        if entry["family"] not in out or depth(entry) > depth(out[entry["family"]]):
            out[entry["family"]] = entry
    return out


def _f(value, spec: str, none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _setting(default: Optional[dict]) -> str:
    if default is None:
        return "none holds it"
    text = f"{default['mode']} r={default['ratio']:g}"
    return text if default["holds_and_saves"] else text + " (saves little: loses quality fast)"


def summary_table(result: dict) -> str:
    """Markdown: per family, depth and mode, the largest ratio at the yardstick (noise / photo / both), its errors
    and speed-ups, and the default the rule picks from that depth's rows."""
    yard = result["yardstick"]
    out = [f"| family, size, blocks | mode | largest r at or under the yardstick ({_f(yard['noise'], '.3f')} / "
           f"{_f(yard['photo'], '.3f')}): noise / photo / both | its error noise / photo | work × | wall × | GPU × | "
           "default by the rule |",
           "| --- | --- | --- | --- | ---: | ---: | ---: | --- |"]
    for entry in result["frontier"]:
        largest = " / ".join(_f(entry["largest"][k], "g", "none") for k in ("noise", "photo", "both"))
        errors = entry["errors"] or {}
        out.append(f"| {NAMES.get(entry['family'], entry['family'])} {entry['size']}, {entry['blocks']} | "
                   f"{entry.get('mode', 'merge')} | {largest} | "
                   + " / ".join(_f(errors.get(c), ".3f") for c in CONTENTS)
                   + f" | {_speeds(entry)} | {_setting(entry.get('default')) if 'default' in entry else '-'} |")
    return "\n".join(out)


def _speeds(entry: dict) -> str:
    """The work, wall and GPU-time speed-up cells of a row or a frontier entry (wall only where timed at steady
    state)."""
    wall = entry.get("speedup") if entry.get("timing", "steady") == "steady" else None
    return f"{_f(entry.get('work_speedup'), '.2f')} | {_f(wall, '.2f')} | {_f(entry.get('gpu_speedup'), '.2f')}"


def rows_table(result: dict) -> str:
    """Markdown: every reduced row, its errors against the yardstick's, its wall and GPU-time speed-ups."""
    yard = result["yardstick"]
    out = ["| family, size, blocks | mode r | err noise | err photo | at or under the yardstick | work × | wall × "
           "| GPU × |",
           "| --- | --- | ---: | ---: | --- | ---: | ---: | ---: |"]
    for r in result["rows"]:
        if r["method"] == "vanilla":
            continue
        errors = errors_of(r)
        at = " / ".join(("yes" if within(r, yard, (c,)) else "no") if errors[c] is not None else "-" for c in CONTENTS)
        size = f"{r['width']}x{r['height']}" + (f"x{r['frames']}" if r.get("frames") else "")
        out.append(f"| {NAMES.get(r['family'], r['family'])} {size}, {r.get('blocks')} | {r['method']} "
                   f"{r['ratio']:g} | {_f(errors['noise'], '.3f')} | {_f(errors['photo'], '.3f')} | {at} | "
                   f"{_speeds(r)} |")
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
    from tome_core.catalogue.quality import defaults_table

    def block(match: re.Match) -> str:
        result = json.loads((root / match.group(2).strip()).read_text(encoding="utf-8"))
        return match.group(1) + summary_table(result) + "\n" + match.group(4)
    text = DEFAULTS_BLOCK.sub(lambda m: m.group(1) + defaults_table() + "\n" + m.group(3), text)
    return BLOCK.sub(block, text)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m tome_bench.experiments.frontier", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: cpu)")
    p.add_argument("--depth", choices=("blocks", "released"), default="blocks",
                   help="the bench's --depth: 'released' builds each family at its released depth and width on the "
                        "GPU (default: blocks)")
    p.add_argument("--blocks", default=None, help="--depth blocks: blocks of each kind, or a comma list run one after "
                                                 "the other, shallow first (e.g. 1,2,8: how the error grows with "
                                                 "depth; default: 2; --tiny: 1)")
    p.add_argument("--tiny", action="store_true", help="tiny-width models at 64 px (the path, not the figures)")
    p.add_argument("--quick", action="store_true",
                   help="the smaller sizes of merged_token_use --quick (images 512², Wan 480x320 x 13 frames, LTX-2 "
                        "768x512 x 25) instead of the native ones: a CPU's run (the errors are those sizes')"),
    p.add_argument("--families", default=None, help="comma list of merging families (default: every one: "
                                                    f"{', '.join(merging_families())})")
    p.add_argument("--ratios", default=",".join(f"{r:g}" for r in RATIOS),
                   help="mode merge's, comma list (default: %(default)s)")
    p.add_argument("--kv-ratios", default=",".join(f"{r:g}" for r in KV_RATIOS),
                   help="mode kv's, comma list (default: %(default)s: its 1x2 and 2x2 windows)")
    p.add_argument("--modes", default="merge", help="comma list of merge and kv (default: %(default)s); kv runs on "
                                                    "every family given, merge where the family takes it")
    p.add_argument("--errors-only", action="store_true",
                   help="the warm-up round alone: each setting's errors (noise and photo) from one forward each, its "
                        "speed-up from those forwards' times (profiled, single: marked 'warm-up'); a third of the "
                        "forwards, for deep models on the CPU")
    p.add_argument("--flops", action="store_true",
                   help="also count each setting's floating-point operations (one more forward each): the rows' "
                        "work_speedup, which the default's rule reads before the timed speed-up")
    p.add_argument("--quality", type=Path, default=None, metavar="JSON",
                   help="write tome_core/catalogue/quality.json (what the defaults and a higher ratio cost, shown "
                        "by the nodes, the WebUI and describe()) from this frontier JSON in the repository, and exit")
    p.add_argument("--combine", nargs="+", type=Path, default=None, metavar=("OUT", "JSON"),
                   help="write OUT, one frontier JSON of the rows of several (the same yardstick), and exit")
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


def combine(out: Path, paths: Sequence[Path]) -> dict:
    """One frontier JSON from several runs of the same yardstick: their rows, each run's command, commit and wall
    time kept under ``runs``; the frontier computed again over every row."""
    results = [json.loads(Path(p).read_text()) for p in paths]
    yards = {json.dumps({k: r["yardstick"][k] for k in CONTENTS}) for r in results}
    if len(yards) != 1:
        raise ValueError(f"{', '.join(map(str, paths))}: their yardsticks differ; combine runs of one yardstick")
    first = results[0]
    combined = {k: v for k, v in first.items() if k not in ("rows", "frontier", "command", "yardstick_rows")}
    combined["runs"] = [{"file": f"{Path(p).parent.name}/{Path(p).name}", "command": r["command"],
                         "commit": r.get("commit"),
                         "complete": r["complete"], "wall_s": r["environment"].get("wall_s"),
                         "settings": r["settings"]} for p, r in zip(paths, results)]
    commits = [r.get("commit") or "" for r in results]  # the newest run's code, "+dirty" said apart
    combined["commit"] = commits[-1].split("+")[0]
    combined["dirty"] = any(c.endswith("+dirty") for c in commits)
    combined["complete"] = all(r["complete"] for r in results)
    combined["rows"] = [row for r in results for row in r["rows"]]
    combined["frontier"] = frontier(combined["rows"], combined["yardstick"])
    report.write_json(combined, Path(out))
    return combined


def quality_summary(result: dict, source: str) -> dict:
    """``tome_core/catalogue/quality.json``: per family, from its deepest run, the rule's default and every setting
    measured (mode, ratio, errors, speed-up), with the yardstick and where it was measured."""
    families = {}
    for family, entry in deepest(result).items():
        if entry["default"] is None:
            continue
        case = [r for r in result["rows"] if r["method"] != "vanilla" and r["family"] == family
                and r.get("blocks") == entry["blocks"]]
        families[family] = {"title": NAMES.get(family, family), "size": entry["size"], "blocks": entry["blocks"],
                            "default": entry["default"],
                            "settings": [{"mode": r["method"], "ratio": r["ratio"], "errors": errors_of(r),
                                          "work_speedup": r.get("work_speedup")} for r in case]}
    yard, device = result["yardstick"], result["device"].split(" (")[0]
    return {"source": source, "commit": result.get("commit"), "device": result["device"],
            "where": f"{result['settings']['dtype']} on {'the CPU' if device == 'cpu' else device}, each family at its "
                     f"deepest run, cfg err peaked on noise and a photo; {source}",
            "yardstick": {"what": yard["what"], "noise": yard["noise"], "photo": yard["photo"]},
            "saves": SAVES, "families": families}


def write_quality(path: Path, root: Path = REPO) -> dict:
    """Write ``tome_core/catalogue/quality.json`` from the frontier JSON at ``path`` (a path in the repository)."""
    relative = path.resolve().relative_to(root.resolve()).as_posix()
    summary = quality_summary(json.loads(path.read_text(encoding="utf-8")), relative)
    (root / "tome_core" / "catalogue" / "quality.json").write_text(json.dumps(summary, separators=(",", ":")) + "\n",
                                                                   encoding="utf-8")  # one line: it ships with the nodes
    return summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = _parser().parse_args(argv)
    if args.tables:
        print(markdown(json.loads(args.tables.read_text())))
        return 0
    if args.docs:
        write_docs(args.docs[0], args.docs[1:])
        return 0
    if args.quality:
        write_quality(args.quality)
        return 0
    if args.combine:
        combine(args.combine[0], args.combine[1:])
        return 0
    modes = tuple(args.modes.split(","))
    allowed = tuple(DIT_FAMILIES) if "kv" in modes else merging_families()
    families = merging_families() if args.families is None else tuple(args.families.split(","))
    unknown = [f for f in families if f not in allowed]
    if unknown or not set(modes) <= set(MODES):
        print(f"error: {', '.join(unknown) or args.modes}: choose families from {', '.join(allowed)} and modes from "
              f"{', '.join(MODES)}", file=sys.stderr)
        return 2
    ratios = tuple(float(r) for r in args.ratios.split(","))
    kv_ratios = tuple(float(r) for r in args.kv_ratios.split(","))
    depths = [None] if args.blocks is None else [int(b) for b in str(args.blocks).split(",")]
    try:  # every run's settings checked before the first forward
        configs = [family_config(args, family, ratios, blocks, kv_ratios, modes)
                   for family in families for blocks in depths]
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
                    "environment": env, "settings": dict(ratios=list(ratios), kv_ratios=list(kv_ratios),
                                                         modes=list(modes), depth=args.depth, blocks=args.blocks,
                                                         tiny=args.tiny, quick=args.quick, dtype=_dtype(args),
                                                         errors_only=args.errors_only, flops=args.flops,
                                                         peaked=3.0, guidance=7.5,
                                                         seed=args.seed),
                    "complete": False, "rows": [], "frontier": []}
    path, t0 = args.out / "frontier.json", time.perf_counter()
    if args.yardstick:
        earlier = json.loads(args.yardstick.read_text())
        result["yardstick"] = (dict(earlier["yardstick"], source=str(args.yardstick)) if "yardstick" in earlier
                               else yardstick_from(rows_of(earlier), str(args.yardstick)))  # a frontier's, or rows
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
