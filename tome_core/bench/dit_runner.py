"""DiT families (Flux, SD3, Wan) in the benchmark: vanilla vs mode "kv" through the runner's rounds.

The model is the real diffusers architecture at full width with ``cfg.blocks`` blocks of each kind
(``dit_models``; ``--tiny``: the tiny test width). Each size runs the runner's own case: a warm-up
round on peaked attention (errors, memory, kernel), vanilla once more (drift check), here also
timing its share in scaled_dot_product_attention (the ceiling of any kv speed-up is
1/(1-share)), then interleaved timed rounds with paired ratios and noise bands (``stats``). Rows
are the runner's, plus token counts, blocks, attention share and ceiling; Flux is
guidance-distilled, so its guided error is the output's.
"""
from __future__ import annotations

import torch

from . import dit_models, measure, stats

DIT_FAMILIES = dit_models.DIT_FAMILIES
DIT_METHODS = ("vanilla", "kv")
_NOT_FOR_DITS = "Flux, SD3 and Wan take mode kv (nearest picks) only"
SKIPPED = {"merge": f"merges tokens through UNet transformer blocks; {_NOT_FOR_DITS}",
           "tomesd": f"patches UNets only; {_NOT_FOR_DITS}"}
DEFAULT_SIZES = {"flux": (1024, 1024), "sd3": (1024, 1024), "wan": (832, 480)}
DEFAULT_BATCH = {"flux": 1}  # guidance-distilled: no CFG pair; SD3 and Wan: [uncond; cond]


def check_config(cfg, method_names: tuple[str, ...]) -> None:
    """Refuse a DiT run the benchmark cannot do, naming the fix (``cfg``: a ``runner.BenchConfig``)."""
    dits = [f for f in cfg.families if f in DIT_FAMILIES]
    if not dits:
        return
    unets = [f for f in cfg.families if f not in DIT_FAMILIES]
    if unets:
        raise ValueError(f"families: {','.join(unets)} (UNet) and {','.join(dits)} (DiT) need separate runs "
                         f"(their methods differ): --families {','.join(unets)}, then --families {','.join(dits)}")
    bad = [m for m in method_names if m not in DIT_METHODS]
    if bad:
        raise ValueError(f"methods: {', '.join(bad)} not available for DiT families ({', '.join(dits)}): "
                         f"{_NOT_FOR_DITS}; use --methods vanilla,kv (their default)")
    if cfg.compile:
        raise ValueError("--compile is for UNet families only; DiT families run eager")
    if cfg.blocks < 1:
        raise ValueError(f"blocks must be >= 1, got {cfg.blocks}")
    if cfg.frames < 1 or cfg.frames % 4 != 1:
        raise ValueError(f"frames must be 4k + 1 (Wan's VAE keeps 1 + (frames - 1) / 4 latent frames), "
                         f"e.g. 33 or 81, got {cfg.frames}")
    for w, h in cfg.resolutions or ():
        if w % 16 or h % 16:
            raise ValueError(f"DiT sizes must be multiples of 16 px (latent = px / 8, then 2x2 patches), "
                             f"got {w}x{h}")


def build(family: str, cfg) -> torch.nn.Module:
    """The benchmark's ``family`` DiT: full width (``--tiny``: tiny), ``cfg.blocks`` blocks, on ``cfg.device``."""
    from .runner import DTYPES

    model = dit_models.build_dit(family, cfg.blocks, cfg.seed, scale="tiny" if cfg.scale == "tiny" else "full")
    # torch's own Module.to: diffusers' would warn about an empty list of fp32-kept modules
    return torch.nn.Module.to(model, cfg.device, DTYPES[cfg.dtype])


def blocks_text(family: str, blocks: int) -> str:
    """Blocks built, by kind: Flux has double- and single-stream blocks (1:2, as the real 19:38)."""
    return f"{blocks}+{2 * blocks}" if family == "flux" else str(blocks)


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


def _errors(y: torch.Tensor, ref: torch.Tensor, family: str, guidance: float) -> tuple[float, float | None]:
    raw, guided = measure.errors(y, ref, guidance)
    return raw, raw if family == "flux" else guided  # Flux: the output is the guided prediction


def run_case(model: torch.nn.Module, family: str, size: tuple[int, int], variants: list, cfg,
             progress, clock) -> list[dict]:
    """All variants at one size (``variants[0]`` is vanilla): one row each (see ``runner.run_case``)."""
    from .runner import DTYPES, _measure, _row

    width, height = size
    batch = cfg.batch_for(family)
    inputs = dit_models.make_dit_inputs(model, family, batch, height, width, cfg.frames, cfg.seed,
                                        DTYPES[cfg.dtype])
    inputs = {k: v.to(cfg.device) for k, v in inputs.items()}
    share: dict = {}
    m = _measure(model, inputs, variants, cfg, progress, clock, forward=_forward,
                 peaked=dit_models.peaked_attention, probe=_attention_probe(share))
    ratios = m.ratios(variants)
    ranks = stats.ranking(ratios)
    image, text = dit_models.token_counts(family, height, width, cfg.frames)
    a = share.get("share")
    extra = dict(image_tokens=image, text_tokens=text, blocks=blocks_text(family, cfg.blocks),
                 real_blocks=dit_models.REAL_DEPTH[family], attn_share=a,
                 speedup_ceiling=None if a is None or a >= 1 else 1 / (1 - a),
                 guided="distilled" if family == "flux" else ("cfg" if batch % 2 == 0 else None))
    if family == "wan":
        extra.update(frames=cfg.frames,
                     latent=f"{dit_models.latent_frames(cfg.frames)}x{height // 8}x{width // 8}")
    rows = []
    for v in variants:
        row = _row(family, size, v, variants[0], m, cfg, ranks, ratios)
        row.update(extra)
        row["rel_err"], row["cfg_err"] = _errors(m.out[v], m.out[variants[0]], family, cfg.guidance)
        if cfg.peaked != 1.0:
            row["rel_err_peaked"], row["cfg_err_peaked"] = _errors(
                m.out_peaked[v], m.out_peaked[variants[0]], family, cfg.guidance)
        rows.append(row)
    return rows
