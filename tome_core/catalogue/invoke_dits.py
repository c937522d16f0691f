"""InvokeAI's bindings: which of its denoise invocations run a family, and the model classes of InvokeAI's own.

InvokeAI runs most transformer families on diffusers classes (the family's diffusers bindings patch them as they
are); FLUX.1 runs on its own BFL-derived ``invokeai.backend.flux.model.Flux``, whose block processors call each
block's parts one by one (``custom_block_processor.py``) and the attention as a function, never as a module: its
binding (``WindowedDiT``) says between which two parts each block's attention runs. No InvokeAI import here.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from .diffusers_dits import DiffusersDiT


@dataclass(frozen=True)
class WindowedDiT(DiffusersDiT):
    """A class whose blocks' attention is reached between two of the block's parts: each ``BlockList.attentions``
    entry names the part called just before the attention (it opens the window), ``closes`` the part called just
    after it, per block list (``(attr, part)``). Mode kv shortens the keys/values of the attention calls in the
    window; mode merge has no block to hook (``merge`` stays None)."""

    closes: Tuple[Tuple[str, str], ...] = ()

    def close_of(self, name: str) -> str:
        """The closing part of the attention ``name`` ("double_blocks.3.img_attn.norm" -> "img_attn.proj")."""
        return dict(self.closes)[name.split(".", 1)[0]]


@dataclass(frozen=True)
class InvokeDenoise:
    """One InvokeAI denoise invocation that runs a family: its type (the ToMe node pack offers a variant of it),
    what InvokeAI calls the model, whether the class it loads takes mode merge, and ``own``: the binding of
    InvokeAI's own class (None: the class is diffusers', bound in the family's ``diffusers``)."""

    invocation: str
    title: str
    merges: bool
    own: Optional[WindowedDiT] = None

    @property
    def name(self) -> str:
        return self.invocation

    @property
    def merge(self) -> Optional[bool]:
        """What the catalogue's host lists read of a binding: not None where mode merge is reached."""
        return True if self.merges else None

    @property
    def classes(self) -> Tuple[str, ...]:
        return self.own.classes if self.own is not None else ()


__all__ = ["InvokeDenoise", "WindowedDiT"]
