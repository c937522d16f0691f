"""A ComfyUI-style ``ModelPatcher`` (ComfyUI, and Forge's UNet patcher): patches registered on a clone.

unet (attn1/attn2 patches and an APPLY_MODEL wrapper for SD1.x/SD2.x/SDXL UNets), dit (mode kv on DiTs
through ``optimized_attention_override``), layout and reports (where a DiT call's tokens sit, derived or
as the host reports them). Duck typed: nothing here imports ComfyUI or Forge.
"""
