"""ComfyUI's own step caches, EasyCache and LazyCache, beside ToMe's nodes on the transformer families, on a server.

Each prompt goes through ``POST /prompt`` as a user's does: ``TomeTestTinyDiT`` (tome_test_nodes/dit_nodes.py: the
reduced seeded models of test_comfy_dit / test_comfy_families, built from ComfyUI's own classes in the server) ->
``TomeTestKeySpy`` (an attention override that records the key count and step of each attention call the model makes;
ToMe chains it) -> ToMe and the cache, in either order -> KSampler (5 steps, euler/simple, cfg 1) ->
``TomeTestSaveLatent`` (the sampled latent, compared bit for bit). The caches run as test_comfy_compose's UNet rows do
(``reuse_threshold`` 3, ``start_percent`` 0): alone each skips 2 or 3 of the 5 steps on these models, read from its
closing log line ("EasyCache - skipped 2/5 steps").

For each family x cache x ToMe node (ToMe (advanced) in mode merge where the family merges and kv; ToMe (token
merging) in the family's default mode) x node order:
- both act: the cache still skips whole steps beside ToMe (the spy sees attention in the other steps only, as many
  calls in each as without it); ToMe reduces in the steps the cache computes (the spy sees key counts the cache alone
  never hands attention; the node shows its plan); the latent differs from the cache alone's, from ToMe alone's and
  from the plain one;
- ratio 0: the cache alone's latent, bit for bit;
- removal: the next prompt without the ToMe node (the loader's MODEL taken from the server's cache, the sampler run
  again) gives the cache alone's latent, bit for bit;
- the node order: the same latent either way.
Then the speed check beside each cache (ToMe (advanced) merge from half the schedule, the UNet's from a quarter,
speed_check "on"; the model call's real repeats run, then a forced figure gives a "reduced" or a "left whole" verdict)
on Flux, Wan and the tiny SD1.5 UNet: the call is timed beside either cache (ToMe repeats it with EasyCache's
DIFFUSION_MODEL wrapper stepped over: tome_core/adapters/model_patcher/step_caches.py), the verdict is a measured one,
the cache skips exactly what it skips with the check off, and the latent is the check-off one (reduced) or the cache
alone's (left whole), bit for bit. Another node's DIFFUSION_MODEL wrapper (TomeTestDiffusionModelWrapper) leaves the
call unrepeated, and the verdict says so (a transformer's: not timed; the UNet's: its self-attention alone).

EasyCache is a DIFFUSION_MODEL wrapper: ComfyUI's MMDiT (SD3) runs none, so EasyCache skips nothing on SD3 by itself
(that case is skipped, after checking it); LazyCache (a PREDICT_NOISE wrapper) acts on every model. The 2024 ComfyUI
has neither node: every test skips there, naming it. ``TOME_STEP_CACHES_TABLE=path`` appends the measured table
(steps skipped, mean |difference| from the plain latent, the speed check's verdicts) as markdown when the module ends;
``TOME_STEP_CACHES_FULL=1`` runs the whole matrix (KEPT below).
"""
from __future__ import annotations

import json
import os
import re

import pytest

from comfy_env import advanced, api_prompt
from test_comfy_compose import CACHE_STEPS, CACHES, skipped_steps
from test_comfy_speed_check import LEVELS_EVENT, run_listening

torch = pytest.importorskip("torch")
safetensors_torch = pytest.importorskip("safetensors.torch")

# family (the builders' names) -> the modes ToMe (advanced) takes on it (its catalogue default first)
FAMILY_MODES = {
    "flux": ("merge", "kv"), "qwen_image": ("merge", "kv"), "z_image": ("merge", "kv"), "wan": ("merge", "kv"),
    "ltxav": ("merge", "kv"),  # LTX-2: ComfyUIs from 2026 (skipped, naming the class, where it is missing)
    "ltxv": ("kv",), "hunyuan_video": ("kv",), "sd3": ("kv",),
}
# and "basic": ToMe (token merging), the family's default mode, at ratio 0.5 (some families' default ratios merge no
# token of these tiny grids)
ORDERS = ("tome_first", "cache_first")
# ComfyUI's MMDiT runs no DIFFUSION_MODEL wrapper, where EasyCache sits: it skips nothing on SD3 alone
INERT = {("sd3", "EasyCache"): "ComfyUI's MMDiT (SD3) runs no DIFFUSION_MODEL wrapper, where EasyCache sits: "
                               "EasyCache alone skips nothing on it"}
