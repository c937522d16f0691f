"""A diffusers SD1.5 pipeline as one single-file checkpoint (the LDM key layout of a WebUI's or ComfyUI's .safetensors).

The inverse of the conversion diffusers' ``from_single_file`` applies (the key maps of diffusers'
scripts/convert_diffusers_to_original_stable_diffusion.py, with today's VAE attention names ``to_q``... and
transformers' flattened ``CLIPTextModel``). For the tests' tiny pipelines; tests/test_compare.py checks the round
trip: the pipeline loaded back from the file renders the same images.
"""


def _unet_layer_map():
    pairs = []
    for i in range(4):
        for j in range(2):
            pairs.append((f"input_blocks.{3 * i + j + 1}.0.", f"down_blocks.{i}.resnets.{j}."))
            if i < 3:
                pairs.append((f"input_blocks.{3 * i + j + 1}.1.", f"down_blocks.{i}.attentions.{j}."))
        for j in range(3):
            pairs.append((f"output_blocks.{3 * i + j}.0.", f"up_blocks.{i}.resnets.{j}."))
            if i > 0:
                pairs.append((f"output_blocks.{3 * i + j}.1.", f"up_blocks.{i}.attentions.{j}."))
        if i < 3:
            pairs.append((f"input_blocks.{3 * (i + 1)}.0.op.", f"down_blocks.{i}.downsamplers.0.conv."))
            pairs.append((f"output_blocks.{3 * i + 2}.{1 if i == 0 else 2}.", f"up_blocks.{i}.upsamplers.0."))
    pairs.append(("middle_block.1.", "mid_block.attentions.0."))
    pairs += [(f"middle_block.{2 * j}.", f"mid_block.resnets.{j}.") for j in range(2)]
    return pairs


UNET_WHOLE = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
              "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}
UNET_RESNET = [("in_layers.0", "norm1"), ("in_layers.2", "conv1"), ("out_layers.0", "norm2"),
               ("out_layers.3", "conv2"), ("emb_layers.1", "time_emb_proj"), ("skip_connection", "conv_shortcut")]


def unet_to_ldm(state):
    out = {}
    for key, value in state.items():
        head, _, leaf = key.rpartition(".")
        name = f"{UNET_WHOLE[head]}.{leaf}" if head in UNET_WHOLE else key
        if "resnets" in name:
            for ldm, hf in UNET_RESNET:
                name = name.replace(hf, ldm)
        for ldm, hf in _unet_layer_map():
            name = name.replace(hf, ldm)
        out["model.diffusion_model." + name] = value
    return out


def _vae_map():
    pairs = [("nin_shortcut", "conv_shortcut"), ("norm_out", "conv_norm_out"),
             ("mid.attn_1.", "mid_block.attentions.0.")]
    for i in range(4):
        pairs += [(f"encoder.down.{i}.block.{j}.", f"encoder.down_blocks.{i}.resnets.{j}.") for j in range(2)]
        if i < 3:
            pairs.append((f"down.{i}.downsample.", f"down_blocks.{i}.downsamplers.0."))
            pairs.append((f"up.{3 - i}.upsample.", f"up_blocks.{i}.upsamplers.0."))
        pairs += [(f"decoder.up.{3 - i}.block.{j}.", f"decoder.up_blocks.{i}.resnets.{j}.") for j in range(3)]
    pairs += [(f"mid.block_{i + 1}.", f"mid_block.resnets.{i}.") for i in range(2)]
    return pairs


VAE_ATTN = [("norm.", "group_norm."), ("q.", "to_q."), ("k.", "to_k."), ("v.", "to_v."), ("proj_out.", "to_out.0.")]


def vae_to_ldm(state):
    out = {}
    for key, value in state.items():
        name = key
        for ldm, hf in _vae_map():
            name = name.replace(hf, ldm)
        if "attentions" in key:
            for ldm, hf in VAE_ATTN:
                name = name.replace(hf, ldm)
            if value.ndim == 2:  # LDM's VAE attention projections are 1x1 convolutions
                value = value[:, :, None, None]
        out["first_stage_model." + name] = value
    return out


def pipeline_to_ldm(pipe) -> dict:
    """{LDM key: tensor} of the pipeline's UNet, VAE and CLIP text encoder, ready for safetensors' save_file."""
    state = unet_to_ldm(pipe.unet.state_dict())
    state.update(vae_to_ldm(pipe.vae.state_dict()))
    text = pipe.text_encoder.state_dict()  # transformers >= 5.6 flattened CLIPTextModel (no text_model.)
    state.update({"cond_stage_model.transformer." + ("" if k.startswith("text_model.") else "text_model.") + k: v
                  for k, v in text.items()})
    return {k: v.contiguous() for k, v in state.items()}
