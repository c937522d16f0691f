"""When ToMe's reduction never ran in a model call where it should: say so in the UI, naming who ran the model.

Step caches such as ComfyUI-TeaCache and Comfy-WaveSpeed's First Block Cache swap a DiT's ``forward_orig`` (or
``forward``) for their own copy on the model instance for each call (``unittest.mock.patch``), and their copy calls
the blocks without ``transformer_options``: neither ComfyUI's attention override (mode kv) nor a block replace
patch's call plan (mode merge) reaches them, and the image would come back without ToMe while the UI says
otherwise. The APPLY_MODEL wrapper runs inside such a swap, so it can read the replacement and name its pack.
"""
from __future__ import annotations

from typing import Any, Optional

from ...catalogue.comfy_dits import base_model

FORWARDS = ("forward_orig", "_forward", "forward")


def pack_name(module: str) -> str:
    """The custom node folder of a function's module: ComfyUI's ``nodes.load_custom_node`` names a pack's modules
    after the folder's path ("/.../custom_nodes/ComfyUI-TeaCache.nodes")."""
    tail = module.replace("\\", "/").rsplit("custom_nodes/", 1)[-1]
    return tail.split("/")[0].split(".", 1)[0] or module


def forward_replacement(diffusion_model: Any) -> Optional[str]:
    """"ComfyUI-TeaCache's teacache_flux_forward (in place of Flux.forward_orig)" where a node replaced the model's
    forward on the instance, else None."""
    model = base_model(diffusion_model)
    for attr in FORWARDS:
        replaced = model.__dict__.get(attr)
        if replaced is None:
            continue
        function = getattr(replaced, "__func__", replaced)
        name = getattr(function, "__qualname__", attr)
        return f"{pack_name(getattr(function, '__module__', '') or '')}'s {name} (in place of " \
               f"{type(model).__name__}.{attr})"
    return None


def unreached_error(diffusion_model: Any, mode: str, what: str) -> RuntimeError:
    """The error that stops the prompt when no ``what`` (attention, block) of the first reduced call reached ToMe."""
    model = base_model(diffusion_model)
    who = forward_replacement(diffusion_model)
    cause = (f"{who} runs its blocks without ComfyUI's transformer_options" if who else
             "its blocks ran without ComfyUI's transformer_options (a node replaced the model's forward or its "
             "blocks, or this ComfyUI calls them directly)")
    return RuntimeError(
        f"ToMe: mode {mode} reached no {what} of {type(model).__name__}'s first model call: {cause}, so the image "
        "would come back without ToMe. Use one of the two, not both (ComfyUI's own EasyCache node composes with "
        "ToMe).")