SEED, REMOVAL_SEED = 42, 43
SPY = {"class_type": "TomeTestKeySpy", "inputs": {}}
KEY_SPY_LOG = "TomeTestKeySpy: "  # its log line (tome_test_nodes/dit_nodes.py)
# a speed-check verdict line: "level 1 (8x8 tokens, 3 blocks) at 64x64 px: reduced: ...", "3x3x5 video tokens,
# batch 1: left whole: ...", "...: reduced (not timed on cpu: ...)"
VERDICT_LINE = re.compile(r"(px|batch \d+): (reduced|left whole)[:( ]")


# The matrix kept in every run (about 3 minutes per ComfyUI on 2 cores): every family in its default mode with
# EasyCache (SD3, where EasyCache is inert, with LazyCache), LazyCache on Flux and Wan in both modes, and the basic
# node beside each cache; every case in both node orders. TOME_STEP_CACHES_FULL=1: every family x cache x
# ToMe node/mode x order.
FULL = os.environ.get("TOME_STEP_CACHES_FULL") == "1"
KEPT = {(family, "EasyCache" if family != "sd3" else "LazyCache", modes[0]) for family, modes in FAMILY_MODES.items()} \
    | {(family, "LazyCache", mode) for family in ("flux", "wan") for mode in ("merge", "kv")} \
    | {("flux", "EasyCache", "basic"), ("wan", "LazyCache", "basic")}


def cases():
    return [pytest.param(family, cache, mode, order, id=f"{family}-{cache}-{mode}-{order}")
            for family, modes in FAMILY_MODES.items() for cache in CACHES for mode in modes + ("basic",)
            for order in ORDERS if FULL or (family, cache, mode) in KEPT]


def cache_node(name: str) -> dict:
    return {"class_type": name, "inputs": dict(CACHES[name])}


def tome_node(mode: str, **changes) -> dict:
    if mode == "basic":
        return {"class_type": "TomeCoreToMe", "inputs": dict({"ratio": 0.5, "max_downsample": 1}, **changes)}
    return advanced(mode=mode, **changes)


def chain_of(tome, cache, order):
    return (tome, cache) if order == "tome_first" else (cache, tome)


