"""ToMe for one InvokeAI job: the denoise model patched while the job holds it, and never after.

InvokeAI's denoise invocations load their model inside ``invoke()`` from the model cache
(``context.models.load(...).model_on_device()``); the object is the cache's, shared by every later job. So the
ToMe nodes hand the core invocation a view of its context whose model loads patch the denoising model (the UNet or
transformer submodel) when the job takes it onto its device, and remove the patch when the job lets it go: also
after an error or a cancelled job (a context manager's exit). A model ToMe does not reduce is refused there, naming
its class, before the first step. No InvokeAI import: the context is duck-typed.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, Optional

try:  # loaded as a subpackage of the repository's package (InvokeAI's node loader, tests)
    from ..tome_core import ToMeConfig
    from ..tome_core.adapters.hooks.api import apply_config, defaults_of, describe, remove_patch
    from ..tome_core.catalogue.defaults import MODEL_DEFAULT, UNET_DEFAULTS
except ImportError:  # imported with tome_core on sys.path
    from tome_core import ToMeConfig
    from tome_core.adapters.hooks.api import apply_config, defaults_of, describe, remove_patch
    from tome_core.catalogue.defaults import MODEL_DEFAULT, UNET_DEFAULTS

# The submodels a denoise invocation denoises with (InvokeAI's SubModelType values): the ones ToMe patches.
DENOISERS = ("unet", "transformer", "transformer_2")


def check_settings(asked: Dict[str, Any]) -> None:
    """Refuse, before the job loads anything, what no model could take (a ratio below -1, a window that ends
    before it starts, ...): the engine's checks with the model's defaults left for later."""
    ratio = asked.get("ratio")
    if isinstance(ratio, (int, float)) and ratio < 0 and ratio != MODEL_DEFAULT:
        raise ValueError(f"ToMe: ratio = {ratio:g}: use -1 for the model's default ratio, or 0 to 0.75 (0 = off).")
    ToMeConfig(**UNET_DEFAULTS.settle(asked).values)


class ToMeJob:
    """The ToMe settings of one job and the patch they put on each denoising model it loads."""

    def __init__(self, asked: Dict[str, Any], logger: Any = None, progress: Optional[Callable[[str], Any]] = None):
        check_settings(asked)
        self.asked = dict(asked)
        self.logger = logger
        self.progress = progress  # InvokeAI's progress message (``context.util.signal_progress``): the UI shows it
        self.described: list = []  # what each patched model did (``describe``), in load order

    def say(self, text: str, progress: bool = False) -> None:
        if self.logger is not None:
            self.logger.info(text)
        if progress and self.progress is not None:
            self.progress(text.splitlines()[0])

    @contextmanager
    def applied(self, model: Any) -> Iterator[Any]:
        """``model`` patched for the ``with`` body (settings left to the model settled against its family's
        defaults), unpatched after it whatever happens; a model ToMe does not reduce raises here, named."""
        config = ToMeConfig(**defaults_of(model).settle(self.asked).values)
        if not config.enabled:  # ratio 0: ToMe off, nothing patched (a patch that does nothing costs nothing)
            yield model
            return
        apply_config(model, config)
        said = describe(model)
        try:
            self.say(said, progress=True)
            yield model
        finally:
            done = describe(model)  # with what the speed check decided while the job ran
            self.described.append(done)
            remove_patch(model)
            if done != said:
                self.say(done)

    def context(self, context: Any) -> Any:
        """``context`` as the core invocation uses it, its denoising models' loads patched for this job."""
        return _JobContext(context, self)


class _JobContext:
    """An invocation context whose ``models`` patch the denoising models they load; everything else is the
    context's own."""

    def __init__(self, context: Any, job: ToMeJob) -> None:
        self._context = context
        self.models = _JobModels(context.models, job)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._context, name)


class _JobModels:
    def __init__(self, models: Any, job: ToMeJob) -> None:
        self._models, self._job = models, job

    def __getattr__(self, name: str) -> Any:
        return getattr(self._models, name)

    def load(self, identifier: Any, submodel_type: Any = None) -> Any:
        loaded = self._models.load(identifier, submodel_type)
        kind = submodel_type if submodel_type is not None else getattr(identifier, "submodel_type", None)
        return _PatchedLoad(loaded, self._job) if getattr(kind, "value", kind) in DENOISERS else loaded

    def load_by_attrs(self, name: str, base: Any, type: Any, submodel_type: Any = None) -> Any:  # noqa: A002
        loaded = self._models.load_by_attrs(name, base, type, submodel_type)
        return _PatchedLoad(loaded, self._job) if getattr(submodel_type, "value", submodel_type) in DENOISERS \
            else loaded


class _PatchedLoad:
    """A loaded model (InvokeAI's ``LoadedModel``) whose model is patched while a job holds it, through either of
    its two ways: ``model_on_device()`` and the older ``with loaded as model``."""

    def __init__(self, loaded: Any, job: ToMeJob) -> None:
        self._loaded, self._job = loaded, job
        self._held: Optional[Any] = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loaded, name)

    @contextmanager
    def model_on_device(self, *args: Any, **kwargs: Any) -> Iterator[Any]:
        with self._loaded.model_on_device(*args, **kwargs) as (weights, model):
            with self._job.applied(model):
                yield weights, model

    def __enter__(self) -> Any:
        model = self._loaded.__enter__()
        try:
            self._held = self._job.applied(model)
            self._held.__enter__()
        except BaseException:
            self._loaded.__exit__(None, None, None)
            raise
        return model

    def __exit__(self, *exc: Any) -> Any:
        held, self._held = self._held, None
        try:
            if held is not None:
                held.__exit__(*exc)
        finally:
            result = self._loaded.__exit__(*exc)
        return result


__all__ = ["DENOISERS", "ToMeJob", "check_settings"]
