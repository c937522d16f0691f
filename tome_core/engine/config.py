"""The validated settings of one ToMe patch.

Every host (diffusers, the WebUI, ComfyUI) builds a ``ToMeConfig``; validation happens here, at the
boundary, so a bad value fails with a message that names the fix instead of deep in a sampler.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Optional, Tuple

MODES = ("merge", "kv")
MATCHINGS = ("block", "level")
SPEED_CHECKS = ("off", "auto", "on")
KV_DOWNSAMPLES = ("nearest", "avg")
MERGE_ATTENTIONS = ("plain", "balanced", "proportional")  # token_merge.key_bias
MAX_DOWNSAMPLES = (1, 2, 4, 8)


def _require_int(name: str, value: object, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"ToMe: {name} must be an int >= {minimum}, got {value!r} ({type(value).__name__}).")
    if value < minimum:
        raise ValueError(f"ToMe: {name} must be an int >= {minimum}, got {value}.")


def _require_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise TypeError(f"ToMe: {name} must be True or False, got {value!r} ({type(value).__name__}).")


def _require_real(name: str, value: object) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"ToMe: {name} must be a finite number, got {value!r}.")
    return float(value)


@dataclass(frozen=True)
class ToMeConfig:
    """Settings of a ToMe patch; names, defaults and meaning follow ``tomesd.apply_patch``.

    ratio: fraction of tokens removed at each patched block (0.3-0.5 recommended; 0 = off).
    max_downsample: deepest UNet level patched, counted from the first level that has attention
        (1 = only that level; SD1/SD2: 1x latent resolution, SDXL: 2x downsampled).
    sx, sy: size of the cell that holds one destination token (2, 2 recommended).
    use_rand: pick the destination inside each cell at random (seeded by ``seed`` and the step).
    merge_attn / merge_crossattn / merge_mlp: where tokens are merged (self-attention only is best);
        mode "kv" acts on self-attention only (merge_attn).
    mode: "merge" (tomesd's merge/unmerge) or "kv" (keep every query, downsample keys and values).
    kv_downsample: how mode "kv" downsamples: "nearest" (one token per window, ToDo's default; the
        lower error on SD1.5 in our measurements) or "avg" (the window's mean; lower on SDXL).
    matching: mode "merge" only: "block" (tomesd's: every block matches its own input) or "level"
        (the first block of a level matches its input once per model call, and the level's other
        blocks reuse that matching: one matching instead of one per block, a different result).
    match_every: mode "merge" with matching "level", and DiT merge: one model call in ``match_every``
        matches, the calls between reuse its matching (ToMA, CA-ToMe; engine/reuse.py); 1 = every call.
    speed_check: "off" (tomesd's: every selected level is reduced), "auto" (on a GPU, each level is
        timed once per device and shape and left whole where reducing it measured slower; the CPU is
        not timed) or "on" (timed on any device, the CPU included). See speed_check.py.
    seed: seed of the partition's dedicated generator; the global RNG is never touched.
    start_percent, end_percent: the part of the sampling schedule (0 = first step, 1 = last)
        where ToMe is active.
    min_tokens: levels with fewer tokens than this are left alone (merging cannot pay there).
    merge_attention: DiT mode "merge" only: how attention in a merged block weighs the merged keys
        (``token_merge.key_bias``): "plain" (each as one token), "balanced" (the merged grid keys together as
        the grid's tokens against the keys carried whole: text, references), "proportional" (each as the tokens
        it holds, ToMe's prop_attn); None: the model family's default (the catalogue's).
    block_start, block_end: DiTs (mode "kv") only: the share of the model's blocks, in depth order,
        that ToMe reduces (Flux: its double blocks, then its single blocks); block i of n is reduced
        iff block_start <= (i + 0.5) / n <= block_end. block_start None: the model's default (Flux:
        its single blocks, where reduction costs the least error per unit of speed-up; other DiTs:
        the first block). UNets choose levels with max_downsample.
    """

    ratio: float = 0.5
    max_downsample: int = 1
    sx: int = 2
    sy: int = 2
    use_rand: bool = True
    merge_attn: bool = True
    merge_crossattn: bool = False
    merge_mlp: bool = False
    mode: str = "merge"
    kv_downsample: str = "nearest"
    matching: str = "block"
    match_every: int = 1
    speed_check: str = "off"
    seed: int = 0
    start_percent: float = 0.0
    end_percent: float = 1.0
    min_tokens: int = 0
    block_start: Optional[float] = None
    block_end: float = 1.0
    merge_attention: Optional[str] = None

    def __post_init__(self) -> None:
        _require_int("sx", self.sx, 1)
        _require_int("sy", self.sy, 1)
        ratio = _require_real("ratio", self.ratio)
        limit = 1.0 - 1.0 / (self.sx * self.sy)
        if not 0.0 <= ratio < 1.0:
            raise ValueError(f"ToMe: ratio must be in [0, 1), got {ratio}; use e.g. 0.5 (0 turns ToMe off).")
        if ratio > limit:
            raise ValueError(
                f"ToMe: ratio {ratio} is above the mergeable fraction 1 - 1/(sx*sy) = {limit:.4g} "
                f"for sx={self.sx}, sy={self.sy}; lower the ratio or raise sx/sy."
            )
        if isinstance(self.max_downsample, bool) or self.max_downsample not in MAX_DOWNSAMPLES:
            raise ValueError(f"ToMe: max_downsample must be one of {MAX_DOWNSAMPLES}, got {self.max_downsample!r}.")
        for name in ("use_rand", "merge_attn", "merge_crossattn", "merge_mlp"):
            _require_bool(name, getattr(self, name))
        if self.mode not in MODES:
            raise ValueError(f"ToMe: mode must be one of {MODES}, got {self.mode!r}.")
        if self.kv_downsample not in KV_DOWNSAMPLES:
            raise ValueError(f"ToMe: kv_downsample must be one of {KV_DOWNSAMPLES}, got {self.kv_downsample!r}.")
        if self.matching not in MATCHINGS:
            raise ValueError(f"ToMe: matching must be one of {MATCHINGS}, got {self.matching!r}.")
        if self.speed_check not in SPEED_CHECKS:
            raise ValueError(f"ToMe: speed_check must be one of {SPEED_CHECKS}, got {self.speed_check!r}; "
                             "'off' reduces every selected level, 'auto' times them on a GPU.")
        if self.mode == "kv" and (self.merge_crossattn or self.merge_mlp):
            raise ValueError(
                "ToMe: mode='kv' only pools self-attention keys/values; set merge_crossattn=False and "
                "merge_mlp=False, or use mode='merge'."
            )
        if self.merge_attention is not None and self.merge_attention not in MERGE_ATTENTIONS:
            raise ValueError(f"ToMe: merge_attention must be one of {MERGE_ATTENTIONS} (or None: the model family's "
                             f"default), got {self.merge_attention!r}.")
        _require_int("seed", self.seed, 0)
        _require_int("match_every", self.match_every, 1)
        if self.match_every > 1 and self.mode != "merge":
            raise ValueError(f"ToMe: match_every={self.match_every} reuses a merge's matching; mode={self.mode!r} "
                             "has none: set match_every=1, or mode='merge'.")
        _require_int("min_tokens", self.min_tokens, 0)
        start = _require_real("start_percent", self.start_percent)
        end = _require_real("end_percent", self.end_percent)
        if not 0.0 <= start <= end <= 1.0:
            raise ValueError(
                f"ToMe: need 0 <= start_percent <= end_percent <= 1, got start_percent={start}, "
                f"end_percent={end}; e.g. start_percent=0.0, end_percent=1.0 for the whole schedule."
            )
        first = 0.0 if self.block_start is None else _require_real("block_start", self.block_start)
        last = _require_real("block_end", self.block_end)
        if not 0.0 <= first < last <= 1.0:
            raise ValueError(
                f"ToMe: need 0 <= block_start < block_end <= 1, got block_start={self.block_start}, "
                f"block_end={last}; e.g. block_start=0.0, block_end=1.0 for every block."
            )

    def block_range(self, default_start: float = 0.0) -> Tuple[float, float]:
        """(start, end) of the block range; ``default_start`` (the model's default) where block_start is None."""
        return (default_start if self.block_start is None else self.block_start), self.block_end

    def block_on(self, index: int, count: int, default_start: float = 0.0) -> bool:
        """Whether DiT block ``index`` of ``count`` (depth order) lies in the block range."""
        start, end = self.block_range(default_start)
        return count <= 0 or start <= (index + 0.5) / count <= end

    @property
    def enabled(self) -> bool:
        """Whether this config changes anything at all (ratio 0 is the identity)."""
        return self.ratio > 0 and (self.merge_attn or self.merge_crossattn or self.merge_mlp)

    def in_schedule(self, progress: float | None) -> bool:
        """progress: 0 at the first (noisiest) step, 1 at the last; None means unknown (always on)."""
        return progress is None or self.start_percent <= progress <= self.end_percent

    def as_dict(self) -> dict:
        return asdict(self)


def require_all_blocks(config: ToMeConfig, model_name: str) -> None:
    """What a UNet cannot take, refused naming the fix: a block range (max_downsample picks its levels), and
    match_every with matching "block" (only a level's one matching per call is kept across calls)."""
    if config.block_range() != (0.0, 1.0):
        raise ValueError(
            f"ToMe: block_start/block_end choose a share of a DiT's blocks (Flux, Qwen-Image, Wan, LTX-2, ...); {model_name} is a "
            "UNet, whose levels max_downsample chooses: set block_start=0.0 and block_end=1.0."
        )
    if config.merge_attention not in (None, "plain"):
        raise ValueError(
            f"ToMe: merge_attention={config.merge_attention!r} weighs the merged keys of a DiT's merged blocks; "
            f"{model_name} is a UNet (tomesd's merge): leave merge_attention unset."
        )
    if config.match_every > 1 and config.matching != "level":
        raise ValueError(
            f"ToMe: match_every={config.match_every} reuses a level's matching across model calls; on a UNet "
            f"({model_name}) that needs matching='level' (matching='block' matches every block anew): set "
            "matching='level', or match_every=1."
        )


def require_dit_config(config: ToMeConfig, model_name: str, merges: bool = False,
                       merge_families: str = "") -> None:
    """What a transformer-only model (DiT) cannot take, refused naming it and the fix: mode "kv" with nearest
    picks (its keys are rotary-encoded) everywhere; mode "merge" where its family carries merged tokens through
    its blocks (``merges``; ``merge_families`` names those that do, for the message)."""
    if config.mode == "merge" and not merges:
        raise ValueError(
            f"ToMe: mode='merge' on transformers (DiTs) reaches {merge_families or 'no family'} so far; "
            f"{model_name} is not among them: use mode='kv', which keeps every query and text token and "
            "downsamples only the image tokens' keys/values."
        )
    if config.mode == "merge":
        return
    if config.merge_attention not in (None, "plain"):
        raise ValueError(
            f"ToMe: merge_attention={config.merge_attention!r} weighs merged keys, which mode='kv' has none of "
            f"({model_name}): leave merge_attention unset, or use mode='merge'."
        )
    if config.kv_downsample != "nearest":
        raise ValueError(
            f"ToMe: kv_downsample={config.kv_downsample!r} is not supported on {model_name}: its keys are "
            "rotary-encoded (RoPE) and averaging keys rotated by different angles does not give the key "
            "of any position; use kv_downsample='nearest'."
        )
