"""Test-only partner nodes for the composition table (test_comfy_compose.py): a seeded LoRA applied the
way LoraLoaderModelOnly applies a file, and a node that sets ``optimized_attention_override``."""
from __future__ import annotations


class TomeTestSeededLora:
    """LoraLoaderModelOnly's path (``comfy.sd.load_lora_for_models``) with a seeded rank-4 LoRA on every
    self-attention query projection of the UNet, built in memory (no file to download or write)."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "load"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "seed": ("INT", {"default": 0, "min": 0, "max": 1 << 31})}}

    def load(self, model, seed):
        import comfy.sd
        import torch

        generator = torch.Generator().manual_seed(seed)
        lora = {}
        for key, weight in model.model.state_dict().items():
            if not (key.endswith("attn1.to_q.weight") and key.startswith("diffusion_model.")):
                continue
            name = "lora_unet_" + key[len("diffusion_model."):-len(".weight")].replace(".", "_")
            out_features, in_features = weight.shape
            lora[f"{name}.lora_up.weight"] = torch.randn(out_features, 4, generator=generator) * 0.5
            lora[f"{name}.lora_down.weight"] = torch.randn(4, in_features, generator=generator) * 0.5
            lora[f"{name}.alpha"] = torch.tensor(4.0)
        patched, _ = comfy.sd.load_lora_for_models(model, None, lora, 1.0, 0.0)
        return (patched,)


class TomeTestAttentionOverride:
    """Sets ``transformer_options["optimized_attention_override"]`` (ComfyUI 0.3.6x+): every attention call
    goes through it, and it scales the attention output by ``scale``."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "scale": ("FLOAT", {"default": 0.8, "min": 0.0, "max": 2.0})}}

    def patch(self, model, scale):
        def scaled_attention(func, *args, **kwargs):
            return func(*args, **kwargs) * scale

        patched = model.clone()
        options = patched.model_options.setdefault("transformer_options", {})
        options["optimized_attention_override"] = scaled_attention
        return (patched,)


# dict(...), not a literal: ComfyUI-Manager's scanner reads literal mappings in every .py of the repository,
# and these test nodes are not the pack's (tests/test_registry.py).
NODE_CLASS_MAPPINGS = dict(TomeTestSeededLora=TomeTestSeededLora, TomeTestAttentionOverride=TomeTestAttentionOverride)
