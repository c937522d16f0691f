"""One DiT model call, planned the same way in every host: diffusers' hooks, ComfyUI's wrapper, the WanVideoWrapper's.

Every DiT adapter does the same per-call work, and it lives here: given where the call's image tokens sit and at
which step (``CallReading``, the host's reading), decide whether the call is reduced (``CallPlanner.decide``: the
speed check's verdict, timed once per call shape by repeating the call through the host's own per-call hook, forced
whole and reduced; a shape once decided costs one look-up), then build its plan (``CallPlanner.plan``): mode kv's
seeded kept keys (``KVCall``), or mode merge's seeded destinations, whose matching the first reduced block makes
from its input and the call's other blocks and streams share (``MergeCall.matched``). What stays with each adapter is
what its host forces on it: how it is called, how it reads the tokens' layout, and where it installs the plan.
The state lives on the patched object, never in a global.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Tuple

import torch

from .config import ToMeConfig
from .plan import draw_table, partition_seed
from .reuse import MatchingReuse
from .speed_check import GENERATION, Verdict, call_verdict, decided_call
from .grid import TokenLayout
from .kv import dit_window, keep_index, pick_index_nd
from .slices import SequenceSlices
from .token_merge import GridMatch, TokenMerge, match_bands, match_grid, merge_window

_LOG = logging.getLogger("tome.dit")


def call_label(grid: Tuple[int, ...], batch: int) -> str:
    """A call shape in words for the speed check's verdicts: "64x64 image tokens, batch 2", "9x30x52 video ..."."""
    kind = "video" if len(grid) == 3 else "image"
    return f"{'x'.join(str(n) for n in grid)} {kind} tokens, batch {batch}"


@dataclass(frozen=True)
class CallReading:
    """What a host read from one model call: the layout ToMe reduces (kv: the keys' sequence; merge: the image stream
    as a block takes it, the text apart), the step (a device tensor or a float), the batch, dtype and device, the
    model's name (for the speed check's key), and for merge the text a joint block puts beside the stream (``text``,
    after it where ``text_last``); ``image_keys``: kv also picks the grid alone (an image-only self-attention);
    ``host``: what the host's own additions to the plan need; ``slices``: the call's sequence is split across
    processes (context parallelism: kv's kept keys are found in the gathered sequence, merge reduces this process's
    band, and the speed check times the call on every process together)."""

    layout: TokenLayout
    step: Any
    batch: int
    dtype: torch.dtype
    device: torch.device
    model: str
    text: int = 0
    text_last: bool = False
    image_keys: bool = False
    host: Any = None
    slices: Optional[SequenceSlices] = None

    @property
    def what(self) -> Tuple:
        """The speed check's key of the call shape: (model, layout, batch)."""
        return (self.model, self.layout, self.batch)


class PlannedCall:
    """What both modes' plans of one call carry for their host: whether the host's patch was reached in the call
    (``reached``: a first call that reaches none stops, rather than run without ToMe while the host says otherwise),
    whether it only probes that (``probe``: it reduces nothing), the per-block stashes of a running block
    (``pending``) and whether the first reduced block's inputs were checked (``inputs_checked``)."""

    def __init__(self, probe: bool = False) -> None:
        self.probe = probe
        self.reached = False
        self.pending: Dict[Any, Any] = {}
        self.inputs_checked = False


class KVCall(PlannedCall):
    """Mode kv's plan of one call: the kept key indices of its layout (and of the grid alone: ``image``,
    ``image_keep``)."""

    def __init__(self, layout: Optional[TokenLayout], keep: Optional[torch.Tensor], step: Any = 0.0,
                 image_keep: Optional[torch.Tensor] = None, probe: bool = False) -> None:
        super().__init__(probe)
        self.layout, self.keep, self.step, self.image_keep = layout, keep, step, image_keep
        self.image = None if image_keep is None else layout.image_only()


