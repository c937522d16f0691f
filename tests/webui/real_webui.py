"""Checks of ToMe in a real, running AUTOMATIC1111 / Forge WebUI, driven over its HTTP API as a
user's client drives it (not collected by pytest; CI cannot run a real WebUI).

It neither builds nor downloads the WebUI. Start one yourself (API only, ToMe installed as
``extensions/tome`` -> this repository), with the two tiny checkpoints this tool writes:

    # 1. test data (real_webui_checkpoints.py): two random-weight SD1.5-layout checkpoints (small
    #    UNet and VAE, a 2-layer CLIP-L text encoder), each with its <name>.yaml, and the text
    #    encoder's tokenizer/config; --full-size for Forge (run with the WebUI's Python; --ldm is
    #    the WebUI's Stability-AI stablediffusion checkout)
    <webui>/venv/bin/python tests/webui/real_webui.py checkpoints --out <webui>/models/Stable-diffusion \\
        --ldm <webui>/repositories/stable-diffusion-stability-ai --tokenizer <ComfyUI>/comfy/sd1_tokenizer
    # 2. the WebUI, e.g. AUTOMATIC1111 1.8.0-RC on CPU
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 <webui>/venv/bin/python launch.py --skip-prepare-environment \\
        --api --nowebui --skip-torch-cuda-test --use-cpu all --no-half --server-name 127.0.0.1 --port 7861
    #    or Forge (checkpoints written with --full-size)
    HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 <forge>/venv/bin/python launch.py --skip-prepare-environment \\
        --always-cpu --api --nowebui --server-name 127.0.0.1 --port 7862
    # 3. the checks (any Python with numpy and Pillow; the WebUI's is fine)
    <webui>/venv/bin/python tests/webui/real_webui.py run --url http://127.0.0.1:7861 --pid <server pid> \\
        --host a1111 --host-version "1.8.0-RC c8a5322d" --out docs/results \\
        [--checks skip,switch,hires,xyz,soak] [--prompts 100]
    # Forge, whose full-size model is slower on CPU: --host forge --skip-steps 12 --skip-size 128

The checks (every comparison is of the decoded PNG pixels, exact):

- skip: ``/sdapi/v1/skip`` sent halfway through a long ToMe job, whose image then differs from the
  same job run to the end; afterwards a plain and a ToMe run equal the same runs made before it.
- switch: the checkpoint switched per request (``override_settings``) with ToMe on; each image
  equals that checkpoint's run made after switching with ``/sdapi/v1/options``; ToMe acted.
- hires: hires fix with ``n_iter`` 3 in one job, ToMe with its own hires ratio; each image equals
  the one-image job at its seed; ToMe acted; the infotext has the hires ratio.
- xyz: the X/Y/Z plot over "[ToMe] Ratio"; each cell's image and infotext equal the single run at
  that ratio.
- soak: ``--prompts`` consecutive prompts alternating five ToMe settings and the two checkpoints;
  the server's VmRSS after each; every image equals its solo run (run beforehand, grouped by
  checkpoint); growth after the warm-up < 50 MB.

Writes ``<out>/webui_tools_<host>.json`` and ``<out>/webui_soak_<host>.{json,svg}``; exits 1 when
a check fails.
"""
from __future__ import annotations

import argparse
import base64
import io
import json
import statistics
import sys
import threading
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))

from real_webui_checkpoints import CHECKPOINTS, write_checkpoints  # noqa: E402
from rss_chart import write_rss_svg  # noqa: E402

GROWTH_LIMIT_MB = 50.0
PROMPT = "a photo of a cat sitting on a wooden chair"
CHECKS = ("skip", "switch", "hires", "xyz", "soak")

# The script's args in tome_webui/options.py FIELDS order (the ``alwayson_scripts`` "ToMe" list).
ARG_ORDER = ("enabled", "ratio", "hr_ratio", "max_downsample", "sx", "sy", "use_rand", "seed", "mode",
             "merge_attn", "merge_crossattn", "merge_mlp", "start_percent", "end_percent", "min_tokens",
             "kv_downsample", "matching", "speed_check", "match_every")
