"""Whether the attention a merged ComfyUI block runs honours a mask: asked once, with a tiny call.

Balanced and proportional attention (``token_merge.key_bias``) reach the attention as an additive mask, through
ToMe's attention override of each merged block (``dit_merge.DiTMergePatch.weighed_attention``), which hands it on to
whatever runs under it: another node's ``optimized_attention_override`` or ComfyUI's attention function. Neither
says whether it honours a mask: KJNodes' "Patch Sage Attention KJ" override hands it to ``sageattn``, which takes
``attn_mask`` into ``**kwargs`` and drops it (thu-ml/SageAttention, sageattention/core.py, ``sageattn``), as
ComfyUI 0.3.x's own ``attention_sage`` does. So ToMe asks, once per override and device, in the dtype and head width
the model's attention runs in: the same tiny attention with a mask of -inf on every key but one (its output must then
be that key's value) against it unmasked, through ComfyUI's own ``wrap_attn``, so the override is called exactly as
ComfyUI calls it. Where the mask does not
hold, the merged blocks get plain attention (no mask at all, so nothing is spent on one).

ComfyUI's own attention functions that take a mask only by leaving their kernel are not probed (a probe would say
"honours" and hide the lost kernel): the 2026 ``attention_sage`` runs ``attention_pytorch`` for a masked call when
``sageattn`` has no ``attn_mask`` parameter (``SAGE_ATTENTION_SUPPORTS_MASK``), ``attention3_sage`` always, and
``attention_flash`` raises inside, logs a warning and runs PyTorch's SDPA on every masked call (comfy/ldm/modules/
attention.py). They get plain attention too, said so.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Optional

import torch

from .dit_call import OVERRIDE
from .reach import pack_name

ATTENTION_MODULE = "comfy.ldm.modules.attention"
PROBE_TOKENS = 16  # queries and keys of the probe
KEPT_KEY = 5  # the one key the probe's mask keeps


def host_attention() -> Optional[Callable]:
    """ComfyUI's attention function, as its models call it (``optimized_attention_masked``, chosen at start-up:
    ``--use-sage-attention``, ``--use-flash-attention``, ...), unwrapped from ``wrap_attn`` as an override receives
    it; None outside ComfyUI."""
    attention = sys.modules.get(ATTENTION_MODULE)
    func = getattr(attention, "optimized_attention_masked", getattr(attention, "optimized_attention", None))
    return getattr(func, "__wrapped__", func)


def leaves_its_kernel(func: Optional[Callable]) -> bool:
    """Whether ``func`` is one of ComfyUI's attention functions that, handed a mask, run PyTorch's attention instead
    of their own kernel (module docstring)."""
    if getattr(func, "__module__", None) != ATTENTION_MODULE:
        return False
    name = getattr(func, "__name__", "")
    if name == "attention_sage":  # 0.3.x hands the mask to sageattn (probed); 2026 leaves sage unless it takes one
        return getattr(sys.modules.get(ATTENTION_MODULE), "SAGE_ATTENTION_SUPPORTS_MASK", True) is False
    return name in ("attention3_sage", "attention_flash")


def named(func: Any) -> str:
    """A function as its users know it: "ComfyUI-KJNodes' PathchSageAttentionKJ.patch.attention_override_sage",
    "ComfyUI's attention_sage"."""
    module = getattr(func, "__module__", None) or type(func).__module__
    name = (getattr(func, "__qualname__", None) or type(func).__qualname__).replace("<locals>.", "")
    if "custom_nodes" in module.replace("\\", "/"):
        return f"{pack_name(module)}' {name}"
    return f"ComfyUI's {name}" if module.startswith("comfy.") else f"{module}.{name}"


def who(override: Optional[Callable], func: Callable, called: list) -> str:
    """What ran the probe: the override alone, the override over ComfyUI's function it called, or the function."""
    if override is None:
        return named(func)
    return f"{named(override)} over {named(func)}" if called else named(override)


def head_width(base: Any) -> int:
    """The width of the model's attention heads from its ComfyUI config (Qwen-Image ``attention_head_dim``, Flux
    ``hidden_size / num_heads``, Wan and Lumina ``dim / heads``), so a kernel sees the width it will run."""
    config = getattr(getattr(base, "model_config", None), "unet_config", None) or {}
    heads = config.get("num_attention_heads") or config.get("num_heads") or config.get("n_heads") or 1
    width = config.get("attention_head_dim") or (config.get("hidden_size") or config.get("dim") or 0) // heads
    return int(width) or 128


def compute_dtype(base: Any, fallback: torch.dtype) -> torch.dtype:
    """The dtype the model's attention runs in (its manual cast, else its weights')."""
    dtype = getattr(base, "manual_cast_dtype", None)
    if dtype is None and callable(getattr(base, "get_dtype", None)):
        dtype = base.get_dtype()
    return dtype if isinstance(dtype, torch.dtype) else fallback


def mask_dropped(override: Optional[Callable], options: dict, device: torch.device, dtype: torch.dtype,
                 width: int) -> str:
    """Who drops the mask of a merged block whose attention runs ``override`` (another node's, or None) around
    ComfyUI's attention function ("ComfyUI-KJNodes' ... ignores masks"), or "" where the mask holds. Syncs once:
    set-up work, run once per override and device, outside any compiled region (in the APPLY_MODEL wrapper)."""
    attention = sys.modules.get(ATTENTION_MODULE)
    func = host_attention()
    leaving = leaves_its_kernel(func)
    if override is None and leaving:
        return f"{named(func)} runs a mask only in PyTorch's attention, not its own kernel"
    if func is None or not hasattr(attention, "wrap_attn"):
        return ""  # not ComfyUI (no attention override reaches the blocks there)
    fallback = getattr(attention, "attention_pytorch", None)
    runs = getattr(fallback, "__wrapped__", fallback) if leaving else func
    called = []

    def handed_func(*args: Any, **kwargs: Any) -> Any:  # what the override gets as ``func``
        called.append(True)
        return runs(*args, **kwargs)

    heads, generator = 2, torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, PROBE_TOKENS, heads * width, generator=generator).to(device, dtype) for _ in range(3))
    mask = torch.full((1, PROBE_TOKENS), -float("inf")).index_fill_(1, torch.tensor([KEPT_KEY]), 0.0)  # one key
    call = attention.wrap_attn(handed_func)  # calls the override as ComfyUI does, with the unwrapped function
    probe_options = dict(options, **({OVERRIDE: override} if override is not None else {}))
    try:
        with torch.no_grad():
            masked = call(q, k, v, heads, mask=mask.to(device, dtype), transformer_options=probe_options).float()
            plain = call(q, k, v, heads, transformer_options=dict(probe_options)).float()
    except Exception as error:  # noqa: BLE001 - whatever fails here cannot be relied on to take the mask
        return f"{who(override, func, called)} ignores masks (it fails with one: {type(error).__name__}: {error})"
    expected = v[:, KEPT_KEY:KEPT_KEY + 1].float().expand_as(masked)
    if (masked - expected).norm() >= (masked - plain).norm():  # the probe's one host read
        return f"{who(override, func, called)} ignores masks"
    if called and leaving:
        return f"{named(func)} (under {named(override)}) runs a mask only in PyTorch's attention, not its own kernel"
    return ""
