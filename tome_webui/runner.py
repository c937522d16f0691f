"""What the Script's callbacks do to the model during one generation (one ``p``).

AUTOMATIC1111 (LDM/SGM ``sd_model``): ``tome_core.apply_patch`` on ``p.sd_model`` before each
batch, the hires pass with its own ratio, removal in ``postprocess`` and, because a run that raises midway never
reaches ``postprocess``, also when the WebUI closes ``p`` (``with closing(p)`` in txt2img, img2img
and the API) and again at the start of the next run.

Forge / reForge / Forge Neo: ``p.sd_model.forge_objects.unet`` is a ComfyUI-style ModelPatcher that Forge
restores before every sampling pass, so each pass gets a patched clone and nothing needs removing. The clone comes
from the same plan as ComfyUI's nodes (``model_patcher.plan``): the UNet patch, or on Forge Neo's transformers the
DiT patch through Neo's patch points (``model_patcher.neo``).

Host-free: ``p`` is duck-typed; nothing here imports ``modules`` or gradio.
"""
from __future__ import annotations

import importlib.util
from dataclasses import dataclass, field
from typing import Any, Sequence

# Everything is imported here, at import time: the WebUI puts the extension folder on sys.path only
# while it imports scripts/*.py, so a later `import tome_core...` inside a callback would fail.
import tome_core
from tome_core import ToMeConfig
import tome_core.adapters.hooks.api
from tome_core.adapters.model_patcher import neo
from tome_core.adapters.model_patcher.plan import plan_patch, resolve
from tome_core.catalogue.defaults import UNET_DEFAULTS
from tome_core.adapters.model_patcher.unet import describe_patcher

from .options import INFOTEXT_KEYS, LEVELS_KEY, SKIPPED_KEY, SKIPPED_VALUE, WebUIArgs

RUN_ATTR = "tome_run"  # per-run state on p
OVERRIDES_ATTR = "tome_overrides"  # set on p by the XYZ axes (see xyz.py)


def log(message: str) -> None:
    print(f"[ToMe] {message}")


def is_forge(p: Any) -> bool:
    """Forge and reForge hand scripts a model whose UNet lives in ``forge_objects.unet``."""
    return getattr(getattr(p, "sd_model", None), "forge_objects", None) is not None


def forge_installed() -> bool:
    """Forge, reForge and Forge Classic all ship the top-level package ``modules_forge``; A1111 does not.

    For the UI, which is built before any model is loaded (``is_forge(p)`` needs one).
    """
    return importlib.util.find_spec("modules_forge") is not None


def builtin_ratio(p: Any) -> float:
    """The WebUI's own token merging ratio in force for this run (first pass or hires pass)."""
    get_ratio = getattr(p, "get_token_merging_ratio", None)
    if get_ratio is None:
        return 0.0
    ratios = [get_ratio()]
    if getattr(p, "enable_hr", False):
        ratios.append(get_ratio(for_hr=True))
    return max(float(r or 0) for r in ratios)


@dataclass
class Run:
    """ToMe's state for one generation; lives on ``p`` as ``p.tome_run``."""

    base: ToMeConfig
    hires: ToMeConfig
    patched: list = field(default_factory=list)  # A1111 models this run patched
    forge_source: Any = None  # Forge: the UNet patcher last cloned, and the clone handed back
    forge_clone: Any = None
    levels: list = field(default_factory=list)  # the speed check's verdicts so far (describe lines)

    def patch(self, model: Any, config: ToMeConfig) -> None:
        self.collect(model)  # a new patch starts with no verdicts: keep the previous pass's
        if not config.enabled:
            unpatch(model)
            return
        tome_core.apply_config(model, config)  # validated once, in start()
        if not any(m is model for m in self.patched):
            self.patched.append(model)

    def collect(self, model: Any) -> None:
        """Add the verdicts of the patch now on ``model`` (A1111) or on the Forge clone to ``levels``: per UNet
        level, or on a Forge Neo transformer per call shape ("64x64 image tokens, batch 2: ...")."""
        state = neo.state_of(self.forge_clone) if is_forge_run(self) else None
        if state is not None:
            lines = state.describe_verdicts()
        elif is_forge_run(self):
            lines = levels_only(describe_patcher(self.forge_clone))
        elif model is not None and tome_core.is_patched(model):
            lines = levels_only(tome_core.describe(model).splitlines())
        else:
            lines = []
        self.levels += [line for line in lines if line not in self.levels]

    def release(self) -> None:
        for model in self.patched:
            unpatch(model)
        self.patched.clear()


def levels_only(lines: list) -> list:
    """The speed check's verdict lines of a UNet patch's description ("level 1: ...")."""
    return [line for line in lines if line.startswith("level ")]


def is_forge_run(run: Run) -> bool:
    return run.forge_clone is not None


def unpatch(model: Any) -> bool:
    if model is not None and tome_core.is_patched(model):
        tome_core.remove_patch(model)
        return True
    return False