ARG_DEFAULTS = {"enabled": True, "ratio": 0.5, "hr_ratio": 0.5, "max_downsample": "1", "sx": 2, "sy": 2,
                "use_rand": True, "seed": 0, "mode": "merge", "merge_attn": True, "merge_crossattn": False,
                "merge_mlp": False, "start_percent": 0.0, "end_percent": 1.0, "min_tokens": 0,
                "kv_downsample": "nearest", "matching": "level", "speed_check": "auto", "match_every": 1}


def tome_args(**values: Any) -> List[Any]:
    """All 18 script args: ToMe on at the defaults, plus ``values``."""
    unknown = set(values) - set(ARG_ORDER)
    if unknown:
        raise KeyError(f"unknown ToMe args {sorted(unknown)}")
    merged = {**ARG_DEFAULTS, **values}
    return [merged[name] for name in ARG_ORDER]


# The soak's five settings (as tests/comfyui/soak.py): None = no ToMe.
SOAK_SETTINGS: Dict[str, Optional[List[Any]]] = {
    "off": None,
    "ratio 0.5": tome_args(ratio=0.5),
    "ratio 0.3": tome_args(ratio=0.3),
    "merge 0.6 no-rand ds2": tome_args(ratio=0.6, use_rand=False, max_downsample="2"),
    "kv 0.75 avg": tome_args(ratio=0.75, mode="kv", kv_downsample="avg"),
}


# ---------------------------------------------------------------------------------------------
# The client
# ---------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Client:
    """A WebUI's HTTP API."""

    url: str
    timeout: float = 1800.0

    def call(self, path: str, payload: Optional[dict] = None) -> Any:
        data = None if payload is None else json.dumps(payload).encode()
        request = urllib.request.Request(self.url.rstrip("/") + path, data=data,
                                         headers={"Content-Type": "application/json"},
                                         method="GET" if payload is None else "POST")
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                body = response.read()
        except urllib.error.HTTPError as error:
            raise RuntimeError(f"{path}: HTTP {error.code}: {error.read()[:2000]!r}") from None
        return json.loads(body) if body else None

    def txt2img(self, payload: dict) -> "Result":
        answer = self.call("/sdapi/v1/txt2img", payload)
        info = json.loads(answer["info"])
        return Result([decode(image) for image in answer["images"]], info.get("infotexts", []), info)


@dataclass
class Result:
    images: List[Any]  # numpy uint8 arrays
    infotexts: List[str]
    info: dict


def decode(b64: str) -> Any:
    import numpy as np
    from PIL import Image

    return np.asarray(Image.open(io.BytesIO(base64.b64decode(b64.split(",", 1)[-1]))).convert("RGB"))


def equal(a: Any, b: Any) -> bool:
    import numpy as np

    return a.shape == b.shape and bool(np.array_equal(a, b))


def max_diff(a: Any, b: Any) -> int:
    import numpy as np

    if a.shape != b.shape:
        return -1
    return int(np.abs(a.astype(np.int16) - b.astype(np.int16)).max())


def payload(tome: Optional[List[Any]], ckpt: Optional[str] = None, seed: int = 1234, steps: int = 3,
            size: int = 128, **extra: Any) -> dict:
    """A txt2img request; ``tome`` None sends ToMe's args with ToMe off."""
    body = {
        "prompt": PROMPT, "negative_prompt": "blurry", "seed": seed, "steps": steps, "width": size,
        "height": size, "sampler_name": "Euler", "cfg_scale": 6.0, "batch_size": 1, "n_iter": 1,
        "alwayson_scripts": {"ToMe": {"args": tome if tome is not None else tome_args(enabled=False)}},
        "override_settings": {"live_previews_enable": False},
        "override_settings_restore_afterwards": False,
    }
    if ckpt is not None:
        body["override_settings"]["sd_model_checkpoint"] = ckpt
    body.update(extra)
    return body


