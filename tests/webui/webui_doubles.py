"""Minimal test doubles for the WebUI modules the extension touches (they cannot be installed here).

Each follows the real AUTOMATIC1111 (1.6+) / Forge signature and call order it stands in for:
- ``modules.scripts``: ``Script`` (attributes, ``elem_id``), ``AlwaysVisible``, ``scripts_data``
  entries ``ScriptClassData(script_class, path, basedir, module)``, and ``load_scripts``' loading
  of one file: by path via ``importlib.util.spec_from_file_location(basename, path)``, the
  extension folder prepended to ``sys.path`` only for that import.
- ``modules.shared``: ``opts`` (an ``Options`` with ``add_option``, defaults by attribute) and
  ``OptionInfo(default, label, component, component_args, onchange, section, ...)``.
- ``modules.script_callbacks``: ``on_ui_settings`` / ``on_before_ui`` registries.
- ``modules.ui_components.InputAccordion``: a ``gr.Checkbox`` whose context opens an accordion.
- ``modules.scripts.ScriptRunner``: every callback inside ``try/except Exception`` that only
  reports, as the real one (A1111 c8a5322d 1.8-dev and 1.10's ``ordered_scripts`` version, Forge
  dfdcbab, reForge 3b56b268, Forge Classic 1f95d717): a script that raises does not stop
  the generation.
- ``modules.processing``: ``StableDiffusionProcessingTxt2Img`` fields the extension reads, and
  ``process_images`` calling the scripts' hooks in the real order (process; per batch
  process_batch, then ``p.sample(...)`` outside any handler — first pass, ``is_hr_pass`` +
  before_hr + hires pass — then postprocess_batch, before the batch's infotexts are made;
  postprocess only on success), ``close`` through ``contextlib.closing``
  as modules/txt2img.py does. Forge's ``sample`` restores ``forge_objects`` from
  ``forge_objects_after_applying_lora`` before every sampling pass and then calls
  ``process_before_every_sampling`` (in the hires pass also once before restoring, as Forge's
  ``sample_hr_pass`` does).
- ``modules.api.api``: ``text2imgapi``'s ``alwayson_scripts`` mapping (``init_default_script_args``,
  ``init_script_args``) and its exception handler's status and JSON (``api_txt2img``).
- ``modules.call_queue.wrap_gradio_call``: an exception becomes the UI's error box; Forge-family
  UIs run generation through ``modules_forge.main_thread`` (``MainThread``), which swallows it.
- ``create_infotext`` / ``parse_generation_parameters`` / ``paste``: the "k: v, ..." format with
  A1111's quoting and connect_paste's value conversion (bool "False", int via float, else type()).
"""
from __future__ import annotations

import contextlib
import copy
import html
import importlib.util
import json
import os
import re
import sys
import types
from collections import namedtuple
from typing import Any, Callable

import torch
from fastapi import HTTPException  # the API's own exception class (A1111 pins fastapi 0.94)

# ---------------------------------------------------------------- modules.scripts


class AlwaysVisibleType:
    pass


AlwaysVisible = AlwaysVisibleType()
ScriptClassData = namedtuple("ScriptClassData", ["script_class", "path", "basedir", "module"])


class Script:
    name = None
    section = None
    filename = None
    args_from = None
    args_to = None
    alwayson = False
    is_txt2img = False
    is_img2img = False
    tabname = None
    group = None
    create_group = True
    infotext_fields = None
    paste_field_names = None
    api_info = None
    controls = None
    sorting_priority = 0

    def title(self):
        raise NotImplementedError()

    def show(self, is_img2img):
        return True

    def elem_id(self, item_id):
        need_tabname = self.show(True) == self.show(False)
        tabkind = "img2img" if self.is_img2img else "txt2img"
        tabname = f"{tabkind}_" if need_tabname else ""
        title = re.sub(r"[^a-z_0-9]", "", re.sub(r"\s", "_", self.title().lower()))
        return f"script_{tabname}{title}_{item_id}"


