"""DiT families (Flux, SD3, Wan, Z-Image, Qwen-Image, LTX-2) in the benchmark: vanilla vs mode "kv"
through the runner's rounds (:data:`DIT` is their ``family.BenchFamily``; a new DiT family is a
``dit_models`` family plus its entry in :data:`DEFAULT_SIZES`).

The model is the real diffusers architecture at full width with ``cfg.blocks`` blocks of each kind
(``dit_models``; ``--tiny``: the tiny test width), or with ``cfg.depth`` "released" the released model, its weights
made and seeded on the device (``released``; a GPU, or the tiny width). Each size runs the runner's own case: a warm-up
round on peaked attention (errors, memory, kernel), vanilla once more (drift check), here also
timing its share in scaled_dot_product_attention (the ceiling of any kv speed-up is
1/(1-share)), then interleaved timed rounds with paired ratios and noise bands (``stats``). Rows
are the runner's, plus token counts, blocks, attention share and ceiling; Flux is
guidance-distilled and Z-Image-Turbo runs at CFG 1 (batch 1), so their guided error is the output's.
LTX-2's error is its video prediction's (the reduced stream; its audio keeps every key).
"""
from __future__ import annotations

import torch

from tome_core.catalogue.diffusers_lookup import merging_families
from tome_core.catalogue.families import BY_NAME, modes_of

from . import dit_models, measure, released
from .family import Case

DIT_FAMILIES = dit_models.DIT_FAMILIES
VIDEO_FAMILIES = dit_models.VIDEO_FAMILIES
DIT_METHODS = ("vanilla", "kv")  # the default; merge where the family has it (--methods ...,merge)
MERGE_METHODS = ("merge", "merge-plain", "merge-bal", "merge-prop")  # the family's merge attention, then each one
DIT_ALLOWED = DIT_METHODS + MERGE_METHODS
_NOT_FOR_DITS = "DiTs (Flux, SD3, Wan, Z-Image, Qwen-Image, LTX-2) take mode kv, and mode merge where it reaches them"
SKIPPED = {"merge": "not in the DiT default (kv is the reference every family has); it reaches "
                    f"{merging_families()}: --methods vanilla,kv,merge",
           "tomesd": f"patches UNets only; {_NOT_FOR_DITS}"}
# native sizes (width, height) from the catalogue (tome_core/catalogue/families.py): Qwen-Image's 1:1 is 1328 px,
# LTX-2's default 768x512 (frames: --frames)
DEFAULT_SIZES = {name: BY_NAME[name].native_px for name in DIT_FAMILIES}
DEFAULT_BATCH = dit_models.DEFAULT_BATCH  # Flux, Z-Image-Turbo: 1 (no CFG pair); the others [uncond; cond]


def methods_for(name: str) -> tuple[str, ...]:
    """The methods the benchmark runs on DiT family ``name``: vanilla and kv, and merge where the catalogue gives
    its diffusers classes mode merge (the benchmark builds diffusers models)."""
    return DIT_METHODS + (("merge",) if "merge" in modes_of(BY_NAME[name], "diffusers") else ())


def methods_text() -> str:
    """The DiT families' methods, grouped, for help texts: "vanilla, kv, merge (flux, ...); vanilla, kv (sd3)"."""
    groups: dict[tuple[str, ...], list[str]] = {}
    for name in DIT_FAMILIES:
        groups.setdefault(methods_for(name), []).append(name)
    return "; ".join(f"{', '.join(methods)} ({', '.join(names)})" for methods, names in groups.items())


def check_config(cfg, method_names: tuple[str, ...]) -> None:
    """Refuse a DiT run the benchmark cannot do, naming the fix (``cfg``: a ``runner.BenchConfig``)."""
    dits = [f for f in cfg.families if f in DIT_FAMILIES]  # all of them: one kind per run
    bad = [m for m in method_names if m not in DIT_ALLOWED]
    if bad:
        raise ValueError(f"methods: {', '.join(bad)} not available for DiT families ({', '.join(dits)}): "
                         f"{_NOT_FOR_DITS}; use --methods vanilla,kv (their default)")
    unmerged = [f for f in dits if "merge" not in methods_for(f)]
    if any(m.split("@")[0] in MERGE_METHODS for m in method_names) and unmerged:
        raise ValueError(f"methods: merge does not reach {', '.join(unmerged)} yet (mode merge on DiTs: "
                         f"{merging_families()}); run those with --methods vanilla,kv")
    if cfg.blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {cfg.blocks}")
    if cfg.depth not in dit_models.DEPTHS:
        raise ValueError(f"depth must be one of {', '.join(dit_models.DEPTHS)}, got {cfg.depth!r}")
    if cfg.depth == "released" and cfg.scale != "tiny" and torch.device(cfg.device).type == "cpu":
        raise ValueError("depth released builds the released models (" + ", ".join(
            f"{f} {dit_models.RELEASED[f].title}" for f in dits) + ") at full width: that needs a GPU; on the CPU "
            "use --depth blocks --blocks N (the released width, fewer blocks), or --tiny")
    if cfg.frames < 1 or cfg.frames % 4 != 1:
        raise ValueError(f"frames must be 4k + 1 (Wan's VAE keeps 1 + (frames - 1) / 4 latent frames), "
                         f"e.g. 33 or 81, got {cfg.frames}")
    if "ltx2" in cfg.families and cfg.frames % 8 != 1:
        raise ValueError(f"frames must be 8k + 1 for ltx2 (LTX-2's VAE keeps 1 + (frames - 1) / 8 latent "
                         f"frames), e.g. 33 or 121, got {cfg.frames}")
    for w, h in cfg.resolutions or ():
        if w % 16 or h % 16:
            raise ValueError(f"DiT sizes must be multiples of 16 px (latent = px / 8, then 2x2 patches), "
                             f"got {w}x{h}")
        if "ltx2" in cfg.families and (w % 32 or h % 32):
            raise ValueError(f"ltx2 sizes must be multiples of 32 px (LTX-2's latent = px / 32), got {w}x{h}")