def dit_prompt(family: str, chain, seed: int = SEED, spy: bool = True, prefix: str = "caches") -> dict:
    """TomeTestTinyDiT(family) -> [spy] -> chain -> KSampler -> TomeTestSaveLatent, in API format; the chain's nodes
    get ids 11, 12, ... in order (the spy 10)."""
    prompt = {"1": {"class_type": "TomeTestTinyDiT", "inputs": {"family": family}}}
    model = ["1", 0]
    nodes = ([(SPY, "10")] if spy else []) + [(node, str(11 + i)) for i, node in enumerate(chain)]
    for node, node_id in nodes:
        prompt[node_id] = {"class_type": node["class_type"], "inputs": dict(node["inputs"], model=model)}
        model = [node_id, 0]
    prompt["5"] = {"class_type": "KSampler", "inputs": {
        "model": model, "seed": seed, "steps": CACHE_STEPS, "cfg": 1.0, "sampler_name": "euler",
        "scheduler": "simple", "positive": ["1", 1], "negative": ["1", 1], "latent_image": ["1", 2], "denoise": 1.0}}
    prompt["7"] = {"class_type": "TomeTestSaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}}
    return prompt


def unet_prompt(chain, seed: int = SEED, prefix: str = "caches") -> dict:
    """The tiny SD1.5 checkpoint (comfy_env.api_prompt: 64x64, cfg 5) -> chain -> KSampler (5 steps) ->
    TomeTestSaveLatent; the chain's nodes get ids 11, 12, ... in order, as in dit_prompt."""
    prompt = api_prompt(None, seed=seed, steps=CACHE_STEPS, prefix=prefix)
    model = ["1", 0]
    for i, node in enumerate(chain):
        prompt[str(11 + i)] = {"class_type": node["class_type"], "inputs": dict(node["inputs"], model=model)}
        model = [str(11 + i), 0]
    prompt["5"]["inputs"]["model"] = model
    del prompt["6"]
    prompt["7"] = {"class_type": "TomeTestSaveLatent", "inputs": {"samples": ["5", 0], "filename_prefix": prefix}}
    return prompt


class Sampled:
    """One prompt's run: its latent (None where it failed), what the server logged meanwhile, its result."""

    def __init__(self, comfy, result, log: str, messages=()) -> None:
        self.result, self.log, self.messages = result, log, list(messages)
        self.latent = None
        if result.success:
            name = result.outputs["7"]["tome_latents"][0]["filename"]
            self.latent = safetensors_torch.load_file(str(comfy.workdir / "output" / name))["samples"]

    def skipped(self, cache: str) -> int:
        return skipped_steps(self.log, cache)

    def keys(self) -> dict:
        """The spy's record: {"calls": attention calls, "keys": {key count: calls}, "steps": steps with attention}."""
        lines = [line.split(KEY_SPY_LOG, 1)[1] for line in self.log.splitlines() if KEY_SPY_LOG in line]
        assert len(lines) == 1, self.log[-3000:]
        return json.loads(lines[0])

    def plan(self, node_id: str):
        """The ToMe node's UI output (its plan: mode, family, blocks, ...), where the node ran in this prompt (the
        server's cache hands a node unchanged since an earlier prompt on without running it)."""
        shown = self.result.outputs.get(node_id, {}).get("tome", [])
        return shown[0] if shown else None

    def levels(self, node_id: str) -> list:
        """The speed check's verdict lines the ToMe node ``node_id`` was sent last (its ``tome.levels`` messages, as
        the browser gets them; the prompt run with ``listen``), without the settings line a UNet's come after."""
        sent = [m["data"]["lines"] for m in self.messages
                if m["type"] == LEVELS_EVENT and m["data"]["node"] == node_id]
        return [line for line in sent[-1] if VERDICT_LINE.search(line)] if sent else []

    def failure(self) -> str:
        error = self.result.error_message() or {}
        return error.get("exception_message", "") or repr(self.result.messages)[-2000:]


class Runs:
    """Runs prompts on the server and keeps each once per module (``fresh``: run it again)."""

    def __init__(self, comfy) -> None:
        self.comfy, self.done = comfy, {}

    def __call__(self, family: str, *chain: dict, seed: int = SEED, spy: bool = True, fresh: bool = False,
                 listen: bool = False) -> Sampled:
        """``family`` UNET: the tiny SD1.5 checkpoint (no spy); ``listen``: with a websocket open, as the browser
        has it (the ``tome.levels`` messages kept)."""
        key = json.dumps([family, chain, seed, spy, listen], sort_keys=True)
        if fresh or key not in self.done:
            prefix = f"caches{len(self.done)}"
            prompt = unet_prompt(chain, seed, prefix) if family == UNET else \
                dit_prompt(family, chain, seed, spy, prefix=prefix)
            start = self.comfy.log_path.stat().st_size
            result, messages = run_listening(self.comfy, prompt) if listen else (self.comfy.run(prompt), ())
            with open(self.comfy.log_path, "rb") as log:
                log.seek(start)
                text = log.read().decode(errors="replace")
            self.done[key] = Sampled(self.comfy, result, text, messages)
        return self.done[key]


@pytest.fixture(scope="module")
def runs(comfy):
    return Runs(comfy)


@pytest.fixture(scope="module")
def available(comfy):
    return set(comfy.get_json("/object_info"))


def comfy_version(comfy) -> str:
    found = re.search(r'__version__\s*=\s*"([^"]+)"', (comfy.comfy_dir / "comfyui_version.py").read_text()) \
        if (comfy.comfy_dir / "comfyui_version.py").is_file() else None
    return found.group(1) if found else "unknown"


ROWS = {}  # (family, cache, mode, order) -> the measured row (written by the table fixture)
SPEED_ROWS = {}  # (family, cache, order, forced verdict) -> what the speed check did beside the cache


@pytest.fixture(scope="module", autouse=True)
def table(comfy):
    yield
    target = os.environ.get("TOME_STEP_CACHES_TABLE")
    if not target or not (ROWS or SPEED_ROWS):
        return
    lines = [f"### ComfyUI {comfy_version(comfy)} ({comfy.comfy_dir})", "",
             "| family | cache | ToMe | order | skipped alone | skipped with ToMe "
             "| mean abs diff vs plain: cache alone | ToMe alone | both "
             "| keys per attention call (cache alone -> both) | result |",
             "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for (family, cache, mode, order), row in sorted(ROWS.items()):
        lines.append(f"| {family} | {cache} | {mode} | {order} | {row.get('alone', '-')}/5 | {row.get('both', '-')}/5 "
                     f"| {row.get('d_alone', '-')} | {row.get('d_tome', '-')} | {row.get('d_both', '-')} "
                     f"| {row.get('keys', '-')} | {row.get('result', '-')} |")
    if SPEED_ROWS:
        lines += ["", "Speed check \"on\" beside the cache (ToMe (advanced) merge, start_percent 0.5, sd15 0.25; the "
                      "call's real repeats run, then the figure is forced: 1.40x reduced, 0.50x left whole):",
                  "", "| family | cache | order | forced | verdict sent to the node | calls repeated "
                      "| skipped: check off | check on | latent (check on) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for (family, cache, order, forced), row in sorted(SPEED_ROWS.items()):
            steps = [f"{row[side]}/5" if isinstance(row[side], int) else row[side] for side in ("off", "on")]
            lines.append(f"| {family} | {cache} | {order} | {forced} | {row['verdict']} | {row['repeats']} "
                         f"| {steps[0]} | {steps[1]} | {row['latent']} |")
    with open(target, "a") as out:
        out.write("\n".join(lines) + "\n\n")


def mad(a, b) -> str:
    return f"{(a.float() - b.float()).abs().mean().item():.4f}"


def require(runs, available, family: str, cache: str) -> None:
    """Skips where this ComfyUI has no ``cache`` node or no class of ``family`` (naming it)."""
    if cache not in available:
        pytest.skip(f"this ComfyUI has no {cache} node (ComfyUI's comfy_extras/nodes_easycache.py)")
    plain = runs(family)
    if family == UNET:
        assert plain.latent is not None, plain.failure()
        return
    if plain.latent is None and "TomeTestTinyDiT unavailable" in plain.failure():
        pytest.skip(plain.failure().split("TomeTestTinyDiT unavailable: ", 1)[1].strip())
    assert plain.latent is not None, plain.failure()


@pytest.mark.parametrize("family, cache, mode, order", cases())
def test_the_cache_and_tome_both_act(comfy, runs, available, family, cache, mode, order):
    require(runs, available, family, cache)
    row = ROWS.setdefault((family, cache, mode, order), {"result": "failed"})
    plain, alone = runs(family), runs(family, cache_node(cache))
    tome_alone = runs(family, tome_node(mode))
    assert alone.latent is not None and tome_alone.latent is not None, (alone.failure(), tome_alone.failure())
    row.update(alone=alone.skipped(cache), d_alone=mad(alone.latent, plain.latent),
               d_tome=mad(tome_alone.latent, plain.latent))
    if (family, cache) in INERT:
        assert row["alone"] == 0 and torch.equal(alone.latent, plain.latent)
        row["result"] = "skipped: cache inert alone"
        pytest.skip(INERT[(family, cache)])
    assert row["alone"] >= 1, f"{cache} skips nothing alone on {family}"
    # whole steps skipped: attention ran in the others only, as many calls in each as without the cache
    per_step = plain.keys()["calls"] // CACHE_STEPS
    assert plain.keys()["steps"] == CACHE_STEPS and plain.keys()["calls"] == per_step * CACHE_STEPS
    assert alone.keys()["steps"] == CACHE_STEPS - row["alone"]
    assert alone.keys()["calls"] == per_step * (CACHE_STEPS - row["alone"])

    tome = tome_node(mode)
    both = runs(family, *chain_of(tome, cache_node(cache), order))
    assert both.latent is not None, both.failure()
    row.update(both=both.skipped(cache), d_both=mad(both.latent, plain.latent))
    assert row["both"] >= 1, f"{cache} skips nothing beside ToMe"
    assert both.keys()["steps"] == CACHE_STEPS - row["both"]
    assert both.keys()["calls"] == per_step * (CACHE_STEPS - row["both"])

    # ToMe reduced the calls the cache let through: key counts the cache alone never hands attention
    plan = both.plan("11" if order == "tome_first" else "12") or tome_alone.plan("11")
    assert plan is not None and plan["mode"] == (FAMILY_MODES[family][0] if mode == "basic" else mode), plan
    seen_alone, seen_both = set(alone.keys()["keys"]), set(both.keys()["keys"])
    fewer = sorted(int(k) for k in seen_both - seen_alone)
    assert fewer and max(fewer) < max(int(k) for k in seen_alone), (alone.keys(), both.keys())
    row["keys"] = f"{'/'.join(sorted(seen_alone, key=int))} -> {'/'.join(sorted(seen_both, key=int))}"

    assert not torch.equal(both.latent, alone.latent), "ToMe lost beside the cache"
    assert not torch.equal(both.latent, tome_alone.latent), "the cache lost beside ToMe"
    assert not torch.equal(both.latent, plain.latent)
    assert torch.isfinite(both.latent).all()
    row["result"] = "pass"


@pytest.mark.parametrize("family, cache, mode, order", cases())
def test_ratio_zero_gives_the_cache_alones_latent(comfy, runs, available, family, cache, mode, order):
    require(runs, available, family, cache)
    alone = runs(family, cache_node(cache))
    off = runs(family, *chain_of(tome_node(mode, ratio=0.0), cache_node(cache), order))
    assert off.latent is not None, off.failure()
    assert off.skipped(cache) == alone.skipped(cache)
    assert torch.equal(off.latent, alone.latent)
    ROWS.setdefault((family, cache, mode, order), {}).setdefault("ratio0", "equal")


@pytest.mark.parametrize("family, cache, mode, order", cases())
def test_removing_tome_gives_the_cache_alones_latent_again(comfy, runs, available, family, cache, mode, order):
    """The prompt after ToMe's, without the ToMe node: the loader's MODEL (the object ToMe's clone shared) comes from
    the server's cache, the sampler runs again (a seed neither prompt used before, the same for both), and the latent
    is the cache alone's at that seed."""
    require(runs, available, family, cache)
    reference = runs(family, cache_node(cache), seed=REMOVAL_SEED)
    assert reference.latent is not None, reference.failure()
    both = runs(family, *chain_of(tome_node(mode), cache_node(cache), order), seed=REMOVAL_SEED, fresh=True)
    assert both.latent is not None, both.failure()
    assert "5" not in both.result.cached_nodes()
    after = runs(family, cache_node(cache), seed=REMOVAL_SEED, fresh=True)
    assert after.latent is not None, after.failure()
    cached = after.result.cached_nodes()
    assert "5" not in cached, "the server handed back a stored sample: nothing was re-sampled"
    assert "1" in cached, cached  # the same model object as the ToMe prompt's
    assert after.skipped(cache) == reference.skipped(cache)
    assert torch.equal(after.latent, reference.latent), "ToMe's patch outlived its node"
    ROWS.setdefault((family, cache, mode, order), {}).setdefault("removal", "equal")


@pytest.mark.parametrize("family, cache, mode", sorted({case.values[:3] for case in cases()}))
def test_the_node_order_changes_nothing(runs, available, family, cache, mode):
    """ToMe's APPLY_MODEL wrapper and the caches' wrappers (DIFFUSION_MODEL, PREDICT_NOISE: each at its own level
    of ComfyUI's call) nest the same way whichever node comes first: the same latent, the same steps skipped."""
    require(runs, available, family, cache)
    first = runs(family, *chain_of(tome_node(mode), cache_node(cache), "tome_first"))
    second = runs(family, *chain_of(tome_node(mode), cache_node(cache), "cache_first"))
    assert first.latent is not None and second.latent is not None, (first.failure(), second.failure())
    assert first.skipped(cache) == second.skipped(cache)
    assert torch.equal(first.latent, second.latent)


def test_the_key_spy_changes_no_latent(runs, available):
    """The spy every prompt here carries passes each attention call on unchanged."""
    require(runs, available, "flux", "EasyCache")
    assert torch.equal(runs("flux", spy=False).latent, runs("flux").latent)
    with_cache = runs("flux", cache_node("EasyCache"), spy=False)
    assert torch.equal(with_cache.latent, runs("flux", cache_node("EasyCache")).latent)


# ---------------------------------------------------------------- the speed check beside a step cache
#
# speed_check "on" times the model call whole against reduced by repeating it through ToMe's APPLY_MODEL wrapper, on
# the CPU too. EasyCache's step state sits inside that call (a DIFFUSION_MODEL wrapper): ToMe repeats the call with
# that wrapper stepped over (tome_core/adapters/model_patcher/step_caches.py), a step the cache computes, its state
# as the real call finds it; another node's DIFFUSION_MODEL wrapper leaves the call unrepeated (a transformer's call
# untimed; a UNet's level timed by its self-attention alone). LazyCache (PREDICT_NOISE) sits outside the repeated call.
# TomeTestForceSpeedups (tome_test_nodes/speed_nodes.py) with ``repeat`` on runs the check's real timing, every repeat
# of it, and then hands the check a forced figure: 1.4x (reduced) or 0.5x (left whole), so both verdicts are reached
# on any machine. ToMe starts at half the schedule (the UNet: a quarter), where the cache has computed steps to compare
# with (a repeat the cache saw would count as a step: "skipped 11/5" before ToMe stepped over it).

UNET = "sd15"  # the tiny SD1.5 checkpoint (CheckpointLoaderSimple, 64x64, cfg 5: a cond and an uncond per call)
FORCED = {"reduced": 1.4, "left whole": 0.5}
SPEED_CASES = [pytest.param(family, cache, order, verdict, id=f"{family}-{cache}-{order}-{verdict.replace(' ', '_')}")
               for family in ("flux", "wan", UNET) for cache in CACHES for order in ORDERS for verdict in FORCED]
REPEATS_LOG = "TomeTestForceSpeedups: ran the call "  # speed_nodes.FORCED_LOG: the timer ran the repeats
WRAPPER = {"class_type": "TomeTestDiffusionModelWrapper", "inputs": {}}
# the verdict where another node's wrapper would see a repeat: a transformer's call is not timed; a UNet's level is
# timed by its self-attention alone (engine speed_check.verdict without a call to repeat: the stand-in of hosts that
# cannot repeat the model call)
UNTIMED = {"dit": "reduced (not timed on cpu: cannot repeat the call beside another hook on the model)",
           UNET: "reduced: its self-attention alone with merging measured 1.40x on cpu"}


def forced(verdict: str) -> dict:
    return {"class_type": "TomeTestForceSpeedups", "inputs": {"speedups": f"*={FORCED[verdict]}", "repeat": True}}


def speed_tome(check: str, family: str) -> dict:
    """ToMe (advanced) merge from half the schedule, after the cache has computed steps; the UNet's from a quarter
    (EasyCache computes its steps 1 and 2 only: from half, ToMe would reduce no step it computes)."""
    return tome_node("merge", start_percent=0.25 if family == UNET else 0.5, speed_check=check)


def tome_id(chain) -> str:
    """The ToMe node's id in a prompt of ``chain`` (dit_prompt / unet_prompt: 11, 12, ... in order)."""
    return str(11 + [node["class_type"] for node in chain].index("TomeCoreToMeAdvanced"))


def repeats(sampled: Sampled) -> list:
    """How many times the forced timer ran the model call, per timing, in this prompt."""
    return [int(line.split(REPEATS_LOG, 1)[1].split(" ")[0]) for line in sampled.log.splitlines()
            if REPEATS_LOG in line]


def verdict_of(line: str) -> str:
    """The verdict in a speed-check line ("...: reduced: the model call ..." -> "reduced")."""
    for state in ("reduced (not timed", "left whole: ", "reduced: "):
        if state in line:
            return state.rstrip(": ")
    return "?"


def speed_runs(runs, family: str, cache: str, order: str, verdict: str):
    """(speed_check off, on) beside ``cache``: ToMe (advanced) merge (``speed_tome``); the "on" prompt times
    its calls (their real repeats) and is handed ``verdict``'s figure; the verdict lines come from the
    ``tome.levels`` messages of the prompt's websocket, as the browser gets them."""
    first = runs(family, *chain_of(speed_tome("off", family), cache_node(cache), order))
    chain = (forced(verdict),) + chain_of(speed_tome("on", family), cache_node(cache), order)
    timed = runs(family, *chain, listen=True)
    assert first.latent is not None and timed.latent is not None, (first.failure(), timed.failure())
    lines = timed.levels(tome_id(chain))
    if (family, cache, order, verdict) not in SPEED_ROWS:
        alone = runs(family, cache_node(cache))
        latent = "check off's" if torch.equal(timed.latent, first.latent) else \
            "cache alone's" if torch.equal(timed.latent, alone.latent) else "neither"
        SPEED_ROWS[(family, cache, order, verdict)] = dict(
            verdict="; ".join(lines) or "-", off=first.skipped(cache), on=timed.skipped(cache), latent=latent,
            repeats="/".join(map(str, repeats(timed))) or "0")
    return first, timed, lines


@pytest.mark.parametrize("family, cache, order, verdict", SPEED_CASES)
def test_the_speed_check_times_the_call_beside_the_cache_and_leaves_it_undisturbed(runs, available, family, cache,
                                                                                   order, verdict):
    """The call is timed (its real repeats run: the forced timer counts them) and the verdict is a measured one; the
    cache skips exactly the steps it skips with the check off (EasyCache's closing line says so: no repeat counted as
    a step); the latent is the check-off one, bit for bit (verdict reduced), or the cache alone's (left whole)."""
    require(runs, available, family, cache)
    off, timed, lines = speed_runs(runs, family, cache, order, verdict)
    assert lines, timed.log[-3000:]
    assert all(verdict_of(line) == verdict for line in lines), lines
    assert all(f"{verdict}: the model call with merging measured {FORCED[verdict]:.2f}x on cpu" in line
               for line in lines), lines
    counts = repeats(timed)
    assert counts and all(count >= 2 for count in counts), (counts, timed.log[-3000:])  # whole and reduced, at least
    assert off.skipped(cache) >= 1, f"{cache} skips nothing beside ToMe with the check off on {family}"
    assert timed.skipped(cache) == off.skipped(cache), (timed.skipped(cache), off.skipped(cache), lines)
    alone = runs(family, cache_node(cache))
    assert not torch.equal(off.latent, alone.latent), "ToMe reduced no step the cache computes: nothing to tell apart"
    assert torch.equal(timed.latent, off.latent if verdict == "reduced" else alone.latent), lines


@pytest.mark.parametrize("family, cache", [pytest.param(family, cache, id=family + (f"-{cache}" if cache else ""))
                                           for family in ("flux", UNET) for cache in (None, "EasyCache")])
def test_another_nodes_diffusion_model_wrapper_leaves_the_call_unrepeated(runs, available, family, cache):
    """A DIFFUSION_MODEL wrapper of another node (TomeTestDiffusionModelWrapper: it only calls the executor) would see
    a repeat of the call: ToMe does not repeat it (the forced timer never runs the call) and the verdict says so
    (a transformer: reduced, not timed, "cannot repeat the call"; the UNet: its level's self-attention alone stands
    in), and the latent is the check-off one; EasyCache beside it changes nothing there (stepped over or not, the
    other wrapper would see the repeat) and skips what it skips with the check off."""
    require(runs, available, family, cache or "EasyCache")
    extra = () if cache is None else (cache_node(cache),)
    off = runs(family, WRAPPER, speed_tome("off", family), *extra)
    chain = (forced("reduced"), WRAPPER, speed_tome("on", family)) + extra
    timed = runs(family, *chain, listen=True)
    assert off.latent is not None and timed.latent is not None, (off.failure(), timed.failure())
    lines = timed.levels(tome_id(chain))
    SPEED_ROWS.setdefault((family, f"{cache or 'none'} + another DIFFUSION_MODEL wrapper", "tome_first", "-"), dict(
        verdict="; ".join(lines) or "-", off=off.skipped(cache) if cache else "-",
        on=timed.skipped(cache) if cache else "-", repeats="/".join(map(str, repeats(timed))) or "0",
        latent="check off's" if torch.equal(timed.latent, off.latent) else "not the check off's"))
    assert repeats(timed) == [], "the model call was repeated beside another node's DIFFUSION_MODEL wrapper"
    assert lines and all(UNTIMED[UNET if family == UNET else "dit"] in line for line in lines), lines
    if cache is not None:
        assert timed.skipped(cache) == off.skipped(cache) >= 1
    assert torch.equal(timed.latent, off.latent)
    assert torch.equal(runs(family, WRAPPER).latent, runs(family).latent)  # the wrapper itself changes nothing
