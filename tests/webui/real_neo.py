"""Checks of ToMe on the transformers of a real, running Forge Neo, driven over its HTTP API as a user's client drives
it (not collected by pytest; CI cannot run Forge Neo).

It neither builds nor downloads Forge Neo nor its models. Start one yourself (``../shared/REAL_HOSTS.md``, "Forge
Neo": API only, on the CPU, ToMe copied into ``extensions/tome``), holding tiny random-weight checkpoints built from
Neo's own classes (one per family in ``FAMILIES``, named ``tiny-<...>-a.safetensors``), then:

    <neo>/venv/bin/python tests/webui/real_neo.py --url http://127.0.0.1:7861 --host-version "neo de2193d9" \\
        [--families flux,chroma,qwen_image,z_image,wan] [--baselines plain.json] [--out docs/results]

Per family (the checkpoint selected with its Neo preset), every comparison of the decoded PNG pixels, exact:

- identity: ToMe's accordion off, ToMe on at ratio 0, and a request without ToMe's args all give one image (and
  that image's sha256 equals ``--baselines``' entry, a run of the same request on a Neo without the extension);
- modes: each mode the catalogue gives the family on Forge Neo at ratio 0.5 changes the image, and its infotext says
  the ratio and the mode; mode "default" runs the family's default (same image and infotext mode);
- refusals: a ratio out of range and a mode the family lacks stop the job with HTTP 500 and ToMe's message; the server
  answers afterwards;
- hires: hires fix with its own ratio runs, the infotext has it, the image differs from hires without ToMe;
- xyz (first family only): the X/Y/Z plot over "[ToMe] Ratio"; each cell equals the single run at that ratio;
- timing: whole-request seconds without ToMe and with ToMe at its default (median of ``--repeats``, interleaved).

Writes ``<out>/webui_neo.json``; exits 1 when a check fails.
"""
from __future__ import annotations

import argparse
import base64
import hashlib
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(REPO))

from real_webui import Client, Result, equal, max_diff, tome_args  # noqa: E402
from tome_bench.report import source_commit  # noqa: E402
from tome_core.catalogue.families import BY_NAME, modes_of  # noqa: E402

# family -> (checkpoint file stem, Neo preset (forge_preset), extra request fields)
FAMILIES: Dict[str, Tuple[str, str, dict]] = {
    "flux": ("tiny-flux1-dev-a", "flux", {}),
    "chroma": ("tiny-chroma-a", "flux", {}),
    "qwen_image": ("tiny-qwen-image-a", "qwen", {}),
    "z_image": ("tiny-zimage-a", "zit", {}),
    # Neo's Wan: batch_size is the frame count (4k+1); it writes each video with ffmpeg into outdir_videos
    "wan": ("tiny-wan22-t2v-a", "wan", {"batch_size": 5, "override_settings": {
        "live_previews_enable": False, "outdir_videos": "/tmp/neo/videos"}}),
}
PROMPT = "a red cube on a table"


def request(tome: Optional[List[Any]], seed: int = 1, steps: int = 2, size: int = 128, cfg: float = 1.0,
            **extra: Any) -> dict:
    """A txt2img request; ``tome`` None sends no ToMe args at all."""
    body = {"prompt": PROMPT, "negative_prompt": "", "seed": seed, "steps": steps, "width": size, "height": size,
            "sampler_name": "Euler", "scheduler": "Simple", "cfg_scale": cfg, "batch_size": 1, "n_iter": 1,
            "override_settings": {"live_previews_enable": False}, "override_settings_restore_afterwards": False}
    if tome is not None:
        body["alwayson_scripts"] = {"ToMe": {"args": tome}}
    body.update(extra)
    return body


def refused(client: Client, body: dict) -> str:
    """The error message of a request that must fail (HTTP 500), "" where it did not fail."""
    try:
        client.txt2img(body)
    except RuntimeError as error:
        return str(error)
    return ""


def png_sha(client: Client, body: dict) -> str:
    """The sha256 of the first PNG the server returns for ``body`` (as the baselines record it)."""
    return hashlib.sha256(base64.b64decode(client.call("/sdapi/v1/txt2img", body)["images"][0])).hexdigest()


