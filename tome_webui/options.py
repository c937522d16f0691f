"""The extension's controls as data: their order, defaults, infotext keys and conversion.

Host-free (no gradio, no ``modules``): the UI, the runner, the XYZ axes and the tests all read the
same table, so the ``alwayson_scripts`` argument order, the infotext keys and the paste-back mapping
cannot drift apart.
"""
from __future__ import annotations

from dataclasses import dataclass, field, fields, make_dataclass, replace
from typing import Any, Callable, Sequence

from tome_core import ToMeConfig
from tome_core.catalogue.defaults import DEFAULT_MODE, MODEL_DEFAULT, UNET_DEFAULTS, ModelDefaults
from tome_core.engine.config import KV_DOWNSAMPLES, MATCHINGS, MODES, SPEED_CHECKS

INFOTEXT_PREFIX = "ToMe"
SKIPPED_KEY = "ToMe skipped"
SKIPPED_VALUE = "built-in token merging is on"
MAX_DOWNSAMPLE_CHOICES = ("1", "2", "4", "8")
# The mode dropdown's "default" and the ratio slider's -1: the loaded model's own (tome_core.catalogue.defaults: merge
# 0.5 on UNets, a transformer family's measured default)
MODE_CHOICES = (DEFAULT_MODE,) + MODES
MODEL_RATIO = MODEL_DEFAULT
KV_DOWNSAMPLE_CHOICES = KV_DOWNSAMPLES
MATCHING_CHOICES = MATCHINGS
SPEED_CHECK_CHOICES = SPEED_CHECKS
# Not a control: what the speed check decided per UNet level, written after each batch (runner.after_batch).
LEVELS_KEY = "ToMe levels"
# The WebUI's defaults: GPU users get no level that measured slower than doing nothing (the CPU is not
# timed), and one matching per level (as close to the original as tomesd's per-block matching or closer,
# with a fifth of its matching work; docs/BENCHMARK.md "Which matching?").
WEBUI_SPEED_CHECK = "auto"
WEBUI_MATCHING = "level"


def _to_bool(value: Any) -> bool:
    # Infotext and the API hand over strings; "False" must not become True.
    if isinstance(value, str):
        return value.strip().lower() in ("true", "1", "yes")
    return bool(value)


def _to_int(value: Any) -> int:
    # Sliders give floats (2.0), radios give strings ("2"), the API gives either.
    return int(float(value))


@dataclass(frozen=True)
class Field:
    """One control: ``name`` is the ``WebUIArgs`` attribute, ``key`` its infotext key."""

    name: str
    key: str
    convert: Callable[[Any], Any]

    @property
    def kind(self) -> type:
        """The value's type (a ``WebUIArgs`` field's)."""
        return {_to_bool: bool, _to_int: int}.get(self.convert, self.convert)

    def parse(self, value: Any) -> Any:
        """``convert(value)``; a value of the wrong kind (API JSON, pasted infotext) gets ToMe's message."""
        try:
            return self.convert(value)
        except (TypeError, ValueError):
            kind = {float: "a number", _to_int: "a whole number"}.get(self.convert, "a valid value")
            raise ValueError(f"ToMe: {self.name} must be {kind}, got {value!r}.") from None


# The order of ui()'s return value and so of the ``alwayson_scripts`` "ToMe" args list.
FIELDS: tuple[Field, ...] = (
    Field("enabled", "", _to_bool),  # no key of its own: on when "ToMe ratio" is in the infotext
    Field("ratio", "ToMe ratio", float),
    Field("hr_ratio", "ToMe hr ratio", float),
    Field("max_downsample", "ToMe max downsample", _to_int),
    Field("sx", "ToMe sx", _to_int),
    Field("sy", "ToMe sy", _to_int),
    Field("use_rand", "ToMe use rand", _to_bool),
    Field("seed", "ToMe seed", _to_int),
    Field("mode", "ToMe mode", str),
    Field("merge_attn", "ToMe merge attn", _to_bool),
    Field("merge_crossattn", "ToMe merge crossattn", _to_bool),
    Field("merge_mlp", "ToMe merge mlp", _to_bool),
    Field("start_percent", "ToMe start percent", float),
    Field("end_percent", "ToMe end percent", float),
    Field("min_tokens", "ToMe min tokens", _to_int),
    Field("kv_downsample", "ToMe kv downsample", str),  # appended after the first release: older API
    Field("matching", "ToMe matching", str),            # arg lists stay valid (a shorter list keeps
    Field("speed_check", "ToMe speed check", str),      # the defaults of what it lacks)
    Field("match_every", "ToMe match every", _to_int),
)
FIELD_BY_NAME = {f.name: f for f in FIELDS}
INFOTEXT_KEYS = tuple(f.key for f in FIELDS if f.key)


