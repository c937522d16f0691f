"""Mode "kv" on ComfyUI's DiTs (Flux, SD3/MMDiT, Wan) through its public patch API; duck typed, no comfy import.

Two host mechanisms, both per patched clone: an APPLY_MODEL wrapper (``add_wrapper_with_key``,
chained by ComfyUI itself) reads the latent and text shapes and the sigma of each model call, and
for the duration of that call sets ``transformer_options["optimized_attention_override"]``, which
ComfyUI (0.3.6x+, ``comfy/ldm/modules/attention.py: wrap_attn``) calls around every
``optimized_attention``. The override shortens the image tokens' keys/values and then calls the
override that was there before (set by another node, earlier or later in the graph) or the
attention function itself. Installing per call is what lets it survive an override set after ours.
"""
from __future__ import annotations

import math
import sys
from typing import Any, Callable, Dict, Optional, Tuple

import torch

from ..config import ToMeConfig
from .diffusers_dit import check_config
from .grid import TokenLayout
from .kv import dit_window
from .state import KVPatchState

OVERRIDE = "optimized_attention_override"
WRAPPER_KEY = "tome_dit_kv"
APPLY_MODEL = "apply_model"  # comfy.patcher_extension.WrappersMP.APPLY_MODEL

# diffusion_model class -> (family, text position). Flux: [text, image] (comfy/ldm/flux/layers.py,
# model.py); MMDiT: [context, x] (mmdit.py: _block_mixing); Wan: self-attention on video tokens only.
FAMILIES: Dict[str, Tuple[str, str]] = {
    "Flux": ("flux", "first"),
    "OpenAISignatureMMDITWrapper": ("sd3", "first"),
    "MMDiT": ("sd3", "first"),
    "WanModel": ("wan", "none"),
    "VaceWanModel": ("wan", "none"),
    "CameraWanModel": ("wan", "none"),
}


def _diffusion_model(patcher: Any) -> Any:
    model = getattr(patcher, "model", None)
    return getattr(model, "diffusion_model", None)


def _family_entry(diffusion_model: Any) -> Optional[Tuple[str, str]]:
    """FAMILIES entry of a diffusion model, seen through torch.compile's OptimizedModule.

    TorchCompileModel's APPLY_MODEL wrapper swaps ``diffusion_model`` for the compiled module while
    a call runs; when it was added before ToMe's wrapper, ToMe sees that module at call time.
    """
    return FAMILIES.get(type(getattr(diffusion_model, "_orig_mod", diffusion_model)).__name__)


def dit_family(patcher: Any) -> Optional[str]:
    """The family ("flux", "sd3", "wan") of the patcher's diffusion model, or None for anything else."""
    entry = _family_entry(_diffusion_model(patcher))
    return entry[0] if entry else None


def _host_has_override() -> bool:
    attention = sys.modules.get("comfy.ldm.modules.attention")
    return attention is None or hasattr(attention, "wrap_attn")  # wrap_attn is what calls the override


def _layout(diffusion_model: Any, x: torch.Tensor, context: Optional[torch.Tensor]) -> Optional[TokenLayout]:
    """Token layout of one model call from the latent x [B, C, (T,) H, W], the text and the patch size."""
    entry = _family_entry(diffusion_model)
    if entry is None:
        return None
    text_at = entry[1]
    patch = diffusion_model.patch_size
    patch = tuple(patch) if isinstance(patch, (tuple, list)) else (patch,) * (x.ndim - 2)
    if len(patch) != x.ndim - 2:
        return None
    grid = tuple(math.ceil(n / p) for n, p in zip(x.shape[2:], patch))  # the host pads to the patch size
    if text_at == "none":
        return TokenLayout(grid)
    if context is None:
        return None
    return TokenLayout(grid, prefix=context.shape[1] + int(getattr(diffusion_model, "register_length", 0) or 0))


