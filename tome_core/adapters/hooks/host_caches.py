"""Another speed-up's cache inside what ToMe changes: refused, never silently wrong.

diffusers' cache hooks (PyramidAttentionBroadcast, FasterCache, TaylorSeer, FirstBlockCache, MagCache,
SeaCache) return a module's output from an earlier step instead of running it. ToMe's hooks stay
outside those (PyTorch runs forward hooks around whatever ``forward`` a host installed), so:
- a cache on a whole transformer block or on a kv-reduced self-attention holds full-size outputs,
  valid at any step: both act, and ToMe has nothing to reduce on a call the cache skips;
- a cache on a module ToMe merges around (mode "merge": attn1, and attn2/ff where merged; on a DiT its whole
  blocks and all inside them) or inside
  a kv-reduced attention (its projections see the reduced keys/values) would hand back tokens
  merged or picked for another step, which unmerge would scatter to the wrong positions. That is
  refused, at ``apply_patch`` or at the first model call after the cache was added, naming the
  cache, where it sits and what works instead.
Detected by the registry diffusers keeps on each hooked module (duck typing, no diffusers import).
"""
from __future__ import annotations

from typing import Iterable, Optional, Tuple

import torch

_REGISTRY_ATTR = "_diffusers_hook"
# diffusers 0.42 hook names (prefixes) of the techniques that may skip a module's forward.
_CACHE_HOOKS = (
    ("pyramid_attention_broadcast", "PyramidAttentionBroadcast"),
    ("faster_cache", "FasterCache"),
    ("taylorseer", "TaylorSeerCache"),
    ("fbc_", "FirstBlockCache"),
    ("mag_cache", "MagCache"),
    ("sea_cache", "SeaCache"),
)

Guarded = Tuple[str, torch.nn.Module, bool]  # (qualified name, module, whether the module itself counts)


def cache_on(module: torch.nn.Module) -> Optional[str]:
    """The name of the diffusers cache technique hooked on ``module`` itself, or None."""
    hooks = getattr(module.__dict__.get(_REGISTRY_ATTR), "hooks", None)
    if not isinstance(hooks, dict):
        return None
    for hook_name in hooks:
        for prefix, technique in _CACHE_HOOKS:
            if str(hook_name).startswith(prefix):
                return technique
    return None


def refuse_caches_inside(guarded: Iterable[Guarded], mode: str, fix: Optional[str] = None) -> None:
    """Raise RuntimeError if a diffusers cache hook sits on a module ToMe changes the tokens of.

    guarded: the modules ToMe's hooks change (see hooks.py); cheap enough to run once per model call
    (a dict lookup per module of the hooked attentions, no tensor work, no host sync).
    fix: what works instead, where the mode's usual advice does not apply (a DiT's merged blocks).
    """
    for name, module, include_self in guarded:
        for sub_name, sub in module.named_modules(prefix=name):
            if sub is module and not include_self:
                continue
            technique = cache_on(sub)
            if technique is None:
                continue
            fix = fix or ("use mode='kv' (it keeps every query, so a cached attention output stays valid), or apply "
                   f"{technique} to whole transformer blocks" if mode == "merge" else
                   f"apply {technique} to the attention module or its transformer block, not to its projections")
            raise RuntimeError(
                f"ToMe: diffusers' {technique} caches {sub_name}, whose tokens ToMe's mode '{mode}' changes at "
                f"every step: a cached output would come back with another step's tokens. Remove {technique} "
                f"from it, or {fix}."
            )