def select(client: Client, stem: str, preset: str) -> str:
    client.call("/sdapi/v1/refresh-checkpoints", {})
    titles = [m["title"] for m in client.call("/sdapi/v1/sd-models")]
    title = next((t for t in titles if t.startswith(stem)), None)
    if title is None:
        raise SystemExit(f"Forge Neo does not list {stem}: write the tiny checkpoints first")
    client.call("/sdapi/v1/options", {"forge_preset": preset, "sd_model_checkpoint": title})
    return title


def check_family(client: Client, family: str, baseline: Optional[str], repeats: int) -> Tuple[bool, dict]:
    stem, preset, extra = FAMILIES[family]
    entry = BY_NAME[family]
    modes, default = modes_of(entry, "neo"), entry.mode_for("merge" in modes_of(entry, "neo"))
    title = select(client, stem, preset)
    details: Dict[str, Any] = {"checkpoint": title, "preset": preset, "modes": list(modes), "default_mode": default}
    none = client.txt2img(request(None, **extra))
    if "Model: " + stem not in none.infotexts[0]:
        return False, dict(details, error=f"the infotext names another model: {none.infotexts[0][-200:]}")
    off = client.txt2img(request(tome_args(enabled=False), **extra))
    zero = client.txt2img(request(tome_args(ratio=0.0, mode="default"), **extra))
    details["identity"] = {
        "off_equals_none": equal(off.images[0], none.images[0]),
        "ratio0_equals_none": equal(zero.images[0], none.images[0]),
        "sha256": png_sha(client, request(None, **extra)), "baseline_without_extension": baseline}
    details["identity"]["equals_baseline"] = baseline is None or details["identity"]["sha256"] == baseline
    passed = all(v for k, v in details["identity"].items() if k.startswith(("off", "ratio0", "equals")))
    runs: Dict[str, Result] = {}
    details["modes_run"] = {}
    for mode in modes:
        runs[mode] = client.txt2img(request(tome_args(ratio=0.5, mode=mode), **extra))
        info = runs[mode].infotexts[0]
        row = {"max_abs_diff_vs_none": max_diff(runs[mode].images[0], none.images[0]),
               "infotext_ratio": "ToMe ratio: 0.5" in info, "infotext_mode": f"ToMe mode: {mode}" in info}
        details["modes_run"][mode] = row
        passed &= row["max_abs_diff_vs_none"] > 0 and row["infotext_ratio"] and row["infotext_mode"]
    chosen = client.txt2img(request(tome_args(ratio=0.5, mode="default"), **extra))
    details["default"] = {"equals_its_mode": equal(chosen.images[0], runs[default].images[0]),
                          "infotext_mode": f"ToMe mode: {default}" in chosen.infotexts[0]}
    passed &= all(details["default"].values())
    bad_ratio = refused(client, request(tome_args(ratio=1.5, mode="default"), **extra))
    lacking = [m for m in ("kv", "merge") if m not in modes]
    bad_mode = refused(client, request(tome_args(ratio=0.5, mode=lacking[0]), **extra)) if lacking else None
    alive = client.call("/sdapi/v1/options") is not None
    details["refusals"] = {"ratio_1.5": bad_ratio[-400:], f"mode_{lacking[0] if lacking else '-'}": (bad_mode or "")[-400:],
                           "server_answers_after": alive}
    passed &= "ToMe" in bad_ratio and "ratio" in bad_ratio and (bad_mode is None or "ToMe" in bad_mode) and alive
    hires = {"enable_hr": True, "hr_scale": 1.5, "hr_upscaler": "None", "denoising_strength": 0.6,
             "hr_second_pass_steps": 1, "hr_additional_modules": ["Use same choices"]}
    # Neo's sample_hr_pass cannot take a video (PIL fails on the frames, with or without ToMe): one frame
    hr_extra = dict(extra, batch_size=1) if "batch_size" in extra else extra
    plain_hr = client.txt2img(request(None, **hires, **hr_extra))
    tome_hr = client.txt2img(request(tome_args(ratio=0.5, hr_ratio=0.3, mode="default"), **hires, **hr_extra))
    details["hires"] = {"size": list(tome_hr.images[0].shape[:2]), "frames": hr_extra.get("batch_size", 1),
                        "max_abs_diff_vs_plain": max_diff(tome_hr.images[0], plain_hr.images[0]),
                        "infotext_has_hr_ratio": "ToMe hr ratio: 0.3" in tome_hr.infotexts[0]}
    passed &= details["hires"]["max_abs_diff_vs_plain"] > 0 and details["hires"]["infotext_has_hr_ratio"]
    times: Dict[str, List[float]] = {"without": [], "with": []}
    for _ in range(repeats):
        for side, tome in (("without", None), ("with", tome_args(ratio=0.5, mode="default"))):
            started = time.monotonic()
            client.txt2img(request(tome, **extra))
            times[side].append(time.monotonic() - started)
    details["seconds_per_request"] = {side: round(statistics.median(v), 2) for side, v in times.items()}
    details["seconds_per_request"]["ratio"] = round(times["without"] and statistics.median(times["without"])
                                                    / statistics.median(times["with"]), 3)
    return bool(passed), details


