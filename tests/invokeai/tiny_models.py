"""Tiny seeded models for the InvokeAI tests, written once into a cache folder (nothing is downloaded).

SD1.5: a single-file checkpoint in the LDM key layout (what users drop into InvokeAI), built from a tiny diffusers
``StableDiffusionPipeline`` and converted with tests/sd15_single_file.py. InvokeAI probes it as sd-1 / main /
checkpoint from ``model.diffusion_model.input_blocks.2.1.transformer_blocks.0.attn2.to_k.weight`` (its last
dimension must be 768, so the cross-attention and the CLIP text encoder stay 768 wide) and
``input_blocks.0.0.weight`` (4 input channels: normal variant). Everything else is small: UNet channels
(32, 64, 64, 64) on SD1.5's four levels and two layers per block (the LDM block numbering InvokeAI and diffusers
expect), a 2-layer CLIP text encoder over a character-level vocabulary, an 8-channel VAE.

Loading the checkpoint, InvokeAI calls diffusers' ``StableDiffusionPipeline.from_single_file(path)``, which
finds no config for it and fetches the configs of the Hub repo diffusers maps SD1.5 to
(``DIFFUSERS_DEFAULT_PIPELINE_PATHS["v1"]`` = ``stable-diffusion-v1-5/stable-diffusion-v1-5`` in diffusers 0.40)
with ``snapshot_download(allow_patterns=["**/*.json", "*.json", "*.txt", "**/*.txt", "**/*.model"])``. Offline
(``HF_HUB_OFFLINE=1``) it reads them from the HF cache, so ``write_hf_config_cache`` writes that repo into
``$HF_HOME/hub`` in the Hub cache layout (refs/main -> snapshots/<commit>/...) holding the tiny pipeline's
config jsons and tokenizer files only: the configs describe the tiny model, the weights come from the checkpoint.
"""
from __future__ import annotations

import json
import shutil
import string
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))
SD15_REPO_ID = "stable-diffusion-v1-5/stable-diffusion-v1-5"  # diffusers 0.40 DIFFUSERS_DEFAULT_PIPELINE_PATHS["v1"]
FAKE_COMMIT = "0" * 39 + "1"
SD15_CHECKPOINT = "tiny_sd15_invoke_v1.safetensors"  # bump the name when build_tiny_sd15 changes


def _seed_all(module, seed: int) -> None:
    """Every float tensor seeded: weights ~ N(0, 1/fan_in), norm scales 1, biases 0 (zero-initialised output
    layers of diffusers get random weights too, so the UNet's output and ToMe's effect on it show)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in sorted(module.state_dict(keep_vars=True).items()):
            if not tensor.is_floating_point():
                continue
            if tensor.dim() >= 2:
                tensor.copy_(torch.randn(tensor.shape, generator=generator) / tensor[0].numel() ** 0.5)
            elif name.endswith("weight"):
                tensor.fill_(1.0)
            else:
                tensor.zero_()


def write_tokenizer(folder: Path):
    """A CLIP tokenizer with a character-level vocabulary (no merges), model_max_length 77."""
    import transformers

    folder.mkdir(parents=True, exist_ok=True)
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    symbols = list(string.ascii_lowercase + string.digits)
    for s in symbols + [s + "</w>" for s in symbols]:
        vocab[s] = len(vocab)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(folder / "vocab.json"), str(folder / "merges.txt"),
                                           pad_token="<|endoftext|>", model_max_length=77)
    return tokenizer


def build_tiny_sd15(seed: int = 0):
    """The tiny seeded ``StableDiffusionPipeline`` (PNDM scheduler with SD1.5's settings, no safety checker)."""
    import torchvision_guard

    torchvision_guard.install()
    import diffusers
    import tempfile
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        tokenizer = write_tokenizer(Path(tmp))
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=768, intermediate_size=64, num_attention_heads=12, num_hidden_layers=2,
        vocab_size=len(tokenizer), max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
        pad_token_id=1)).eval()
    unet = diffusers.UNet2DConditionModel(
        sample_size=8, in_channels=4, out_channels=4, layers_per_block=2, norm_num_groups=8,
        block_out_channels=(32, 64, 64, 64), cross_attention_dim=768, attention_head_dim=4,
        down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
        up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4, latent_channels=4, layers_per_block=2,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4).eval()
    for offset, module in enumerate((unet, vae, text_encoder)):
        _seed_all(module, seed + offset)
    with torch.no_grad():  # a gentler VAE decoder, so images are not saturated noise
        vae.decoder.conv_out.weight.mul_(0.3)
    scheduler = diffusers.PNDMScheduler(beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                                        num_train_timesteps=1000, skip_prk_steps=True, steps_offset=1,
                                        set_alpha_to_one=False)
    return diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=scheduler,
        safety_checker=None, feature_extractor=None, requires_safety_checker=False)


