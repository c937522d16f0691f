"""Finding a diffusers model's binding in the catalogue: by its class's module and name (two classes with one name are
never confused). The binding type (``diffusers_dits``) knows nothing of the list; this module reads it. The classes
patched the same way (per-module hooks, no host patch API) are here too: InvokeAI's own (``invoke_dits``)."""
from __future__ import annotations

from typing import Dict, List, Optional, Tuple

import torch

from .diffusers_dits import DiffusersDiT, class_path
from .families import host_bindings


_OWN: Dict[str, Dict] = {}  # "by_class" / "by_name": the tables, built on first use


def bindings() -> Tuple[DiffusersDiT, ...]:
    """The diffusers bindings, then those of InvokeAI's own classes."""
    own = tuple(denoise.own for denoise in host_bindings("invoke")[0] if denoise.own is not None)
    return host_bindings("diffusers")[0] + own  # type: ignore[return-value]


def binding_named(name: str) -> DiffusersDiT:
    if "by_name" not in _OWN:
        _OWN["by_name"] = {binding.name: binding for binding in bindings()}
    return _OWN["by_name"][name]


def by_class() -> Dict[str, DiffusersDiT]:
    """"module.Class" -> binding: the one dict ``family_of`` reads (tests may patch an entry of it)."""
    if "by_class" not in _OWN:
        _OWN["by_class"] = {cls: binding for binding in bindings() for cls in binding.classes}
    return _OWN["by_class"]


def family_of(model: object) -> Optional[DiffusersDiT]:
    """The table entry of ``model``'s class (module and class name), else None."""
    return by_class().get(class_path(model))


def merging_families() -> str:
    """The families whose blocks mode "merge" reaches in diffusers, for messages."""
    return ", ".join(binding.name for binding in bindings() if binding.merge is not None)


def supported_classes() -> List[str]:
    return [cls.rsplit(".", 1)[1] for family in bindings() for cls in family.classes]


def find_dit(model: object) -> Optional[torch.nn.Module]:
    """The supported DiT in ``model`` (itself or a pipeline's ``.transformer``), else None."""
    for candidate in (model, getattr(model, "transformer", None)):
        if isinstance(candidate, torch.nn.Module) and family_of(candidate) is not None:
            return candidate
    return None


def unsupported_dit(model: object) -> Optional[str]:
    """Class name of a transformer-only model that mode "kv" cannot reach (e.g. HunyuanDiT, AuraFlow), else None."""
    for candidate in (model, getattr(model, "transformer", None)):
        name = type(candidate).__name__
        if isinstance(candidate, torch.nn.Module) and family_of(candidate) is None and (
                ("Transformer" in name or "DiT" in name) and not name.startswith("UNet")
                or hasattr(candidate, "transformer_blocks") and not hasattr(candidate, "down_blocks")):
            return name
    return None
