"""kijai's ComfyUI-WanVideoWrapper (model type WANVIDEOMODEL): ToMe on its own Wan transformer.

The wrapper runs its transformer itself (its own sampler, no ComfyUI model wrapper), so ToMe acts through what it
does pass along: the patcher clone's ``model_options["transformer_options"]``, which reaches the transformer and each
block as ``transformer_options``. patch: refusals, description and the clone; hooks: the forward hooks on the
transformer and its blocks (shared by every clone, doing nothing in a call whose options lack ToMe's key, recorded in
the transformer's one attribute ``_tome_wanvideo``; the first block of a call checks its inputs); state: one
clone's settings and each model call's plan; blocks: what a block's hooks do (merge: the video tokens and their
per-token inputs cut, the update put back; kv: the self-attention's keys shortened). Duck typed: nothing here imports
the wrapper or ComfyUI; its classes are the catalogue's (``catalogue/wanvideo.py``).
"""
from .patch import OPTIONS_KEY, check_wanvideo, describe_patch, patch_of, plan_wanvideo, patch_wanvideo, settle_wanvideo

__all__ = ["OPTIONS_KEY", "check_wanvideo", "describe_patch", "patch_of", "plan_wanvideo", "patch_wanvideo", "settle_wanvideo"]
