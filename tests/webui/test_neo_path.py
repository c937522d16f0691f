"""ToMe on Forge Neo's transformers through the extension's Forge path, on stand-ins of Neo's own modules.

Forge Neo cannot be installed in CI; ``neo_standin/backend`` mirrors the Neo modules ToMe meets (each file names the
Neo file and function it mirrors, de2193d9): the DiT classes under their own module and class names (ToMe matches
them so), ``backend.attention.attention_function`` as each DiT module's own global, the patcher ported from ComfyUI
(one ``model_function_wrapper`` slot, replace and object patches applied at load), ``KModel`` and its predictor, and
``sampling_function``'s model call. ``NeoProcessing.sample`` follows ``modules/processing.py`` (1379-1383, hires
1543-1547): each pass restores ``forge_objects`` from ``forge_objects_after_applying_lora``, calls the scripts'
``process_before_every_sampling``, then samples (``neo_sampler``: ``KDiffusionSampler.sample`` with Euler). The same
checks ran on a real Forge Neo over its API (tests/webui/real_neo.py, docs/results/webui_neo.json).
"""
from __future__ import annotations

import copy
import importlib
import sys
import types
from pathlib import Path

import pytest
import torch

import webui_doubles as wd
from webui_helpers import make_p, script_args

STANDIN = Path(__file__).resolve().parent / "neo_standin"
TRANSFORMERS = ("flux", "chroma", "qwen_image", "z_image", "wan")
ATTENTION_GLOBALS = ("backend.nn.flux.attention_function", "backend.nn.qwen.attention_function",
                     "backend.nn.lumina.attention_function", "backend.nn.wan.attention")


@pytest.fixture(scope="module")
def neo():
    """The stand-in modules, importable as Neo's ``backend`` for this module's tests."""
    sys.path.insert(0, str(STANDIN))
    try:
        yield types.SimpleNamespace(models=importlib.import_module("neo_models"),
                                    sampler=importlib.import_module("neo_sampler"))
    finally:
        sys.path.remove(str(STANDIN))


@pytest.fixture(scope="module")
def patchers(neo):
    """One seeded patcher (and its conds) per family, built once; tests never change them (ToMe patches clones)."""
    return {family: neo.models.build_patcher(family) for family in TRANSFORMERS + ("svdq_flux", "nunchaku_qwen")}


class NeoObjects:
    def __init__(self, unet):
        self.unet = unet

    def shallow_copy(self):
        return NeoObjects(self.unet)


class NeoEngine:
    """The ``ForgeDiffusionEngine`` scripts see: ``forge_objects`` restored before every pass."""

    def __init__(self, family, built):
        self.family = family
        patcher, self.make_conds = built
        self.forge_objects_after_applying_lora = NeoObjects(patcher)
        self.forge_objects = self.forge_objects_after_applying_lora.shallow_copy()


class NeoProcessing(wd.Processing):
    """txt2img's ``sample`` as Neo runs it (module docstring); cfg 2, so each model call holds [uncond, cond]."""

    cfg_scale = 2.0

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        model, neo_models = self.sd_model, sys.modules["neo_models"]
        cond, uncond = model.make_conds(self.batch_size, seeds[0])
        noise = torch.randn(neo_models.latent_shape(model.family, self.batch_size),
                            generator=torch.Generator().manual_seed(seeds[0]))
        x = self._pass(noise, cond, uncond)
        if self.enable_hr:
            self.is_hr_pass = True
            wide = noise.shape[:-2] + (noise.shape[-2] * 2, noise.shape[-1] * 2)
            x = self._pass(torch.randn(wide, generator=torch.Generator().manual_seed(seeds[0] + 1)), cond, uncond)
            self.is_hr_pass = False
        return x

    def _pass(self, noise, cond, uncond):
        model, sampler = self.sd_model, sys.modules["neo_sampler"]
        model.forge_objects = model.forge_objects_after_applying_lora.shallow_copy()
        if self.scripts is not None:
            self.scripts.process_before_every_sampling(self, x=noise, noise=noise, c=cond, uc=uncond)
        unet = model.forge_objects.unet
        sigmas = sampler.simple_sigmas(unet.model.predictor, self.steps)
        return sampler.sample(unet, noise, sigmas, cond, uncond, self.cfg_scale)