def write_tiny_sd15(cache: Path, seed: int = 0) -> tuple:
    """(checkpoint path, HF_HOME) under ``cache``: the single-file checkpoint and the offline config cache
    of ``SD15_REPO_ID`` (see the module docstring); built once, reused while the files exist."""
    import safetensors.torch

    cache = Path(cache)
    checkpoint = cache / SD15_CHECKPOINT
    hf_home = cache / "hf_home"
    snapshot = hf_home / "hub" / ("models--" + SD15_REPO_ID.replace("/", "--")) / "snapshots" / FAKE_COMMIT
    if checkpoint.is_file() and (snapshot / "model_index.json").is_file():
        return checkpoint, hf_home
    if str(TESTS) not in sys.path:
        sys.path.insert(0, str(TESTS))
    from sd15_single_file import pipeline_to_ldm

    pipe = build_tiny_sd15(seed)
    staging = cache / "tiny_sd15_diffusers.partial"
    shutil.rmtree(staging, ignore_errors=True)
    pipe.save_pretrained(staging)
    if snapshot.exists():
        shutil.rmtree(snapshot)
    for path in sorted(staging.rglob("*")):
        if path.is_file() and path.suffix in (".json", ".txt", ".model"):
            target = snapshot / path.relative_to(staging)
            target.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(path, target)
    refs = snapshot.parents[1] / "refs"
    refs.mkdir(parents=True, exist_ok=True)
    (refs / "main").write_text(FAKE_COMMIT)
    shutil.rmtree(staging, ignore_errors=True)
    state = {key: value.float().contiguous() for key, value in pipeline_to_ldm(pipe).items()}
    tmp = checkpoint.with_suffix(".partial")
    safetensors.torch.save_file(state, str(tmp))
    tmp.replace(checkpoint)
    return checkpoint, hf_home


# ---------------------------------------------------------------- transformer families (diffusers folders)
#
# Each family below is a diffusers pipeline folder (``save_pretrained``: model_index.json and one subfolder per
# submodel, tokenizers included), which InvokeAI's model manager probes offline from the folder alone
# (``configs/main.py``: the pipeline's ``_class_name``) and loads submodel by submodel with ``from_pretrained``
# (``load/model_loaders``). Weights are seeded random (``_seed_all``); the tokenizers are tiny, character-level,
# written here (no download).

SD3_FOLDER = "tiny_sd3_invoke_v1"  # bump the name when build_tiny_sd3 changes
FLUX2_KLEIN_FOLDER = "tiny_flux2_klein_invoke_v1"
Z_IMAGE_FOLDER = "tiny_z_image_invoke_v1"
QWEN_IMAGE_FOLDER = "tiny_qwen_image_invoke_v1"


def _t5_tokenizer():
    """A T5 tokenizer (transformers 5: the tokenizers-backed Unigram one) over a character-level vocabulary."""
    import transformers

    chars = string.ascii_lowercase + string.digits
    vocab = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    vocab += [("\u2581" + c, -3.0) for c in chars] + [(c, -4.0) for c in chars]
    return transformers.T5Tokenizer(vocab=vocab, extra_ids=0, model_max_length=512)


def _save_pipeline(pipe, folder: Path) -> Path:
    """``pipe.save_pretrained`` into ``folder`` through a staging folder (a half-written model never counts)."""
    staging = folder.with_name(folder.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    pipe.save_pretrained(staging, safe_serialization=True)
    if folder.exists():
        shutil.rmtree(folder)
    staging.replace(folder)
    return folder


def build_tiny_sd3(seed: int = 0):
    """A tiny seeded ``StableDiffusion3Pipeline``: a 2-block SD3 MMDiT (4 heads of 8, patch 2, 16 latent channels),
    two 1-layer CLIPs with projection (32 wide each, so CLIP-L + CLIP-G pad into the 64 joint width), a 1-layer T5
    (64 = ``joint_attention_dim``), an 8-channel VAE that downsamples by 8 into 16 channels."""
    import torchvision_guard

    torchvision_guard.install()
    import diffusers
    import tempfile
    import torch
    import transformers

    with tempfile.TemporaryDirectory() as tmp:
        clip_tokenizer = write_tokenizer(Path(tmp) / "l")
        clip_tokenizer_2 = write_tokenizer(Path(tmp) / "g")
    t5_tokenizer = _t5_tokenizer()

    def clip(seed_offset):
        return transformers.CLIPTextModelWithProjection(transformers.CLIPTextConfig(
            hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=1, projection_dim=32,
            vocab_size=len(clip_tokenizer), max_position_embeddings=77, bos_token_id=0, eos_token_id=1,
            pad_token_id=1)).eval()

    text_encoder, text_encoder_2 = clip(0), clip(1)
    text_encoder_3 = transformers.T5EncoderModel(transformers.T5Config(
        vocab_size=len(t5_tokenizer), d_model=64, d_kv=8, d_ff=64, num_layers=1, num_heads=2,
        relative_attention_num_buckets=8, pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)).eval()
    transformer = diffusers.SD3Transformer2DModel(
        sample_size=16, patch_size=2, in_channels=16, num_layers=2, attention_head_dim=8, num_attention_heads=4,
        joint_attention_dim=64, caption_projection_dim=32, pooled_projection_dim=64, out_channels=16,
        pos_embed_max_size=32).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4, latent_channels=16, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        scaling_factor=1.5305, shift_factor=0.0609, use_quant_conv=False, use_post_quant_conv=False).eval()
    for offset, module in enumerate((transformer, vae, text_encoder, text_encoder_2, text_encoder_3)):
        _seed_all(module, seed + 10 + offset)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.3)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.StableDiffusion3Pipeline(
        transformer=transformer, scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=clip_tokenizer,
        text_encoder_2=text_encoder_2, tokenizer_2=clip_tokenizer_2, text_encoder_3=text_encoder_3,
        tokenizer_3=t5_tokenizer)


