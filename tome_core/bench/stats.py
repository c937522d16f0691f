"""Statistics that hold up on a busy machine: paired per-round ratios, a noise band, and a
ranking that says "too noisy to rank" rather than guess.

Every round runs all methods back to back (interleaved), so machine load that drifts between
rounds hits vanilla and the method alike; the per-round ratio ``t_vanilla / t_method`` cancels
it. The noise band of a method is ``median +- Z * robust_sd / sqrt(n)`` of those ratios (robust
sd = 1.4826 * median absolute deviation): like a boxplot notch, it narrows as rounds are added,
so more rounds can separate methods that one or two rounds could not. Vanilla's band is exactly
1.0. Methods (vanilla included) whose bands overlap, directly or through a chain, form one tier:
a tier of one gets a rank, the members of a bigger tier are "too noisy to rank" against each
other.
"""
from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

Z = 2.0  # band half-width in standard errors (about 95 % for normal noise)
TOO_NOISY = "too noisy to rank"
ONE_ROUND = "1 round: unranked"


@dataclass(frozen=True)
class Ratio:
    """Per-round speed-ups of one method over vanilla: median and noise band."""

    median: float
    low: float
    high: float
    n: int

    @property
    def half_width(self) -> float:
        return (self.high - self.low) / 2


def paired_speedups(t_vanilla: list[float], t_method: list[float]) -> list[float]:
    """``t_vanilla[i] / t_method[i]`` for each round i (both timed in the same round)."""
    if len(t_vanilla) != len(t_method) or not t_vanilla:
        raise ValueError(f"need the same non-zero number of rounds, got {len(t_vanilla)} "
                         f"and {len(t_method)}")
    return [tv / tm for tv, tm in zip(t_vanilla, t_method)]


def ratio_stats(speedups: list[float]) -> Ratio:
    """Median and noise band of per-round speed-ups (band of zero width for one round)."""
    med = statistics.median(speedups)
    n = len(speedups)
    mad = statistics.median(abs(s - med) for s in speedups)
    half = Z * 1.4826 * mad / math.sqrt(n)
    return Ratio(med, med - half, med + half, n)


def tiers(ratios: dict[str, Ratio]) -> list[list[str]]:
    """Methods sorted fastest first, grouped where noise bands overlap (chained)."""
    order = sorted(ratios, key=lambda k: ratios[k].median, reverse=True)
    groups: list[list[str]] = []
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


def ranking(ratios: dict[str, Ratio]) -> dict[str, str]:
    """'1', '2', ... for methods separated from all others by their noise bands (1 = fastest),
    else :data:`TOO_NOISY`; :data:`ONE_ROUND` for all when there is no noise estimate (one
    round). ``ratios`` should include vanilla (``Ratio(1, 1, 1, n)``)."""
    if any(r.n < 2 for r in ratios.values()):
        return dict.fromkeys(ratios, ONE_ROUND)
    result: dict[str, str] = {}
    for i, group in enumerate(tiers(ratios), start=1):
        for name in group:
            result[name] = str(i) if len(group) == 1 else TOO_NOISY
    return result


def unsettled(ratios: dict[str, Ratio]) -> list[str]:
    """Methods that more rounds could still separate: those in a tier of more than one (a
    band crossing vanilla's 1.0 is such an overlap). Empty when the ranking is settled."""
    return [name for group in tiers(ratios) if len(group) > 1 for name in group]


def vanilla_ratio(n: int) -> Ratio:
    return Ratio(1.0, 1.0, 1.0, n)


def summarize(times: dict[str, list[float]], vanilla: str = "vanilla") -> dict[str, Ratio]:
    """Per-method :class:`Ratio` from per-round times (``times[vanilla]`` is the reference)."""
    base = times[vanilla]
    return {name: vanilla_ratio(len(base)) if name == vanilla
            else ratio_stats(paired_speedups(base, t)) for name, t in times.items()}