def neo_run(host, script, patchers, family, args, **kwargs):
    model = NeoEngine(family, patchers[family])
    p = make_p(model, host, script, args, **kwargs)
    p.__class__ = NeoProcessing
    return wd.txt2img(p, forge=True), p


def attention_globals():
    return {path: getattr(sys.modules[path.rpartition(".")[0]], path.rpartition(".")[2]) for path in ATTENTION_GLOBALS}


def own_options(patcher):
    """The patcher's model_options without what Neo's sampler itself writes into them (the run's sigmas)."""
    options = copy.deepcopy(patcher.model_options)
    options["transformer_options"].pop("sampling_sigmas", None)
    return options


def state_of_run(p):
    from tome_core.adapters.model_patcher import neo

    return neo.state_of(p.tome_run.forge_clone)


def neo_modes(family):
    from tome_core.catalogue.families import BY_NAME, modes_of

    return modes_of(BY_NAME[family], "neo")


CASES = [(family, mode) for family in TRANSFORMERS for mode in ("kv", "merge")]


@pytest.mark.parametrize("family, mode", CASES)
def test_each_family_takes_the_modes_the_catalogue_gives_it_on_neo(script, host, neo, patchers, family, mode):
    """Every mode a family has on Forge Neo reduces its calls (the image changes, ToMe's counter says each reduced
    model call reached its blocks), writes the infotext, leaves Neo's attention globals and the original patcher as
    they were; a mode the family lacks stops the job naming the modes it takes."""
    patcher = patchers[family][0]
    before_options, before_globals = own_options(patcher), attention_globals()
    plain, _ = neo_run(host, None, patchers, family, [], steps=2)
    args = script_args(ratio=0.5, mode=mode, speed_check="off")
    if mode not in neo_modes(family):
        with pytest.raises(ValueError, match="mode='merge'.*use mode='kv'"):
            neo_run(host, script, patchers, family, args, steps=2)
        return
    out, p = neo_run(host, script, patchers, family, args, steps=2)
    assert torch.isfinite(out.images[0]).all()
    assert not torch.equal(out.images[0], plain.images[0])
    assert state_of_run(p).reduced_calls >= 2  # each of the 2 steps' model calls
    assert f"ToMe ratio: 0.5" in out.info and f"ToMe mode: {mode}" in out.info
    assert attention_globals() == before_globals
    assert own_options(patcher) == before_options
    again, _ = neo_run(host, None, patchers, family, [], steps=2)  # Neo loads the original: object patches undone
    assert torch.equal(again.images[0], plain.images[0])


@pytest.mark.parametrize("family", TRANSFORMERS)
def test_disabled_and_ratio_0_are_pixel_identical_to_no_tome(script, host, neo, patchers, family):
    plain, _ = neo_run(host, None, patchers, family, [], steps=2)
    off, _ = neo_run(host, script, patchers, family, script_args(enabled=False), steps=2)
    zero, _ = neo_run(host, script, patchers, family, script_args(ratio=0.0, hr_ratio=0.0), steps=2)
    assert torch.equal(off.images[0], plain.images[0]) and torch.equal(zero.images[0], plain.images[0])


@pytest.mark.parametrize("family", TRANSFORMERS)
def test_mode_default_runs_the_familys_default_and_the_infotext_says_which(script, host, neo, patchers, family):
    from tome_core.catalogue.families import BY_NAME

    default = BY_NAME[family].mode_for("merge" in neo_modes(family))
    chosen, _ = neo_run(host, script, patchers, family, script_args(ratio=0.5, speed_check="off"), steps=2)
    explicit, _ = neo_run(host, script, patchers, family, script_args(ratio=0.5, mode=default, speed_check="off"),
                          steps=2)
    assert f"ToMe mode: {default}" in chosen.info
    assert torch.equal(chosen.images[0], explicit.images[0])


