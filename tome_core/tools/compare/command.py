"""``python -m tome_core compare``: plain against ToMe settings on the user's own diffusers pipeline and device.

Every prompt is rendered plain and with each setting, from the same seed, on one pipeline (``apply_patch`` /
``remove_patch``); the report is an image grid (plain beside each setting, labelled with the time per image, the
speed-up and PSNR/SSIM to plain) and a JSON of every number. diffusers, Pillow and tqdm are imported on use:
``import tome_core`` never needs them.
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import textwrap
import time
import typing
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

import numpy as np
import torch

from ... import apply_patch, describe, remove_patch
from ..._version import __version__
from .images import Cell, grid, metric_text, psnr, ssim
from .load import CompareError, load_pipeline

PLAIN = "plain"
DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def setting_types() -> Dict[str, Any]:
    """The keyword arguments of ``tome_core.apply_patch`` a setting may give, with their types."""
    hints = typing.get_type_hints(apply_patch)
    return {name: kind for name, kind in hints.items() if name not in ("model", "return")}


def _convert(key: str, text: str, kind: Any) -> Any:
    optional = typing.get_origin(kind) is typing.Union and type(None) in typing.get_args(kind)
    if optional:
        if text.lower() == "none":
            return None
        kind = next(k for k in typing.get_args(kind) if k is not type(None))
    if kind is bool:
        if text.lower() not in TRUE + FALSE:
            raise CompareError(f"{key} must be true or false, got {text!r}")
        return text.lower() in TRUE
    try:
        return kind(text)
    except ValueError:
        raise CompareError(f"{key} must be {'an' if kind is int else 'a'} {kind.__name__}, got {text!r}") from None


def parse_setting(text: str) -> Dict[str, Any]:
    """``"ratio=0.5,mode=kv"`` -> ``{"ratio": 0.5, "mode": "kv"}``: apply_patch's keyword arguments, typed.

    Only the syntax, the names and the types are checked here; the values are checked by the engine when the
    setting is applied to the loaded pipeline (``check_settings``).
    """
    types, kwargs = setting_types(), {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        key, sep, value = (s.strip() for s in part.partition("="))
        if not sep or not key or not value:
            raise CompareError(f"--settings {text!r}: {part!r} is not key=value (e.g. \"ratio=0.5,mode=kv\")")
        if key not in types:
            raise CompareError(f"--settings {text!r}: unknown key {key!r}; choose from: {', '.join(types)}")
        if key in kwargs:
            raise CompareError(f"--settings {text!r}: {key!r} is given twice")
        try:
            kwargs[key] = _convert(key, value, types[key])
        except CompareError as e:
            raise CompareError(f"--settings {text!r}: {e}") from None
    if not kwargs:
        raise CompareError(f"--settings {text!r}: no key=value in it (e.g. \"ratio=0.5\")")
    return kwargs


def setting_label(kwargs: Dict[str, Any]) -> str:
    return ",".join(f"{k}={v}" for k, v in kwargs.items())


def check_settings(pipe: Any, settings: Sequence[Dict[str, Any]]) -> None:
    """Apply and remove each setting on ``pipe`` before anything is rendered: a bad value stops the run with the
    engine's own message instead of after the plain images."""
    for kwargs in settings:
        try:
            apply_patch(pipe, **kwargs)
        except (TypeError, ValueError) as e:
            raise CompareError(f"--settings {setting_label(kwargs)!r}: {e}") from None
        finally:
            remove_patch(pipe)


def read_prompts(prompts: Sequence[str], files: Sequence[str]) -> List[str]:
    """``--prompt`` values, then the non-empty lines of each ``--prompts`` file."""
    found = list(prompts)
    for name in files:
        path = Path(name)
        if not path.is_file():
            raise CompareError(f"--prompts {name}: no such file")
        found += [line.strip() for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
    if not found:
        raise CompareError("no prompt: give --prompt TEXT (repeatable) and/or --prompts FILE (one per line)")
    return found


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name)
    except RuntimeError as e:
        raise CompareError(f"--device {name!r}: {e}") from None
    if device.type == "cuda" and not torch.cuda.is_available():
        raise CompareError(f"--device {name}: CUDA is not available to this torch ({torch.__version__})")
    return device


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    if name == "auto":
        return torch.float16 if device.type == "cuda" else torch.float32
    return DTYPES[name]


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return f"{device.type} ({platform.processor() or platform.machine()}, {torch.get_num_threads()} threads)"