# Where each family keeps its blocks, in the order they run (comfy/ldm/flux/model.py, mmdit.py, wan/model.py;
# VACE runs its vace_blocks between the main ones, so for it the depth order is the order of the calls).
_BLOCK_LISTS = {"flux": ("double_blocks", "single_blocks"), "sd3": ("joint_blocks",), "wan": ("blocks", "vace_blocks")}


def block_count(patcher_or_model: Any) -> int:
    """The blocks of a patcher's (or diffusion model's) DiT, in the sense of the block range."""
    model = _diffusion_model(patcher_or_model) if hasattr(patcher_or_model, "model") else patcher_or_model
    model = getattr(model, "_orig_mod", model)
    entry = _family_entry(model)
    return 0 if entry is None else sum(len(getattr(model, name, None) or ()) for name in _BLOCK_LISTS[entry[0]])


def blocks_on(diffusion_model: Any, config: ToMeConfig) -> Optional[Tuple[bool, ...]]:
    """Per block, in depth order, whether config's block range holds it; None for every block.

    Raises ValueError naming the model when the range holds none of its blocks.
    """
    if config.all_blocks:
        return None
    model = getattr(diffusion_model, "_orig_mod", diffusion_model)
    count = block_count(model)
    chosen = tuple(config.block_on(index, count) for index in range(count))
    if not any(chosen):
        raise ValueError(
            f"ToMe: block_start={config.block_start}..block_end={config.block_end} holds none of "
            f"{type(model).__name__}'s {count} blocks (block i is in it iff its centre (i + 0.5) / {count} is); "
            "widen the range.")
    return chosen


class DiTKVPatch(KVPatchState):
    """The state of one patched clone: config, sigma window, block choice and the per-step kept indices."""

    def __init__(self, config: ToMeConfig, sigma_high: float, sigma_low: float,
                 blocks: Optional[Tuple[bool, ...]] = None) -> None:
        super().__init__(config)
        self.sigma_high, self.sigma_low = sigma_high, sigma_low
        self.blocks_on = blocks

    def override(self, layout: TokenLayout, keep: torch.Tensor, ambiguous: int,
                 previous: Optional[Callable], blocks_on: Optional[Tuple[bool, ...]] = None) -> Callable:
        """The optimized_attention_override for one model call; chains ``previous``.

        blocks_on: per block in depth order, whether ToMe reduces it (None: every block). The
        self-attentions over the layout come one per block in depth order (Flux: double, then single
        blocks; MMDiT: joint blocks; Wan: its blocks), so their count in this call is the block index.
        """
        seen = [0]  # self-attentions over the layout so far in this model call

        def tome_kv_override(func: Callable, *args: Any, **kwargs: Any) -> Any:
            args = list(args)
            q, k, v = args[:3] if len(args) >= 3 else (kwargs.get("q"), kwargs.get("k"), kwargs.get("v"))
            seq = 2 if kwargs.get("skip_reshape", False) else 1
            n = layout.length
            # Self-attention over exactly this layout only; a cross-attention whose text happens to have
            # the same length cannot be told apart, so that length is left alone (``ambiguous``).
            block_on = False
            if q is not None and n != ambiguous and q.shape[seq] == k.shape[seq] == v.shape[seq] == n:
                index, seen[0] = seen[0], seen[0] + 1
                block_on = blocks_on is None or (index < len(blocks_on) and blocks_on[index])
            if block_on:
                k, v = k.index_select(seq, keep), v.index_select(seq, keep)
                if len(args) >= 3:
                    args[1], args[2] = k, v
                else:
                    kwargs["k"], kwargs["v"] = k, v
                mask = kwargs.get("mask")
                if isinstance(mask, torch.Tensor) and mask.shape[-1] == n:
                    kwargs["mask"] = mask.index_select(-1, keep)
                if not torch.compiler.is_compiling():  # a diagnostic count; in traced code an int guard, a recompile
                    self.reduced_calls += 1
            if previous is not None:
                return previous(func, *args, **kwargs)
            return func(*args, **kwargs)

        return tome_kv_override

    def apply_model_wrapper(self, executor: Any, x: torch.Tensor, t: Any, c_concat: Any = None,
                            c_crossattn: Any = None, control: Any = None, transformer_options: Optional[dict] = None,
                            **kwargs: Any) -> Any:
        """APPLY_MODEL wrapper: set our override for this call only, restore what was there afterwards."""
        options = transformer_options if transformer_options is not None else {}
        plan = self._plan(executor.class_obj, x, t, c_crossattn)
        if plan is None:
            return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)
        had, previous = OVERRIDE in options, options.get(OVERRIDE)
        options[OVERRIDE] = self.override(*plan, previous=previous, blocks_on=self.blocks_on)
        try:
            return executor(x, t, c_concat, c_crossattn, control, options, **kwargs)
        finally:
            if had:
                options[OVERRIDE] = previous
            else:
                options.pop(OVERRIDE, None)

    def _plan(self, base_model: Any, x: torch.Tensor, t: Any, context: Any) -> Optional[Tuple]:
        config = self.config
        if not config.enabled:
            return None
        layout = _layout(base_model.diffusion_model, x, context if isinstance(context, torch.Tensor) else None)
        if layout is None or layout.grid_tokens < max(config.min_tokens, 2):
            return None
        if all(s == 1 for s in dit_window(config.ratio, layout.grid, config.sx, config.sy)):
            return None
        # One host read per model call (not per block): the sigma drives the schedule and the seed.
        sigma = float(t.detach().max()) if isinstance(t, torch.Tensor) else float(t)
        if not self.sigma_low <= sigma <= self.sigma_high:
            return None
        text = context.shape[1] if isinstance(context, torch.Tensor) else -1
        ambiguous = text if layout.prefix == 0 and layout.suffix == 0 else -1
        if layout.length == ambiguous:
            self.warn_once("ambiguous", f"ToMe: {layout.grid_tokens} video tokens equal the text length; "
                           "this size is left unreduced (self- and cross-attention cannot be told apart).")
        return layout, self.keep_for(layout, sigma, x.device), ambiguous


