"""How Forge Neo runs a DiT family: ComfyUI's binding (``ComfyDiT``) plus the two things Neo's port lacks.

Neo's ``backend/nn`` classes are ports of ComfyUI's: the same block lists, token order, block replace contract
(``patches_replace["dit"][("double_block", i)]``) and ``transformer_options`` block reports, so a family's Neo binding
is a ``ComfyDiT`` over Neo's module and class names. What Neo has not: an attention override (its blocks call a module
global chosen at start-up, ``attention``), and, in some classes, ``transformer_options`` in the replace patch's args
(``replace_options``: Qwen-Image's blocks get none, nor does its attention). The adapter (``model_patcher/neo.py``)
reads both from here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Tuple

from .comfy_dits import ComfyDiT


@dataclass(frozen=True)
class NeoDiT(ComfyDiT):
    """A ``ComfyDiT`` of Neo's classes.

    attention: "module.name" of the module globals the family's self-attention calls (``backend.nn.flux.
        attention_function``; Wan's ``backend.nn.wan.attention``, the slot Neo's Radial Attention swaps), which ToMe
        replaces for the duration of one model call it plans.
    replace_options: the block replace patch's args carry ``transformer_options`` (False: Qwen-Image).
    """

    attention: Tuple[str, ...] = ()
    replace_options: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        if not self.attention or any("." not in path for path in self.attention):
            raise ValueError(f"ToMe: {self.name}: a Neo binding names its attention globals as 'module.name', got "
                             f"{self.attention!r}.")