def build(family: str, cfg) -> torch.nn.Module:
    """The benchmark's ``family`` DiT on ``cfg.device``: full width (``--tiny``: tiny), ``cfg.blocks`` blocks; or
    with ``cfg.depth`` "released" the released model, its weights made and seeded on the device (``released``)."""
    scale = "tiny" if cfg.scale == "tiny" else "full"
    if cfg.depth == "released":
        return released.build(family, cfg.device, measure.DTYPES[cfg.dtype], cfg.seed, scale)
    model = dit_models.build_dit(family, cfg.blocks, cfg.seed, scale=scale)
    # torch's own Module.to: diffusers' would warn about an empty list of fp32-kept modules
    return torch.nn.Module.to(model, cfg.device, measure.DTYPES[cfg.dtype])


def built_blocks(family: str, cfg) -> str:
    """The blocks a run's model has (``blocks_text``): ``cfg.blocks`` of each kind, or the released model's."""
    blocks = dit_models.RELEASED[family].blocks if cfg.depth == "released" else cfg.blocks
    return blocks_text(family, blocks, cfg.scale)


def blocks_text(family: str, blocks: int, scale: str = "full") -> str:
    """Blocks built, by kind: Flux has double- and single-stream blocks (1:2, as the real 19:38); Z-Image
    its layers, then its noise + caption refiners where the depth has any (``dit_models.refiner_layers``)."""
    if family == "flux":
        return f"{blocks}+{2 * blocks}"
    refiners = dit_models.refiner_layers(blocks, scale) if family == "z_image" else 0
    return f"{blocks}+{refiners}+{refiners}" if refiners else str(blocks)


def _forward(model: torch.nn.Module, inputs: dict) -> torch.Tensor:
    return dit_models.forward(model, inputs).float()


def _attention_probe(share: dict):
    """measure.timed that also records the share of the forward spent in SDPA (CUDA: synchronised)."""
    def probe(fn, device: torch.device):
        sync = device.type == "cuda"
        timer = dit_models.AttentionTimer(sync=sync)
        with timer:
            seconds, out = measure.timed(fn, device)
        share["share"] = min(timer.seconds / seconds, 1.0) if seconds > 0 else None
        return seconds, out
    return probe


def _errors(family: str):
    """measure.errors, except that a distilled model's output is its guided prediction (Flux; Z-Image-Turbo)."""
    def errors(y: torch.Tensor, ref: torch.Tensor, guidance: float) -> tuple[float, float | None]:
        raw, guided = measure.errors(y, ref, guidance)
        return raw, raw if dit_models.distilled(family, y.shape[0]) else guided
    return errors


class DiTFamily:
    """The benchmark's DiTs: vanilla vs mode kv through the runner's rounds (see the module)."""

    kind = "DiT"
    names = DIT_FAMILIES
    methods = DIT_METHODS
    skipped = SKIPPED
    compiles = False
    defaults_in_config = False  # sizes and batch differ by family

    def check(self, cfg, method_names: tuple[str, ...]) -> None:
        check_config(cfg, method_names)

    def default_sizes(self, name: str) -> tuple[tuple[int, int], ...]:
        return (DEFAULT_SIZES[name],)

    def default_batch(self, name: str) -> int:
        return DEFAULT_BATCH.get(name, 2)

    def build(self, name: str, cfg) -> torch.nn.Module:
        return build(name, cfg)

    def case(self, model: torch.nn.Module, name: str, size: tuple[int, int], cfg) -> Case:
        width, height = size
        batch = cfg.batch_for(name)
        device = torch.device(cfg.device)

        def inputs_of(content: str) -> dict:
            inputs = dit_models.make_dit_inputs(model, name, batch, height, width, cfg.frames, cfg.seed,
                                                measure.DTYPES[cfg.dtype], content=content, photo=cfg.photo)
            return dit_models.to_device(inputs, device)

        share: dict = {}

        def extra() -> dict:
            image, text = dit_models.token_counts(name, height, width, cfg.frames)
            a = share.get("share")
            fields = dict(image_tokens=image, text_tokens=text, blocks=built_blocks(name, cfg), depth=cfg.depth,
                          real_blocks=(blocks_text(name, dit_models.RELEASED[name].blocks)
                                       if cfg.depth == "released" else dit_models.REAL_DEPTH[name]),
                          weights_gb=round(released.parameter_bytes(model, model.dtype) / 1e9, 3), attn_share=a,
                          speedup_ceiling=None if a is None or a >= 1 else 1 / (1 - a),
                          guided="distilled" if dit_models.distilled(name, batch) else
                          ("cfg" if batch % 2 == 0 else None))
            if name in VIDEO_FAMILIES:
                f, h, w = dit_models.latent_shape(name, height, width, cfg.frames)
                fields.update(frames=cfg.frames, latent=f"{f}x{h}x{w}")
            if name == "ltx2":  # its audio stream: every key kept, cost not reduced
                fields.update(audio_tokens=dit_models.audio_tokens(cfg.frames))
            return fields

        return Case(inputs_of(cfg.inputs_content), _forward, dit_models.peaked_attention,
                    probe=_attention_probe(share), errors=_errors(name), extra=extra,
                    photo_inputs=inputs_of("photo") if cfg.content == "both" else None)


DIT = DiTFamily()