def write_tiny_sd3(cache: Path, seed: int = 0) -> Path:
    """The tiny SD3 diffusers folder under ``cache`` (built once)."""
    folder = Path(cache) / SD3_FOLDER
    if (folder / "model_index.json").is_file():
        return folder
    return _save_pipeline(build_tiny_sd3(seed), folder)


QWEN_CHAT_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message['role'] }}\n{{ message['content'] }}"
                      "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def _qwen_tokenizer():
    """A Qwen2 tokenizer (byte-level BPE, no merges: one token per byte) with Qwen's chat markers and a ChatML
    chat template (InvokeAI's Qwen3 encoders call ``apply_chat_template``)."""
    import transformers
    from tokenizers.pre_tokenizers import ByteLevel

    vocab = {"<|endoftext|>": 0, "<|im_start|>": 1, "<|im_end|>": 2}
    for char in sorted(ByteLevel.alphabet()):  # the 256 byte-level symbols
        vocab.setdefault(char, len(vocab))
    tokenizer = transformers.Qwen2Tokenizer(vocab=vocab, merges=[], chat_template=QWEN_CHAT_TEMPLATE,
                                            model_max_length=1024)
    tokenizer.add_tokens([transformers.AddedToken(marker, special=True) for marker in ("<|im_start|>", "<|im_end|>")])
    return tokenizer


def _qwen3(tokenizer, hidden: int = 32, layers: int = 2):
    """A tiny Qwen3 causal LM (InvokeAI's Klein / Z-Image text encoders read its hidden states)."""
    import transformers

    return transformers.Qwen3ForCausalLM(transformers.Qwen3Config(
        vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
        num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=1024,
        tie_word_embeddings=True, pad_token_id=0, eos_token_id=2)).eval()


def build_tiny_flux2_klein(seed: int = 0):
    """A tiny seeded ``Flux2KleinPipeline``: a FLUX.2 transformer with 1 double and 2 single blocks (2 heads of 16,
    RoPE axes 4x4), a 2-layer Qwen3 (32 wide: joint width 3 x 32, which InvokeAI's prober reads as Klein 4B, its
    fallback for an unknown width), a 32-channel ``AutoencoderKLFlux2`` (8 wide, downsampling 8, BN over its 128
    patchified channels with unit running variance)."""
    import torchvision_guard

    torchvision_guard.install()
    import diffusers
    import torch

    tokenizer = _qwen_tokenizer()
    text_encoder = _qwen3(tokenizer)
    transformer = diffusers.Flux2Transformer2DModel(
        patch_size=1, in_channels=128, num_layers=1, num_single_layers=2, attention_head_dim=16,
        num_attention_heads=2, joint_attention_dim=3 * 32, timestep_guidance_channels=32, mlp_ratio=2.0,
        axes_dims_rope=(4, 4, 4, 4), guidance_embeds=False).eval()
    vae = diffusers.AutoencoderKLFlux2(
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4, latent_channels=32, layers_per_block=1,
        mid_block_add_attention=False).eval()
    for offset, module in enumerate((transformer, vae, text_encoder)):
        _seed_all(module, seed + 20 + offset)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.3)
        vae.bn.running_var.fill_(1.0)  # _seed_all zeroes it: the latents would be scaled by 1/sqrt(eps)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0, use_dynamic_shifting=True)
    return diffusers.Flux2KleinPipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder,
                                        tokenizer=tokenizer, transformer=transformer, is_distilled=True)


def write_tiny_flux2_klein(cache: Path, seed: int = 0) -> Path:
    """The tiny FLUX.2 Klein diffusers folder under ``cache`` (built once)."""
    folder = Path(cache) / FLUX2_KLEIN_FOLDER
    if (folder / "model_index.json").is_file():
        return folder
    return _save_pipeline(build_tiny_flux2_klein(seed), folder)


