"""``python -m tome_core compare`` end to end on a tiny seeded SD1.5-like pipeline the test writes itself.

The pipeline folder is what ``save_pretrained`` writes: a reduced-channel SD1.5 UNet (tome_bench.models), a
tiny AutoencoderKL and CLIPTextModel with seeded weights, and a CLIP tokenizer with a character-level
vocabulary written here; the single-file checkpoint is the same pipeline in the LDM key layout
(tests/sd15_single_file.py). Nothing is downloaded.
"""
from __future__ import annotations

import json
import math
import string
import sys

import numpy as np
import pytest
import torch

import tome_core
from tome_bench.models import build_unet
from tome_core.__main__ import main as tome_main
from sd15_single_file import pipeline_to_ldm
from tome_core.tools.compare import CompareError, parse_setting
from tome_core.tools.compare.images import cell_size, psnr, ssim

diffusers = pytest.importorskip("diffusers")
transformers = pytest.importorskip("transformers")
PIL_Image = pytest.importorskip("PIL.Image")
safetensors_torch = pytest.importorskip("safetensors.torch")

PROMPTS = ("a red fox in the snow", "a lighthouse at dusk")


@pytest.fixture(scope="module")
def pipeline(tmp_path_factory):
    """(the folder, the pipeline it holds)."""
    root = tmp_path_factory.mktemp("compare")
    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    symbols = list(string.ascii_lowercase + string.digits)
    for s in symbols + [s + "</w>" for s in symbols]:
        vocab[s] = len(vocab)
    (root / "vocab.json").write_text(json.dumps(vocab))
    (root / "merges.txt").write_text("#version: 0.2\n")
    tokenizer = transformers.CLIPTokenizer(str(root / "vocab.json"), str(root / "merges.txt"),
                                           pad_token="<|endoftext|>", model_max_length=77)
    torch.manual_seed(0)
    text_encoder = transformers.CLIPTextModel(transformers.CLIPTextConfig(
        hidden_size=32, intermediate_size=37, num_attention_heads=4, num_hidden_layers=2, vocab_size=len(tokenizer),
        max_position_embeddings=77, bos_token_id=0, eos_token_id=1, pad_token_id=1)).eval()
    vae = diffusers.AutoencoderKL(
        block_out_channels=(8, 8, 8, 8), norm_num_groups=4, latent_channels=4,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4).eval()
    pipe = diffusers.StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=build_unet("sd15", "tiny", seed=0),
        scheduler=diffusers.DDIMScheduler(clip_sample=False, steps_offset=1), safety_checker=None,
        feature_extractor=None, requires_safety_checker=False)
    folder = root / "tiny_sd15"
    pipe.set_progress_bar_config(disable=True)
    pipe.save_pretrained(folder)
    return folder, pipe


def _args(folder, out, *settings, extra=()):
    argv = ["compare", str(folder), "--steps", "2", "--width", "64", "--height", "64", "--seed", "7",
            "--device", "cpu", "--out", str(out), *extra]
    for s in settings:
        argv += ["--settings", s]
    return argv


@pytest.fixture(scope="module")
def compared(pipeline, tmp_path_factory):
    out = tmp_path_factory.mktemp("compare_out")
    prompts_file = out / "prompts.txt"
    prompts_file.write_text(f"\n{PROMPTS[1]}\n\n")
    argv = _args(pipeline[0], out, "ratio=0", "ratio=0.5",
                 extra=["--prompt", PROMPTS[0], "--prompts", str(prompts_file)])
    assert tome_main(argv) == 0
    return out, json.loads((out / "compare.json").read_text())


def test_the_grid_has_plain_beside_each_setting_for_each_prompt(compared, pipeline):
    out, _ = compared
    image = np.asarray(PIL_Image.open(out / "compare.png").convert("RGB"))
    cw, ch = cell_size(64, 64)
    assert image.shape == (2 * ch, 3 * cw, 3)
    # the first cell is the plain image the pipeline renders from that seed, as it renders it
    plain = pipeline[1](PROMPTS[0], num_inference_steps=2, height=64, width=64, output_type="np",
                 generator=torch.Generator().manual_seed(7)).images[0]
    left = (cw - 64) // 2
    assert np.array_equal(image[:64, left:left + 64], (plain * 255).round().astype(np.uint8))
    assert image[:64, cw + left:cw + left + 64].std() > 1.0  # an image in every column, not a blank


