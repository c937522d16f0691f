"""tome: Token Merging for Stable Diffusion, as a ComfyUI custom-node package.

ComfyUI loads this file as the package of ``custom_nodes/<this repository>``. Where the host has the V3
node API (``comfy_api.latest``, ComfyUI 0.3.x) the nodes are offered through ``comfy_entrypoint``;
elsewhere (the 2024 ComfyUI) through ``NODE_CLASS_MAPPINGS``. Exactly one of the two is exported:
ComfyUI 0.3.75's ``nodes.load_custom_node`` uses ``NODE_CLASS_MAPPINGS`` whenever it is present and
then never calls ``comfy_entrypoint``. The nodes use only the ModelPatcher object they are given, so
this file also imports cleanly where ComfyUI is absent (pytest, diffusers users, the WebUI).
``nodes`` is imported relatively: ComfyUI has a top-level module of that name.
InvokeAI loads the same folder as a node pack (``$INVOKEAI_ROOT/nodes/<this repository>``, its
``load_custom_nodes``, which has imported its invocations first): there the InvokeAI nodes are registered
(``tome_invokeai``, docs/INVOKEAI.md) and nothing of ComfyUI's.
"""
import sys

if "invokeai.app.invocations.baseinvocation" in sys.modules and __package__:  # InvokeAI's node loader
    from .tome_invokeai import invocations as invokeai_nodes  # noqa: F401  (registers the ToMe denoise nodes)
try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
except ImportError as error:  # imported as a plain module, not as a package (e.g. by a test collector)
    if "relative import" not in str(error):
        raise
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}
else:
    try:
        import comfy_api.latest  # noqa: F401  (present in ComfyUI 0.3.x only)
    except ImportError:
        pass
    else:
        from .nodes.tome_v3 import comfy_entrypoint  # noqa: F401
        del NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS

WEB_DIRECTORY = "./web"

__all__ = [name for name in ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "comfy_entrypoint")
           if name in globals()] + ["WEB_DIRECTORY"]
