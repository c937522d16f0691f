"""The ToMe nodes: MODEL in, a patched clone of it out (ComfyUI's ``ModelPatcher`` API, no comfy import).

Node ids are permanent (saved workflows name them) and deliberately differ from core's
``TomePatchModel``: ComfyUI silently skips a custom node whose id equals a core id.
"""
from __future__ import annotations

from typing import Any, Dict, Optional

try:  # loaded as a subpackage of the custom-node package (ComfyUI, tests)
    from ..tome_core import ToMeConfig
    from ..tome_core.engine.config import KV_DOWNSAMPLES, MATCHINGS, MODES, SPEED_CHECKS
    from ..tome_core.adapters.model_patcher.plan import plan_request
    from ..tome_core.adapters.model_patcher.unet import merger_of
    from ..tome_core.adapters.model_patcher.dit_call import call_patch_of
    from ..tome_core.catalogue.families import UNET_FAMILIES, default_modes, merging, mode_summary, short_title
    from ..tome_core.catalogue.defaults import MODEL_DEFAULT
except ImportError:  # imported with tome_core on sys.path (e.g. WebUI Forge)
    from tome_core import ToMeConfig
    from tome_core.engine.config import KV_DOWNSAMPLES, MATCHINGS, MODES, SPEED_CHECKS
    from tome_core.adapters.model_patcher.plan import plan_request
    from tome_core.adapters.model_patcher.unet import merger_of
    from tome_core.adapters.model_patcher.dit_call import call_patch_of
    from tome_core.catalogue.families import UNET_FAMILIES, default_modes, merging, mode_summary, short_title
    from tome_core.catalogue.defaults import MODEL_DEFAULT
from .ui_messages import announce_levels

CATEGORY = "model_patches/unet"
MAX_SEED = 0xFFFFFFFF
# Where each input is explained at length: the node's help panel (the 2026 frontend shows web/docs/<node id>.md).
MORE = " More: the node's help (?)."

# The families and their modes are the catalogue's (tome_core/catalogue/families.py), never written here.
MERGING = ", ".join(short_title(family) for family in merging())
UNETS = ", ".join(family.split(" (")[0] for family in UNET_FAMILIES)
MODEL_INPUT = ("MODEL", {"tooltip": f"The model to speed up: a UNet ({UNETS}) or a transformer; {mode_summary()}. "
                                    "Returned as a patched copy."})
RATIO = ("FLOAT", {
    "default": MODEL_DEFAULT, "min": MODEL_DEFAULT, "max": 0.75, "step": 0.01,
    "tooltip": "How many image tokens are merged away: higher is faster but softer. \"model default\" (-1) uses the "
               "model's own (0.5 on SD1.5/SDXL; each transformer family its measured one). 0 turns ToMe off; at most "
               "0.75." + MORE,
})
MAX_DOWNSAMPLE = ("INT", {
    "default": 1, "min": 1, "max": 8, "step": 1,
    "tooltip": "UNets: how deep ToMe goes. 1 = only the first attention level (most of the speed, least damage); 2, "
               "4 or 8 add deeper levels. Transformers ignore it." + MORE,
})
ADVANCED_INPUTS = {
    "sx": ("INT", {"default": 2, "min": 1, "max": 8, "step": 1, "tooltip":
                   "Width of the cell that keeps one token (2 recommended). With sy it bounds ratio at "
                   "1 - 1/(sx*sy)."}),
    "sy": ("INT", {"default": 2, "min": 1, "max": 8, "step": 1, "tooltip":
                   "Height of the cell that keeps one token (2 recommended)."}),
    "use_rand": ("BOOLEAN", {"default": True, "tooltip":
                             "Pick each cell's kept token at random (seeded) instead of its top-left one; random "
                             "avoids grid artifacts."}),
    "tome_seed": ("INT", {"default": 0, "min": 0, "max": MAX_SEED, "control_after_generate": False, "tooltip":
                          "Seed of ToMe's own random choice. The sampler's noise is not affected; the same seed gives "
                          "the same image."}),
    "mode": (list(MODES), {"default": "merge", "tooltip":
                               "merge: attention runs on merged tokens (tomesd's method; on transformers, fewer tokens "
                               f"through whole blocks: {MERGING}). kv: every token keeps its query, only keys/values "
                               "are thinned (gentler, less speed)." + MORE}),
    "merge_crossattn": ("BOOLEAN", {"default": False, "tooltip":
                                    "UNets, mode merge: also merge the tokens entering cross-attention. Little extra "
                                    "speed, visible quality cost; off is recommended."}),
    "start_percent": ("FLOAT", {"default": 0.0, "min": 0.0, "max": 1.0, "step": 0.001, "tooltip":
                                "Sampling progress from which ToMe is on (0 = the first step), as ControlNet's "
                                "start_percent."}),
    "end_percent": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.001, "tooltip":
                              "Sampling progress after which ToMe is off (1 = until the last step)."}),
    "min_tokens": ("INT", {"default": 0, "min": 0, "max": 1 << 20, "step": 64, "tooltip":
                           "UNets: leave levels with fewer tokens than this alone (small images gain nothing). "
                           "0 = every chosen level."}),
}
# Optional so that workflows saved before it existed still load and run with the default.
KV_DOWNSAMPLE_INPUT = (list(KV_DOWNSAMPLES), {"default": "nearest", "tooltip":
                       "Mode kv only: nearest keeps one real token per window (lower error on SD1.5), avg averages "
                       "each window (lower on SDXL)."})
