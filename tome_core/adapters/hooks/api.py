"""The public, tomesd-compatible API: ``apply_patch`` / ``remove_patch`` for diffusers and LDM models."""
from __future__ import annotations

from typing import Optional, TypeVar

from ...engine.config import ToMeConfig, require_all_blocks
from ...engine.token_merge import ATTENTION_WORDS
from . import dit as diffusers_dit
from .context_parallel import refuse as refuse_split
from .unet import STATE_ATTR, check_partners, install, refuse_compiled, uninstall
from ...catalogue.defaults import UNET_DEFAULTS, ModelDefaults
from ...catalogue.families import family_of_binding, short_title
from ...catalogue.quality import trade
from ...catalogue.unets import attention_base_downsample, transformer_blocks
from .targets import SUPPORTED, find_unets, patched_modules

Model = TypeVar("Model")


def apply_patch(
    model: Model,
    ratio: Optional[float] = None,
    max_downsample: int = 1,
    sx: int = 2,
    sy: int = 2,
    use_rand: bool = True,
    merge_attn: bool = True,
    merge_crossattn: bool = False,
    merge_mlp: bool = False,
    *,
    mode: Optional[str] = None,
    kv_downsample: str = "nearest",
    matching: str = "block",
    match_every: int = 1,
    speed_check: str = "off",
    seed: int = 0,
    start_percent: float = 0.0,
    end_percent: float = 1.0,
    min_tokens: int = 0,
    block_start: Optional[float] = None,
    block_end: float = 1.0,
    merge_attention: Optional[str] = None,
) -> Model:
    """Patch ``model`` in place with ToMe and return it (a drop-in for ``tomesd.apply_patch``).

    model: a diffusers pipeline (its UNet and any ControlNet are patched), a diffusers
        UNet2DConditionModel / ControlNetModel, an LDM/SGM model with ``.model.diffusion_model``
        (what the WebUI holds), or an LDM-style UNet.
    The first nine arguments mean what they mean in tomesd (see ``ToMeConfig``), except that
    ``max_downsample`` counts from the model's first attention level, so SDXL is merged too.
    DiTs (the catalogue, tome_core.catalogue.families: Flux.1/.2, Chroma, Qwen-Image, SD3/3.5, Wan, HunyuanVideo,
    Lumina 2, Z-Image, LTX-Video, LTX-2) take mode "kv", and Flux.1/.2, Qwen-Image, Z-Image, Lumina 2, Wan and
    LTX-2 mode "merge" too (fewer image tokens through whole blocks; ``tome_core.engine.token_merge``). mode None:
    "merge" on UNets (tomesd's), the family's default on DiTs (kv; merge on Flux, Qwen-Image, Z-Image / Lumina 2,
    Wan, LTX-2); under context parallelism each process reduces its own chunk (docs/DIFFUSERS.md, "Past one GPU").
    ratio None: tomesd's 0.5 on UNets; on a DiT its family's default ratio in the family's default mode
    (``ModelFamily.default_ratio``: the fastest setting at or under tomesd's error on SD1.5, measured; 0.5 in the
    other mode; ``tome_core.catalogue.quality`` says what the default and a higher ratio cost).
    block_start/block_end pick the share of their blocks, in depth order, that is reduced (block_start None: the
    model's default, on Flux its single blocks); UNets refuse a range (max_downsample picks their levels).
    merge_attention (DiT mode merge): how attention in a merged block weighs the merged keys: "plain" (each as one
    token), "balanced" (the merged image keys together as the image's tokens against the text), "proportional"
    (each as the tokens it holds, ToMe's prop_attn); None: the family's default (balanced on Qwen-Image, plain on
    the others; docs/TRANSFORMERS.md).
    matching "level" (mode merge) matches each level once per model call instead of once per block.
    match_every N > 1 (UNets with matching "level", DiT merge) reuses a call's matching in the next N - 1
    calls of the same shape (off under torch.compile); diffusers marks no sampling run, so the count runs on
    across generations (``restart_matching`` starts it afresh).
    speed_check "auto" times each UNet level once per GPU and shape and leaves it whole where reducing
    it measured slower ("on": on any device); the default "off" keeps tomesd's behaviour. ``describe``
    says what was decided.
    Applying again replaces the previous patch. Bad values raise before anything is patched.
    """
    settled = defaults_of(model).settle({"mode": mode, "ratio": ratio})  # tomesd's on UNets; a DiT family's own
    mode, ratio = settled.values["mode"], settled.values["ratio"]
    config = ToMeConfig(
        ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=use_rand, merge_attn=merge_attn,
        merge_crossattn=merge_crossattn, merge_mlp=merge_mlp, mode=mode, kv_downsample=kv_downsample,
        matching=matching, match_every=match_every, speed_check=speed_check, seed=seed,
        start_percent=start_percent, end_percent=end_percent, min_tokens=min_tokens,
        block_start=block_start, block_end=block_end, merge_attention=merge_attention,
    )
    return apply_config(model, config)


