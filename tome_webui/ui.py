"""The "ToMe" accordion in txt2img and img2img (gradio 3.41, the WebUI's version).

The accordion's header checkbox enables ToMe (``modules.ui_components.InputAccordion``, in A1111
since 1.6 and in Forge); a WebUI without it gets a plain accordion with an "Enable ToMe" checkbox. The returned controls
follow ``options.FIELDS`` exactly: that order is the ``alwayson_scripts`` API's argument order.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

from tome_core.catalogue.families import default_modes
from tome_core.catalogue.quality import trade_summary

from .options import (FIELDS, INFOTEXT_KEYS, KV_DOWNSAMPLE_CHOICES, MATCHING_CHOICES, MAX_DOWNSAMPLE_CHOICES,
                      MODE_CHOICES, MODEL_RATIO, SPEED_CHECK_CHOICES, WebUIArgs, enabled_from_infotext)

TITLE = "ToMe (token merging)"
MODE_INFO = ("default: the model's own (merge on UNets; on transformers in Forge Neo the family's: "
             f"{default_modes()}). merge: merge and unmerge tokens (tomesd; transformers: fewer image tokens "
             "through whole blocks); kv: keep queries, downsample keys/values.")
RATIO_INFO = ("Fraction of tokens merged. -1 = the model's default: 0.5 on UNets; on transformers (Forge Neo) their "
              "family's, the fastest measured at or under tomesd's error. " + trade_summary())
FORGE_MLP_NOTE = ("Merge MLP is not offered here: Forge's UNet patcher has no patch point around the "
                  "feed-forward (an API request that sets it is refused).")


@contextlib.contextmanager
def _enabled_accordion(gr: Any, input_accordion: Callable | None, value: bool, elem_id: str) -> Iterator[Any]:
    """Yield the enabling checkbox inside the open accordion context: an InputAccordion where the
    WebUI has one (its header checkbox), else a plain accordion with an "Enable ToMe" checkbox."""
    if input_accordion is not None:
        with input_accordion(value, label=TITLE, elem_id=elem_id) as enabled:
            yield enabled
    else:
        with gr.Accordion(TITLE, open=False):
            yield gr.Checkbox(label="Enable ToMe", value=value, elem_id=elem_id)


def build(script: Any, is_img2img: bool, defaults: WebUIArgs, gr: Any, input_accordion: Callable | None,
          forge: bool = False) -> list:
    """Create the controls; sets ``script.infotext_fields`` and ``script.paste_field_names``.

    forge: the host is Forge / reForge / Forge Classic, whose UNet patcher has no patch point around
    the feed-forward, so "Merge MLP" is not offered (hidden; it keeps its place in the API args).
    """
    d = defaults
    with _enabled_accordion(gr, input_accordion, d.enabled, script.elem_id("enabled")) as enabled:
        with gr.Row():
            ratio = gr.Slider(label="Ratio", minimum=MODEL_RATIO, maximum=0.75, step=0.05, value=d.ratio,
                              elem_id=script.elem_id("ratio"), info=RATIO_INFO)
            hr_ratio = gr.Slider(label="Hires ratio", minimum=0.0, maximum=0.75, step=0.05, value=d.hr_ratio,
                                 elem_id=script.elem_id("hr_ratio"), visible=not is_img2img,
                                 info="Ratio of the hires-fix pass (0 = no merging there).")
        max_downsample = gr.Radio(label="Max downsample", choices=list(MAX_DOWNSAMPLE_CHOICES),
                                  value=str(d.max_downsample), elem_id=script.elem_id("max_downsample"),
                                  info="UNet levels merged, from the first with attention: 1 = that level only.")
        with gr.Accordion("Advanced", open=False):
            with gr.Row():
                sx = gr.Slider(label="sx", minimum=1, maximum=8, step=1, value=d.sx, elem_id=script.elem_id("sx"))
                sy = gr.Slider(label="sy", minimum=1, maximum=8, step=1, value=d.sy, elem_id=script.elem_id("sy"))
            with gr.Row():
                use_rand = gr.Checkbox(label="Random destinations", value=d.use_rand,
                                       elem_id=script.elem_id("use_rand"))
                seed = gr.Number(label="Partition seed", value=d.seed, precision=0, elem_id=script.elem_id("seed"))
            mode = gr.Radio(label="Mode", choices=list(MODE_CHOICES), value=d.mode, elem_id=script.elem_id("mode"),
                            info=MODE_INFO)
            kv_downsample = gr.Radio(label="kv downsampling", choices=list(KV_DOWNSAMPLE_CHOICES),
                                     value=d.kv_downsample, elem_id=script.elem_id("kv_downsample"),
                                     info="Mode kv only: nearest keeps one token per window (lower error on SD1.5 "
                                          "in our measurements), avg averages it (lower on SDXL).")
            matching = gr.Radio(label="Matching", choices=list(MATCHING_CHOICES), value=d.matching,
                                elem_id=script.elem_id("matching"),
                                info="Mode merge only: block matches every block's tokens (tomesd); level matches "
                                     "once per UNet level and step and reuses it (fewer GPU kernels).")
            speed_check = gr.Radio(label="Speed check", choices=list(SPEED_CHECK_CHOICES), value=d.speed_check,
                                   elem_id=script.elem_id("speed_check"),
                                   info="auto: on a GPU, time each level once and leave it whole where ToMe "
                                        "would be slower (the infotext says which); off: always reduce; on: "
                                        "time on the CPU too.")
            match_every = gr.Slider(label="Match every", minimum=1, maximum=10, step=1, value=d.match_every,
                                    elem_id=script.elem_id("match_every"),
                                    info="Mode merge with level matching: one model call in this many matches, "
                                         "the calls between reuse its matching (fewer GPU kernels, a little more "
                                         "error; its GPU gain is not measured yet). 1 = every call (tomesd). "
                                         "A1111, and Forge Neo's transformers (Forge marks no sampling run for its UNets).")
            with gr.Row():
                merge_attn = gr.Checkbox(label="Merge self-attention", value=d.merge_attn,
                                         elem_id=script.elem_id("merge_attn"))
                merge_crossattn = gr.Checkbox(label="Merge cross-attention", value=d.merge_crossattn,
                                              elem_id=script.elem_id("merge_crossattn"))
                merge_mlp = gr.Checkbox(label="Merge MLP", value=d.merge_mlp and not forge, visible=not forge,
                                        interactive=not forge, elem_id=script.elem_id("merge_mlp"))
            if forge:
                gr.Markdown(FORGE_MLP_NOTE, elem_id=script.elem_id("merge_mlp_note"))
            with gr.Row():
                start_percent = gr.Slider(label="Start percent", minimum=0.0, maximum=1.0, step=0.01,
                                          value=d.start_percent, elem_id=script.elem_id("start_percent"))
                end_percent = gr.Slider(label="End percent", minimum=0.0, maximum=1.0, step=0.01,
                                        value=d.end_percent, elem_id=script.elem_id("end_percent"))
            min_tokens = gr.Number(label="Min tokens", value=d.min_tokens, precision=0,
                                   elem_id=script.elem_id("min_tokens"))

    controls = [enabled, ratio, hr_ratio, max_downsample, sx, sy, use_rand, seed, mode,
                merge_attn, merge_crossattn, merge_mlp, start_percent, end_percent, min_tokens, kv_downsample,
                matching, speed_check, match_every]
    assert len(controls) == len(FIELDS)
    script.infotext_fields = [(enabled, enabled_from_infotext)] + [
        (control, field.key) for control, field in zip(controls, FIELDS) if field.key
    ]
    script.paste_field_names = list(INFOTEXT_KEYS)
    return controls
