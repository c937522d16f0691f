"""Stand-in of Neo's ``backend/attention.py`` (de2193d9): ``attention_basic`` (90-144), ``attention_pytorch``
(203-235) and the import-time choice of ``attention_function`` (333-363).

Neo picks one implementation once, at import (sage / flash / xformers / pytorch / basic); every DiT module then does
``from backend.attention import attention_function``, so each holds its own module global of that name. Here the
choice is fixed to ``attention_pytorch`` (the signature and the layouts are the same for every choice; on a CPU Neo
logs "Using Basic Cross Attention" and picks ``attention_basic``, also kept here, same results up to rounding).
``operations.scaled_dot_product_attention`` is torch's SDPA; ``SDP_BATCH_LIMIT`` (2**15 on NVIDIA) is not modelled.
"""
import torch
import torch.nn.functional as F


def attention_basic(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                    **kwargs):
    """Mirrors attention.py:90-144 attention_basic (einsum softmax; bool mask filled, additive mask added)."""
    if skip_reshape:
        b, _, _, dim_head = q.shape
        q, k, v = (t.reshape(b * heads, -1, dim_head) for t in (q, k, v))
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.reshape(b, -1, heads, dim_head).permute(0, 2, 1, 3).reshape(b * heads, -1, dim_head)
                   for t in (q, k, v))
    sim = torch.einsum("b i d, b j d -> b i j", q, k) * dim_head**-0.5
    if mask is not None:
        if mask.dtype == torch.bool:
            mask = mask.reshape(mask.shape[0], -1).repeat_interleave(heads, dim=0).unsqueeze(1)
            sim.masked_fill_(~mask, -torch.finfo(sim.dtype).max)
        else:
            bs = 1 if mask.ndim == 2 else mask.shape[0]
            mask = mask.reshape(bs, -1, mask.shape[-2], mask.shape[-1]).expand(b, heads, -1, -1)
            sim.add_(mask.reshape(-1, mask.shape[-2], mask.shape[-1]))
    out = torch.einsum("b i j, b j d -> b i d", sim.softmax(dim=-1).to(v.dtype), v).reshape(b, heads, -1, dim_head)
    if skip_output_reshape:
        return out
    return out.permute(0, 2, 1, 3).reshape(b, -1, heads * dim_head)


def attention_pytorch(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                      **kwargs):
    """Mirrors attention.py:203-235 attention_pytorch: [B, L, H*D] (or [B, H, L, D] with skip_reshape) to SDPA."""
    if skip_reshape:
        b, _, _, dim_head = q.shape
    else:
        b, _, dim_head = q.shape
        dim_head //= heads
        q, k, v = (t.view(b, -1, heads, dim_head).transpose(1, 2) for t in (q, k, v))
    if mask is not None:
        if mask.ndim == 2:
            mask = mask.unsqueeze(0)
        if mask.ndim == 3:
            mask = mask.unsqueeze(1)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, dropout_p=0.0, is_causal=False)
    if not skip_output_reshape:
        out = out.transpose(1, 2).reshape(b, -1, heads * dim_head)
    return out


attention_function = attention_pytorch  # attention.py:358-360 (the "Using PyTorch Cross Attention" branch)
