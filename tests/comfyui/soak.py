"""A long ComfyUI session with ToMe, driven over HTTP as a user's client drives it (not collected by pytest).

    <comfy venv>/bin/python tests/comfyui/soak.py [--prompts 100] [--out docs/results/comfy_soak]

One real ComfyUI server runs ``--prompts`` consecutive prompts that alternate two checkpoints (the
tests' tiny SD1.5 layout, two seeds) and five ToMe settings (no ToMe, the basic node at two
ratios, the advanced node in merge and in kv), so no prompt repeats the one before it and ComfyUI
re-samples each time. After every prompt it reads the server's resident memory (VmRSS of its
process). Beforehand, each of the ten distinct prompts runs alone on a fresh server (its "solo
run"); every soak image must equal its solo image exactly. Writes ``<out>.json`` (settings, RSS
curve, growth after warm-up, mismatches) and ``<out>.svg`` (the RSS curve), and exits 1 when an
image differs or memory grows by 50 MB or more after warm-up.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Dict, List, Tuple

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

import comfy_env  # noqa: E402
from rss_chart import write_rss_svg  # noqa: E402
import numpy as np  # noqa: E402

GROWTH_LIMIT_MB = 50.0
SECOND_CHECKPOINT = "tiny_sd15_v1_seed1.safetensors"
SETTINGS: Dict[str, dict] = {
    "off": None,
    "basic r=0.5": {"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.5, "max_downsample": 1}},
    "basic r=0.3": {"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.3, "max_downsample": 1}},
    "merge r=0.6": comfy_env.advanced(ratio=0.6, use_rand=False),
    "kv r=0.75": comfy_env.advanced(mode="kv", ratio=0.75, kv_downsample="avg"),
}


def checkpoints(cache: Path) -> List[str]:
    """The two checkpoint names, written into ``cache`` once (seeds 0 and 1)."""
    first, second = cache / comfy_env.CHECKPOINT_NAME, cache / SECOND_CHECKPOINT
    if not (first.exists() and second.exists()):
        comfy_env.import_comfy(comfy_env.find_comfyui())
        if not first.exists():
            comfy_env.write_tiny_sd15_checkpoint(first, seed=0)
        if not second.exists():
            comfy_env.write_tiny_sd15_checkpoint(second, seed=1)
    return [first.name, second.name]


def start_server(cache: Path) -> comfy_env.ComfyServer:
    workdir = Path(tempfile.mkdtemp(prefix="tome_soak_"))
    (workdir / "checkpoints").mkdir()
    for name in (comfy_env.CHECKPOINT_NAME, SECOND_CHECKPOINT):
        (workdir / "checkpoints" / name).symlink_to(cache / name)
    return comfy_env.ComfyServer(comfy_env.find_comfyui(), workdir)


def rss_mb(pid: int) -> float:
    """The process's resident set (VmRSS) in MB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def schedule(count: int, ckpts: List[str], names: List[str]) -> List[Tuple[str, str]]:
    """(setting, checkpoint) per prompt: the checkpoint alternates every prompt, the setting every two."""
    return [(names[(i // 2) % len(names)], ckpts[i % 2]) for i in range(count)]


def prompt_for(setting: str, ckpt: str, index: int) -> dict:
    return comfy_env.api_prompt(SETTINGS[setting], ckpt=ckpt, prefix=f"soak_{index:03d}")


def solo_images(cache: Path, pairs: List[Tuple[str, str]]) -> Dict[Tuple[str, str], np.ndarray]:
    """Each distinct prompt alone on a fresh server."""
    images = {}
    for setting, ckpt in pairs:
        server = start_server(cache)
        try:
            images[(setting, ckpt)] = comfy_env.run_image(server, prompt_for(setting, ckpt, 0))
        finally:
            server.stop()
    return images


def comfyui_version() -> str:
    """The ComfyUI under test, as its comfyui_version.py names it ("2024" for the 2024 one, which has none)."""
    version_file = comfy_env.find_comfyui() / "comfyui_version.py"
    return version_file.read_text().split('"')[1] if version_file.is_file() else "2024"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=20, help="prompts before the memory baseline")
    parser.add_argument("--out", default="docs/results/comfy_soak")
    parser.add_argument("--settings", default=",".join(SETTINGS),
                        help="comma-separated settings to alternate (default: all; 'off' alone: the server's own "
                             "baseline without ToMe)")
    args = parser.parse_args(argv)
    names = [name.strip() for name in args.settings.split(",") if name.strip()]
    unknown = [name for name in names if name not in SETTINGS]
    if unknown or not names:
        parser.error(f"--settings: unknown {unknown}; choose from {list(SETTINGS)}")
    cache = Path(os.environ.get("TOME_COMFY_CACHE", ".cache/comfy")).resolve()
    cache.mkdir(parents=True, exist_ok=True)
    ckpts = checkpoints(cache)
    plan = schedule(args.prompts, ckpts, names)
    started = time.monotonic()
    solo = solo_images(cache, sorted(set(plan)))
    server = start_server(cache)
    rss, mismatches = [], []
    try:
        for index, (setting, ckpt) in enumerate(plan):
            image = comfy_env.run_image(server, prompt_for(setting, ckpt, index + 1))
            rss.append(rss_mb(server.process.pid))
            if not np.array_equal(image, solo[(setting, ckpt)]):
                mismatches.append({"prompt": index + 1, "setting": setting, "checkpoint": ckpt})
    finally:
        server.stop()
    baseline = statistics.median(rss[args.warmup - 5:args.warmup])
    final = statistics.median(rss[-5:])
    growth = final - baseline
    distinct_off = {s: bool(np.array_equal(solo[(s, ckpts[0])], solo[("off", ckpts[0])]))
                    for s in names if ("off", ckpts[0]) in solo}
    report = {
        "comfyui": comfyui_version(), "prompts": args.prompts, "warmup": args.warmup, "settings": names,
        "schedule": [list(p) for p in plan], "rss_mb": [round(v, 1) for v in rss],
        "rss_after_warmup_mb": round(baseline, 1), "rss_final_mb": round(final, 1),
        "growth_after_warmup_mb": round(growth, 1), "growth_limit_mb": GROWTH_LIMIT_MB,
        "images_equal_to_solo_runs": len(plan) - len(mismatches), "mismatches": mismatches,
        "setting_image_equals_off": distinct_off, "wall_s": round(time.monotonic() - started, 1),
    }
    json_path, svg_path = Path(args.out + ".json"), Path(args.out + ".svg")
    json_path.parent.mkdir(parents=True, exist_ok=True)
    json_path.write_text(json.dumps(report, indent=1) + "\n")
    with_tome = "with ToMe" if any(name != "off" for name in names) else "without ToMe"
    write_rss_svg(svg_path, rss, args.warmup,
                  f"ComfyUI server RSS (MB) after each of {len(rss)} prompts {with_tome}")
    print(f"{args.prompts} prompts: {report['images_equal_to_solo_runs']} images equal their solo runs; "
          f"RSS {baseline:.0f} MB after warm-up -> {final:.0f} MB at the end ({growth:+.1f} MB, "
          f"limit {GROWTH_LIMIT_MB:.0f}); {json_path}, {svg_path}")
    return 0 if not mismatches and growth < GROWTH_LIMIT_MB and not any(
        v for s, v in distinct_off.items() if s != "off") else 1


if __name__ == "__main__":
    sys.exit(main())