def build_tiny_z_image(seed: int = 0):
    """A tiny seeded ``ZImagePipeline`` (Turbo: scheduler shift 3): a Z-Image transformer 32 wide (2 heads of 16,
    RoPE axes 4/6/6, 2 main blocks and 1 refiner block each for the image and the caption), a 2-layer Qwen3 (32
    wide = the caption feature width) with the chat-template tokenizer, a 16-channel VAE downsampling by 8."""
    import torchvision_guard

    torchvision_guard.install()
    import diffusers
    import torch

    tokenizer = _qwen_tokenizer()
    text_encoder = _qwen3(tokenizer)
    transformer = diffusers.ZImageTransformer2DModel(
        all_patch_size=(2,), all_f_patch_size=(1,), in_channels=16, dim=32, n_layers=2, n_refiner_layers=1,
        n_heads=2, n_kv_heads=2, cap_feat_dim=32, axes_dims=[4, 6, 6], axes_lens=[1024, 128, 128]).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4, latent_channels=16, layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        scaling_factor=0.3611, shift_factor=0.1159, use_quant_conv=False, use_post_quant_conv=False).eval()
    for offset, module in enumerate((transformer, vae, text_encoder)):
        _seed_all(module, seed + 30 + offset)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.3)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(shift=3.0)
    return diffusers.ZImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                    transformer=transformer)


def write_tiny_z_image(cache: Path, seed: int = 0) -> Path:
    """The tiny Z-Image diffusers folder under ``cache`` (built once)."""
    folder = Path(cache) / Z_IMAGE_FOLDER
    if (folder / "model_index.json").is_file():
        return folder
    return _save_pipeline(build_tiny_z_image(seed), folder)



def build_tiny_qwen_image(seed: int = 0):
    """A tiny seeded ``QwenImagePipeline``: a 2-block Qwen-Image MMDiT (2 heads of 16, RoPE axes 4/6/6, 64 packed
    channels = 16 latent channels x 2x2), a 2-layer Qwen2.5-VL (32 wide text model with M-RoPE sections 2/3/3, a
    1-block vision tower; its tokenizer knows the vision markers Qwen2_5_VLProcessor looks up), a Qwen-Image VAE
    (8 wide, downsampling 8 into 16 channels)."""
    import torchvision_guard

    torchvision_guard.install()
    import diffusers
    import torch
    import transformers

    tokenizer = _qwen_tokenizer()
    markers = ("<|vision_start|>", "<|vision_end|>", "<|image_pad|>", "<|video_pad|>")
    tokenizer.add_tokens([transformers.AddedToken(marker, special=True) for marker in markers])
    ids = {marker: tokenizer.convert_tokens_to_ids(marker) for marker in markers}
    text_encoder = transformers.Qwen2_5_VLForConditionalGeneration(transformers.Qwen2_5_VLConfig(
        text_config=dict(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                         tie_word_embeddings=True),
        vision_config=dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=32,
                           patch_size=14, spatial_merge_size=2, temporal_patch_size=2, fullatt_block_indexes=[0]),
        image_token_id=ids["<|image_pad|>"], video_token_id=ids["<|video_pad|>"],
        vision_start_token_id=ids["<|vision_start|>"], tie_word_embeddings=True)).eval()
    transformer = diffusers.QwenImageTransformer2DModel(
        patch_size=2, in_channels=64, out_channels=16, num_layers=2, attention_head_dim=16, num_attention_heads=2,
        joint_attention_dim=32, axes_dims_rope=(4, 6, 6)).eval()
    vae = diffusers.AutoencoderKLQwenImage(base_dim=8, z_dim=16, dim_mult=[1, 2, 2, 2], num_res_blocks=1).eval()
    for offset, module in enumerate((transformer, vae, text_encoder)):
        _seed_all(module, seed + 40 + offset)
    with torch.no_grad():
        vae.decoder.conv_out.weight.mul_(0.3)
    scheduler = diffusers.FlowMatchEulerDiscreteScheduler(
        shift=1.0, use_dynamic_shifting=True, base_shift=0.5, max_shift=0.9, base_image_seq_len=256,
        max_image_seq_len=8192, shift_terminal=0.02, time_shift_type="exponential")
    return diffusers.QwenImagePipeline(scheduler=scheduler, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                       transformer=transformer)


def write_tiny_qwen_image(cache: Path, seed: int = 0) -> Path:
    """The tiny Qwen-Image diffusers folder under ``cache`` (built once)."""
    folder = Path(cache) / QWEN_IMAGE_FOLDER
    if (folder / "model_index.json").is_file():
        return folder
    return _save_pipeline(build_tiny_qwen_image(seed), folder)