def rss_mb(pid: int) -> float:
    """The process's resident set (VmRSS) in MB, from /proc."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise RuntimeError(f"no VmRSS for pid {pid}")


def select(client: Client, ckpt: str) -> None:
    """Switch the loaded checkpoint the way the settings page does (``/sdapi/v1/options``)."""
    client.call("/sdapi/v1/options", {"sd_model_checkpoint": ckpt})


# ---------------------------------------------------------------------------------------------
# Checks; each returns (passed, details)
# ---------------------------------------------------------------------------------------------

def check_skip(client: Client, ckpt: str, steps: int = 30, size: int = 256) -> Tuple[bool, dict]:
    """Skip a long ToMe job halfway; afterwards plain and ToMe runs equal the runs made before, and
    the skipped job's image differs from the same job run to the end (the skip took effect)."""
    select(client, ckpt)
    plain_ref = client.txt2img(payload(None)).images[0]
    tome_ref = client.txt2img(payload(tome_args(ratio=0.5))).images[0]
    long_job = payload(tome_args(ratio=0.5), steps=steps, size=size, seed=77)
    answer: Dict[str, Any] = {}

    def run() -> None:
        try:
            answer["result"] = client.txt2img(long_job)
        except Exception as error:  # reported below
            answer["error"] = repr(error)

    thread = threading.Thread(target=run)
    started = time.monotonic()
    skipped_at = None
    thread.start()
    step_at_skip, steps_total = None, None
    deadline = time.monotonic() + 900
    while thread.is_alive() and time.monotonic() < deadline:
        state = client.call("/sdapi/v1/progress?skip_current_image=true")["state"]
        steps_total = state.get("sampling_steps") or steps_total
        if state.get("sampling_step", 0) >= long_job["steps"] // 2 and state.get("job_count", 0) > 0:
            step_at_skip = state["sampling_step"]
            client.call("/sdapi/v1/skip", {})
            skipped_at = time.monotonic()
            break
        time.sleep(0.2)
    thread.join()
    ended = time.monotonic()
    skipped_state = client.call("/sdapi/v1/progress?skip_current_image=true")["state"]
    plain_after = client.txt2img(payload(None)).images[0]
    tome_after = client.txt2img(payload(tome_args(ratio=0.5))).images[0]
    full = client.txt2img(long_job).images[0]
    skipped_image = answer["result"].images[0] if "result" in answer else None
    details = {
        "long_job": {"steps": steps, "size": size},
        "seconds_job_start_to_skip": None if skipped_at is None else round(skipped_at - started, 1),
        "seconds_skip_to_answer": None if skipped_at is None else round(ended - skipped_at, 1),
        "skipped_image_differs_from_full_run": skipped_image is not None and not equal(skipped_image, full),
        "skip_sent_at_step": step_at_skip, "steps_of_skipped_job": steps_total,
        "skipped_job_answer": "error: " + answer["error"] if "error" in answer else
        f"{len(answer['result'].images)} image(s)",
        "state_after": {k: skipped_state.get(k) for k in ("skipped", "interrupted", "job_count")},
        "plain_after_equals_before": equal(plain_after, plain_ref),
        "tome_after_equals_before": equal(tome_after, tome_ref),
        "tome_differs_from_plain": not equal(tome_ref, plain_ref),
        "tome_vs_plain_max_abs_diff": max_diff(tome_ref, plain_ref),
    }
    passed = (step_at_skip is not None and details["skipped_image_differs_from_full_run"]
              and details["plain_after_equals_before"]
              and details["tome_after_equals_before"] and details["tome_differs_from_plain"])
    return passed, details


def check_switch(client: Client) -> Tuple[bool, dict]:
    """Per-request checkpoint switches with ToMe on equal each checkpoint's own runs."""
    tome = tome_args(ratio=0.5)
    refs = {}
    for ckpt in CHECKPOINTS:
        select(client, ckpt)
        refs[(ckpt, "tome")] = client.txt2img(payload(tome)).images[0]
        refs[(ckpt, "off")] = client.txt2img(payload(None)).images[0]
    order = [(CHECKPOINTS[1], "tome"), (CHECKPOINTS[0], "tome"), (CHECKPOINTS[0], "off"),
             (CHECKPOINTS[1], "off"), (CHECKPOINTS[1], "tome"), (CHECKPOINTS[0], "tome")]
    rows = []
    for ckpt, setting in order:
        result = client.txt2img(payload(tome if setting == "tome" else None, ckpt=ckpt))
        rows.append({"checkpoint": ckpt, "setting": setting,
                     "equals_checkpoint_run": equal(result.images[0], refs[(ckpt, setting)]),
                     "infotext_model": _infotext_value(result.infotexts[0], "Model")})
    acted = {ckpt: max_diff(refs[(ckpt, "tome")], refs[(ckpt, "off")]) for ckpt in CHECKPOINTS}
    checkpoints_differ = not equal(refs[(CHECKPOINTS[0], "off")], refs[(CHECKPOINTS[1], "off")])
    details = {"runs": rows, "tome_vs_plain_max_abs_diff": acted, "checkpoints_differ": checkpoints_differ}
    passed = all(r["equals_checkpoint_run"] for r in rows) and all(v > 0 for v in acted.values()) \
        and checkpoints_differ
    return passed, details


