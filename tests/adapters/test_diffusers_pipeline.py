"""Real diffusers pipelines (StableDiffusion and ControlNet) built from tiny seeded components.

No weights are downloaded: the text encoder, VAE, UNet and ControlNet are seeded random models and
the CLIP tokenizer is given a character-level vocabulary written by the test.
"""
from __future__ import annotations

import json
import string

import numpy as np
import pytest
import torch

import tome_core
from tome_bench.models import build_unet

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")


def _tokenizer(tmp_path_factory):
    folder = tmp_path_factory.mktemp("clip_tokenizer")
    symbols = list(string.ascii_lowercase + string.digits)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for s in symbols + [s + "</w>" for s in symbols]:
        vocab[s] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"), pad_token="<|endoftext|>",
                                   model_max_length=77)


@pytest.fixture(scope="module")
def components(tmp_path_factory):
    tokenizer = _tokenizer(tmp_path_factory)
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2,
        vocab_size=len(tokenizer), max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    )).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
    ).eval()
    unet = build_unet("sd15", "tiny", seed=0)
    return dict(vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet,
                scheduler=diffusers.DDIMScheduler(clip_sample=False, steps_offset=1), safety_checker=None, feature_extractor=None,
                requires_safety_checker=False)


def _generate(pipe, **extra) -> np.ndarray:
    return pipe("a cat on a mat", num_inference_steps=2, height=256, width=256, guidance_scale=7.5,
                output_type="np", generator=torch.Generator().manual_seed(0), **extra).images


def test_stable_diffusion_pipeline(components):
    pipe = diffusers.StableDiffusionPipeline(**components)
    pipe.set_progress_bar_config(disable=True)
    vanilla = _generate(pipe)
    tome_core.apply_patch(pipe, ratio=0.5)  # exactly as with tomesd.apply_patch(pipe, ratio=0.5)
    assert tome_core.is_patched(pipe.unet)
    patched, again = _generate(pipe), _generate(pipe)
    tome_core.remove_patch(pipe)
    assert not tome_core.is_patched(pipe.unet)
    assert np.isfinite(patched).all() and patched.shape == vanilla.shape == (1, 256, 256, 3)
    assert np.array_equal(patched, again)  # same seed, same image
    assert not np.array_equal(patched, vanilla)
    assert np.array_equal(_generate(pipe), vanilla)


def test_controlnet_pipeline_patches_unet_and_controlnet(components):
    torch.manual_seed(1)
    controlnet = diffusers.ControlNetModel.from_unet(components["unet"]).eval()
    with torch.no_grad():  # ControlNet's zero convolutions would hide any effect of merging
        for conv in list(controlnet.controlnet_down_blocks) + [controlnet.controlnet_mid_block]:
            conv.weight.normal_(0, 0.05)
    pipe = diffusers.StableDiffusionControlNetPipeline(controlnet=controlnet, **components)
    pipe.set_progress_bar_config(disable=True)
    hint = torch.rand(1, 3, 256, 256, generator=torch.Generator().manual_seed(3))
    vanilla = _generate(pipe, image=hint)

    tome_core.apply_patch(pipe, ratio=0.5)
    assert tome_core.is_patched(pipe.unet) and tome_core.is_patched(pipe.controlnet)
    assert pipe.controlnet._tome_core.num_blocks == 7  # 2 layers x 3 attention levels of the down path + mid
    patched = _generate(pipe, image=hint)
    tome_core.remove_patch(pipe)

    assert not tome_core.is_patched(pipe.controlnet) and not tome_core.is_patched(pipe.unet)
    assert np.isfinite(patched).all() and not np.array_equal(patched, vanilla)
    assert np.array_equal(_generate(pipe, image=hint), vanilla)