# ComfyUI's defaults (the basic node uses them too): GPU users never get a level that measured slower
# than doing nothing; one matching per level, which measured as close to the original as tomesd's per-block
# matching or closer, with a fifth of its matching work (docs/BENCHMARK.md "Which matching?").
COMFY_DEFAULTS = {"matching": "level", "speed_check": "auto"}
# Optional for the same reason as kv_downsample.
SPEED_INPUTS = {
    "matching": (list(MATCHINGS), {"default": COMFY_DEFAULTS["matching"], "tooltip":
                 "Mode merge on UNets: block matches tokens in every block (tomesd); level matches once per level "
                 "and step and reuses it (fewer GPU kernels, same quality in our measurements)."}),
    "speed_check": (list(SPEED_CHECKS), {"default": COMFY_DEFAULTS["speed_check"], "tooltip":
                    "auto: on a GPU, ToMe times itself at the first step and stays off where it would be slower "
                    "(the result is shown on this node); the CPU is not timed. off: always on. on: time on the CPU "
                    "too."}),
    "match_every": ("INT", {"default": 1, "min": 1, "max": 10, "tooltip":
                    "Mode merge: match tokens in one model call of this many and reuse that matching in the calls "
                    "between. Fewer GPU kernels for a little more error; 1 = every call (tomesd)." + MORE}),
}
# Optional for the same reason; their rule block_start < block_end is checked when the node runs.
BLOCK_INPUTS = {
    "block_start": ("FLOAT", {"default": -1.0, "min": -1.0, "max": 1.0, "step": 0.01, "tooltip":
                              "Transformers: the share of blocks ToMe reduces starts here (0 = the first block). "
                              "\"model default\" (-1): Flux its single blocks, the others their first block. "
                              "UNets ignore it." + MORE}),
    "block_end": ("FLOAT", {"default": 1.0, "min": 0.0, "max": 1.0, "step": 0.01, "tooltip":
                            "Transformers: the reduced share of the blocks ends here (1 = the last block). UNets "
                            "ignore it."}),
}
# What a user types in ComfyUI's node search to find these nodes (the 2026 frontend reads SEARCH_ALIASES / V3's
# search_aliases beside the display name).
SEARCH_ALIASES = ["token merging", "tomesd", "merge tokens", "speed up", "faster sampling", "ToDo"]


