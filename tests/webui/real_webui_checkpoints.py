"""Test data for tests/webui/real_webui.py: two random-weight SD1.5-layout checkpoints, written by
our own code with fixed seeds (0 and 1), fp16.

By default small (UNet ``model_channels`` 32, VAE ``ch`` 32, a 2-layer CLIP-L text encoder), each
with its ``<name>.yaml`` beside it, which AUTOMATIC1111 reads instead of guessing the config; the
text encoder's config and tokenizer go to ``tome_tiny_clip/`` (the yaml names it as
FrozenCLIPEmbedder's ``version``), so nothing is looked up on a hub. ``full=True`` writes SD1.5's own
sizes without yaml, for Forge, which recognises a model from its state dict.

Run with the WebUI's Python (torch, omegaconf, transformers, safetensors) through
``real_webui.py checkpoints``; ``ldm_root`` is the WebUI's Stability-AI stablediffusion checkout.
"""
from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Any, List

CHECKPOINTS = ("tome_tiny_sd15_seed0.safetensors", "tome_tiny_sd15_seed1.safetensors")


YAML = """model:
  target: ldm.models.diffusion.ddpm.LatentDiffusion
  params:
    linear_start: 0.00085
    linear_end: 0.0120
    num_timesteps_cond: 1
    log_every_t: 200
    timesteps: 1000
    first_stage_key: "jpg"
    cond_stage_key: "txt"
    image_size: 64
    channels: 4
    cond_stage_trainable: false
    conditioning_key: crossattn
    monitor: val/loss_simple_ema
    scale_factor: 0.18215
    use_ema: False
    unet_config:
      target: ldm.modules.diffusionmodules.openaimodel.UNetModel
      params:
        image_size: 32
        in_channels: 4
        out_channels: 4
        model_channels: 32
        attention_resolutions: [ 4, 2, 1 ]
        num_res_blocks: 2
        channel_mult: [ 1, 2, 4, 4 ]
        num_heads: 4
        use_spatial_transformer: True
        transformer_depth: 1
        context_dim: 768
        use_checkpoint: True
        legacy: False
    first_stage_config:
      target: ldm.models.autoencoder.AutoencoderKL
      params:
        embed_dim: 4
        monitor: val/rec_loss
        ddconfig:
          double_z: true
          z_channels: 4
          resolution: 256
          in_channels: 3
          out_ch: 3
          ch: 32
          ch_mult: [ 1, 2, 4, 4 ]
          num_res_blocks: 1
          attn_resolutions: []
          dropout: 0.0
        lossconfig:
          target: torch.nn.Identity
    cond_stage_config:
      target: ldm.modules.encoders.modules.FrozenCLIPEmbedder
      params:
        version: {clip_dir}
"""

# ComfyUI's comfy/sd1_clip_config.json (CLIP-L text model) with 2 of its 12 layers.
CLIP_CONFIG = {
    "_name_or_path": "openai/clip-vit-large-patch14", "architectures": ["CLIPTextModel"],
    "attention_dropout": 0.0, "bos_token_id": 0, "dropout": 0.0, "eos_token_id": 49407,
    "hidden_act": "quick_gelu", "hidden_size": 768, "initializer_factor": 1.0, "initializer_range": 0.02,
    "intermediate_size": 3072, "layer_norm_eps": 1e-05, "max_position_embeddings": 77,
    "model_type": "clip_text_model", "num_attention_heads": 12, "num_hidden_layers": 2, "pad_token_id": 1,
    "projection_dim": 768, "torch_dtype": "float32", "vocab_size": 49408,
}


def reinit_zero_layers(module: Any, seed: int) -> None:
    """LDM zero-initialises proj_out, each ResBlock's last conv and the output conv; give them
    PyTorch's default init so the attention ToMe merges reaches the image (as webui_helpers)."""
    import torch

    torch.manual_seed(seed + 1)
    for m in module.modules():
        weight = getattr(m, "weight", None)
        if isinstance(m, (torch.nn.Conv1d, torch.nn.Conv2d, torch.nn.Linear)) and not weight.any():
            m.reset_parameters()


def full_size(yaml: str) -> str:
    """SD1.5's own sizes (configs/v1-inference.yaml): a 320-channel UNet, 128-channel VAE, 12-layer
    CLIP-L. Forge recognises a checkpoint from its state dict (huggingface_guess) and refuses the
    small UNet, so for Forge the checkpoints are full size (and need no yaml)."""
    return (yaml.replace("model_channels: 32", "model_channels: 320").replace("num_heads: 4", "num_heads: 8")
            .replace("ch: 32", "ch: 128").replace("num_res_blocks: 1", "num_res_blocks: 2"))


def write_checkpoints(out: Path, ldm_root: Path, tokenizer: Path, full: bool = False) -> List[Path]:
    """Write the two checkpoints (seeds 0 and 1, fp16), their yaml and the text encoder's folder."""
    sys.path.insert(0, str(ldm_root))
    import torch
    from omegaconf import OmegaConf
    from safetensors.torch import save_file
    from transformers import CLIPTextConfig, CLIPTextModel
    from ldm.util import instantiate_from_config

    out.mkdir(parents=True, exist_ok=True)
    clip_dir = out / "tome_tiny_clip"
    clip_dir.mkdir(exist_ok=True)
    for name in ("vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copy(tokenizer / name, clip_dir / name)
    clip_config = {**CLIP_CONFIG, "num_hidden_layers": 12} if full else CLIP_CONFIG
    (clip_dir / "config.json").write_text(json.dumps(clip_config, indent=1) + "\n")
    yaml = YAML.format(clip_dir=clip_dir.resolve())
    yaml = full_size(yaml) if full else yaml
    params = OmegaConf.create(yaml).model.params
    written = []
    for seed, name in enumerate(CHECKPOINTS):
        torch.manual_seed(seed)
        parts = {
            "model.diffusion_model.": instantiate_from_config(params.unet_config),
            "first_stage_model.": instantiate_from_config(params.first_stage_config),
            "cond_stage_model.transformer.": CLIPTextModel(CLIPTextConfig(**clip_config)),
        }
        state = {}
        for prefix, module in parts.items():
            reinit_zero_layers(module, seed)
            for key, value in module.state_dict().items():
                value = value.half() if value.is_floating_point() else value
                state[prefix + key] = value.contiguous()
        path = out / name
        save_file(state, str(path))
        if not full:
            path.with_suffix(".yaml").write_text(yaml)
        written.append(path)
    return written
