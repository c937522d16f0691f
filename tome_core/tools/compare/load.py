"""Loading the user's diffusers pipeline for ``python -m tome_core compare``: a local folder or a single file.

diffusers is imported on use (by the caller's ``load_pipeline`` call), so ``import tome_core`` never needs it.
"""
from __future__ import annotations

import inspect
import json
from pathlib import Path
from typing import Any, Dict, Optional

import torch


class CompareError(Exception):
    """A request the command cannot run; ``python -m tome_core compare`` prints it and exits with status 2."""


def _no_safety_checker(pipeline_class: Any) -> Dict[str, Any]:
    """A safety checker, where the pipeline has one, is not loaded: an image it blacked out would make the
    comparison meaningless."""
    return {"safety_checker": None} if "safety_checker" in inspect.signature(pipeline_class).parameters else {}


def checkpoint_keys(path: Path) -> list:
    """The tensor names of a .safetensors file (its header only is read)."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            return list(f.keys())
    except (SafetensorError, OSError) as e:
        raise CompareError(f"{path}: not a readable .safetensors checkpoint ({e})") from None


def single_file_class(diffusers: Any, keys: list, config: Optional[str]) -> Any:
    """The pipeline class of a single-file checkpoint: the --config folder's, else SDXL's when the file holds
    SDXL's second text encoder, else Stable Diffusion's (SD1.x/2.x)."""
    if config is not None:
        index = Path(config) / "model_index.json"
        if not index.is_file():
            raise CompareError(f"--config {config}: a diffusers pipeline folder with a model_index.json expected")
        name = json.loads(index.read_text(encoding="utf-8"))["_class_name"]
        if not hasattr(getattr(diffusers, name, None), "from_single_file"):
            raise CompareError(f"--config {config}: {name} cannot load a single-file checkpoint")
        return getattr(diffusers, name)
    sdxl = any(key.startswith("conditioner.embedders.1.") for key in keys)
    return diffusers.StableDiffusionXLPipeline if sdxl else diffusers.StableDiffusionPipeline


def load_pipeline(model: str, device: torch.device, dtype: torch.dtype, config: Optional[str] = None) -> Any:
    """A diffusers pipeline from a local folder (``save_pretrained``'s layout; nothing downloaded) or a
    single-file ``.safetensors`` checkpoint (``from_single_file``, its configs from the ``config`` folder, or
    else diffusers' lookup of that model type's configs in the Hugging Face cache)."""
    try:
        import diffusers
    except ImportError as e:
        raise CompareError(f"the compare command renders with diffusers, which does not import here ({e}); "
                           "pip install diffusers transformers") from None

    path = Path(model)
    if config is not None and not path.is_file():
        raise CompareError(f"--config is for a single-file checkpoint; {model} is not a file")
    if path.is_file() and path.suffix == ".safetensors":
        from diffusers.loaders.single_file_utils import SingleFileComponentError

        cls = single_file_class(diffusers, checkpoint_keys(path), config)
        try:
            pipe = cls.from_single_file(str(path), config=config, local_files_only=True, torch_dtype=dtype,
                                        **_no_safety_checker(cls))
        except (OSError, ValueError, SingleFileComponentError) as e:  # no configs for it, a component missing
            raise CompareError(f"{model}: diffusers could not load it as a {cls.__name__} ({e}); "
                               "--config DIR names a diffusers folder of the same model type") from None
    elif (path / "model_index.json").is_file():
        index = json.loads((path / "model_index.json").read_text(encoding="utf-8"))
        extra = {"safety_checker": None} if "safety_checker" in index else {}
        pipe = diffusers.DiffusionPipeline.from_pretrained(str(path), local_files_only=True, dtype=dtype, **extra)
    else:
        raise CompareError(f"{model}: a diffusers pipeline folder (with model_index.json) or a single-file "
                           ".safetensors checkpoint expected")
    pipe.to(device)
    pipe.set_progress_bar_config(disable=True)
    return pipe
