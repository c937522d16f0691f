"""tome: Token Merging for Stable Diffusion, as a ComfyUI custom-node package.

ComfyUI loads this file as the package of ``custom_nodes/<this repository>``. The nodes use only
the ModelPatcher object they are given (no ``comfy`` import), so this file also imports cleanly
where ComfyUI is absent (pytest, diffusers users, the WebUI). ``nodes`` is imported relatively:
ComfyUI has a top-level module of that name.
"""
try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
except ImportError as error:  # imported as a plain module, not as a package (e.g. by a test collector)
    if "relative import" not in str(error):
        raise
    NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}

WEB_DIRECTORY = "./web"

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
