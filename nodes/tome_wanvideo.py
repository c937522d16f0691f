"""ToMe (WanVideoWrapper): kijai's ComfyUI-WanVideoWrapper model (``WANVIDEOMODEL``) in, a patched clone of it out.

Registered with the pack's other nodes whether or not the wrapper is there: ComfyUI reads a pack's nodes once, when it
loads the pack (``nodes.load_custom_node``), and loads the packs in the order their folders are listed
(``init_external_custom_nodes``), so the wrapper may load after this pack and nothing it registers can be seen yet.
Its ``WANVIDEOMODEL`` input connects to the wrapper's model loader only, and the wrapper is found when it is needed:
the model the node is given must be the wrapper's ``WanModel`` (matched by module and name, ``catalogue/wanvideo.py``),
else the node refuses it, naming what it got. The node is thin: widgets in, ``tome_core.adapters.wanvideo``'s plan
(every refusal the model already shows, and the description) and clone out; the description is the node's UI message
and goes to the log.
"""
from __future__ import annotations

import logging
from typing import Any, Dict, Optional

try:  # loaded as a subpackage of the custom-node package (ComfyUI, tests)
    from ..tome_core.adapters.wanvideo import patch_of, patch_wanvideo, plan_wanvideo, settle_wanvideo
    from ..tome_core.engine.config import MODES, SPEED_CHECKS
    from ..tome_core.catalogue.families import BY_NAME
except ImportError:  # imported with tome_core on sys.path
    from tome_core.adapters.wanvideo import patch_of, patch_wanvideo, plan_wanvideo, settle_wanvideo
    from tome_core.engine.config import MODES, SPEED_CHECKS
    from tome_core.catalogue.families import BY_NAME
from .tome_nodes import (ADVANCED_INPUTS, BLOCK_INPUTS, CATEGORY, MORE, RATIO, SEARCH_ALIASES, ToMe,
                         ToMeAdvanced, _config)
from .ui_messages import announce_levels

WANVIDEOMODEL = "WANVIDEOMODEL"
WAN = BY_NAME["wan"]  # the wrapper runs Wan only: its defaults are the catalogue's
_LOG = logging.getLogger("tome")

MODE_INPUT = (list(MODES), {"default": "merge", "tooltip":
              "merge: fewer video tokens through whole blocks (the most speed). kv: every token keeps its query, only "
              "the self-attention's keys/values are thinned (gentler, less speed; needs attention_mode sdpa or comfy)."
              + MORE})
START_INPUT = ("FLOAT", dict(ADVANCED_INPUTS["start_percent"][1], tooltip=
               "Sampling progress from which ToMe is on: the wrapper's step / steps (0 = the first step)."))
END_INPUT = ("FLOAT", dict(ADVANCED_INPUTS["end_percent"][1], tooltip=
             "Sampling progress after which ToMe is off (1 = until the last step)."))
SPEED_CHECK_INPUT = (list(SPEED_CHECKS), {"default": "auto", "tooltip":
                     "auto: on a GPU, ToMe times itself at the first step and stays off where it would be slower (the "
                     "result is shown on this node); not timed beside a step cache; the CPU is not timed. off: always "
                     "on. on: time on the CPU too."})


class ToMeWanVideo:
    """ToMe for kijai's ComfyUI-WanVideoWrapper: its WANVIDEOMODEL in, a patched copy out."""

    NODE_ID = "TomeCoreToMeWanVideo"
    DISPLAY_NAME = "ToMe (WanVideoWrapper)"
    SEARCH_ALIASES = SEARCH_ALIASES
    DESCRIPTION = ("Token Merging for the Wan models of kijai's ComfyUI-WanVideoWrapper (its WANVIDEOMODEL: the node "
                   "needs the wrapper): fewer video tokens through the blocks (merge) or fewer keys/values (kv). Put it "
                   "between the WanVideo model loader (and its LoRA, block swap and attention nodes) and the WanVideo "
                   "sampler; features it cannot carry are refused by name before sampling.")
    CATEGORY = CATEGORY
    RETURN_TYPES = (WANVIDEOMODEL,)
    OUTPUT_TOOLTIPS = ("A copy of the model with ToMe applied.",)
    FUNCTION = "patch"

    @classmethod
    def INPUT_TYPES(cls) -> dict:
        model = (WANVIDEOMODEL, {"tooltip": "The model of the WanVideo model loader (Wan 2.1/2.2 t2v, i2v, Fun, "
                                            "Phantom, VACE, ...). It is not changed: the node returns a patched copy."})
        ratio = (RATIO[0], dict(RATIO[1], max=0.98, tooltip=
                                "How many video tokens are merged away (merge), or the key/value window closest to it "
                                "(kv). \"model default\" (-1): Wan's own in the mode chosen "
                                f"({WAN.default_ratio:g} in {WAN.default_mode}). 0 turns ToMe off; at most "
                                "1 - 1/(sx*sy)." + MORE))
        required = {"model": model, "ratio": ratio, "mode": MODE_INPUT, "sx": ADVANCED_INPUTS["sx"],
                    "sy": ADVANCED_INPUTS["sy"], "use_rand": ADVANCED_INPUTS["use_rand"],
                    "tome_seed": ADVANCED_INPUTS["tome_seed"], "start_percent": START_INPUT,
                    "end_percent": END_INPUT}
        return {"required": required, "optional": dict(BLOCK_INPUTS, speed_check=SPEED_CHECK_INPUT),
                "hidden": {"unique_id": "UNIQUE_ID"}}

    spec = classmethod(ToMe.spec.__func__)  # every input's (type, options): the one table both schemas use
    VALIDATE_INPUTS = classmethod(ToMeAdvanced.VALIDATE_INPUTS.__func__)  # declares mode alone, as the advanced node

    def patch(self, model, ratio, mode, sx, sy, use_rand, tome_seed, start_percent, end_percent, block_start=-1.0,
              block_end=1.0, speed_check="auto", unique_id=None):
        patched, ui = patch(model, self.spec(), dict(
            ratio=ratio, mode=mode, sx=sx, sy=sy, use_rand=use_rand, tome_seed=tome_seed, start_percent=start_percent,
            end_percent=end_percent, block_start=block_start, block_end=block_end, speed_check=speed_check), unique_id)
        return {"ui": ui, "result": (patched,)}

def patch(model: Any, spec: Dict[str, tuple], values: Dict[str, Any], node_id: Optional[str] = None) -> tuple:
    """The patched clone and the node's UI message (the plan's description, also logged); shared by V1 and V3. The
    speed check's verdicts, decided while sampling, go to the log and to node ``node_id`` (``announce_levels``)."""
    settled, said = settle_wanvideo(values)  # ratio -1: Wan's default ratio in the mode chosen
    config = _config(spec, **settled)
    description = dict(plan_wanvideo(model, config), **said)  # every refusal first
    patched = patch_wanvideo(model, config)
    for line in description["text"]:
        _LOG.info(line)
    if node_id is not None:
        announce_levels(patch_of(patched), node_id)
    return patched, {"tome": [description]}


ToMeWanVideo.patch_function = staticmethod(patch)  # what the V3 node (tome_v3.py) runs
WANVIDEO_NODES = (ToMeWanVideo,)