def test_the_json_has_every_prompt_and_setting(compared):
    _, doc = compared
    assert doc["prompts"] == list(PROMPTS) and doc["steps"] == 2 and doc["width"] == doc["height"] == 64
    assert [s["setting"] for s in doc["settings"]] == ["plain", "ratio=0.0", "ratio=0.5"]
    assert [(row["prompt_index"], row["setting"]) for row in doc["images"]] == [
        (i, s) for s in ("plain", "ratio=0.0", "ratio=0.5") for i in (0, 1)]
    assert all(math.isfinite(row["seconds"]) and row["seconds"] > 0 for row in doc["images"])
    assert doc["device"] == "cpu" and doc["dtype"] == "float32"
    assert doc["torch"] == torch.__version__ and doc["diffusers"] == diffusers.__version__
    assert doc["tome_core"] == tome_core.__version__ and "commit" in doc


def test_ratio_zero_is_identical_and_ratio_half_is_not(compared):
    _, doc = compared
    rows = {(row["setting"], row["prompt_index"]): row for row in doc["images"]}
    for i in (0, 1):
        zero, half = rows["ratio=0.0", i], rows["ratio=0.5", i]
        assert zero["identical"] is True and zero["psnr_db"] is None and zero["ssim"] == 1.0
        assert half["identical"] is False and math.isfinite(half["psnr_db"]) and 0 < half["ssim"] < 1.0
    summary = {s["setting"]: s for s in doc["settings"]}
    assert summary["ratio=0.5"]["description"].startswith("ToMe merge r=0.5 on UNet levels 1")  # tome_core.describe
    assert summary["ratio=0.0"]["psnr_db"] is None and math.isfinite(summary["ratio=0.5"]["psnr_db"])


@pytest.mark.parametrize("setting, message", [
    ("ratoi=0.5", "--settings 'ratoi=0.5': unknown key 'ratoi'; choose from: ratio, max_downsample"),
    ("ratio=half", "--settings 'ratio=half': ratio must be a float, got 'half'"),
    ("ratio=0.5,ratio=0.3", "'ratio' is given twice"),
    ("ratio", "'ratio' is not key=value"),
    ("ratio=0.95", "--settings 'ratio=0.95': ToMe: ratio 0.95 is above the mergeable fraction"),  # the engine's check
    ("ratio=0.5,mode=fast", "ToMe: mode must be one of ('merge', 'kv'), got 'fast'"),
])
def test_a_bad_setting_stops_before_anything_is_rendered(pipeline, tmp_path, capsys, setting, message):
    out = tmp_path / "out"
    assert tome_main(_args(pipeline[0], out, "ratio=0.5", setting, extra=["--prompt", "a cat"])) == 2
    err = capsys.readouterr().err
    assert "python -m tome_core compare: error: " in err and message in err, err
    assert not out.exists()


def test_a_single_file_checkpoint_renders_as_its_pipeline_folder(compared, pipeline, tmp_path):
    """The tiny pipeline written as one LDM-layout .safetensors (what a WebUI or ComfyUI holds), its configs from
    the folder (--config): the grid's images equal the folder run's."""
    checkpoint = tmp_path / "tiny_sd15.safetensors"
    safetensors_torch.save_file(pipeline_to_ldm(pipeline[1]), str(checkpoint))
    out = tmp_path / "out"
    argv = _args(checkpoint, out, "ratio=0.5", extra=["--prompt", PROMPTS[0], "--config", str(pipeline[0]),
                                                      "--warmup", "0"])
    assert tome_main(argv) == 0
    doc = json.loads((out / "compare.json").read_text())
    assert doc["pipeline"] == "StableDiffusionPipeline" and doc["config"] == str(pipeline[0].resolve())
    single = np.asarray(PIL_Image.open(out / "compare.png").convert("RGB"))
    folder = np.asarray(PIL_Image.open(compared[0] / "compare.png").convert("RGB"))
    cw, _ = cell_size(64, 64)
    left = (cw - 64) // 2
    # plain, ratio=0.5: the same images up to float rounding (single-threaded, the converted weights' other layout
    # takes other GEMM kernels at merged token counts: one pixel one level apart was seen)
    for column, folder_column in ((0, 0), (1, 2)):
        a = single[:64, column * cw + left:][:, :64].astype(int)
        b = folder[:64, folder_column * cw + left:][:, :64].astype(int)
        assert np.abs(a - b).max() <= 1 and (a != b).mean() < 1e-3, (column, np.abs(a - b).max(), (a != b).sum())