# The inputs the advanced node's validation function declares: mode alone. ComfyUI (2024, 0.3.75 and the
# 2026-08 master, execution.py validate_inputs) reports a failed VALIDATE_INPUTS / validate_inputs on
# *every* input the function declares, with the same message, and skips its own min/max (0.3.x) and
# dropdown checks for those inputs. Every range is therefore left to ComfyUI, which reports it on that
# input alone; only mode is declared, because ComfyUI 0.3.75 checks no V3 dropdown's options. The rules
# that span inputs (ratio <= 1 - 1/(sx*sy), start_percent <= end_percent, merge_crossattn and
# kv_downsample with their mode) and max_downsample in {1, 2, 4, 8} cannot be scoped to their inputs by
# one function, so they are checked when the node runs, with a message naming those inputs.
RULE_INPUTS = ("mode",)


def _bound_error(spec: Dict[str, tuple], values: Dict[str, Any]) -> Optional[str]:
    """The widget-range error for values, or None; ComfyUI 0.3.75 skips its own min/max check for
    inputs the validation function takes, so the node repeats it for those (in ToMe's words)."""
    for name, value in values.items():
        if name not in spec:  # a value the node sets itself (the basic node's mode on a DiT)
            continue
        options = spec[name][1] if len(spec[name]) > 1 else {}
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            if "min" in options and value < options["min"]:
                return f"ToMe: {name} = {value} is below its minimum {options['min']}."
            if "max" in options and value > options["max"]:
                return f"ToMe: {name} = {value} is above its maximum {options['max']}."
    return None


def _config(spec: Dict[str, tuple], **values: Any) -> ToMeConfig:
    """Build the validated config from widget values (ValueError/TypeError naming the input)."""
    error = _bound_error(spec, values)
    if error:
        raise ValueError(error)
    seed = values.pop("tome_seed", 0)
    ratio = values.get("ratio")
    if isinstance(ratio, (int, float)) and ratio < 0 and ratio != MODEL_DEFAULT:
        raise ValueError(f"ToMe: ratio = {ratio}: use -1 for the model's default ratio, or 0 to 0.75 (0 = off).")
    if values.get("block_start") is not None and values["block_start"] < 0:  # the widget's "model default"
        values["block_start"] = None
    return ToMeConfig(seed=seed, **values)


def validate(spec: Dict[str, tuple], values: Dict[str, Any]):
    """True, or the engine's message for the declared inputs; the others take their defaults here
    (ComfyUI checks their ranges on its own), linked inputs (None) are checked when the node runs."""
    if any(value is None for value in values.values()):
        return True
    try:
        _config(spec, **values)
    except (TypeError, ValueError) as error:
        return str(error)
    return True


def patch(model: Any, spec: Dict[str, tuple], values: Dict[str, Any], node_id: Optional[str] = None) -> tuple:
    """The patched clone and the info the frontend extension draws; shared by the V1 and V3 nodes.

    DiTs (the catalogue's families: Flux, Qwen-Image, Wan, LTX-2, ...) route to the DiT patch: the basic node, which has
    no mode input, uses the family's default there (``ModelFamily.default_mode``, and at ratio -1 its
    ``default_ratio``: the frontier's rule, README "Each family's default"); the advanced node's mode is honoured: "merge" on the families whose
    bindings take it, refused on the others with the engine's message naming the model and the fix. max_downsample does not apply to DiTs.
    node_id: the node's id, to which the speed check's verdicts are sent when sampling decides them.
    """
    values = dict(COMFY_DEFAULTS, **values)
    # mode (the basic node has none) and ratio -1 are the model's: settled by the plan, which says which they were
    plan = plan_request(model, values, build=lambda **settled: _config(spec, **settled))
    patched = plan.attach()
    source = merger_of(patched) if plan.kind == "unet" else call_patch_of(patched)
    if source is not None and node_id is not None:  # the speed check's verdicts and the patch's notes
        announce_levels(source, node_id)
    return patched, {"tome": [plan.description]}


