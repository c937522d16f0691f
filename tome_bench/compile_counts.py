"""What torch.compile made of a model: dynamo's own counters, read the same way by the bench and the tests.

A model compiles *whole* when dynamo traced it into its graphs without a graph break and without giving up on a frame
(a frame it gave up on runs eagerly: "falling back to eager"). Dynamo counts each in ``torch._dynamo.utils.counters``:
``stats.unique_graphs`` the graphs compiled, ``graph_break`` each break by its reason, ``unimplemented`` each construct
it could not trace that did not become a graph break (the frame was skipped). The counts are the same whatever the
backend (``eager`` counts what inductor would), so the tests count with the cheap one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import List


@dataclass(frozen=True)
class CompileCounts:
    """graphs compiled, graph breaks, constructs that left a frame to eager; ``reasons``: the first line of each."""

    graphs: int
    breaks: int
    to_eager: int
    reasons: tuple = ()

    @classmethod
    def now(cls) -> "CompileCounts":
        """The counts since the last ``reset()`` (``torch._dynamo.reset`` does not clear them)."""
        from torch._dynamo.utils import counters

        breaks, skipped = counters["graph_break"], counters["unimplemented"]
        reasons: List[str] = sorted({key.strip().splitlines()[0][:200] for key in list(breaks) + list(skipped)})
        return cls(counters["stats"]["unique_graphs"], sum(breaks.values()), sum(skipped.values()), tuple(reasons))

    @property
    def whole(self) -> bool:
        return self.breaks == 0 and self.to_eager == 0

    def minus(self, before: "CompileCounts") -> "CompileCounts":
        reasons = tuple(r for r in self.reasons if r not in before.reasons)
        return CompileCounts(self.graphs - before.graphs, self.breaks - before.breaks,
                             self.to_eager - before.to_eager, reasons)

    def text(self) -> str:
        return f"{self.graphs} graph(s), {self.breaks} graph break(s), {self.to_eager} to eager"


def reset() -> None:
    """Forget every compiled graph and every count (each case compiles from nothing)."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    torch._dynamo.reset()
    counters.clear()