def check_hires(client: Client, ckpt: str, forge: bool, n_iter: int = 3) -> Tuple[bool, dict]:
    """Hires fix with n_iter > 1: each image equals its one-image job; ToMe acted in both passes."""
    select(client, ckpt)
    hires = {"enable_hr": True, "hr_scale": 2, "hr_upscaler": "Latent", "denoising_strength": 0.6,
             "hr_second_pass_steps": 2}
    if forge:  # Forge's API needs it for hires fix (its hires pass may load other text encoders/VAE)
        hires["hr_additional_modules"] = ["Use same choices"]
    tome = tome_args(ratio=0.5, hr_ratio=0.3)
    seed = 500
    job = client.txt2img(payload(tome, seed=seed, size=128, n_iter=n_iter, **hires))
    rows = []
    for i in range(n_iter):
        solo = client.txt2img(payload(tome, seed=seed + i, size=128, **hires))
        plain = client.txt2img(payload(None, seed=seed + i, size=128, **hires))
        rows.append({
            "seed": seed + i, "equals_solo_run": equal(job.images[i], solo.images[0]),
            "size": list(job.images[i].shape[:2]),
            "tome_vs_plain_max_abs_diff": max_diff(solo.images[0], plain.images[0]),
            "infotext_has_hr_ratio": "ToMe hr ratio: 0.3" in job.infotexts[i],
            "infotext_equals_solo": job.infotexts[i] == solo.infotexts[0],
        })
    # Hires ratio 0 must give a different image than 0.3 at the same seed: the hires pass merged.
    hr_off = client.txt2img(payload(tome_args(ratio=0.5, hr_ratio=0.0), seed=seed, size=128, **hires))
    details = {"n_iter": n_iter, "images_in_job": len(job.images), "runs": rows,
               "hr_ratio_0_vs_0.3_max_abs_diff": max_diff(hr_off.images[0], job.images[0])}
    passed = len(job.images) == n_iter and all(
        r["equals_solo_run"] and r["tome_vs_plain_max_abs_diff"] > 0 and r["infotext_has_hr_ratio"]
        and r["size"] == [256, 256] for r in rows) and details["hr_ratio_0_vs_0.3_max_abs_diff"] > 0
    return passed, details


def check_xyz(client: Client, ckpt: str, ratios: Sequence[float] = (0.25, 0.5, 0.7)) -> Tuple[bool, dict]:
    """The X/Y/Z plot over "[ToMe] Ratio": each cell equals the single run at that ratio."""
    select(client, ckpt)
    infos = client.call("/sdapi/v1/script-info")
    xyz = next(s for s in infos if s["name"] == "x/y/z plot" and not s["is_img2img"])
    labels = xyz["args"][0]["choices"]
    axis = labels.index("[ToMe] Ratio")
    # xyz_grid.py ui(): x/y/z type, values, dropdown; draw_legend, include_lone_images,
    # include_sub_grids, no_fixed_seeds, vary_seeds_x/y/z, margin_size, csv_mode.
    script_args = [axis, ", ".join(str(r) for r in ratios), [], 0, "", [], 0, "", [],
                   True, True, False, False, False, False, False, 0, False]
    # ToMe's accordion off: the axis must turn it on for each cell.
    grid = client.txt2img(payload(tome_args(enabled=False), script_name="x/y/z plot",
                                  script_args=script_args))
    cells_images, cells_infotexts = grid.images[1:], grid.infotexts[1:]  # [0] is the grid
    rows = []
    plain = client.txt2img(payload(None)).images[0]
    for i, ratio in enumerate(ratios):
        single = client.txt2img(payload(tome_args(ratio=ratio)))
        rows.append({
            "ratio": ratio, "image_equals_single_run": equal(cells_images[i], single.images[0]),
            "infotext_equals_single_run": cells_infotexts[i] == single.infotexts[0],
            "cell_infotext": cells_infotexts[i], "single_infotext": single.infotexts[0],
            "tome_vs_plain_max_abs_diff": max_diff(single.images[0], plain),
        })
    details = {"axis_index": axis, "images_returned": len(grid.images), "cells": rows}
    passed = len(cells_images) == len(ratios) and all(
        r["image_equals_single_run"] and r["infotext_equals_single_run"]
        and r["tome_vs_plain_max_abs_diff"] > 0
        for r in rows)
    return passed, details