def _sync(device: torch.device) -> None:
    """Wait for the device's queued work, so a time covers the image's computation, not its launch."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    elif device.type == "mps":
        torch.mps.synchronize()


def render(pipe: Any, prompt: str, args: argparse.Namespace, device: torch.device) -> tuple:
    """One image ``[H, W, 3]`` in [0, 1] from seed ``args.seed``, and the seconds it took (the device synchronised
    before and after, so the time is the whole image's on a GPU too)."""
    extra = {} if args.guidance is None else {"guidance_scale": args.guidance}
    if args.negative is not None:
        extra["negative_prompt"] = args.negative
    generator = torch.Generator("cpu").manual_seed(args.seed)  # the same noise on every device and run
    _sync(device)
    start = time.perf_counter()
    out = pipe(prompt=prompt, num_inference_steps=args.steps, height=args.height, width=args.width,
               generator=generator, output_type="np", **extra)
    _sync(device)
    seconds = time.perf_counter() - start
    return np.asarray(out.images[0], dtype=np.float32), seconds


@dataclass
class Run:
    """The images and times of one configuration (plain, or one setting) over every prompt."""

    label: str
    kwargs: Optional[Dict[str, Any]]
    images: List[np.ndarray] = field(default_factory=list)
    seconds: List[float] = field(default_factory=list)
    description: str = ""


def run_all(pipe: Any, prompts: Sequence[str], settings: Sequence[Dict[str, Any]], args: argparse.Namespace,
            device: torch.device) -> List[Run]:
    """Plain, then each setting, each over every prompt. A configuration is patched once for all its prompts
    and first renders ``args.warmup`` untimed images (first-call costs: allocation, kernel choice, a speed
    check's timing), so each time is a steady image's."""
    from tqdm.auto import tqdm

    runs = [Run(PLAIN, None)] + [Run(setting_label(kwargs), kwargs) for kwargs in settings]
    with tqdm(total=len(runs) * (args.warmup + len(prompts)), desc="compare", unit="image") as bar:
        for run in runs:
            bar.set_postfix_str(run.label)
            if run.kwargs is not None:
                apply_patch(pipe, **run.kwargs)
            try:
                for _ in range(args.warmup):
                    render(pipe, prompts[0], args, device)
                    bar.update()
                for prompt in prompts:
                    image, seconds = render(pipe, prompt, args, device)
                    run.images.append(image)
                    run.seconds.append(seconds)
                    bar.update()
                run.description = describe(pipe) if run.kwargs is not None else ""
            finally:
                remove_patch(pipe)
    return runs


def git_commit() -> Optional[str]:
    """The commit of the tome checkout this module runs from (``+dirty`` with uncommitted changes), or None: never
    that of a git repository a copy of tome merely sits inside (a ComfyUI checkout holding custom_nodes/tome)."""
    root = Path(__file__).resolve().parents[3]  # tome_core/tools/compare/command.py -> the checkout
    try:
        top = subprocess.run(["git", "-C", str(root), "rev-parse", "--show-toplevel"], capture_output=True,
                             text=True, timeout=10)
        if top.returncode or Path(top.stdout.strip()).resolve() != root:
            return None
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=10)
        if head.returncode:
            return None
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head.stdout.strip() + ("+dirty" if dirty else "")


def _finite(x: float) -> Optional[float]:
    return None if math.isinf(x) else x  # JSON has no infinity: identical images are "identical": true


