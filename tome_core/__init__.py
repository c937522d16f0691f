"""tome_core: Token Merging for diffusion models, portable across diffusers, the WebUI and ComfyUI.

The public API (this module): ``apply_patch`` / ``remove_patch`` (tomesd's), ``describe``, ``ToMeConfig``.
Inside, in layers (docs/ARCHITECTURE.md): ``engine`` (torch only), ``catalogue`` (model families),
``adapters`` (one per host mechanism). No host package is imported anywhere: hosts are recognised by the
module and name of their classes.
"""
from .engine.config import ToMeConfig
from .catalogue.unets import attention_base_downsample
from .engine.levels import grid_for_tokens
from .engine.merge import bipartite_soft_matching, kv_pick_index, kv_pool_window, make_partition, pool_tokens
from .adapters.hooks.api import (apply_config, apply_patch, describe, is_patched, patch_config, remove_patch,
                                 restart_matching)
from .engine.plan import IDENTITY_PLAN, TokenMerger, TokenPlan
from ._version import __version__  # one source: [project] version in pyproject.toml

__all__ = [
    "IDENTITY_PLAN",
    "ToMeConfig",
    "TokenMerger",
    "TokenPlan",
    "apply_config",
    "apply_patch",
    "attention_base_downsample",
    "bipartite_soft_matching",
    "describe",
    "grid_for_tokens",
    "is_patched",
    "kv_pick_index",
    "kv_pool_window",
    "make_partition",
    "patch_config",
    "pool_tokens",
    "remove_patch",
    "restart_matching",
]
