"""Step caches beside ToMe's hooks: composed where a cache keeps whole tokens, refused where it would not.

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

A cache on a merged DiT block itself (FirstBlockCache, MagCache, SeaCache's block hooks, TaylorSeer's lite mode) is
different: ToMe's merge runs in the block's own ``forward``, which ``cache_slot`` places under the cache's hook in
diffusers' chain, so the cache sees and stores the block's whole tokens and calls ToMe's merged block only on the
steps it computes. The block a cache decides from (``probed_by``; cache-dit's first blocks, ``cache_dit_probes``) runs
whole, so the cache computes the steps it computes alone. A speed-check repeat runs with every cache stepped over
(``caches_stepped_over``): a step the cache computes, its state untouched.
"""
from __future__ import annotations

import contextlib
from typing import Any, Dict, Iterator, Iterable, Optional, Tuple

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

# the hooks of a cache's probe block: the block whose output change between steps decides whether the step is computed
_PROBE_HOOKS = (("fbc_leader_block", "FirstBlockCache"), ("mag_cache_leader_block", "MagCache"),
                ("sea_cache_leader_block", "SeaCache"))

Guarded = Tuple[str, torch.nn.Module, bool]  # (qualified name, module, whether the module itself counts)


def _hooked(module: torch.nn.Module, table: Tuple[Tuple[str, str], ...]) -> Optional[str]:
    """The technique of ``table`` (hook name prefix, technique) whose hook diffusers keeps on ``module``, or None."""
    hooks = getattr(module.__dict__.get(_REGISTRY_ATTR), "hooks", None)
    if not isinstance(hooks, dict):
        return None
    for hook_name in hooks:
        for prefix, technique in table:
            if str(hook_name).startswith(prefix):
                return technique
    return None


def cache_on(module: torch.nn.Module) -> Optional[str]:
    """The name of the diffusers cache technique hooked on ``module`` itself, or None."""
    return _hooked(module, _CACHE_HOOKS)


def is_cache_hook(name: str) -> bool:
    return any(str(name).startswith(prefix) for prefix, _ in _CACHE_HOOKS)


def cache_slot(module: torch.nn.Module) -> Optional[Tuple[object, str]]:
    """Where in diffusers' hook chain on ``module`` a wrapper of its forward goes to run under every cache hook there:
    (the innermost cache hook's function reference, the attribute holding what it calls), or None (no cache hook).

    diffusers' ``HookRegistry`` keeps one reference per hook, innermost first; a hook with its own ``new_forward``
    calls ``original_forward``, another ``forward``. Read by duck typing, as ``cache_on``."""
    registry = module.__dict__.get(_REGISTRY_ATTR)
    order, refs = getattr(registry, "_hook_order", None), getattr(registry, "_fn_refs", None)
    if not isinstance(order, list) or not isinstance(refs, list) or len(order) != len(refs):
        return None
    for name, ref in zip(order, refs):
        if is_cache_hook(name):
            return ref, "original_forward" if getattr(ref, "original_forward", None) is not None else "forward"
    return None


def probed_by(module: torch.nn.Module) -> Optional[str]:
    """The technique whose probe block ``module`` is (it computes the block at every step and compares its output with
    the last step's to decide whether the rest is computed), or None."""
    return _hooked(module, _PROBE_HOOKS)


def cache_dit_probes(model: torch.nn.Module) -> Dict[str, str]:
    """The blocks cache-dit's DBCache computes at every step to decide whether the rest is computed (its first
    ``Fn_compute_blocks`` of each cached block list), by qualified name -> "cache-dit DBCache"; empty where cache-dit
    does not cache ``model``. Read from what cache-dit 1.5.3 keeps on the transformer (duck typing, no import):
    ``_is_cached``, ``_context_names`` ("<block list>_<id>") and ``_context_manager.get_context(name).cache_config``."""
    state = model.__dict__
    names, manager = state.get("_context_names"), state.get("_context_manager")
    if not state.get("_is_cached") or not isinstance(names, (list, tuple)) or manager is None:
        return {}
    found = {}
    lists = [str(name).rsplit("_", 1)[0] for name in names]
    for name, blocks in zip(names, lists):
        try:
            first = int(getattr(manager.get_context(name).cache_config, "Fn_compute_blocks", 0) or 0)
        except Exception:  # another cache-dit version's layout: nothing known to leave whole
            continue
        # Flux in cache-dit's default layout: its double and single blocks cached as one list, named after the first
        chain = [blocks] + (["single_transformer_blocks"] if blocks == "transformer_blocks"
                            and "single_transformer_blocks" not in lists
                            and isinstance(getattr(model, "single_transformer_blocks", None), torch.nn.ModuleList)
                            else [])
        for part in chain:
            held = getattr(model, part, None)
            count = len(held) if isinstance(held, torch.nn.ModuleList) else first
            found.update({f"{part}.{index}": "cache-dit DBCache" for index in range(min(first, count))})
            first -= count
            if first <= 0:
                break
    return found


def _step_in(module: torch.nn.Module, *args: Any, **kwargs: Any) -> Tuple[tuple, dict]:
    return args, kwargs


def _step_out(module: torch.nn.Module, output: Any) -> Any:
    return output


@contextlib.contextmanager
def caches_stepped_over(model: torch.nn.Module) -> Iterator[None]:
    """Every diffusers cache hook in ``model`` stepped over while inside (its pre, forward and post), and cache-dit's
    forward: a speed-check repeat then runs as a step the cache computes, and leaves each cache's state (its stored
    residuals, its step count) as the real call will find it."""
    saved = []
    for sub in model.modules():
        registry = sub.__dict__.get(_REGISTRY_ATTR)
        order, refs = getattr(registry, "_hook_order", None), getattr(registry, "_fn_refs", None)
        if not isinstance(order, list) or not isinstance(refs, list):
            continue
        for name, ref in zip(order, refs):
            if not is_cache_hook(name):
                continue
            saved.append((ref, ref.pre_forward, ref.forward, ref.post_forward))
            ref.pre_forward, ref.post_forward = _step_in, _step_out
            if getattr(ref, "original_forward", None) is not None:
                ref.forward = ref.original_forward
    # cache-dit caches through the transformer's own forward (an instance ``forward``), keeping the model's in
    # ``_original_forward``: that one runs every block, outside cache-dit's state
    state = model.__dict__
    own = state.get("forward") if state.get("_is_cached") and state.get("_original_forward") is not None else None
    if own is not None:
        model.forward = state["_original_forward"]
    try:
        yield
    finally:
        if own is not None:
            model.forward = own
        for ref, pre, forward, post in reversed(saved):
            ref.pre_forward, ref.forward, ref.post_forward = pre, forward, post


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
