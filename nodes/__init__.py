"""ComfyUI nodes of tome: "ToMe" (token merging), "ToMe (advanced)" and, for kijai's ComfyUI-WanVideoWrapper,
"ToMe (WanVideoWrapper)".

Imported relatively by the repository's root ``__init__.py`` (ComfyUI has its own top-level
``nodes`` module, so this package must never be imported by that name from ComfyUI's side).
"""
from .tome_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, ToMe, ToMeAdvanced
from .tome_wanvideo import WANVIDEO_NODES, ToMeWanVideo

# The WanVideoWrapper node whether or not the wrapper is there: ComfyUI reads a pack's nodes once, as it loads the pack,
# and the wrapper may load after this one (tome_wanvideo.py); its WANVIDEOMODEL input connects to the wrapper only.
NODE_CLASS_MAPPINGS = dict(NODE_CLASS_MAPPINGS, **{node.NODE_ID: node for node in WANVIDEO_NODES})
NODE_DISPLAY_NAME_MAPPINGS = dict(NODE_DISPLAY_NAME_MAPPINGS,
                                  **{node.NODE_ID: node.DISPLAY_NAME for node in WANVIDEO_NODES})

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WANVIDEO_NODES", "ToMe", "ToMeAdvanced",
           "ToMeWanVideo"]
