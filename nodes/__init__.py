"""ComfyUI nodes of tome: "ToMe (token merging)" and "ToMe (advanced)".

Imported relatively by the repository's root ``__init__.py`` (ComfyUI has its own top-level
``nodes`` module, so this package must never be imported by that name from ComfyUI's side).
"""
from .tome_nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS, ToMe, ToMeAdvanced

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "ToMe", "ToMeAdvanced"]