def soak_schedule(count: int) -> List[Tuple[str, str]]:
    """(setting, checkpoint) per prompt: the checkpoint alternates every prompt, the setting every two."""
    names = list(SOAK_SETTINGS)
    return [(names[(i // 2) % len(names)], CHECKPOINTS[i % 2]) for i in range(count)]


def check_soak(client: Client, pid: int, prompts: int, warmup: int, host: str, host_version: str,
               out: Path) -> Tuple[bool, dict]:
    """A long session: every image equals its solo run; RSS growth after warm-up < 50 MB."""
    plan = soak_schedule(prompts)
    started = time.monotonic()
    solo = {}
    for ckpt in CHECKPOINTS:  # grouped by checkpoint: an order unlike the soak's
        select(client, ckpt)
        for setting in SOAK_SETTINGS:
            if (setting, ckpt) in plan:
                solo[(setting, ckpt)] = client.txt2img(payload(SOAK_SETTINGS[setting])).images[0]
    rss, mismatches, seconds = [], [], []
    for index, (setting, ckpt) in enumerate(plan):
        t0 = time.monotonic()
        image = client.txt2img(payload(SOAK_SETTINGS[setting], ckpt=ckpt)).images[0]
        seconds.append(time.monotonic() - t0)
        rss.append(rss_mb(pid))
        if not equal(image, solo[(setting, ckpt)]):
            mismatches.append({"prompt": index + 1, "setting": setting, "checkpoint": ckpt,
                               "max_abs_diff": max_diff(image, solo[(setting, ckpt)])})
        print(f"soak {index + 1}/{prompts}: {setting} / {ckpt}: {rss[-1]:.1f} MB, {seconds[-1]:.1f} s",
              flush=True)
    baseline = statistics.median(rss[warmup - 5:warmup])
    final = statistics.median(rss[-5:])
    growth = final - baseline
    equals_off = {s: equal(solo[(s, CHECKPOINTS[0])], solo[("off", CHECKPOINTS[0])]) for s in SOAK_SETTINGS}
    report = {
        "host": host, "host_version": host_version, "prompts": prompts, "warmup": warmup,
        "settings": dict(SOAK_SETTINGS),
        "checkpoints": list(CHECKPOINTS), "schedule": [list(p) for p in plan],
        "rss_mb": [round(v, 1) for v in rss], "rss_after_warmup_mb": round(baseline, 1),
        "rss_final_mb": round(final, 1), "growth_after_warmup_mb": round(growth, 1),
        "growth_limit_mb": GROWTH_LIMIT_MB, "images_equal_to_solo_runs": prompts - len(mismatches),
        "mismatches": mismatches, "setting_image_equals_off": equals_off,
        "seconds_per_prompt_median": round(statistics.median(seconds), 2),
        "wall_s": round(time.monotonic() - started, 1),
    }
    out.mkdir(parents=True, exist_ok=True)
    (out / f"webui_soak_{host}.json").write_text(json.dumps(report, indent=1) + "\n")
    write_rss_svg(out / f"webui_soak_{host}.svg", rss, warmup,
                  f"{host} server RSS (MB) after each of {len(rss)} prompts with ToMe")
    passed = not mismatches and growth < GROWTH_LIMIT_MB and not any(
        v for s, v in equals_off.items() if s != "off")
    summary = {k: report[k] for k in ("prompts", "warmup", "rss_after_warmup_mb", "rss_final_mb",
                                      "growth_after_warmup_mb", "images_equal_to_solo_runs", "mismatches",
                                      "setting_image_equals_off", "seconds_per_prompt_median", "wall_s")}
    return passed, summary


def _infotext_value(infotext: str, key: str) -> Optional[str]:
    for part in infotext.replace("\n", ", ").split(", "):
        if part.startswith(key + ": "):
            return part[len(key) + 2:]
    return None


def run_checks(client: Client, pid: int, host: str, host_version: str, out: Path, checks: Sequence[str],
               prompts: int, warmup: int, skip_steps: int = 30, skip_size: int = 256) -> bool:
    """Run ``checks``, write the tools JSON (and the soak's files), print one line per check."""
    client.call("/sdapi/v1/refresh-checkpoints", {})
    titles = [m["title"] for m in client.call("/sdapi/v1/sd-models")]
    missing = [c for c in CHECKPOINTS if not any(t.startswith(c) for t in titles)]
    if missing:
        raise SystemExit(f"the WebUI does not list {missing}; write them with the checkpoints command")
    steps: Dict[str, Callable[[], Tuple[bool, dict]]] = {
        "skip": lambda: check_skip(client, CHECKPOINTS[0], skip_steps, skip_size),
        "switch": lambda: check_switch(client),
        "hires": lambda: check_hires(client, CHECKPOINTS[1], forge=host.startswith("forge")),
        "xyz": lambda: check_xyz(client, CHECKPOINTS[0]),
        "soak": lambda: check_soak(client, pid, prompts, warmup, host, host_version, out),
    }
    results = {}
    for name in checks:
        started = time.monotonic()
        try:
            passed, details = steps[name]()
        except Exception as error:  # a check that cannot run fails, with the reason
            passed, details = False, {"error": repr(error)}
        results[name] = {"passed": passed, "seconds": round(time.monotonic() - started, 1), **details}
        print(f"{name}: {'PASS' if passed else 'FAIL'} {json.dumps(details)[:600]}", flush=True)
    tool_checks = {k: v for k, v in results.items() if k != "soak"}
    if tool_checks:
        report = {"host": host, "host_version": host_version, "checks": tool_checks}
        out.mkdir(parents=True, exist_ok=True)
        path = out / f"webui_tools_{host}.json"
        previous = json.loads(path.read_text())["checks"] if path.exists() else {}
        report["checks"] = {**previous, **tool_checks}
        path.write_text(json.dumps(report, indent=1) + "\n")
    return all(r["passed"] for r in results.values())


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    ck = sub.add_parser("checkpoints", help="write the two tiny checkpoints and their yaml")
    ck.add_argument("--out", type=Path, required=True)
    ck.add_argument("--ldm", type=Path, required=True,
                    help="the folder holding ldm/ (Stability-AI stablediffusion)")
    ck.add_argument("--tokenizer", type=Path, required=True,
                    help="a CLIP-L tokenizer folder (ComfyUI's sd1_tokenizer)")
    ck.add_argument("--full-size", action="store_true", help="SD1.5's own sizes, no yaml (for Forge)")
    run = sub.add_parser("run", help="run the checks against a running WebUI")
    run.add_argument("--url", default="http://127.0.0.1:7861")
    run.add_argument("--pid", type=int, required=True, help="the WebUI server's process id (for VmRSS)")
    run.add_argument("--host", default="a1111", help="names the result files, e.g. a1111 or forge")
    run.add_argument("--host-version", default="", help="recorded in the results, e.g. the commit")
    run.add_argument("--out", type=Path, default=REPO / "docs" / "results")
    run.add_argument("--checks", default=",".join(CHECKS))
    run.add_argument("--prompts", type=int, default=100)
    run.add_argument("--warmup", type=int, default=20)
    run.add_argument("--skip-steps", type=int, default=30, help="steps of the job that is skipped halfway")
    run.add_argument("--skip-size", type=int, default=256, help="its width and height")
    args = parser.parse_args(argv)
    if args.command == "checkpoints":
        for path in write_checkpoints(args.out, args.ldm, args.tokenizer, args.full_size):
            print(path)
        return 0
    checks = [c for c in args.checks.split(",") if c]
    unknown = set(checks) - set(CHECKS)
    if unknown:
        parser.error(f"unknown checks {sorted(unknown)}")
    ok = run_checks(Client(args.url), args.pid, args.host, args.host_version, args.out, checks,
                    args.prompts, args.warmup, args.skip_steps, args.skip_size)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
