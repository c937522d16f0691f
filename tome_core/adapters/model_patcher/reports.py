"""The layout a ComfyUI model reports inside its forward, read by the attention override (no comfy import).

2026 ComfyUIs set ``transformer_options["grid_sizes"]`` (Wan: the post-patch (t, h, w) of the latent the model
patched) and ``["img_slice"]`` ([text tokens, joint sequence length] of Flux's, Chroma's, HunyuanVideo's and Krea 2's
single-stream blocks) in the dict their attention calls receive. The layout derived from the call
(``comfy_layout``) comes from what the APPLY_MODEL wrapper sees; anything between it and the model's patch embedding
that changes the latent or the text makes it wrong, and only the model knows. So where the family's table entry
names a report and the host sets it, the layout is rebuilt from the report, keeping from the derived layout only
what the report does not say: which frames of the reported grid keep every key, and the tokens outside it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from ...catalogue.comfy_dits import ComfyDiT, grid_last
from ...catalogue.comfy_lookup import family_of
from .layout import kept_frames
from ...engine.grid import TokenLayout

Report = Tuple[str, Tuple[int, ...]]


@dataclass(frozen=True)
class ReportBasis:
    """What one model call knows beside the report (built once per call by the APPLY_MODEL wrapper).

    layout: the layout derived from the call.
    frames: (lead, trail) frames at the start and end of a reported grid that keep every key (``kept_frames``),
        None where the call's latents cannot give them (a reported grid is then left whole).
    text_first: the single-stream sequence starts with the text ([text, image]: Flux, or HunyuanVideo on ComfyUI 0.13+),
        so ``img_slice[0]`` is the number of tokens before the image part.
    grid_last: the grid ends the sequence (HunyuanVideo on ComfyUI 0.13+: its references sit between text and grid).
    stale: the objects under the report keys before the model ran: a report left there by an earlier call.
    expected_grid: the ``grid_sizes`` the model reports where the derived layout holds (kept frames included).
    """

    layout: TokenLayout
    frames: Optional[Tuple[int, int]]
    text_first: bool
    grid_last: bool
    stale: Tuple[Any, ...]
    expected_grid: Optional[Tuple[int, ...]] = None


def report_basis(diffusion_model: Any, layout: TokenLayout, extra: Dict[str, Any], options: Dict[str, Any],
                 entry: Optional[ComfyDiT] = None, last: Optional[bool] = None) -> Optional[ReportBasis]:
    """The basis for this call's reports; None where the family reads none (``entry``, ``last``: the binding and
    ``grid_last`` resolved once per patch; read now where not given)."""
    entry = entry or family_of(diffusion_model)
    if entry is None or not entry.host_reports:
        return None
    last = grid_last(entry) if last is None else last
    frames, grid = kept_frames(diffusion_model, extra, entry), layout.grid
    expected = None if frames is None or len(grid) != 3 else (frames[0] + grid[0] + frames[1],) + grid[1:]
    return ReportBasis(layout, frames, entry.text == "first" or last, last,
                       tuple(options.get(key) for key in entry.host_reports), expected)


def host_report(entry: ComfyDiT, options: Dict[str, Any], stale: Tuple[Any, ...]) -> Optional[Report]:
    """The report the model set for this attention call: (key, values), hashable; None where it set none. Values
    that are not plain ints (a tensor would cost a host synchronisation per block) are not read."""
    for key, old in zip(entry.host_reports, stale):
        value = options.get(key)
        if value is not None and value is not old and isinstance(value, (tuple, list)) \
                and all(isinstance(v, int) for v in value):
            return key, tuple(value)
    return None


def agrees(basis: ReportBasis, report: Report) -> bool:
    """Whether the derived layout holds under the report (the common case: its kept indices, built before the model
    ran, serve). Plain int comparisons: under torch.compile they trace to constants, never a recompile per step."""
    key, values = report
    if key == "grid_sizes":
        return values == basis.expected_grid
    if len(values) != 2:
        return False
    start, stop = values
    derived = basis.layout
    if not basis.text_first:  # [image, text]: the report does not place the grid
        return True
    if basis.grid_last:  # the grid ends the sequence whatever the text's length
        return start + derived.grid_tokens <= stop
    return start == derived.prefix and start + derived.grid_tokens + derived.suffix <= stop


def reported_layout(basis: ReportBasis, report: Report) -> Optional[TokenLayout]:
    """The layout of a report the derived layout disagrees with; None where no layout can be built from it (the call
    is then left whole).

    grid_sizes (t, h, w): the grid less its kept leading and trailing frames, the tokens the call adds outside it
    (a ref_conv reference image) kept from the derived layout. img_slice [start, stop] of a [text, image] sequence:
    the derived grid after the ``start`` text tokens, everything after it up to ``stop`` kept.
    """
    key, values = report
    derived = basis.layout
    if key == "grid_sizes":
        if len(values) != 3 or len(derived.grid) != 3 or basis.frames is None:
            return None
        (t, h, w), (lead, trail) = values, basis.frames
        if t - lead - trail < 1 or h < 1 or w < 1:
            return None
        area, derived_area = h * w, math.prod(derived.grid[1:])
        return TokenLayout((t - lead - trail, h, w), prefix=derived.prefix + lead * (area - derived_area),
                           suffix=derived.suffix + trail * (area - derived_area))
    if len(values) != 2 or basis.grid_last or not basis.text_first:
        return None
    start, stop = values
    if start + derived.grid_tokens + derived.suffix > stop:
        return None
    return TokenLayout(derived.grid, prefix=start, suffix=stop - start - derived.grid_tokens)