# Each control's default where it is not the engine's (``ToMeConfig``'s); hr_ratio: the hires-fix pass's ratio
# (0 = no merging in that pass).
WEBUI_DEFAULTS = {"enabled": False, "ratio": MODEL_RATIO, "hr_ratio": ToMeConfig.ratio, "mode": DEFAULT_MODE,
                  "matching": WEBUI_MATCHING, "speed_check": WEBUI_SPEED_CHECK}


class _Args:
    """What ``WebUIArgs`` does with its values (its fields are ``FIELDS``, made below)."""

    @classmethod
    def from_script_args(cls, args: Sequence[Any]) -> "WebUIArgs":
        """``args``: the values of ui()'s controls in ``FIELDS`` order (a shorter list keeps defaults)."""
        if len(args) > len(FIELDS):
            raise ValueError(
                f"ToMe: expected at most {len(FIELDS)} script args "
                f"({', '.join(f.name for f in FIELDS)}), got {len(args)}."
            )
        values = {f.name: f.parse(v) for f, v in zip(FIELDS, args) if v is not None}
        return cls(**values)

    def with_overrides(self, overrides: dict[str, Any]) -> "WebUIArgs":
        """Values set on ``p`` by an XYZ axis; setting one turns ToMe on."""
        if not overrides:
            return self
        converted = {k: FIELD_BY_NAME[k].parse(v) for k, v in overrides.items()}
        return replace(self, enabled=True, **converted)

    def with_model_defaults(self, defaults: ModelDefaults) -> "WebUIArgs":
        """These args with mode "default" and ratio -1 settled by the loaded model's ``defaults`` (the catalogue's
        one rule): the runner's ``start``, so the infotext and the patch carry what ran."""
        settled = defaults.settle({"mode": self.mode, "ratio": self.ratio}).values
        return replace(self, mode=settled["mode"], ratio=settled["ratio"])

    def config(self, hires: bool = False) -> ToMeConfig:
        """The engine config of the first pass, or of the hires pass (its own ratio). A mode still "default" (no
        model resolved it: the XYZ axes' checks of their values) is tomesd's merge."""
        engine_fields = {f.name for f in fields(ToMeConfig)}
        values = {k: v for k, v in self.__dict__.items() if k in engine_fields}
        values["ratio"] = self.hr_ratio if hires else self.ratio
        if values["ratio"] < 0 and values["ratio"] != MODEL_RATIO:
            raise ValueError(f"ToMe: ratio = {values['ratio']:g}: use -1 for the model's default ratio, or 0 to 0.75 "
                             "(0 = off).")
        return ToMeConfig(**UNET_DEFAULTS.settle(values).values)  # not resolved by a model: tomesd's

    def infotext(self, with_hr: bool) -> dict[str, Any]:
        """Generation parameters for ``p.extra_generation_params``: every option, by its key."""
        params = {f.key: getattr(self, f.name) for f in FIELDS if f.key}
        if not with_hr:
            del params[FIELD_BY_NAME["hr_ratio"].key]
        return params


WebUIArgs = make_dataclass(
    "WebUIArgs", [(f.name, f.kind, field(default=WEBUI_DEFAULTS.get(f.name, getattr(ToMeConfig, f.name, None))))
                  for f in FIELDS], bases=(_Args,), frozen=True)
WebUIArgs.__module__ = __name__
WebUIArgs.__doc__ = "The script's arguments (``FIELDS``), converted; defaults: ``WEBUI_DEFAULTS``, else the engine's."


def enabled_from_infotext(params: dict[str, Any]) -> bool:
    """Paste-back rule for the accordion checkbox: on exactly when the image was made with ToMe."""
    return FIELD_BY_NAME["ratio"].key in params