def results(runs: Sequence[Run], prompts: Sequence[str]) -> tuple:
    """(one row per prompt x configuration, one summary per configuration) for the JSON."""
    plain, rows, summary = runs[0], [], []
    for run in runs:
        mse, ssims = [], []
        for i, prompt in enumerate(prompts):
            row = {"prompt_index": i, "prompt": prompt, "setting": run.label, "seconds": run.seconds[i],
                   "speedup": plain.seconds[i] / run.seconds[i]}
            if run is not plain:
                p, s = psnr(run.images[i], plain.images[i]), ssim(run.images[i], plain.images[i])
                row.update(psnr_db=_finite(p), ssim=s, identical=math.isinf(p))
                mse.append(float(np.mean((run.images[i].astype(np.float64) - plain.images[i]) ** 2)))
                ssims.append(s)
            rows.append(row)
        mean = float(np.mean(run.seconds))
        entry = {"setting": run.label, "kwargs": run.kwargs, "seconds_per_image": mean,
                 "speedup": float(np.mean(plain.seconds)) / mean}
        if run is not plain:  # PSNR of the mean squared error over the prompts: inf only if all are identical
            pooled = float(np.mean(mse))
            entry.update(psnr_db=_finite(math.inf if pooled == 0 else -10 * math.log10(pooled)),
                         ssim=float(np.mean(ssims)), description=run.description)
        summary.append(entry)
    return rows, summary


def grid_cells(runs: Sequence[Run], prompts: Sequence[str]) -> List[List[Cell]]:
    plain, rows = runs[0], []
    for i, prompt in enumerate(prompts):
        row = [Cell(plain.images[i], [f"plain: {prompt}", f"{plain.seconds[i]:.3f} s/image"])]
        for run in runs[1:]:
            p, s = psnr(run.images[i], plain.images[i]), ssim(run.images[i], plain.images[i])
            row.append(Cell(run.images[i], [run.label] + metric_text(run.seconds[i], plain.seconds[i], p, s)))
        rows.append(row)
    return rows


DESCRIPTION = """\
Render each prompt plain and with each ToMe setting, from the same seed, on your own diffusers pipeline and
device; write an image grid (plain beside each setting: time per image, speed-up, PSNR/SSIM to plain) and a
JSON of every number.

MODEL is a local diffusers pipeline folder (save_pretrained's layout, with model_index.json), loaded with
local_files_only: nothing is downloaded. Or a single-file .safetensors checkpoint (SD1.x/2.x, SDXL: the files of
a WebUI's or ComfyUI's models folder), loaded with from_single_file: --config DIR names a local diffusers
folder of the same model type for its configs (nothing is downloaded then); without it, diffusers looks up
that type's configs in the Hugging Face cache and, where they are missing, fetches them (a few kB, once).
A safety checker, if the pipeline has one, is not loaded."""