def defaults_of(model: object) -> ModelDefaults:
    """What "model default" means for ``model`` (``catalogue.defaults``): its DiT family's mode and ratio (mode kv on
    a class that takes no merge), tomesd's merge 0.5 on UNets and on models ToMe does not know (refused later)."""
    dit = diffusers_dit.find_dit(model)
    binding = diffusers_dit.family_of(dit) if dit is not None else None
    family = family_of_binding(binding) if binding is not None else None
    return UNET_DEFAULTS if family is None else ModelDefaults(family, merges=binding.merge is not None)


def apply_config(model: Model, config: ToMeConfig) -> Model:
    """``apply_patch`` with a built ``ToMeConfig`` (what a host holds after validating its settings once)."""
    dit = diffusers_dit.find_dit(model)
    if dit is not None:  # a DiT of the catalogue: mode "kv" through per-attention hooks (adapters/hooks/dit.py)
        diffusers_dit.check_config(dit, config)
        if config.enabled:
            refuse_split(dit, config)  # made context parallel before: refused now where ToMe cannot follow it
        remove_patch(model)
        diffusers_dit.install(dit, config)
        return model
    unsupported = diffusers_dit.unsupported_dit(model)
    if unsupported is not None:
        raise TypeError(
            f"ToMe: {unsupported} has no UNet with transformer blocks to merge and is not a DiT that ToMe's "
            f"kv mode reaches; supported DiTs (mode='kv'): {', '.join(diffusers_dit.supported_classes())}; "
            f"UNets: {SUPPORTED}."
        )
    unets = check_patchable(model)
    require_all_blocks(config, type(model).__name__)
    for unet in unets:  # another speed-up ToMe cannot run beside: refused before anything changes
        check_partners(unet, config)
        if config.enabled and config.mode == "merge":
            refuse_compiled([sub for block in transformer_blocks(unet) for sub in block.modules()])
    remove_patch(model)
    for unet in unets:
        install(unet, config)
    return model


def check_patchable(model: object) -> list:
    """The UNets ``apply_patch`` would patch; raises TypeError naming the model when one is unsupported.

    Patches nothing, so a host can refuse a generation before it writes or patches anything.
    """
    unets = find_unets(model)
    for unet in unets:  # fail on any unsupported UNet before touching the first one
        attention_base_downsample(unet)
    return unets


def remove_patch(model: Model) -> Model:
    """Undo ``apply_patch`` exactly: every hook and the state attribute go; unpatched models pass through."""
    for module in patched_modules(model, STATE_ATTR):
        uninstall(module)
    for module in patched_modules(model, diffusers_dit.STATE_ATTR):
        diffusers_dit.uninstall(module)
    return model


def restart_matching(model: object) -> None:
    """Match afresh at the next model call (``match_every``): diffusers marks no sampling run, so a script that
    runs generations one after another calls this between them; no call then reuses the last run's matching."""
    for module in patched_modules(model, STATE_ATTR):
        getattr(module, STATE_ATTR).merger.reuse.restart()
    for module in patched_modules(model, diffusers_dit.STATE_ATTR):
        module.__dict__[diffusers_dit.STATE_ATTR].reuse.restart()


def is_patched(model: object) -> bool:
    return bool(patched_modules(model, STATE_ATTR) or patched_modules(model, diffusers_dit.STATE_ATTR))


def describe(model: object) -> str:
    """What ToMe does to ``model``, in words: its settings and, per UNet level, what the speed check
    decided (e.g. "level 1 (64x64 tokens, 5 blocks) at 512x512 px: left whole: merging measured 0.86x
    on cuda:0 (NVIDIA H200)"); levels are decided at the first model call of each size."""
    modules = patched_modules(model, STATE_ATTR)
    if modules:
        return "\n".join(getattr(modules[0], STATE_ATTR).merger.describe())
    dits = patched_modules(model, diffusers_dit.STATE_ATTR)
    if dits:
        state = dits[0].__dict__[diffusers_dit.STATE_ATTR]
        config = state.config
        what = "blocks carry merged image tokens" if config.mode == "merge" else "attentions reduced"
        head = f"ToMe {config.mode} r={config.ratio:g} on {type(dits[0]).__name__}: {len(state.modules)} {what}"
        if config.mode == "merge":
            head += f", {ATTENTION_WORDS[state.attention]}"
        lines = state.describe(head)
        family = family_of_binding(state.family)
        said = trade(family.name, short_title(family)) if family is not None else None
        return "\n".join(lines + ([said + "."] if said else []))
    return "ToMe is not applied to this model."


def patch_config(model: object) -> "ToMeConfig | None":
    """The config of the patch on ``model`` (its first patched UNet), or None."""
    modules = patched_modules(model, STATE_ATTR)
    if not modules:
        dits = patched_modules(model, diffusers_dit.STATE_ATTR)
        return dits[0].__dict__[diffusers_dit.STATE_ATTR].config if dits else None
    return getattr(modules[0], STATE_ATTR).config if modules else None