def load_script_file(path: str, scripts_data: list) -> types.ModuleType:
    """modules/scripts.py load_scripts + script_loading.load_module for one extension script."""
    basedir = os.path.dirname(os.path.dirname(os.path.abspath(path)))
    syspath = sys.path
    try:
        sys.path = [basedir] + sys.path
        spec = importlib.util.spec_from_file_location(os.path.basename(path), path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        for value in module.__dict__.values():
            if isinstance(value, type) and issubclass(value, Script) and value is not Script:
                scripts_data.append(ScriptClassData(value, path, basedir, module))
    finally:
        sys.path = syspath
    return module


# ---------------------------------------------------------------- modules.shared


class OptionInfo:
    def __init__(self, default=None, label="", component=None, component_args=None, onchange=None,
                 section=None, refresh=None, comment_before="", comment_after="", infotext=None,
                 restrict_api=False, category_id=None):
        self.default = default
        self.label = label
        self.component = component
        self.component_args = component_args
        self.section = section


class Options:
    def __init__(self, defaults: dict[str, Any]):
        super().__setattr__("data", dict(defaults))
        super().__setattr__("data_labels", {})

    def add_option(self, key, info):
        self.data_labels[key] = info
        self.data.setdefault(key, info.default)

    def __getattr__(self, item):
        if item in self.data:
            return self.data[item]
        if item in self.data_labels:
            return self.data_labels[item].default
        raise AttributeError(item)

    def __setattr__(self, key, value):
        self.data[key] = value


# ---------------------------------------------------------------- modules.script_callbacks


class Callbacks:
    def __init__(self):
        self.ui_settings: list[Callable] = []
        self.before_ui: list[Callable] = []

    def module(self) -> types.ModuleType:
        m = types.ModuleType("modules.script_callbacks")
        m.on_ui_settings = self.ui_settings.append
        m.on_before_ui = self.before_ui.append
        return m


# ---------------------------------------------------------------- modules.ui_components


def make_input_accordion(gr):
    class InputAccordionImpl(gr.Checkbox):
        """A hidden checkbox that opens/closes the accordion it creates (modules/ui_components.py)."""

        def __init__(self, value=None, **kwargs):
            elem_id = kwargs.get("elem_id")
            super().__init__(value=value, **{**kwargs, "elem_id": f"{elem_id}-checkbox", "visible": False})
            self.accordion = gr.Accordion(kwargs.get("label", "Accordion"), open=value, elem_id=elem_id)

        def __enter__(self):
            self.accordion.__enter__()
            return self

        def __exit__(self, exc_type, exc_val, exc_tb):
            self.accordion.__exit__(exc_type, exc_val, exc_tb)

        def get_block_name(self):
            return "checkbox"

    def InputAccordion(value=None, **kwargs):
        return InputAccordionImpl(value=value, **kwargs)

    return InputAccordion


# ---------------------------------------------------------------- modules.processing


class ScriptRunner:
    """modules/scripts.py ``ScriptRunner``'s alwayson callbacks (A1111 c8a5322d, 1.8-dev; A1111 1.10,
    which iterates ``ordered_scripts(name)``, the same for one script; Forge head dfdcbab, 2025-06;
    reForge 3b56b268; Forge Classic 1f95d717): each script gets ``p.script_args[args_from:args_to]``,
    and every callback runs inside
    ``try: ... except Exception: errors.report(f"Error running {name}: {filename}", exc_info=True)``,
    so an exception a script raises is reported (here: recorded in ``reported``) and generation
    goes on. Only the Forge family calls ``process_before_every_sampling`` from ``sample``
    (A1111 1.10's runner has it too; the extension acts on it only on Forge)."""

    def __init__(self, scripts: list):
        self.alwayson_scripts = scripts
        self.reported: list[tuple[str, BaseException]] = []  # what errors.report would print

    def _call(self, name, p, *extra, **kwargs):
        for script in self.alwayson_scripts:
            try:
                args = p.script_args[script.args_from:script.args_to]
                getattr(script, name)(p, *extra, *args, **kwargs)
            except Exception as error:  # modules/errors.py report(): printed, never re-raised
                self.reported.append((f"Error running {name}: {getattr(script, 'filename', None)}", error))

    def process(self, p):
        self._call("process", p)

    def process_batch(self, p, **kwargs):
        self._call("process_batch", p, **kwargs)

    def before_hr(self, p):
        self._call("before_hr", p)

    def process_before_every_sampling(self, p, **kwargs):
        self._call("process_before_every_sampling", p, **kwargs)

    def postprocess_batch(self, p, images, **kwargs):
        # modules/scripts.py ScriptRunner.postprocess_batch (A1111 c8a5322d): the images by keyword.
        self._call("postprocess_batch", p, images=images, **kwargs)

    def postprocess(self, p, processed):
        self._call("postprocess", p, processed)


def _context(batch: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + seed)
    return torch.randn(batch, 7, 32, generator=g)


@torch.no_grad()
def _sample(p, unet_call, x: torch.Tensor, context: torch.Tensor, fail_at_step):
    """A 'sampler': cond/uncond batched like the WebUI's CFG denoiser, a few Euler-like steps."""
    for i, t in enumerate(torch.linspace(900, 100, p.steps)):
        if fail_at_step is not None and i == fail_at_step:
            raise RuntimeError("sampling failed midway (test)")
        x_in = torch.cat([x, x])
        c_in = torch.cat([context, torch.zeros_like(context)])
        eps = unet_call(x_in, torch.full((x_in.shape[0],), float(t)), c_in)
        cond, uncond = eps.chunk(2)
        x = x - 0.1 * (uncond + 3.0 * (cond - uncond))
    return x


class Processing:
    """StableDiffusionProcessingTxt2Img's fields used here; sd_model is what shared.sd_model is.

    ``sample`` is a method, as in modules/processing.py, so an instance attribute can stand in for
    it the way it can on the real object. ``host_forge`` selects Forge's ``sample`` (which restores
    ``forge_objects`` and calls ``process_before_every_sampling`` itself) over A1111's.
    """

    def __init__(self, sd_model, opts, *, steps=3, width=128, height=128, batch_size=1, n_iter=1,
                 enable_hr=False, hr_scale=2.0, seed=1, token_merging_ratio=0, token_merging_ratio_hr=0):
        self.sd_model = sd_model
        self.opts = opts
        self.steps, self.width, self.height = steps, width, height
        self.batch_size, self.n_iter = batch_size, n_iter
        self.enable_hr, self.hr_scale = enable_hr, hr_scale
        self.seed = seed
        self.token_merging_ratio = token_merging_ratio
        self.token_merging_ratio_hr = token_merging_ratio_hr
        self.extra_generation_params: dict[str, Any] = {}
        self.is_hr_pass = False
        self.scripts = None
        self.script_args: list = []
        self.closed = False
        self.host_forge = False
        self.fail_at_step = None

    def get_token_merging_ratio(self, for_hr=False):
        opts = self.opts
        if for_hr:
            return (self.token_merging_ratio_hr or opts.token_merging_ratio_hr or self.token_merging_ratio
                    or opts.token_merging_ratio)
        return self.token_merging_ratio or opts.token_merging_ratio

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        """StableDiffusionProcessingTxt2Img.sample: the first pass, then ``sample_hr_pass`` if hires."""
        g = torch.Generator().manual_seed(seeds[0])
        x = torch.randn(self.batch_size, 4, self.height // 8, self.width // 8, generator=g)
        x = _sample(self, _unet_call(self, self.host_forge, x, conditioning), x, conditioning, self.fail_at_step)
        if self.enable_hr:
            self.is_hr_pass = True
            x = torch.nn.functional.interpolate(x, scale_factor=self.hr_scale, mode="nearest")
            if self.scripts is not None:
                self.scripts.before_hr(self)
            x = _sample(self, _unet_call(self, self.host_forge, x, conditioning), x, conditioning, self.fail_at_step)
            self.is_hr_pass = False
        return x

    def close(self):
        self.closed = True


class Img2ImgProcessing(Processing):
    """StableDiffusionProcessingImg2Img: ``sample`` is its own method (no hires pass), started from the
    noised init latent; on Forge it restores ``forge_objects`` and calls ``process_before_every_sampling``
    itself (modules/processing.py, Forge dfdcbab ``StableDiffusionProcessingImg2Img.sample``), as
    txt2img's does. ``process_images_inner`` calls it through ``p.sample(...)`` like txt2img's."""

    def __init__(self, sd_model, opts, *, denoising_strength=0.75, **kwargs):
        super().__init__(sd_model, opts, enable_hr=False, **kwargs)
        self.denoising_strength = denoising_strength
        g = torch.Generator().manual_seed(7)
        self.init_latent = torch.randn(self.batch_size, 4, self.height // 8, self.width // 8, generator=g)

    def sample(self, conditioning, unconditional_conditioning, seeds, subseeds, subseed_strength, prompts):
        g = torch.Generator().manual_seed(seeds[0])
        noise = torch.randn(self.init_latent.shape, generator=g)
        x = self.init_latent + self.denoising_strength * noise
        return _sample(self, _unet_call(self, self.host_forge, x, conditioning), x, conditioning, self.fail_at_step)


def process_images(p, *, fail_at_step=None, forge=False):
    """modules/processing.py process_images -> process_images_inner, in the scripts' call order:
    ``scripts.process``; per batch ``scripts.process_batch`` then ``p.sample(...)`` — the sampling
    call is not inside any script handler, so what it raises ends the job — then
    ``scripts.postprocess`` (only reached when nothing raised)."""
    p.host_forge, p.fail_at_step = forge, fail_at_step
    if p.scripts is not None:
        p.scripts.process(p)
    outputs, infotexts = [], []
    for n in range(p.n_iter):
        p.seeds = [p.seed + n * p.batch_size + i for i in range(p.batch_size)]
        if p.scripts is not None:
            p.scripts.process_batch(p, batch_number=n, prompts=[""] * p.batch_size, seeds=p.seeds,
                                    subseeds=p.seeds)
        conditioning = _context(p.batch_size, p.seeds[0])
        outputs.append(p.sample(conditioning=conditioning, unconditional_conditioning=conditioning, seeds=p.seeds,
                                subseeds=p.seeds, subseed_strength=0.0, prompts=[""] * p.batch_size))
        # process_images_inner: decode, then scripts.postprocess_batch(p, x_samples_ddim, batch_number=n),
        # then each image's infotext(n, i): what a script writes there reaches that batch's infotexts.
        if p.scripts is not None:
            p.scripts.postprocess_batch(p, outputs[-1], batch_number=n)
        infotexts.append(create_infotext(p))
    processed = types.SimpleNamespace(images=outputs, info=create_infotext(p), infotexts=infotexts)
    if p.scripts is not None:
        p.scripts.postprocess(p, processed)
    return processed


def _unet_call(p, forge, x, context):
    if not forge:
        unet = p.sd_model.model.diffusion_model
        return lambda x_in, t, c: unet(x_in, t, context=c)
    if p.is_hr_pass:  # Forge's sample_hr_pass calls the scripts once before restoring forge_objects
        p.scripts.process_before_every_sampling(p, x=x, noise=x, c=context, uc=context)
    # Forge's sample: sampling starts from the LoRA-applied objects, then scripts patch a clone.
    p.sd_model.forge_objects = p.sd_model.forge_objects_after_applying_lora.shallow_copy()
    p.scripts.process_before_every_sampling(p, x=x, noise=x, c=context, uc=context)
    return p.sd_model.forge_apply  # the test's Forge model: Forge's sampling_function model call


def txt2img(p, **kwargs):
    """modules/txt2img.py: ``with closing(p): processed = process_images(p)``."""
    with contextlib.closing(p):
        return process_images(p, **kwargs)


def img2img(p, **kwargs):
    """modules/img2img.py: ``with closing(p): processed = process_images(p)``."""
    with contextlib.closing(p):
        return process_images(p, **kwargs)


def default_script_args(scripts: list) -> list:
    """modules/api/api.py ``Api.init_default_script_args``: each script's slice holds its UI
    controls' values (``[elem.value for elem in script.ui(...)]``), everything else None."""
    args = [None] * max([1] + [s.args_to for s in scripts])
    for script in scripts:
        args[script.args_from:script.args_to] = [control.value for control in script.controls]
    return args


API_ERROR_FIELDS = {
    # where the exception's text goes in the error JSON, per host's handler
    "a1111": "errors",  # modules/api/api.py api_middleware -> handle_exception (A1111 1.8, reForge, Forge Classic)
    "forge": "message",  # Forge dfdcbab webui.py _handle_exception (FastAPI exception_handlers; --nowebui)
}


def api_txt2img(sd_model, opts, scripts: list, request: dict, *, forge=False, handler=None) -> tuple[int, dict]:
    """POST /sdapi/v1/txt2img (modules/api/api.py ``text2imgapi``, A1111 1.8 / Forge dfdcbab) -> (status, JSON).

    ``init_script_args``: a request naming an unknown alwayson script is fastapi's 422
    ``HTTPException`` (the real class: fastapi is installed with gradio); a known one's
    ``args`` overwrite its defaults position by position (at most ``args_to - args_from`` of them).
    Then ``with closing(p): process_images(p)``. An exception anywhere ends in the app's
    ``handle_exception``: status ``vars(e).get('status_code', 500)`` and JSON
    ``{"error": type(e).__name__, "detail", "body", "errors": str(e)}``; Forge's own handler
    (``webui.py`` ``_handle_exception``) writes the same with ``"message"`` for ``"errors"``.
    ``handler``: "a1111" or "forge" (API_ERROR_FIELDS); default "forge" when ``forge`` else "a1111".
    Success: 200 with the images and ``info`` (here the infotext string).
    """
    error_field = API_ERROR_FIELDS[handler or ("forge" if forge else "a1111")]
    by_title = {script.title().lower(): script for script in scripts}
    try:
        script_args = default_script_args(scripts)
        for name, entry in request.get("alwayson_scripts", {}).items():
            script = by_title.get(name.lower())
            if script is None:  # get_script -> script_name_to_index raises this before api.py's own check
                raise HTTPException(status_code=422, detail=f"Script '{name}' not found")
            given = entry.get("args", [])
            for i in range(min(script.args_to - script.args_from, len(given))):
                script_args[script.args_from + i] = given[i]
        p = Processing(sd_model, opts, **{k: v for k, v in request.items() if k != "alwayson_scripts"})
        p.scripts = ScriptRunner(scripts)
        p.script_args = tuple(script_args)
        processed = txt2img(p, forge=forge)
    except Exception as error:
        return vars(error).get("status_code", 500), {  # handle_exception, verbatim in what it returns
            "error": type(error).__name__, "detail": vars(error).get("detail", ""), "body": vars(error).get("body", ""),
            error_field: str(error)}
    return 200, {"images": processed.images, "info": processed.info}


class MainThread:
    """modules_forge/main_thread.py: Forge-family UIs run ``txt2img_function`` / ``img2img_function``
    through ``main_thread.run_and_wait_result`` (modules/txt2img.py, modules/img2img.py), which never
    raises: the worker catches the exception, prints it and the caller gets ``None`` as the result.

    ``keeps_last_exception``: Forge head (dfdcbab, 2025-06) stores it in ``main_thread.last_exception``
    (``Task.work``), which its ``wrap_gradio_call_no_job`` then shows; reForge (3b56b268, 2026-03) and
    Forge Classic (1f95d717, 2025-02) only print it (``loop``), so their UI shows the ``TypeError`` of
    ``list(None)``. The run is synchronous here (the real caller polls ``finished_list``).
    """

    def __init__(self, keeps_last_exception: bool):
        self.keeps_last_exception = keeps_last_exception
        self.last_exception: BaseException | None = None
        self.printed: list[BaseException] = []  # traceback.print_exc(); print(e)

    def run_and_wait_result(self, func: Callable, *args, **kwargs):
        try:
            result = func(*args, **kwargs)
            self.last_exception = None
            return result
        except Exception as error:
            self.printed.append(error)
            if self.keeps_last_exception:
                self.last_exception = error
            return None


def txt2img_ui(p, **kwargs) -> tuple:
    """modules/txt2img.py ``txt2img`` (A1111 1.8) / ``txt2img_function`` (Forge family): the Generate
    button's outputs ``(images, generation_info_js, info_html, comments_html)``."""
    processed = txt2img(p, **kwargs)
    return processed.images, "{}", html.escape(processed.info), ""


TXT2IMG_EXTRA_OUTPUTS = [None, "", ""]  # modules/ui.py: wrap_gradio_gpu_call(txt2img, extra_outputs=[None, '', ''])


def wrap_gradio_call(func: Callable, extra_outputs: list | None = None, main_thread: MainThread | None = None) -> Callable:
    """modules/call_queue.py ``wrap_gradio_call`` -> ``wrap_gradio_call_no_job`` (A1111 c8a5322d,
    1.8-dev; Forge dfdcbab; reForge 3b56b268; Forge Classic 1f95d717): ``res = list(func(...))``; an
    exception is reported and the outputs become ``extra_outputs_array + [<div class='error'>...]``,
    the red box under the gallery, with no images. Forge head first replaces the exception by
    ``main_thread.last_exception`` when one is set (pass its ``MainThread``)."""
    def call(*args, **kwargs):
        try:
            return tuple(list(func(*args, **kwargs)))
        except Exception as error:
            if main_thread is not None and main_thread.last_exception is not None:
                error = main_thread.last_exception
            extra = list(extra_outputs) if extra_outputs is not None else [None, ""]
            return tuple(extra + [f"<div class='error'>{html.escape(f'{type(error).__name__}: {error}')}</div>"])

    return call


# ---------------------------------------------------------------- infotext


def _quote(text: Any) -> str:
    text = str(text)
    if "," not in text and "\n" not in text and ":" not in text:
        return text
    return json.dumps(text, ensure_ascii=False)


def create_infotext(p) -> str:
    """modules/processing.py ``create_infotext``'s last line (A1111 c8a5322d): ``k if k == v else k: quote(v)``."""
    params = {"Steps": p.steps, "Seed": p.seed, "Size": f"{p.width}x{p.height}", **p.extra_generation_params}
    return "prompt\nNegative prompt: \n" + ", ".join(
        k if k == v else f"{k}: {_quote(v)}" for k, v in params.items() if v is not None
    )


_RE_PARAM = re.compile(r'\s*(\w[\w \-/]+):\s*("(?:\\.|[^\\"])+"|[^,]*)(?:,|$)')


def parse_generation_parameters(text: str) -> dict[str, str]:
    """modules/infotext_utils.py ``parse_generation_parameters`` (A1111 c8a5322d): ``re_param`` on the last line."""
    res = {}
    lastline = text.strip().split("\n")[-1]
    for key, value in _RE_PARAM.findall(lastline):
        value = value.strip()
        if value.startswith('"') and value.endswith('"'):
            value = json.loads(value)
        res[key] = value
    return res


def paste(infotext_fields, params: dict) -> list:
    """modules/infotext_utils.py ``connect_paste``'s ``paste_func`` (A1111 c8a5322d, 1.8-dev): one new
    value per field, None where the real one returns ``gr.update()`` (key absent or not convertible)."""
    out = []
    for output, key in infotext_fields:
        v = key(params) if callable(key) else params.get(key, None)
        if v is None:
            out.append(None)
            continue
        try:
            valtype = type(output.value)
            if valtype is bool and v == "False":
                val = False
            elif valtype is int:
                val = float(v)
            else:
                val = valtype(v)
            out.append(val)
        except Exception:  # the real paste_func leaves the control unchanged (gr.update())
            out.append(None)
    return out


# ---------------------------------------------------------------- install into sys.modules


def install(monkeypatch, gr, opts_defaults: dict | None = None):
    """Put the doubles in sys.modules as the ``modules`` package; returns a namespace of them."""
    callbacks = Callbacks()
    opts = Options({"token_merging_ratio": 0.0, "token_merging_ratio_hr": 0.0, **(opts_defaults or {})})
    pkg = types.ModuleType("modules")
    pkg.__path__ = []
    scripts_mod = types.ModuleType("modules.scripts")
    scripts_mod.Script, scripts_mod.AlwaysVisible = Script, AlwaysVisible
    scripts_mod.scripts_data = []
    # modules/scripts.py globals, ScriptRunners set by create_script_runners() (None until then)
    scripts_mod.scripts_txt2img = scripts_mod.scripts_img2img = None
    shared_mod = types.ModuleType("modules.shared")
    shared_mod.opts, shared_mod.OptionInfo = opts, OptionInfo
    ui_components = types.ModuleType("modules.ui_components")
    ui_components.InputAccordion = make_input_accordion(gr)
    cb_mod = callbacks.module()
    for name, mod in {"modules": pkg, "modules.scripts": scripts_mod, "modules.shared": shared_mod,
                      "modules.script_callbacks": cb_mod, "modules.ui_components": ui_components}.items():
        monkeypatch.setitem(sys.modules, name, mod)
        if name != "modules":
            setattr(pkg, name.split(".")[1], mod)
    return types.SimpleNamespace(scripts=scripts_mod, shared=shared_mod, opts=opts, callbacks=callbacks,
                                 ui_components=ui_components)


def copy_p(p):
    """xyz_grid's per-cell ``copy(p)``."""
    return copy.copy(p)
