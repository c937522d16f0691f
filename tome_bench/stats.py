"""Statistics that never say more than the measurement supports: a speed-up that agrees with the
printed median times, a noise band that widens with measured interference, and a ranking that
says "too noisy" rather than guess.

Every round runs all methods back to back (interleaved). The reported speed-up of a method is
``median(t_vanilla) / median(t_method)``, so it is what the printed median times say. Its band is
built from three measured parts:

1. sampling noise of the per-round paired ratios ``t_vanilla[i] / t_method[i]``:
   ``t * 1.4826 * MAD / sqrt(n)`` with the Student-t 97.5 % quantile for ``n - 1`` degrees of
   freedom (n = 2: 12.7, 3: 4.3, 5: 2.8, many: 2.0), so two rounds that happen to agree do not
   make a narrow band;
2. disagreement between the two estimators: the band is widened by ``|paired median - speed-up|``,
   so it holds both (they differ when load changes within a round);
3. interference ``w``: the share of a forward's time lost to other work, per round the larger of
   vanilla's stretch over its fastest round (``1 - min(t_vanilla) / t_vanilla[i]``) and the
   measured CPU wait of the paired forwards (time their threads were runnable but waiting for a
   core, ``measure.cpu_wait``); ``w`` is its median over rounds. A time that lost a share ``w``
   may be off by a factor ``1 / (1 - w)`` either way, so the half-width ``h`` becomes
   ``(h + speedup * w) / (1 - w)``, which covers that worst case on both sides.

Vanilla's band is exactly 1.0. Methods (vanilla included) whose bands overlap, directly or
through a chain, form a tier: ranks are places (1 = fastest), a tier shares its places
("2-3 (tied)"), one tier for all is "too noisy to rank", and when other work took
:data:`BUSY_SHARE` or more of the time nothing is ranked: "too noisy: machine busy".
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Hashable, Sequence

TOO_NOISY = "too noisy to rank"
ONE_ROUND = "1 round: unranked"
BUSY = "too noisy: machine busy"
# a third of the time lost: a 1.5x speed-up could then be vanilla's own time stretched
BUSY_SHARE = 1 / 3
# Student-t 97.5 % quantiles for 1..10 degrees of freedom (two-sided 95 % bands)
_T975 = (12.706, 4.303, 3.182, 2.776, 2.571, 2.447, 2.365, 2.306, 2.262, 2.228)


@dataclass(frozen=True)
class Ratio:
    """Speed-up of one method over vanilla and its band.

    ``median``: the reported speed-up (ratio of median times); ``paired``: median of the
    per-round paired ratios; ``interference``: the share of time lost to other work (0..1)."""

    median: float
    low: float
    high: float
    n: int
    paired: float | None = None
    interference: float = 0.0

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def t_quantile(n: int) -> float:
    """Two-sided 95 % Student-t factor for a band from ``n`` values (``n - 1`` degrees of freedom)."""
    df = n - 1
    if df < 1:
        raise ValueError(f"a band needs at least 2 values, got {n}")
    if df <= len(_T975):
        return _T975[df - 1]
    z = 1.959964  # Cornish-Fisher expansion in 1/df: within 0.001 of the exact value beyond 10
    return (z + (z ** 3 + z) / (4 * df) + (5 * z ** 5 + 16 * z ** 3 + 3 * z) / (96 * df ** 2)
            + (3 * z ** 7 + 19 * z ** 5 + 17 * z ** 3 - 15 * z) / (384 * df ** 3))


def paired_speedups(t_vanilla: Sequence[float], t_method: Sequence[float]) -> list[float]:
    """``t_vanilla[i] / t_method[i]`` for each round i (both timed in the same round)."""
    if len(t_vanilla) != len(t_method) or not t_vanilla:
        raise ValueError(f"need the same non-zero number of rounds, got {len(t_vanilla)} "
                         f"and {len(t_method)}")
    return [tv / tm for tv, tm in zip(t_vanilla, t_method)]


def ratio_stats(speedups: Sequence[float]) -> Ratio:
    """Median and sampling band of per-round speed-ups (zero width for one round: no estimate)."""
    med = statistics.median(speedups)
    n = len(speedups)
    if n < 2:
        return Ratio(med, med, med, n, paired=med)
    mad = statistics.median(abs(s - med) for s in speedups)
    half = t_quantile(n) * 1.4826 * mad / math.sqrt(n)
    return Ratio(med, med - half, med + half, n, paired=med)


def stretch(times: Sequence[float]) -> list[float]:
    """Per round, the share of its time beyond the fastest round: ``1 - min(times) / t``."""
    fastest = min(times)
    return [1 - fastest / t if t > 0 else 0.0 for t in times]


def interference(t_vanilla: Sequence[float], *cpu_waits: Sequence[float | None] | None) -> float:
    """Median over rounds of the share of time lost to other work: vanilla's stretch over its
    fastest round, or the measured CPU-wait share of any of the given forwards, if larger."""
    per_round = stretch(t_vanilla)
    for waits in cpu_waits:
        if waits is not None:
            per_round = [max(s, w) if w is not None else s for s, w in zip(per_round, waits)]
    return min(max(statistics.median(per_round), 0.0), 1.0)


def compare(t_vanilla: Sequence[float], t_method: Sequence[float],
            wait_vanilla: Sequence[float | None] | None = None,
            wait_method: Sequence[float | None] | None = None) -> Ratio:
    """Speed-up of a method over vanilla from per-round times (same rounds), with its band.

    ``wait_*``: per-round share of each forward's time its threads waited for a CPU (None:
    not measured). See the module docstring for how the band is built."""
    paired = ratio_stats(paired_speedups(t_vanilla, t_method))
    point = statistics.median(t_vanilla) / statistics.median(t_method)
    w = interference(t_vanilla, wait_vanilla, wait_method)
    if w >= 1:
        return Ratio(point, 0.0, math.inf, paired.n, paired.median, w)
    half = paired.half_width + abs(paired.median - point)
    half = (half + point * w) / (1 - w)
    return Ratio(point, max(point - half, 0.0), point + half, paired.n, paired.median, w)


def vanilla_ratio(n: int, interference: float = 0.0) -> Ratio:
    return Ratio(1.0, 1.0, 1.0, n, 1.0, interference)


def summarize(times: dict, vanilla: Hashable = "vanilla", cpu_waits: dict | None = None) -> dict:
    """Per-method :class:`Ratio` from per-round times (``times[vanilla]`` is the reference);
    ``cpu_waits``: per-method per-round CPU-wait shares (see :func:`compare`)."""
    waits = cpu_waits or {}
    base = times[vanilla]
    out = {}
    for name, t in times.items():
        if name == vanilla:
            out[name] = vanilla_ratio(len(base), interference(base, waits.get(vanilla)))
        else:
            out[name] = compare(base, t, waits.get(vanilla), waits.get(name))
    return out


def busy(ratios: dict) -> bool:
    """Whether other work took so much of the time that no order can be concluded."""
    return any(r.interference >= BUSY_SHARE for r in ratios.values())


def tiers(ratios: dict) -> list[list]:
    """Methods sorted fastest first, grouped where noise bands overlap (chained)."""
    order = sorted(ratios, key=lambda k: ratios[k].median, reverse=True)
    groups: list[list] = []
    lowest = math.inf  # lowest band edge in the current group
    for name in order:
        r = ratios[name]
        if groups and r.high >= lowest:
            groups[-1].append(name)
        else:
            groups.append([name])
            lowest = math.inf
        lowest = min(lowest, r.low)
    return groups


def ranking(ratios: dict) -> dict:
    """Places, 1 = fastest: ``'2'`` for a method separated from all others by its band,
    ``'2-3 (tied)'`` for the members of a tier whose bands overlap; :data:`TOO_NOISY` for all
    when every band overlaps (nothing ranked), :data:`ONE_ROUND` with no noise estimate,
    :data:`BUSY` when other work took too much of the time. ``ratios`` includes vanilla."""
    if any(r.n < 2 for r in ratios.values()):
        return dict.fromkeys(ratios, ONE_ROUND)
    if busy(ratios):
        return dict.fromkeys(ratios, BUSY)
    groups = tiers(ratios)
    if len(groups) == 1:
        return dict.fromkeys(ratios, TOO_NOISY)
    result, place = {}, 1
    for group in groups:
        last = place + len(group) - 1
        for name in group:
            result[name] = str(place) if len(group) == 1 else f"{place}-{last} (tied)"
        place = last + 1
    return result


def unsettled(ratios: dict) -> list:
    """Methods that more rounds could still separate: all of them without a noise estimate
    (one round) or on a busy machine, else those in a tier of more than one (a band crossing
    vanilla's 1.0 is such an overlap). Empty when the ranking is settled."""
    if any(r.n < 2 for r in ratios.values()) or busy(ratios):
        return list(ratios)
    return [name for group in tiers(ratios) if len(group) > 1 for name in group]


def is_rank(text: str | None) -> bool:
    """Whether a row's rank text names a single place (a conclusion), not a tie or a refusal."""
    return bool(text) and text.isdigit()
