"""A CPU stand-in for the ``sageattention`` package (a CUDA-only kernel library, not installable here).

``sageattn`` mirrors thu-ml/SageAttention's ``sageattn`` (sageattention/core.py, line 79 at d1a57a5) in its
signature and in what it does with a mask: ``attn_mask`` lands in ``**kwargs`` and is never read. The INT8/FP8
kernels are replaced by softmax attention in float32, computed with explicit matmuls: a real sage kernel is not
torch's scaled_dot_product_attention, which ToMe's diffusers mode watches. ``honouring_sageattn`` is the control:
the same, with the mask added to the logits (as a kernel that takes masks would).
"""
from __future__ import annotations

import types
from typing import Any, Optional

import torch

calls: list = []  # (queries, keys, whether a mask was handed in) of every call, for the tests to count


def _attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str, is_causal: bool,
               sm_scale: Optional[float], mask: Optional[torch.Tensor]) -> torch.Tensor:
    if tensor_layout == "NHD":  # [B, N, H, D] -> [B, H, N, D]
        q, k, v = (t.transpose(1, 2) for t in (q, k, v))
    scale = sm_scale if sm_scale is not None else q.shape[-1] ** -0.5
    logits = (q.float() @ k.float().transpose(-1, -2)) * scale
    if mask is not None:
        logits = logits.masked_fill(~mask, -float("inf")) if mask.dtype == torch.bool else logits + mask.float()
    if is_causal:
        logits = logits.masked_fill(torch.ones_like(logits, dtype=torch.bool).triu(1), -float("inf"))
    out = (logits.softmax(-1) @ v.float()).to(q.dtype)
    return out.transpose(1, 2) if tensor_layout == "NHD" else out


def sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str = "HND", is_causal: bool = False,
             sm_scale: Optional[float] = None, return_lse: bool = False, **kwargs: Any) -> torch.Tensor:
    """SageAttention's ``sageattn``: ``attn_mask`` and any other keyword are taken and ignored."""
    seq = 2 if tensor_layout == "HND" else 1
    calls.append((q.shape[seq], k.shape[seq], kwargs.get("attn_mask") is not None))
    return _attention(q, k, v, tensor_layout, is_causal, sm_scale, None)


def honouring_sageattn(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, tensor_layout: str = "HND",
                       is_causal: bool = False, sm_scale: Optional[float] = None, return_lse: bool = False,
                       **kwargs: Any) -> torch.Tensor:
    """The control: ``sageattn`` with ``attn_mask`` added to the logits."""
    seq = 2 if tensor_layout == "HND" else 1
    calls.append((q.shape[seq], k.shape[seq], kwargs.get("attn_mask") is not None))
    return _attention(q, k, v, tensor_layout, is_causal, sm_scale, kwargs.get("attn_mask"))


def module(honouring: bool = False) -> types.ModuleType:
    """A ``sageattention`` module whose ``sageattn`` is the stand-in (or the control), for ``sys.modules``."""
    stand_in = types.ModuleType("sageattention")
    stand_in.sageattn = honouring_sageattn if honouring else sageattn
    return stand_in