class MergeCall(PlannedCall):
    """Mode merge's plan of one call: the image stream's layout, the text beside it, the step and its seeded
    destinations; once the first reduced block has run, the matching (``matched``), the merge of each stream layout
    it is applied to (the image stream; the joint [text, image] or [image, text] stream of Flux.2's single blocks and
    Z-Image's layers) and the per-token tables cut to them (``cuts``: rotary tables, per-token modulation, by input
    and stream), shared by the call's other blocks. ``probe``: a call that reduces nothing and only records that a
    block was reached."""

    def __init__(self, stream: Optional[TokenLayout], step: Any = 0.0, destinations: Optional[torch.Tensor] = None,
                 text: int = 0, text_last: bool = False, reuse_key: Optional[Tuple] = None,
                 probe: bool = False, slices: Optional[SequenceSlices] = None,
                 bands: Tuple[int, Optional[Tuple[int, ...]]] = (1, None)) -> None:
        super().__init__(probe)
        self.stream, self.step, self.destinations, self.text = stream, step, destinations, text
        # context parallelism: ``stream`` and ``text`` are this process's band (``slices.local_grid``), merged alone
        self.slices = slices
        self.bands = bands  # one process merging as (count) processes would, each band laid out as (grid)
        self.joint = None if stream is None else (
            TokenLayout(stream.grid, prefix=stream.prefix, suffix=stream.suffix + text) if text_last else
            TokenLayout(stream.grid, prefix=text + stream.prefix, suffix=stream.suffix))
        self.reuse_key = reuse_key  # where match_every keeps this call's matching (None: a speed-check repeat)
        self.match: Optional[GridMatch] = None
        # keyed by a layout's plain values (grid, prefix, suffix), never by a TokenLayout: a compiled model's blocks
        # fill these, and a layout made inside a traced frame and kept past it is a value torch.compile cannot hand
        # back (a graph break at the model's return, its forward run eagerly)
        self.merges: Dict[Tuple, TokenMerge] = {}
        self.cuts: Dict[Any, Any] = {}
        self.bias: Dict[Tuple, Optional[torch.Tensor]] = {}  # (grid, prefix, suffix, keys) -> key_bias
        self.weigh = False  # the host's: whether the attention that runs takes the merged keys' bias
        self.zero_refs = False  # the host's: reference tokens modulated by position (ComfyUI refuses a shorter grid)

    @property
    def layout(self) -> Optional[TokenLayout]:
        """The layout the call was planned on (as a ``KVCall``'s): the image stream."""
        return self.stream

    @property
    def merge(self) -> Optional[TokenMerge]:
        """The image stream's merge (None before the first reduced block)."""
        return None if self.match is None else self.merge_on(self.stream)

    def merge_on(self, layout: TokenLayout) -> TokenMerge:
        key = (layout.grid, layout.prefix, layout.suffix)  # plain values (see ``merges``)
        if key not in self.merges:
            self.merges[key] = self.match.on(layout)
        return self.merges[key]

    def matched(self, hidden: torch.Tensor, stream: TokenLayout, config: ToMeConfig,
                reuse: MatchingReuse) -> TokenMerge:
        """The merge of a block whose input ``hidden`` [B, stream.length, C] is laid out as ``stream``; the first
        reduced block of the call matches the grid's tokens of its input (``match_grid``: each window's seeded
        destination takes the ratio's most similar tokens of its window), kept for ``match_every``."""
        if self.match is None:
            destinations = self.destinations
            if destinations.device != hidden.device:
                destinations = destinations.to(hidden.device)
            tokens = hidden[:, stream.prefix:stream.prefix + stream.grid_tokens]
            count, band = self.bands
            self.match = match_grid(tokens, stream.grid, config.ratio, destinations,
                                    merge_window(stream.grid, config.sx, config.sy)) if count == 1 else \
                match_bands(tokens, band, count, config.ratio, destinations, merge_window(band, config.sx, config.sy))
            if self.reuse_key is not None:
                reuse.keep(self.reuse_key, self.match)
        return self.merge_on(stream)