@pytest.mark.parametrize("family", TRANSFORMERS)
def test_ratio_minus_one_runs_the_familys_default_ratio_and_the_infotext_says_which(script, host, neo, patchers,
                                                                                      family):
    """The slider's -1 (its default): the family's default ratio in the mode that runs (the catalogue's), written to
    the infotext, the same image as that ratio set by hand; in the family's other mode tomesd's 0.5."""
    from tome_core.catalogue.families import BY_NAME

    entry = BY_NAME[family]
    mode = entry.mode_for("merge" in neo_modes(family))
    chosen, p = neo_run(host, script, patchers, family, script_args(ratio=-1, speed_check="off"), steps=2)
    explicit, _ = neo_run(host, script, patchers, family,
                          script_args(ratio=entry.ratio_for(mode), mode=mode, speed_check="off"), steps=2)
    assert state_of_run(p).config.ratio == entry.ratio_for(mode)
    assert f"ToMe ratio: {entry.ratio_for(mode):g}" in chosen.info and f"ToMe mode: {mode}" in chosen.info
    assert torch.equal(chosen.images[0], explicit.images[0])
    if "merge" in neo_modes(family):
        other = "kv" if mode == "merge" else "merge"
        _, p = neo_run(host, script, patchers, family, script_args(ratio=-1, mode=other, speed_check="off"), steps=2)
        assert state_of_run(p).config.ratio == entry.ratio_for(other) == 0.5


@pytest.mark.parametrize("family, name", [("svdq_flux", "SVDQFluxTransformer2DModel"),
                                          ("nunchaku_qwen", "NunchakuQwenImageTransformer2DModel")])
def test_nunchaku_classes_are_refused_by_name_before_sampling(script, host, neo, patchers, family, name):
    with pytest.raises(TypeError, match=f"backend.nn.svdq.{name}: Nunchaku's SVDQ model runs its own"):
        neo_run(host, script, patchers, family, script_args(ratio=0.5))


def test_a_ratio_out_of_range_stops_the_job_with_its_message(script, host, neo, patchers):
    with pytest.raises(ValueError, match=r"ratio must be in \[0, 1\), got 1.5"):
        neo_run(host, script, patchers, "flux", script_args(ratio=1.5))


@pytest.mark.parametrize("family", ("flux", "wan"))
def test_the_hires_pass_gets_its_own_ratio(script, host, neo, patchers, family):
    """Each pass patches its own clone: hires ratio 0 leaves the second pass whole, 0.3 reduces it."""
    plain, _ = neo_run(host, None, patchers, family, [], steps=2, enable_hr=True)
    hr_off, _ = neo_run(host, script, patchers, family, script_args(ratio=0.5, hr_ratio=0.0, speed_check="off"),
                        steps=2, enable_hr=True)
    hr_on, p = neo_run(host, script, patchers, family, script_args(ratio=0.5, hr_ratio=0.3, speed_check="off"),
                       steps=2, enable_hr=True)
    assert torch.equal(hr_off.images[0], plain.images[0])  # only the last pass's output is returned
    assert not torch.equal(hr_on.images[0], plain.images[0])
    assert state_of_run(p).config.ratio == 0.3 and "ToMe hr ratio: 0.3" in hr_on.info


def test_start_and_end_percent_go_through_the_predictor(script, host, neo, patchers):
    """A window over the first half of the schedule: fewer reduced calls than the whole schedule, another image."""
    whole, p_whole = neo_run(host, script, patchers, "flux", script_args(ratio=0.5, mode="kv", speed_check="off"),
                             steps=4)
    half, p_half = neo_run(host, script, patchers, "flux",
                           script_args(ratio=0.5, mode="kv", speed_check="off", end_percent=0.5), steps=4)
    assert 0 < state_of_run(p_half).reduced_calls < state_of_run(p_whole).reduced_calls
    assert not torch.equal(half.images[0], whole.images[0])


