"""A model's defaults: what "model default" means for mode and ratio, one rule for every host.

Every host lets a user leave mode and ratio to the model (ComfyUI's and the WebUI's ratio -1, their mode "default",
``apply_patch`` without them, InvokeAI's ToMe fields). ``ModelDefaults.settle`` turns what was asked into what runs,
once, where a host's plan resolves the model; nothing else asks the catalogue for a default.
UNets: tomesd's merge at 0.5. A transformer family: its own mode and ratio (``ModelFamily.default_mode`` and
``default_ratio``, the frontier's rule), mode kv on the classes that take no merge, tomesd's 0.5 in the other mode.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple

from .families import TOMESD_RATIO, ModelFamily

MODEL_DEFAULT = -1.0  # a ratio (or block_start) left to the model; hosts show it in words ("model default")
DEFAULT_MODE = "default"  # a mode left to the model, as the WebUI's dropdown names it


def is_default(value: Any) -> bool:
    """Whether a setting was left to the model: None, ``MODEL_DEFAULT`` or the mode "default"."""
    return value is None or value == DEFAULT_MODE or (isinstance(value, (int, float)) and value == MODEL_DEFAULT)


@dataclass(frozen=True)
class Settled:
    """Settings with "model default" resolved: ``values`` (to build a ``ToMeConfig``), ``defaults`` (the names that
    were left to the model, for hosts to say so) and ``default_ratio`` (the model's ratio in the mode that runs)."""

    values: Dict[str, Any]
    defaults: Tuple[str, ...]
    default_ratio: float

    def describe(self) -> Dict[str, Any]:
        """What a plan's description adds: which settings were the model's, and its default ratio."""
        return {"defaults": list(self.defaults), "default_ratio": self.default_ratio}


@dataclass(frozen=True)
class ModelDefaults:
    """The defaults of one model: ``family`` None for a UNet, else the catalogue's family; ``merges``: whether the
    model's class takes mode merge (a family's merge default falls back to kv on the classes that do not)."""

    family: Optional[ModelFamily] = None
    merges: bool = True

    @property
    def mode(self) -> str:
        """The mode used where none is asked for."""
        return "merge" if self.family is None else self.family.mode_for(self.merges)

    def ratio(self, mode: str) -> float:
        """The ratio used in ``mode`` where none is asked for."""
        return TOMESD_RATIO if self.family is None else self.family.ratio_for(mode)

    def settle(self, asked: Mapping[str, Any]) -> Settled:
        """``asked`` with mode and ratio left to the model resolved (the mode first: the ratio depends on it), and
        block_start's "model default" as None (the engine's "the model's range"). Other values pass as they are;
        a negative ratio other than -1 is left for the config to refuse."""
        values = dict(asked)
        defaults = tuple(name for name in ("mode", "ratio", "block_start") if name in values and is_default(values[name]))
        if "mode" in defaults or "mode" not in values:
            values["mode"] = self.mode
        if "ratio" in defaults:
            values["ratio"] = self.ratio(values["mode"])
        if "block_start" in defaults:
            values["block_start"] = None
        return Settled(values, defaults, self.ratio(values["mode"]))


UNET_DEFAULTS = ModelDefaults()

__all__ = ["DEFAULT_MODE", "MODEL_DEFAULT", "ModelDefaults", "Settled", "UNET_DEFAULTS", "is_default"]
