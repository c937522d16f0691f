"""Mode "kv" beside diffusers' fused QKV projections (``unet.fuse_qkv_projections()``).

kv hands self-attention its reduced keys/values as ``encoder_hidden_states``. diffusers' fused
processor (``FusedAttnProcessor2_0``) then takes its cross-attention path: queries from ``to_q`` and
keys/values from ``attn.to_kv``, which fusing creates for cross-attention modules only, so a fused
self-attention fails with ``AttributeError: ... no attribute 'to_kv'``.

ToMe therefore gives each self-attention it reduces a ``to_kv`` that projects with the module's own
``to_k`` and ``to_v``, looked up at every call (a LoRA layer or an offload hook put on them later
still acts). The fused processor then computes exactly the unfused kv attention, whichever of
``apply_patch`` and ``fuse_qkv_projections`` came first. It is a plain attribute, not a submodule:
parameters and the state dict do not change, and removal deletes it.
"""
from __future__ import annotations

from functools import partial
from typing import Optional

import torch

KV_PROJECTION = "to_kv"


def project_kv(attention: torch.nn.Module, context: torch.Tensor) -> torch.Tensor:
    """context: [B, N', C] -> [B, N', 2 * inner]: keys then values, as a fused ``to_kv`` returns them.

    A module-level function in a ``partial`` (not a closure) so torch.compile traces straight through it.
    """
    return torch.cat([attention.to_k(context), attention.to_v(context)], dim=-1)


class KVProjectionHandle:
    """Removes the ``to_kv`` that ``add_kv_projection`` set, and only that one (like a hook handle)."""

    def __init__(self, attention: torch.nn.Module, projection: partial) -> None:
        self.attention, self.projection = attention, projection

    def remove(self) -> None:
        if self.attention.__dict__.get(KV_PROJECTION) is self.projection:
            del self.attention.__dict__[KV_PROJECTION]


def add_kv_projection(attention: torch.nn.Module) -> Optional[KVProjectionHandle]:
    """Give a diffusers self-attention a ``to_kv`` for the fused processor; None where none is needed.

    Only modules with separate ``to_k``/``to_v`` that are not cross-attention and have no ``to_kv``
    of their own (diffusers fuses real cross-attention into one) get it; LDM attention never does.
    """
    if getattr(attention, "is_cross_attention", True) or hasattr(attention, KV_PROJECTION):
        return None
    if not (hasattr(attention, "to_k") and hasattr(attention, "to_v")):
        return None
    projection = partial(project_kv, attention)
    attention.__dict__[KV_PROJECTION] = projection
    return KVProjectionHandle(attention, projection)