def patch_dit_model_patcher(patcher: Any, config: ToMeConfig) -> Any:
    """A clone of ``patcher`` with mode "kv" on its DiT; the input patcher is never changed.

    Raises TypeError naming the model for diffusion models the override cannot reach (PixArt,
    HunyuanDiT, UNets...), ValueError for settings that do not apply (mode "merge", avg), and
    RuntimeError on a ComfyUI without ``optimized_attention_override``. Nothing is patched then.
    """
    diffusion_model = _diffusion_model(patcher)
    if _family_entry(diffusion_model) is None:
        name = type(getattr(diffusion_model, "_orig_mod", diffusion_model)).__name__
        raise TypeError(f"ToMe: {name} is not a DiT that ToMe's kv mode can reach in ComfyUI; supported: "
                        f"Flux, SD3/SD3.5 (MMDiT), Wan 2.x. UNet models (SD1.x/SD2.x/SDXL) use the UNet patch.")
    check_config(diffusion_model, config)
    chosen = blocks_on(diffusion_model, config)
    if not hasattr(patcher, "add_wrapper_with_key") or not _host_has_override():
        raise RuntimeError("ToMe: this ComfyUI has no transformer_options['optimized_attention_override'] "
                           "(added in ComfyUI 0.3.6x); update ComfyUI to use ToMe on DiT models.")
    sampling = patcher.get_model_object("model_sampling")
    high, low = float(sampling.percent_to_sigma(config.start_percent)), float(sampling.percent_to_sigma(config.end_percent))
    state = DiTKVPatch(config, sigma_high=high, sigma_low=low, blocks=chosen)
    clone = patcher.clone()
    clone.remove_wrappers_with_key(APPLY_MODEL, WRAPPER_KEY)  # re-patching replaces, never stacks
    clone.add_wrapper_with_key(APPLY_MODEL, WRAPPER_KEY, state.apply_model_wrapper)
    return clone