class CallPlanner:
    """What a DiT patch keeps, in every host (on the patched object): the config, the seeded candidates per grid, the
    speed check's decisions and verdicts, the matchings kept across calls, one-time warnings; and the per-call
    work: ``decide``, then ``plan``."""

    def __init__(self, config: ToMeConfig) -> None:
        self.config = config
        self._cache: Dict[Tuple, Any] = {}  # (what, grid or layout, device) -> seeded candidates (draw_table)
        self._step: List[Any] = [None, 0]  # the last step tensor and its choice
        self._warned: set = set()
        self.reduced_calls = 0
        self.verdicts: Dict[str, Verdict] = {}  # the speed check's, by call shape in words (decide)
        self.reuse = MatchingReuse(config.match_every)  # mode merge: GridMatches kept across calls (match_every)
        self.forcing: Optional[bool] = None  # a speed-check repeat of the call is running: reduced (True) or whole
        self._decided: Dict[Tuple, Tuple[int, bool]] = {}  # (what, dtype, device) -> (verdicts' generation, reduce)
        self.notes: List[str] = []  # what describe() adds to the settings ("... ignores masks: plain")
        # called with the notes and verdict lines when either changes (a host shows them where users look)
        self.listeners: List[Callable[[List[str]], None]] = []
        # mode merge in one process: merge as this many context-parallel processes would, each its own band of rows
        # (what a split call equals; 1: the whole grid)
        self.bands = 1

    def decide(self, reading: CallReading, repeat: Optional[Callable[[], object]]) -> bool:
        """Whether the model call ``reading`` describes is reduced, asked before anything is planned.

        In a speed-check repeat, as the repeat says. Else the speed check's verdict (``speed_check.call_verdict``):
        cached per call shape, or timed now by running ``repeat()`` (the model call once more, through the patch, as
        the user gets it: the per-call set-up included) whole and reduced (``forcing``). Once decided, a call shape
        costs one look-up here (a call left whole then runs as if unpatched)."""
        if self.forcing is not None:
            return self.forcing
        if self.config.speed_check == "off":
            return True
        key = (reading.what, reading.dtype, reading.device)
        known = self._decided.get(key)
        if known is not None and known[0] == GENERATION[0]:
            return known[1]
        return self._decide(key, reading, repeat)

    def _decide(self, key: Tuple, reading: CallReading, repeat: Optional[Callable[[], object]]) -> bool:
        config, (what, dtype, device) = self.config, key
        slices = reading.slices
        # context parallel: every process times the call together (each repeat runs their collectives) and takes one
        # verdict (``agree``); a host without a collective does not time (a process timing alone would repeat
        # collectives its peers do not, and could decide otherwise): every process reduces
        agree = None if slices is None else slices.agree
        found = None if agree is not None else decided_call(config, what, dtype, device)
        if found is None:
            run = None if repeat is None or (slices is not None and agree is None) else \
                (lambda reduced: self.repeat_forced(reduced, repeat))
            found = call_verdict(config, what, dtype, device, run, agree=agree, untimed=(
                f"untimed under {slices.setting} without a collective to agree by, where every process reduces alike"
                if slices is not None else "cannot repeat the call beside another hook on the model"))
        label = call_label(reading.layout.grid, reading.batch)  # "64x64 image tokens, batch 2": describe_verdicts
        if self.verdicts.get(label) != found:
            self.verdicts[label] = found
            self.warn_once(f"verdict:{label}:{found}", f"ToMe speed check: {label}: {found.text(self.config.mode)}")
            self.verdict_changed()
        self._decided[key] = (GENERATION[0], found.reduce)
        return found.reduce

    def repeat_forced(self, reduced: bool, repeat: Callable[[], object]) -> None:
        """``repeat()`` with the call forced whole or reduced (the speed check's two sides)."""
        previous, self.forcing = self.forcing, reduced
        try:
            repeat()
        finally:
            self.forcing = previous

    def verdict_changed(self) -> None:
        """Called when the speed check decided a new call shape: each of ``listeners`` (the ComfyUI node's sender)
        is called with the notes and ``describe_verdicts``."""
        for listener in self.listeners:
            listener(self.notes + self.describe_verdicts())

    def plan(self, reading: Optional[CallReading], repeat: Optional[Callable[[], object]]) -> Any:
        """The plan of one model call, or None to run it whole: nothing to reduce (``reading`` None), the whole side
        of a speed-check repeat, or a call shape the speed check leaves whole (``decide``; ``repeat()``: the call
        once more through the host's per-call hook). Built outside any compiled code: what is seeded by the step
        never reaches a traced graph."""
        if reading is None or self.forcing is False:
            return None
        if not self.decide(reading, repeat):
            return None
        return self.build(reading, first=self.forcing is None)

    def build(self, reading: CallReading, first: bool) -> Any:
        """A call's plan: mode kv's seeded kept keys, or mode merge's seeded destinations (and, ``first``: not a
        speed-check repeat, the matching kept by an earlier call where ``match_every`` reuses it)."""
        layout, step, device = reading.layout, reading.step, reading.device
        if self.config.mode == "kv":
            keep = self.keep_for(layout, step, device)
            image = self.keep_for(layout.image_only(), step, device) if reading.image_keys else None
            slices = reading.slices
            if slices is not None:  # the same keys, at their places in the gathered sequence (slices.py)
                keep = slices.gathered(layout, keep)
                image = None if image is None else slices.gathered(layout.image_only(), image)
            return KVCall(layout, keep, step, image)
        config, slices, bands = self.config, reading.slices, (1, None)
        if slices is not None or self.bands > 1:  # each process merges its own band of rows, alone
            split = slices or SequenceSlices(self.bands, 0)
            grid = split.local_grid(layout.grid, (config.sy, config.sx))
            if grid is None:
                raise ValueError(f"ToMe: {reading.model}: {split.refusal('merge', layout, 0, (config.sy, config.sx))}.")
            if slices is not None:
                layout = TokenLayout(grid)
            else:
                bands = (split.world, grid)
        grid = bands[1] or layout.grid
        destinations = self.destinations_for(grid, merge_window(grid, config.sx, config.sy), step, device)
        call = MergeCall(layout, step, destinations, reading.text, reading.text_last,
                         reuse_key=(layout.grid, str(device)) if first else None, slices=slices, bands=bands)
        if first and self.reuse.on:  # match_every: an earlier call's matching of this grid (no batch axis)
            call.match = self.reuse.take(call.reuse_key)
        return call

    def describe(self, head: str) -> List[str]:
        """What the patch does, one line each: ``head`` (the host's words for what it patched) with the settings every
        DiT patch shares, its notes (e.g. balanced attention run plain under an attention that drops masks), then
        each call shape the speed check decided."""
        config = self.config
        if config.match_every > 1:
            head += f", each matching reused for {config.match_every} model calls"
        if config.speed_check == "off":
            return [head + "; speed check off: every call is reduced"] + self.notes
        return [head + f"; speed check {config.speed_check}: each call shape is timed once per device (the model call "
                "whole against reduced) and left whole where reducing it measured slower"
                + (" (auto: on a GPU)" if config.speed_check == "auto" else "")] + self.notes + (
            self.describe_verdicts() or ["no call decided yet (decided at the first call)"])

    def describe_verdicts(self) -> list:
        """One line per call shape the speed check decided."""
        return [f"{label}: {found.text(self.config.mode)}" for label, found in self.verdicts.items()]

    def verdict_records(self) -> list:
        """``describe_verdicts`` as plain values: per decided call shape its words and the verdict's ``record``."""
        return [dict(found.record(), call=label) for label, found in self.verdicts.items()]

    def warn_once(self, key: str, message: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            _LOG.warning(message)

    def _generator(self, grid: Tuple[int, ...], step_key: float) -> "torch.Generator | None":
        """A generator seeded like UNets' partitions (seed, step_key, grid); None for centre picks (no use_rand)."""
        if not self.config.use_rand:
            return None
        rows = grid[-2] * (grid[0] if len(grid) == 3 else 1)
        return torch.Generator().manual_seed(partition_seed(self.config.seed, step_key, rows, grid[-1]))

    def _draw(self, key: Tuple, grid: Tuple[int, ...], step_key: Any, device: torch.device,
              build: Callable[[Optional[torch.Generator]], torch.Tensor]) -> torch.Tensor:
        return draw_table(self._cache, key + (str(device),), step_key, device, self.config, build,
                          lambda k: self._generator(grid, float(k)), self._step)

    def keep_for(self, layout: TokenLayout, step_key: Any, device: torch.device) -> torch.Tensor:
        """Kept sequence indices of a call: one of the seeded candidates of (layout, device), the one the step
        draws (``draw_table``: a step tensor is hashed on its device, never read), so both CFG halves and separate
        cond/uncond calls pick alike."""
        window = dit_window(self.config.ratio, layout.grid, self.config.sx, self.config.sy)
        return self._draw(("keep", layout), layout.grid, step_key, device,
                          lambda generator: keep_index(layout, pick_index_nd(layout.grid, window, generator)))

    def destinations_for(self, grid: Tuple[int, ...], window: Tuple[int, ...], step_key: Any,
                         device: torch.device) -> torch.Tensor:
        """Mode merge's destinations: one grid token per window, drawn like ``keep_for``."""
        return self._draw(("merge", grid, window), grid, step_key, device,
                          lambda generator: pick_index_nd(grid, window, generator))
