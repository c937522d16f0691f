"""What ToMe does inside one block call of the wrapper's transformer.

Mode merge (``merged_block_args`` / ``unmerged_output``): the block gets the merged video stream, its per-token RoPE
table ``freqs`` and (Wan 2.2 5B) per-token modulation ``e`` cut to the kept tokens, and ``seq_lens`` (flash-attn's
key lengths) shortened by the tokens merged away; after the block every token gets its group's update back
(``TokenMerge.unmerge_update``), and VACE's hints are added to the whole stream, as the wrapper adds them after its
block. Tokens around the grid (Fun's reference image, Phantom's frames, padding) pass whole.

Mode kv (``KVMode``): a ``TorchFunctionMode`` that lives for one block call and shortens the keys/values of the first
``scaled_dot_product_attention`` whose queries and keys both span the block's stream (its self-attention; the
cross-attentions' keys are the text), to one real key per window plus every token outside the grid.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

from ...catalogue.wanvideo import WanVideoMerge
from ...engine.grid import TokenLayout
from ...engine.passthrough import PYTHON_METHODS
from ...engine.token_merge import TokenMerge

_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


@dataclass
class Pending:
    """One merged block call: the stream it was given, the merged stream it ran on (a copy: the block adds to its
    input in place), the merge, and VACE's hints held back for the whole stream."""

    x: torch.Tensor
    merged: torch.Tensor
    merge: TokenMerge
    hints: Any = None
    scales: Any = None


def merged_block_args(spec: WanVideoMerge, merge: TokenMerge, x: torch.Tensor, args: tuple, kwargs: dict,
                      cuts: Dict[Any, Tuple[Any, Any]]) -> Tuple[tuple, dict, Pending]:
    """The block's (args, kwargs) on the merged stream, and what its output hook needs.

    x: [B, L, C] the stream (``args[0]``); cuts: this call's cut tables by input (one cut per table and call: every
    block of a call gets the same ``freqs`` object)."""
    merged = merge.merge(x)
    out = dict(kwargs)
    freqs = kwargs.get("freqs")
    if isinstance(freqs, torch.Tensor) and freqs.ndim > spec.pe_axis and freqs.shape[spec.pe_axis] == merge.length:
        out["freqs"] = _cut(cuts, freqs, lambda: merge.take(freqs, spec.pe_axis))
    e = kwargs.get("e")
    if isinstance(e, torch.Tensor) and e.ndim == 4 and e.shape[spec.per_token_axis] == merge.length:
        out["e"] = _cut(cuts, e, lambda: merge.take(e, spec.per_token_axis))
    seq_lens = kwargs.get("seq_lens")
    if isinstance(seq_lens, torch.Tensor):
        out["seq_lens"] = _cut(cuts, seq_lens, lambda: seq_lens - (merge.length - merge.slots))
    hints = kwargs.get(spec.hints)
    if hints is not None:
        out[spec.hints] = None
    pending = Pending(x, merged, merge, hints, kwargs.get(spec.hint_scales))
    return (merged.clone(),) + tuple(args[1:]), out, pending


def _cut(cuts: Dict[Any, Tuple[Any, Any]], source: Any, make: Any) -> Any:
    found = cuts.get(id(source))
    if found is None or found[0] is not source:
        found = cuts[id(source)] = (source, make())  # the source is kept: its id stays its own for the call
    return found[1]


def unmerged_output(pending: Pending, block: torch.nn.Module, output: Any) -> Any:
    """The block's output tuple (x, x_ip, lynx_ref_feature, x_ovi) with x back on the whole stream."""
    x = pending.merge.unmerge_update(pending.x, pending.merged, output[0])
    if pending.hints:
        # VACE: wanvideo/modules/model.py BaseWanAttentionBlock.forward adds, after its WanAttentionBlock.forward,
        # x.add_(vace_hints[i][self.block_id].to(x.device), alpha=vace_context_scale[i]) for each hint set; ToMe
        # held the hints back (they span the whole stream) and adds them here the same way.
        block_id = getattr(block, "block_id", None)
        if block_id is not None:
            for i, hints in enumerate(pending.hints):
                x.add_(hints[block_id].to(x.device), alpha=pending.scales[i])
    return (x,) + tuple(output[1:])


class KVMode(TorchFunctionMode):
    """Shortens the keys/values of one block's self-attention (``reached``: it did; ``probe``: only record it)."""

    def __init__(self, layout: TokenLayout, keep: Optional[torch.Tensor], probe: bool = False) -> None:
        super().__init__()
        self.layout, self.keep, self.probe = layout, keep, probe
        self.reached = False

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001 - torch's protocol
        kwargs = kwargs or {}
        if func is not F.scaled_dot_product_attention or self.reached:
            if PYTHON_METHODS.get(getattr(func, "__name__", None)) is func and args and type(args[0]) is torch.Tensor:
                return getattr(args[0], func.__name__)(*args[1:], **kwargs)  # passthrough.py
            return func(*args, **kwargs)
        bound = dict(zip(_SDPA_ARGS, args), **kwargs)
        query, key, value = bound["query"], bound["key"], bound["value"]
        length = self.layout.length
        if not (query.shape[-2] == key.shape[-2] == value.shape[-2] == length):
            return func(*args, **kwargs)  # a cross-attention (text, CLIP image tokens), or another stream
        self.reached = True
        if self.probe or self.keep is None:
            return func(*args, **kwargs)
        keep = self.keep if self.keep.device == key.device else self.keep.to(key.device)
        bound["key"], bound["value"] = key.index_select(-2, keep), value.index_select(-2, keep)
        mask = bound.get("attn_mask")
        if isinstance(mask, torch.Tensor) and mask.shape[-1] == length:
            bound["attn_mask"] = mask.index_select(-1, keep)
        return func(**bound)