EPILOG = """\
a setting is tome_core.apply_patch's keyword arguments, e.g.
  --settings "ratio=0.5" --settings "ratio=0.5,mode=kv" --settings "ratio=0.3,max_downsample=2"
keys: {keys}

example:
  python -m tome_core compare ./sd15 --prompt "a red fox in the snow" --settings ratio=0.5 \\
      --settings ratio=0.5,mode=kv --steps 20 --out compare_out"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m tome_core compare", description=DESCRIPTION,
        epilog=EPILOG.format(keys=textwrap.fill(", ".join(setting_types()), 100, subsequent_indent="      ")), formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model", help="a local diffusers pipeline folder or a .safetensors checkpoint")
    parser.add_argument("--config", default=None, metavar="DIR",
                        help="for a .safetensors checkpoint: a local diffusers folder of its model type (configs)")
    parser.add_argument("--prompt", action="append", default=[], help="a prompt (repeatable)")
    parser.add_argument("--prompts", action="append", default=[], metavar="FILE", help="a file of prompts, one a line")
    parser.add_argument("--negative", default=None, help="a negative prompt for every image")
    parser.add_argument("--settings", action="append", default=[], metavar="K=V,...", required=True,
                        help="one ToMe setting to compare with plain (repeatable)")
    parser.add_argument("--seed", type=int, default=0, help="the seed of every image (default 0)")
    parser.add_argument("--steps", type=int, default=20, help="sampling steps (default 20)")
    parser.add_argument("--width", type=int, default=None, help="px (default: the pipeline's)")
    parser.add_argument("--height", type=int, default=None, help="px (default: the pipeline's)")
    parser.add_argument("--guidance", type=float, default=None, help="guidance scale (default: the pipeline's)")
    parser.add_argument("--device", default="auto", help="auto (cuda if available), cpu, cuda, cuda:1, mps, ...")
    parser.add_argument("--dtype", default="auto", choices=["auto", *DTYPES],
                        help="auto: float16 on CUDA, float32 elsewhere")
    parser.add_argument("--warmup", type=int, default=1,
                        help="untimed images per configuration before the timed ones (default 1)")
    parser.add_argument("--out", default="tome_compare", help="output folder (default ./tome_compare)")
    return parser


def report(pipe: Any, runs: Sequence[Run], prompts: Sequence[str], args: argparse.Namespace,
           device: torch.device, dtype: torch.dtype) -> dict:
    """The JSON document of a finished run."""
    rows, summary = results(runs, prompts)
    return {
        "model": str(Path(args.model).resolve()), "pipeline": type(pipe).__name__,
        "config": None if args.config is None else str(Path(args.config).resolve()),
        "prompts": list(prompts), "negative_prompt": args.negative,
        "seed": args.seed, "steps": args.steps, "width": args.width, "height": args.height,
        "guidance_scale": args.guidance, "warmup_images_per_setting": args.warmup,
        "device": str(device), "device_name": device_name(device), "dtype": str(dtype).removeprefix("torch."),
        "torch": torch.__version__, "diffusers": metadata.version("diffusers"), "tome_core": __version__,
        "commit": git_commit(), "python": platform.python_version(),
        "settings": summary, "images": rows,
    }


def print_summary(summary: Sequence[dict]) -> None:
    width = max(len(entry["setting"]) for entry in summary)
    print(f"{'setting':<{width}}  {'s/image':>8}  {'speed-up':>8}  {'PSNR dB':>8}  {'SSIM':>6}")
    for entry in summary:
        line = f"{entry['setting']:<{width}}  {entry['seconds_per_image']:8.3f}  {entry['speedup']:7.2f}x"
        if "ssim" in entry:
            shown = "inf" if entry["psnr_db"] is None else f"{entry['psnr_db']:.2f}"
            line += f"  {shown:>8}  {entry['ssim']:6.4f}"
        print(line)


def main(argv: Optional[List[str]] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        settings = [parse_setting(text) for text in args.settings]
        prompts = read_prompts(args.prompt, args.prompts)
        for name in ("steps", "warmup"):
            if getattr(args, name) < (1 if name == "steps" else 0):
                raise CompareError(f"--{name} must be >= {1 if name == 'steps' else 0}, got {getattr(args, name)}")
        device = resolve_device(args.device)
        dtype = resolve_dtype(args.dtype, device)
        pipe = load_pipeline(args.model, device, dtype, args.config)
        check_settings(pipe, settings)
    except CompareError as e:
        print(f"python -m tome_core compare: error: {e}", file=sys.stderr)
        return 2
    runs = run_all(pipe, prompts, settings, args, device)
    if args.width is None or args.height is None:  # the pipeline's default size, as rendered
        args.height, args.width = runs[0].images[0].shape[:2]
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    doc = report(pipe, runs, prompts, args, device, dtype)
    (out / "compare.json").write_text(json.dumps(doc, indent=2) + "\n", encoding="utf-8")
    grid(grid_cells(runs, prompts)).save(out / "compare.png")
    print_summary(doc["settings"])
    print(f"wrote {out / 'compare.png'} and {out / 'compare.json'} ({doc['device_name']}, {doc['dtype']})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
