"""Token reduction (mode "kv") for transformer-only and video diffusion models (DiTs).

Every query and every text token is kept; only the image/video tokens' keys and values are
downsampled on their grid. ``grid`` describes where the tokens sit, ``kv`` is the pure tensor
engine, ``diffusers_dit`` the diffusers adapter (imports diffusers lazily, never at module level).
"""
from .grid import TokenLayout
from .kv import dit_window, keep_index, pick_index_nd, reduce_kv

__all__ = ["TokenLayout", "dit_window", "keep_index", "pick_index_nd", "reduce_kv"]
