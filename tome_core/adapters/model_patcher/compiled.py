"""ToMe under ComfyUI's compiled model calls (``set_torch_compile_wrapper``: TorchCompileModel and the nodes built on it).

ComfyUI's TorchCompileModel (2026: ``comfy_extras/nodes_torch_compile.py``) compiles with a guard filter that drops
every dynamo guard whose name holds ``transformer_options``. Everything ToMe hands a model call travels there (its
patches, tables and per-call plan), so without more a graph traced for one ToMe state runs for another: the graph of
an unpatched model for a ToMe clone (ToMe silently off), a ToMe graph for an unpatched clone or another ratio
(``KeyError`` on its tables, or the old ratio).

Where a call runs the compiled model and ToMe reduces it, ToMe's APPLY_MODEL wrapper passes the model one extra
keyword, named after this patch and the call's plan (``CompileKey.added``): ``BaseModel._apply_model`` hands the
call's keywords to the diffusion model, whose ``**kwargs`` dynamo does guard by their names. So each ToMe state gets
its graph, and a call ToMe leaves whole (its patches taken out of it) the graph of the model without them; dynamo
keeps each (up to its ``recompile_limit``), so switching back costs nothing. A diffusion model whose ``forward``
takes no extra keywords (HiDream I1) cannot be told apart: ToMe refuses it under compile, naming both fixes.
"""
from __future__ import annotations

import inspect
import itertools
from typing import Any, Dict, Hashable, Optional

from ...catalogue.comfy_dits import base_model

APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL, where ToMe's wrappers sit (every adapter)
COMPILE_KEY = "torch.compile"  # comfy_api.torch_helpers.torch_compile.COMPILE_KEY, set_torch_compile_wrapper's key
_SERIALS = itertools.count(1)  # one per patch, never reused (an object id is, once the object is freed)


def compiled_call(options: Any) -> bool:
    """Whether this model call runs the diffusion model that ``set_torch_compile_wrapper`` compiled."""
    wrappers = options.get("wrappers") if isinstance(options, dict) else None
    return bool(wrappers) and bool((wrappers.get(APPLY_MODEL) or {}).get(COMPILE_KEY))


def takes_extra_keywords(model: Any) -> bool:
    """Whether the model's ``forward`` takes keywords beyond its own (``**kwargs``)."""
    try:
        parameters = inspect.signature(type(model).forward).parameters.values()
    except (TypeError, ValueError):
        return False
    return any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters)


class CompileKey:
    """One patch's keyword for compiled calls: ``tome_<patch>_<plan>``, one name per patch and call plan."""

    def __init__(self) -> None:
        self.serial = next(_SERIALS)
        self.names: Dict[Hashable, str] = {}
        self.checked: Optional[Any] = None  # the diffusion model last found to take the keyword

    def added(self, kwargs: Dict[str, Any], diffusion_model: Any, plan: Hashable) -> Dict[str, Any]:
        """``kwargs`` with this patch's keyword for ``plan`` (anything hashable that tells the call's plans apart)."""
        model = base_model(diffusion_model)
        if model is not self.checked:
            if not takes_extra_keywords(model):
                cls = type(model)
                raise RuntimeError(
                    f"ToMe: TorchCompileModel compiles this {cls.__module__}.{cls.__qualname__}, whose forward takes "
                    "no extra keywords, so ToMe cannot give each of its states its own compiled graph (ComfyUI's "
                    "TorchCompileModel keeps no guard on transformer_options): the compiled model would run without "
                    "ToMe, or with ToMe's old settings. Use ToMe without TorchCompileModel on this model, or "
                    "TorchCompileModel without ToMe.")
            self.checked = model
        name = self.names.get(plan)
        if name is None:
            name = self.names[plan] = f"tome_{self.serial}_{len(self.names)}"
        added = dict(kwargs)
        added[name] = None
        return added
