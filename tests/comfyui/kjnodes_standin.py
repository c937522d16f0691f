"""A stand-in of KJNodes' "Patch Sage Attention KJ" node for CI, which cannot fetch the pack (not ours to vendor).

It mirrors kijai/ComfyUI-KJNodes at 3f20054, nodes/model_optimization_nodes.py, line for line where ToMe is
concerned: ``get_sage_func`` (line 28) in its "auto" mode, whose ``attention_sage`` (line 61, wrapped by ComfyUI's
``wrap_attn``) casts float32 inputs to float16, reshapes to sage's NHD or HND layout, adds the batch and head axes to
a mask and hands it to ``sageattn(..., attn_mask=mask)``; and ``PathchSageAttentionKJ.patch`` (line 121), which sets
``optimized_attention_override`` on the clone's transformer_options to a closure that runs that function in place of
ComfyUI's. ``sageattention`` is the CPU stand-in of tests/sage_standin.py (``module()``, put in sys.modules by the
tests), which, as the real ``sageattn``, ignores the mask. Load it with ``load()``: named as ComfyUI's
``nodes.load_custom_node`` names a pack's modules, so what ToMe reports names the pack.
"""
from __future__ import annotations

import importlib.util
import logging
import sys
from pathlib import Path

import torch
from comfy.ldm.modules.attention import attention_pytorch, wrap_attn

MODULE = "/opt/ComfyUI/custom_nodes/ComfyUI-KJNodes.nodes.model_optimization_nodes"


def load():
    """This file as the pack's module (``MODULE``), loaded once per process."""
    if MODULE not in sys.modules:
        spec = importlib.util.spec_from_file_location(MODULE, Path(__file__))
        module = importlib.util.module_from_spec(spec)
        sys.modules[MODULE] = module
        spec.loader.exec_module(module)
    return sys.modules[MODULE]


def get_sage_func(sage_attention, allow_compile=False):
    logging.info(f"Using sage attention mode: {sage_attention}")
    if sage_attention == "auto":
        from sageattention import sageattn

        def sage_func(q, k, v, is_causal=False, attn_mask=None, tensor_layout="NHD"):
            return sageattn(q, k, v, is_causal=is_causal, attn_mask=attn_mask, tensor_layout=tensor_layout)

    if not allow_compile:
        sage_func = torch.compiler.disable()(sage_func)

    @wrap_attn
    def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                       **kwargs):
        if kwargs.get("low_precision_attention", True) is False:
            return attention_pytorch(q, k, v, heads, mask=mask, skip_reshape=skip_reshape,
                                     skip_output_reshape=skip_output_reshape, **kwargs)
        in_dtype = v.dtype
        if q.dtype == torch.float32 or k.dtype == torch.float32 or v.dtype == torch.float32:
            q, k, v = q.to(torch.float16), k.to(torch.float16), v.to(torch.float16)
        if skip_reshape:
            b, _, _, dim_head = q.shape
            tensor_layout = "HND"
        else:
            b, _, dim_head = q.shape
            dim_head //= heads
            q, k, v = map(lambda t: t.view(b, -1, heads, dim_head), (q, k, v))
            tensor_layout = "NHD"
        if mask is not None:
            # add a batch dimension if there isn't already one
            if mask.ndim == 2:
                mask = mask.unsqueeze(0)
            # add a heads dimension if there isn't already one
            if mask.ndim == 3:
                mask = mask.unsqueeze(1)
        # Copy only when a row offset would actually exceed int32.
        seq_dim = 2 if tensor_layout == "HND" else 1
        if any((t.shape[seq_dim] - 1) * t.stride(seq_dim) >= 2**31 for t in (q, k, v)):
            q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
        out = sage_func(q, k, v, attn_mask=mask, is_causal=False, tensor_layout=tensor_layout).to(in_dtype)
        if tensor_layout == "HND":
            if not skip_output_reshape:
                out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
        else:
            if skip_output_reshape:
                out = out.transpose(1, 2)
            else:
                out = out.reshape(b, -1, heads * dim_head)
        return out
    return attention_sage


class PathchSageAttentionKJ:
    """The node (display name "Patch Sage Attention KJ")."""

    def patch(self, model, sage_attention, allow_compile=False):
        if sage_attention == "disabled":
            return model,

        model_clone = model.clone()

        new_attention = get_sage_func(sage_attention, allow_compile=allow_compile)

        def attention_override_sage(func, *args, **kwargs):
            return new_attention.__wrapped__(*args, **kwargs)

        # attention override
        model_clone.model_options["transformer_options"]["optimized_attention_override"] = attention_override_sage

        return model_clone,