def wrapper_script(set_wrapper):
    """A script (ScriptRunner double's protocol) whose process_before_every_sampling sets Neo's one
    model_function_wrapper slot on the pass's UNet (as MultiDiffusion and Radial Attention do)."""
    def noop(p, *args, **kwargs):
        return None

    def before_every_sampling(p, *args, **kwargs):
        objects = p.sd_model.forge_objects
        objects.unet = objects.unet.clone()
        objects.unet.set_model_unet_function_wrapper(set_wrapper)

    return types.SimpleNamespace(args_from=0, args_to=0, process=noop, process_batch=noop, before_hr=noop,
                                 process_before_every_sampling=before_every_sampling, postprocess_batch=noop,
                                 postprocess=noop)


def counting_wrapper(calls):
    def wrapper(apply_model, args):
        calls.append(tuple(args["input"].shape))
        return apply_model(args["input"], args["timestep"], **args["c"])
    return wrapper


@pytest.mark.parametrize("family", ("qwen_image", "z_image"))
def test_a_wrapper_set_before_tome_acts_with_it_and_one_set_after_stops_the_job(script, host, neo, patchers, family):
    """Neo's one wrapper slot: a wrapper already there is called in turn by ToMe's (both act, the image as with ToMe
    alone); one set after ToMe's would drop it, so the first model call stops the job naming the order that works."""
    args = script_args(ratio=0.5, speed_check="off")
    alone, _ = neo_run(host, script, patchers, family, args, steps=2)
    calls = []
    model = NeoEngine(family, patchers[family])
    p = make_p(model, host, None, args, steps=2)
    p.__class__ = NeoProcessing
    p.scripts = wd.ScriptRunner([wrapper_script(counting_wrapper(calls)), script])
    p.script_args = args
    both = wd.txt2img(p, forge=True)
    assert len(calls) == 2 and state_of_run(p).reduced_calls >= 2
    assert torch.equal(both.images[0], alone.images[0])

    p = make_p(NeoEngine(family, patchers[family]), host, None, args, steps=2)
    p.__class__ = NeoProcessing
    p.scripts = wd.ScriptRunner([script, wrapper_script(counting_wrapper([]))])
    p.script_args = args
    with pytest.raises(RuntimeError, match="without ToMe's model_function_wrapper.*Run that extension before ToMe"):
        wd.txt2img(p, forge=True)


def test_a_class_of_neos_name_without_its_block_patches_is_refused_before_sampling(script, host, neo, patchers):
    """lllyasviel's Forge has a ``backend.nn.flux.IntegratedFluxTransformer2DModel`` whose forward calls its blocks
    without Neo's "dit" replace patches: matched by module and name, then refused by what its forward holds."""
    patcher, make_conds = neo.models.build_patcher("flux")
    base = type(patcher.model.diffusion_model)

    def forward_orig(self, *args, **kwargs):  # Forge's: each block called directly
        return base.forward_orig(self, *args, **kwargs)

    forge_class = type(base.__name__, (base,), {"forward_orig": forward_orig, "__module__": base.__module__})
    patcher.model.diffusion_model.__class__ = forge_class
    with pytest.raises(TypeError, match="forward_orig has no 'blocks_replace'.*Forge Neo"):
        neo_run(host, script, {"flux": (patcher, make_conds)}, "flux", script_args(ratio=0.5, mode="kv"))


def test_the_speed_check_times_a_neo_model_call_through_tomes_wrapper(script, host, neo, patchers):
    """speed_check "on" (timed on the CPU too): the call is repeated whole and reduced through ToMe's
    model_function_wrapper, and the verdict per call shape reaches the infotext."""
    out, p = neo_run(host, script, patchers, "qwen_image", script_args(ratio=0.5, speed_check="on"), steps=2)
    verdicts = state_of_run(p).describe_verdicts()
    assert len(verdicts) == 1 and verdicts[0].startswith("8x8 image tokens, batch 2: ")
    assert "ToMe levels: " in out.info and verdicts[0] in out.info


