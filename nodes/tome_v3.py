"""The same nodes in ComfyUI's V3 schema (``comfy_api.latest``), for ComfyUIs that have it (0.3.x).

Built from the V1 classes' input tables (``tome_nodes``), so ids, input names, types, defaults, ranges,
tooltips, display names, category and output are one definition; only the registration differs.
Importing this module needs ``comfy_api``: the root package imports it only where that succeeds.
"""
from __future__ import annotations

from typing import Any, Dict, List, Type

from comfy_api.latest import ComfyExtension, io

from .tome_nodes import V1_NODES, ToMe, patch
from .tome_wanvideo import WANVIDEO_NODES

_NUMBER_KEYS = ("default", "min", "max", "step")


def _v3_input(name: str, kind: Any, options: Dict[str, Any], optional: bool) -> io.Input:
    """One V1 (type, options) pair as the equivalent V3 input."""
    common = dict(optional=optional, tooltip=options.get("tooltip"))
    if isinstance(kind, (list, tuple)):
        return io.Combo.Input(name, options=list(kind), default=options.get("default"), **common)
    if kind == "MODEL":
        return io.Model.Input(name, **common)
    if kind == "BOOLEAN":
        return io.Boolean.Input(name, default=options.get("default"), **common)
    numbers = {key: options[key] for key in _NUMBER_KEYS if key in options}
    if kind == "INT":
        return io.Int.Input(name, control_after_generate=options.get("control_after_generate"), **numbers, **common)
    if kind == "FLOAT":
        return io.Float.Input(name, **numbers, **common)
    if isinstance(kind, str) and kind.isupper():  # another pack's type: ComfyUI-WanVideoWrapper's WANVIDEOMODEL
        return io.Custom(kind).Input(name, **common)
    raise TypeError(f"ToMe: no V3 input for {name} of type {kind!r}.")


def _search_aliases(v1: Type[ToMe]) -> Dict[str, Any]:
    """``search_aliases`` where this ComfyUI's ``io.Schema`` has it (2026; 0.3.75 has not)."""
    names = getattr(io.Schema, "__dataclass_fields__", {})  # a dataclass in every V3 ComfyUI so far
    return {"search_aliases": list(v1.SEARCH_ALIASES)} if "search_aliases" in names else {}


def _v3_node(v1: Type[ToMe]) -> Type[io.ComfyNode]:
    """A V3 ``io.ComfyNode`` with v1's schema, validation and patch."""
    inputs = v1.INPUT_TYPES()
    optional = set(inputs.get("optional", {}))
    spec = v1.spec()
    run = getattr(v1, "patch_function", patch)
    kind = v1.RETURN_TYPES[0]
    output = io.Model.Output if kind == "MODEL" else io.Custom(kind).Output

    class Node(io.ComfyNode):
        @classmethod
        def define_schema(cls) -> io.Schema:
            return io.Schema(
                node_id=v1.NODE_ID, display_name=v1.DISPLAY_NAME, category=v1.CATEGORY,
                description=v1.DESCRIPTION,
                inputs=[_v3_input(name, kind_options[0], kind_options[1], name in optional)
                        for name, kind_options in spec.items()],
                outputs=[output(tooltip=v1.OUTPUT_TOOLTIPS[0])],
                hidden=[io.Hidden.unique_id],  # where the speed check's verdicts are shown
                **_search_aliases(v1),
            )

        @classmethod
        def execute(cls, model: Any, **values: Any) -> io.NodeOutput:
            hidden = getattr(cls, "hidden", None)
            patched, ui = run(model, spec, values, getattr(hidden, "unique_id", None))
            return io.NodeOutput(patched, ui=ui)

        @classmethod
        def spec(cls) -> Dict[str, tuple]:
            return spec

    # The V1 hook itself: ComfyUI reads its declared argument names (inspect.getfullargspec) to decide
    # which inputs an error is reported on, so both schemas report on the same inputs.
    Node.validate_inputs = classmethod(v1.VALIDATE_INPUTS.__func__)
    Node.__name__ = Node.__qualname__ = f"{v1.__name__}V3"
    Node.__doc__ = v1.__doc__
    return Node


V3_NODES = tuple(_v3_node(node) for node in V1_NODES + WANVIDEO_NODES)


class ToMeExtension(ComfyExtension):
    """The extension ComfyUI 0.3.x asks for its node list."""

    async def get_node_list(self) -> List[Type[io.ComfyNode]]:
        return list(V3_NODES)


async def comfy_entrypoint() -> ToMeExtension:
    return ToMeExtension()