def start(p: Any, script_args: Sequence[Any]) -> Run | None:
    """Script.process: clean up after a failed run, check everything, then write the infotext.

    Patching is per batch (A1111) or per sampling pass (Forge). Every check that can refuse the
    settings runs here, before anything is written or patched; a refusal stops the generation (see
    ``refuse``) instead of raising here, where the WebUI would report the error and go on without ToMe.
    """
    forge = is_forge(p)
    _clear_refusal(p)
    if not forge and unpatch(p.sd_model):
        log("removed a patch left on the model by an earlier run that did not finish.")
    setattr(p, RUN_ATTR, None)
    # XYZ plot cells are shallow copies of one p and share its extra_generation_params dict.
    for key in (*INFOTEXT_KEYS, SKIPPED_KEY, LEVELS_KEY):
        p.extra_generation_params.pop(key, None)

    try:
        args = WebUIArgs.from_script_args(script_args).with_overrides(getattr(p, OVERRIDES_ATTR, None) or {})
        if not args.enabled:
            return None
        builtin = builtin_ratio(p)
        if builtin > 0:
            log(
                f"skipped: the WebUI's built-in token merging is on (ratio {builtin:g}), and two merges "
                "must not stack. Set Settings > Optimizations > Token merging ratio (and its hires "
                "counterpart) to 0 to use this extension."
            )
            p.extra_generation_params[SKIPPED_KEY] = SKIPPED_VALUE
            return None
        if forge:
            unet = p.sd_model.forge_objects.unet
            args = args.with_model_defaults(resolve(unet).defaults)
        else:
            args = args.with_model_defaults(UNET_DEFAULTS)
        run = Run(base=args.config(), hires=args.config(hires=True))
        check_model(p, run)
    except (TypeError, ValueError) as error:
        refuse(p, error)
        return None

    p.extra_generation_params.update(args.infotext(with_hr=bool(getattr(p, "enable_hr", False))))
    setattr(p, RUN_ATTR, run)
    if not forge:
        _release_when_closed(p, run)
    return run


def check_model(p: Any, run: Run) -> None:
    """Raise the engine's error if the loaded model cannot take these settings (patches nothing).

    Forge / reForge / Forge Neo: the plan's refusals on the model patcher (merge_mlp has no patch point there, a
    model that is neither a UNet nor a transformer of the catalogue, a mode the family lacks, a schedule window
    without ``percent_to_sigma``). A1111: the model has a UNet ``apply_patch`` can patch (not e.g. SD3 in A1111 1.10).
    """
    for config in (run.base, run.hires):
        if not config.enabled:
            continue
        if is_forge(p):
            plan_patch(p.sd_model.forge_objects.unet, config)
        else:
            tome_core.adapters.hooks.api.check_patchable(p.sd_model)


def refuse(p: Any, error: Exception) -> None:
    """Stop this generation with ToMe's ``error``, shown by the WebUI as the job's error.

    The WebUI's ScriptRunner catches and only logs what a script's callbacks raise, then generates
    without ToMe. ``processing.process_images_inner`` calls ``p.sample(...)`` outside any such
    handler (A1111 1.8-dev and later master, Forge, reForge, Forge Classic), and an exception there
    ends the job: the API answers HTTP 500 with the message in ``errors``; the UI shows it in its
    error box (reForge and Forge Classic, whose ``main_thread`` swallows it, a generic error and the
    message in the console). So ``p.sample`` becomes, for this ``p`` only, a function that raises
    ``error``; nothing is patched or written.
    """
    log(f"refused, the generation stops: {error}")

    def sample(*args: Any, **kwargs: Any) -> Any:
        raise error

    sample.tome_refusal = True
    p.sample = sample


def _clear_refusal(p: Any) -> None:
    """Drop a refusal an earlier ``process`` left on this ``p`` (a reused or copied processing object)."""
    if getattr(vars(p).get("sample"), "tome_refusal", False):
        del p.sample


def before_batch(p: Any) -> None:
    """Script.process_batch (A1111): first pass of each batch at the base ratio."""
    run = getattr(p, RUN_ATTR, None)
    if run is not None and not is_forge(p):
        run.patch(p.sd_model, run.base)


def before_hr(p: Any) -> None:
    """Script.before_hr (A1111): the hires pass at its own ratio (the model may be a hires checkpoint)."""
    run = getattr(p, RUN_ATTR, None)
    if run is not None and not is_forge(p):
        run.patch(p.sd_model, run.hires)


def before_sampling(p: Any) -> None:
    """Script.process_before_every_sampling (Forge): patch a clone of the UNet patcher for this pass."""
    run = getattr(p, RUN_ATTR, None)
    if run is None or not is_forge(p):
        return
    config = run.hires if getattr(p, "is_hr_pass", False) else run.base
    objects = p.sd_model.forge_objects
    if run.forge_clone is not None:
        run.collect(None)  # the last pass's verdicts, before its clone is replaced
    if objects.unet is run.forge_clone:  # not restored since our last patch: never stack two merges
        objects.unet = run.forge_source
    if not config.enabled:
        return
    run.forge_source = objects.unet
    run.forge_clone = objects.unet = plan_patch(objects.unet, config).attach()


def after_batch(p: Any) -> None:
    """Script.postprocess_batch: after a batch is sampled and decoded, before its images' infotexts are
    written, "ToMe levels" says what the speed check decided for each UNet level (timed on a GPU:
    reduced or left whole, with the measured speed-up; on the CPU with "auto": not timed)."""
    run = getattr(p, RUN_ATTR, None)
    if run is None:
        return
    run.collect(None if is_forge(p) else p.sd_model)
    if run.levels:
        p.extra_generation_params[LEVELS_KEY] = "; ".join(run.levels)


def finish(p: Any) -> None:
    """Script.postprocess: the run ended normally."""
    run = getattr(p, RUN_ATTR, None)
    if run is not None:
        run.release()


def _release_when_closed(p: Any, run: Run) -> None:
    # The WebUI closes p in a `finally` (contextlib.closing) even when sampling raised, while
    # postprocess only runs on success; chaining p.close is the one host path that always runs.
    close = getattr(p, "close", None)
    if close is None:
        return

    def close_and_release() -> None:
        try:
            close()
        finally:
            run.release()

    p.close = close_and_release