def check_xyz(client: Client, family: str, ratios: Sequence[float] = (0.25, 0.5)) -> Tuple[bool, dict]:
    """The X/Y/Z plot over "[ToMe] Ratio" on a transformer: each cell equals the single run at that ratio."""
    stem, preset, extra = FAMILIES[family]
    select(client, stem, preset)
    xyz = next(s for s in client.call("/sdapi/v1/script-info") if s["name"] == "x/y/z plot" and not s["is_img2img"])
    axis = xyz["args"][0]["choices"].index("[ToMe] Ratio")
    script_args = [axis, ", ".join(str(r) for r in ratios), [], 0, "", [], 0, "", [],
                   True, True, False, False, False, False, False, 0, False]
    if len(xyz["args"]) == 19:  # Neo's xyz_grid.py run(): row_count before margin_size
        script_args.insert(16, 0)
    grid = client.txt2img(request(tome_args(enabled=False, mode="default"), script_name="x/y/z plot",
                                  script_args=script_args, **extra))
    rows = []
    for i, ratio in enumerate(ratios):
        single = client.txt2img(request(tome_args(ratio=ratio, mode="default"), **extra))
        rows.append({"ratio": ratio, "image_equals_single_run": equal(grid.images[1 + i], single.images[0]),
                     "infotext_equals_single_run": grid.infotexts[1 + i] == single.infotexts[0]})
    passed = len(grid.images) == len(ratios) + 1 and all(all(r.values()) for r in rows)
    return passed, {"family": family, "axis_index": axis, "cells": rows}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:7861")
    parser.add_argument("--host-version", default="", help="recorded in the results, e.g. the commit")
    parser.add_argument("--families", default=",".join(FAMILIES))
    parser.add_argument("--baselines", type=Path, help="JSON {family: sha256 of the plain request without ToMe}")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    args = parser.parse_args(argv)
    client = Client(args.url)
    baselines = json.loads(args.baselines.read_text()) if args.baselines else {}
    families = [f for f in args.families.split(",") if f]
    results: Dict[str, Any] = {}
    for name, run in [(f, lambda f=f: check_family(client, f, baselines.get(f), args.repeats)) for f in families] + \
            [("xyz", lambda: check_xyz(client, families[0]))]:
        started = time.monotonic()
        try:
            passed, details = run()
        except Exception as error:  # a check that cannot run fails, with the reason
            passed, details = False, {"error": repr(error)}
        results[name] = {"passed": passed, "seconds": round(time.monotonic() - started, 1), **details}
        print(f"{name}: {'PASS' if passed else 'FAIL'} {json.dumps(details)[:800]}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"host": "forge-neo", "host_version": args.host_version, "device": "cpu",
              "commit": (source_commit() or "")[:12], "checks": results}
    (args.out / "webui_neo.json").write_text(json.dumps(report, indent=1) + "\n")
    return 0 if all(r["passed"] for r in results.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