class ToMe:
    """ToMe with the two settings that matter: how much to merge and how deep."""

    NODE_ID = "TomeCoreToMe"
    DISPLAY_NAME = "ToMe"  # exactly what users type: ComfyUI's node search ranks an exact name first
    SEARCH_ALIASES = SEARCH_ALIASES
    DESCRIPTION = (f"Token Merging: speeds up {UNETS.replace(', ', '/')} sampling by merging similar image tokens "
                   f"in self-attention, and transformers in their family's default mode ({default_modes()}); put "
                   "it between the model loader and the sampler.")
    CATEGORY = CATEGORY
    RETURN_TYPES = ("MODEL",)
    OUTPUT_TOOLTIPS = ("A copy of the model with ToMe applied.",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        return {"required": {"model": MODEL_INPUT, "ratio": RATIO, "max_downsample": MAX_DOWNSAMPLE},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def spec(cls) -> Dict[str, tuple]:
        """Every input's (type, options), required and optional: the one table both schemas use."""
        inputs = cls.INPUT_TYPES()
        return dict(inputs["required"], **inputs.get("optional", {}))

    @classmethod
    def VALIDATE_INPUTS(cls, max_downsample=None):
        # ratio's bound is fixed here (sx = sy = 2): ComfyUI's own max check reports it on ratio.
        return validate(cls.spec(), {"max_downsample": max_downsample})

    def patch(self, model, ratio, max_downsample, unique_id=None):
        patched, ui = patch(model, self.spec(), {"ratio": ratio, "max_downsample": max_downsample}, unique_id)
        return {"ui": ui, "result": (patched,)}


class ToMeAdvanced(ToMe):
    """ToMe with every option the ComfyUI patch points allow."""

    NODE_ID = "TomeCoreToMeAdvanced"
    DISPLAY_NAME = "ToMe (advanced)"
    DESCRIPTION = ("Token Merging with all options: cell size, randomness and its seed, merge or key/value "
                   "pooling, cross-attention merging and the part of the schedule where ToMe is on.")

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        ratio = (RATIO[0], dict(RATIO[1], max=0.98))  # the real bound, 1 - 1/(sx*sy), is checked with sx, sy
        return {"required": dict(ToMe.INPUT_TYPES()["required"], ratio=ratio, **ADVANCED_INPUTS),
                "optional": {"kv_downsample": KV_DOWNSAMPLE_INPUT, **BLOCK_INPUTS, **SPEED_INPUTS},
                "hidden": {"unique_id": "UNIQUE_ID"}}

    @classmethod
    def VALIDATE_INPUTS(cls, mode=None):
        if mode is None or mode in MODES:  # None: linked, checked when the node runs
            return True
        return f"ToMe: mode must be one of {', '.join(MODES)}, got {mode!r}."

    def patch(self, model, ratio, max_downsample, sx, sy, use_rand, tome_seed, mode, merge_crossattn,
              start_percent, end_percent, min_tokens, kv_downsample="nearest", block_start=-1.0, block_end=1.0,
              matching=COMFY_DEFAULTS["matching"], speed_check=COMFY_DEFAULTS["speed_check"], match_every=1,
              unique_id=None):
        patched, ui = patch(model, self.spec(), dict(
            ratio=ratio, max_downsample=max_downsample, sx=sx, sy=sy, use_rand=use_rand, tome_seed=tome_seed,
            mode=mode, merge_crossattn=merge_crossattn, start_percent=start_percent, end_percent=end_percent,
            min_tokens=min_tokens, kv_downsample=kv_downsample, block_start=block_start, block_end=block_end,
            matching=matching, speed_check=speed_check, match_every=match_every), unique_id)
        return {"ui": ui, "result": (patched,)}


V1_NODES = (ToMe, ToMeAdvanced)
# Literal dicts: ComfyUI-Manager's scanner (scanner.py, extract_nodes / the "_CLASS_MAPPINGS = {...}" regex) reads
# node ids from literal keys only, so "Install Missing Custom Nodes" finds this pack for a shared workflow; the
# keys are the saved workflows' node ids (tests/comfyui/test_comfy_registry.py checks them against NODE_ID).
NODE_CLASS_MAPPINGS = {"TomeCoreToMe": ToMe, "TomeCoreToMeAdvanced": ToMeAdvanced}
NODE_DISPLAY_NAME_MAPPINGS = {"TomeCoreToMe": "ToMe", "TomeCoreToMeAdvanced": "ToMe (advanced)"}