def test_what_is_not_a_pipeline_or_a_prompt_is_refused(pipeline, tmp_path, capsys):
    (tmp_path / "model.ckpt").write_bytes(b"")
    (tmp_path / "broken.safetensors").write_bytes(b"not a header")
    cases = {
        tmp_path / "model.ckpt": "a diffusers pipeline folder (with model_index.json) or a single-file .safetensors "
                                 "checkpoint expected",
        tmp_path / "broken.safetensors": "broken.safetensors: not a readable .safetensors checkpoint",
    }
    for model, message in cases.items():
        assert tome_main(_args(model, tmp_path / "o", "ratio=0.5", extra=["--prompt", "x"])) == 2
        assert message in capsys.readouterr().err
    assert tome_main(_args(pipeline[0], tmp_path / "o", "ratio=0.5", extra=["--prompt", "x", "--config", "."])) == 2
    assert "--config is for a single-file checkpoint" in capsys.readouterr().err
    assert tome_main(_args(tmp_path, tmp_path / "o", "ratio=0.5")) == 2
    assert "no prompt: give --prompt TEXT" in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_without_diffusers_the_command_says_what_to_install(monkeypatch, tmp_path, capsys):
    monkeypatch.setitem(sys.modules, "diffusers", None)  # import diffusers raises ImportError
    assert tome_main(_args(tmp_path, tmp_path / "o", "ratio=0.5", extra=["--prompt", "x"])) == 2
    assert "renders with diffusers, which does not import here" in capsys.readouterr().err


def test_settings_are_typed_as_apply_patch_takes_them():
    assert parse_setting(" ratio=0.3, mode=kv ,use_rand=false,block_start=none,max_downsample=2") == {
        "ratio": 0.3, "mode": "kv", "use_rand": False, "block_start": None, "max_downsample": 2}
    with pytest.raises(CompareError, match="use_rand must be true or false, got 'maybe'"):
        parse_setting("use_rand=maybe")
    with pytest.raises(CompareError, match="max_downsample must be an int, got '1.5'"):
        parse_setting("max_downsample=1.5")


def test_psnr_and_ssim():
    rng = np.random.default_rng(0)
    a = rng.random((40, 50, 3))
    b = np.clip(a + 0.1 * rng.standard_normal(a.shape), 0, 1)
    assert psnr(a, a) == math.inf and ssim(a, a) == 1.0
    assert psnr(a, np.clip(a + 0.1, 0, 1)) > psnr(a, np.clip(a + 0.2, 0, 1))
    assert psnr(np.zeros((16, 16, 3)), np.full((16, 16, 3), 0.1)) == pytest.approx(20.0)
    skimage_metrics = pytest.importorskip("skimage.metrics")
    reference = skimage_metrics.structural_similarity(a, b, channel_axis=2, data_range=1, gaussian_weights=True,
                                                      sigma=1.5, use_sample_covariance=False)
    assert ssim(a, b) == pytest.approx(reference, abs=1e-12) and ssim(a, b) < 0.99


def test_the_compare_json_names_toms_own_commit_never_a_repository_around_a_copy(tmp_path):
    """A copy of tome inside another git repository (ComfyUI's custom_nodes/tome, a WebUI's extensions folder)
    names no commit; its own checkout names its HEAD."""
    import os
    import shutil
    import subprocess

    if shutil.which("git") is None:
        pytest.skip("needs git")
    from pathlib import Path

    env = dict(os.environ, GIT_AUTHOR_NAME="t", GIT_AUTHOR_EMAIL="t@t", GIT_COMMITTER_NAME="t",
               GIT_COMMITTER_EMAIL="t@t")

    def git(cwd, *args):
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True,
                              env=env).stdout.strip()

    repo = Path(tome_core.__file__).resolve().parents[1]
    outer, own = tmp_path / "outer", tmp_path / "own"
    for root in (outer, own):
        root.mkdir()
        git(root, "init", "-q")
    (outer / "other.txt").write_text("another project\n")
    git(outer, "add", "other.txt")
    git(outer, "commit", "-q", "-m", "other")
    ignore = shutil.ignore_patterns("__pycache__")
    for root in (outer / "tome", own):
        shutil.copytree(repo / "tome_core", root / "tome_core", ignore=ignore)
    git(own, "add", "tome_core")
    git(own, "commit", "-q", "-m", "tome")
    code = ("import tome_core.tools.compare.command as command\n"
            "assert command.__file__.startswith(__import__('sys').argv[1]), command.__file__\n"
            "print(command.git_commit())\n")
    seen = {}
    for name, root in (("copy", outer / "tome"), ("own", own)):
        proc = subprocess.run([sys.executable, "-c", code, str(root)], capture_output=True, text=True, timeout=120,
                              cwd=root, env=dict(os.environ, PYTHONPATH=str(root)))
        assert proc.returncode == 0, proc.stderr
        seen[name] = proc.stdout.strip()
    assert seen == {"copy": "None", "own": git(own, "rev-parse", "HEAD")}
