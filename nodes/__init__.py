"""ComfyUI nodes of tome: "ToMe (token merging)", "ToMe (advanced)" and, where kijai's ComfyUI-WanVideoWrapper is
installed, "ToMe (WanVideoWrapper)".

Imported relatively by the repository's root ``__init__.py`` (ComfyUI has its own top-level
``nodes`` module, so this package must never be imported by that name from ComfyUI's side).
"""
from .tome_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, ToMe, ToMeAdvanced
from .tome_wanvideo import WANVIDEO_NODES, ToMeWanVideo, wrapper_installed

# The WanVideoWrapper node only beside the wrapper: its model type exists nowhere else (node_list.json lists its id
# for ComfyUI-Manager's missing-node lookup either way).
OPTIONAL_NODES = WANVIDEO_NODES if wrapper_installed() else ()
NODE_CLASS_MAPPINGS = dict(NODE_CLASS_MAPPINGS, **{node.NODE_ID: node for node in OPTIONAL_NODES})
NODE_DISPLAY_NAME_MAPPINGS = dict(NODE_DISPLAY_NAME_MAPPINGS,
                                  **{node.NODE_ID: node.DISPLAY_NAME for node in OPTIONAL_NODES})

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "OPTIONAL_NODES", "ToMe", "ToMeAdvanced",
           "ToMeWanVideo"]