def test_match_every_reuses_a_matching_and_restarts_on_each_run(script, host, neo, patchers, monkeypatch):
    """Mode merge with match_every 2 on Neo: the run's ``sampling_sigmas`` mark each sampling run."""
    from tome_core.engine import call_plan

    matched = []
    original = call_plan.match_grid

    def counting(*args, **kwargs):
        matched.append(1)
        return original(*args, **kwargs)

    monkeypatch.setattr(call_plan, "match_grid", counting)
    every_call, _ = neo_run(host, script, patchers, "wan", script_args(ratio=0.5, speed_check="off"), steps=4)
    per_call = len(matched)
    matched.clear()
    args = script_args(ratio=0.5, speed_check="off", match_every=2)
    reused, _ = neo_run(host, script, patchers, "wan", args, steps=4)
    assert per_call == 4 and len(matched) == 2
    assert not torch.equal(reused.images[0], every_call.images[0])
    again, _ = neo_run(host, script, patchers, "wan", args, steps=4)  # never on the last run's matching
    assert torch.equal(again.images[0], reused.images[0])


def test_the_stand_ins_keep_the_neo_contracts_tome_relies_on(neo):
    """``neo_standin/smoke_check.py`` on the stand-ins themselves: the wrapper call, the replace patches' args, the
    attention globals, object patches applied and undone by loading, clones leaving their parent alone (the same
    checks printed the same on a real Forge Neo, de2193d9, with the same weights)."""
    importlib.import_module("smoke_check").main()


def test_the_catalogues_neo_entries_match_neos_classes_by_module_and_name(neo, patchers):
    """Each family's Neo binding is found for Neo's class (module and name: Neo's WanModel, NextDiT and
    QwenImageTransformer2DModel share bare names with ComfyUI's), and each of its attention globals exists there."""
    from tome_core.catalogue.comfy_lookup import family_of
    from tome_core.catalogue.families import BY_NAME
    from tome_core.catalogue.neo_dits import NeoDiT

    for family in TRANSFORMERS:
        model = patchers[family][0].model.diffusion_model
        found = family_of(model)
        assert isinstance(found, NeoDiT) and found in BY_NAME[family].neo
        for path in found.attention:
            module, _, name = path.rpartition(".")
            assert callable(getattr(importlib.import_module(module), name))
    assert family_of(patchers["svdq_flux"][0].model.diffusion_model) is None


def test_a_neo_transformer_outside_the_catalogue_is_refused_naming_what_neo_reduces(script, host, neo):
    """Anima, Krea 2, ERNIE-Image: no Neo entry; the job stops naming the class and the families ToMe reduces there."""
    patcher, make_conds = neo.models.build_patcher("flux")
    model = patcher.model.diffusion_model
    model.__class__ = type("Anima", (type(model),), {"__module__": "backend.nn.anima"})
    with pytest.raises(TypeError, match=r"\(Anima, backend.nn.anima.Anima\).*Transformers it reduces in Forge Neo: "
                                        r"Flux .*Chroma.*Qwen-Image.*Z-Image.*Wan"):
        neo_run(host, script, {"flux": (patcher, make_conds)}, "flux", script_args(ratio=0.5))


@pytest.mark.parametrize("mode", ["kv", "merge"])
def test_qwen_image_edit_references_from_neos_process_global_are_placed(script, host, neo, patchers, mode,
                                                                         monkeypatch):
    """Neo hands Qwen-Image Edit its reference images through ``dynamic_args.ref_latents`` (qwen.py:399), not the
    call: their tokens follow the image's, kept whole, and the call is still reduced in both modes (kv counts its
    joint attentions by their length, which the references lengthen)."""
    from backend.args import dynamic_args

    # one per sample of the call ([uncond, cond] at cfg 2), as Neo's edit engine leaves them
    reference = torch.randn(neo.models.latent_shape("qwen_image", 2), generator=torch.Generator().manual_seed(3))
    monkeypatch.setattr(dynamic_args, "ref_latents", [reference])
    plain, _ = neo_run(host, None, patchers, "qwen_image", [], steps=2)
    out, p = neo_run(host, script, patchers, "qwen_image", script_args(ratio=0.5, mode=mode, speed_check="off"),
                     steps=2)
    assert state_of_run(p).reduced_calls >= 2 and not torch.equal(out.images[0], plain.images[0])
    monkeypatch.setattr(dynamic_args, "ref_latents", [])
    alone, _ = neo_run(host, None, patchers, "qwen_image", [], steps=2)
    assert not torch.equal(alone.images[0], plain.images[0])  # the references took part in the call
