"""The device-independent cost of a patch: ATen ops dispatched and bytes gathered/scattered (``--ops``).

On a GPU with fused attention every extra kernel launch and every pass over the tokens is paid
in full, and the attention a reduction saves is a small share of the step; on the CPU attention
dominates and hides both. So the benchmark counts, for one model forward right after the patch
is applied, a second one that reuses what the first built for the step (as every later model call
of a sampling step does), and reports the second, and what the first added:

- ``aten_ops``: ATen ops dispatched (views included: each is a dispatch, and on CUDA most of the
  rest are kernel launches);
- ``moved_mib``: MiB of the tensors produced by gather / scatter / index ops (an in-place one:
  the tensor written into), the data a merge moves that attention does not;
- ``host_syncs``: ops that make the host wait for the device (``.item()`` and the like);
- ``tome_calls``: Python calls into ``tome_core`` during the forward (``sys.setprofile``): hooks and the
  functions they call, each paid in full as launch time on a fast GPU, even where ToMe reduces nothing.

Counted under a ``TorchDispatchMode`` below autograd, on whatever device the run uses, along the
code path a GPU takes (the CPU's matching scores only the sources, see ``merge.match_tokens``; while
counting, every device takes the GPU's path), so they are the GPU cost's proxy where no GPU is at hand.
"""
from __future__ import annotations

import os
import sys
from collections import Counter
from dataclasses import dataclass, field
from typing import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import tome_core
from tome_core.engine import merge

TOME_CORE_DIR = os.path.dirname(os.path.abspath(tome_core.__file__))

MOVING_OPS = ("gather", "scatter", "index", "take", "masked_select", "put")
SYNC_OPS = ("_local_scalar_dense", "item", "nonzero", "unique", "_assert_async")


def _moves(name: str) -> bool:
    return any(part in name for part in MOVING_OPS)


@dataclass
class OpCount:
    """What one counted call dispatched."""

    ops: Counter = field(default_factory=Counter)        # op name -> times dispatched
    moved: Counter = field(default_factory=Counter)      # op name -> bytes produced
    syncs: int = 0
    tome_calls: int = 0  # Python calls into tome_core

    @property
    def total(self) -> int:
        return sum(self.ops.values())

    @property
    def moved_mib(self) -> float:
        return sum(self.moved.values()) / 2**20

    def added_over(self, base: "OpCount") -> dict:
        """Per op name, how many more times it ran than in ``base`` (only the ones that differ)."""
        diff = Counter(self.ops)
        diff.subtract(base.ops)
        return {name: n for name, n in sorted(diff.items()) if n}


class _Counting(TorchDispatchMode):
    def __init__(self, count: OpCount) -> None:
        super().__init__()
        self.count = count

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        self.count.ops[name] += 1
        if name in SYNC_OPS:
            self.count.syncs += 1
        if _moves(name):
            outs = out if isinstance(out, (tuple, list)) else (out,)
            self.count.moved[name] += sum(o.numel() * o.element_size() for o in outs
                                          if isinstance(o, torch.Tensor))
        return out


def count_ops(fn: Callable[[], torch.Tensor]) -> tuple[OpCount, torch.Tensor]:
    """Run ``fn()`` once and count what it dispatched; returns (count, its result)."""
    count, device_paths = OpCount(), merge.GATHER_SOURCES_ON
    merge.GATHER_SOURCES_ON = ()  # the GPU's code path
    try:
        with _Counting(count):
            out = fn()
    finally:
        merge.GATHER_SOURCES_ON = device_paths
    count.tome_calls = count_tome_calls(fn)
    return count, out


def count_tome_calls(fn: Callable[[], object]) -> int:
    """Run ``fn()`` once and count the Python calls it makes into functions defined in ``tome_core``."""
    return count_python_calls(fn, TOME_CORE_DIR)


def count_python_calls(fn: Callable[[], object], under: str = "") -> int:
    """Run ``fn()`` once and count the Python calls it makes into functions defined in files under ``under`` (every
    one where it is empty: a host's property walking the model on each call costs as much as ToMe's own code)."""
    calls = [0]

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename.startswith(under):
            calls[0] += 1

    previous = sys.getprofile()
    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(previous)
    return calls[0]


def row_fields(count: OpCount, first: OpCount, vanilla: OpCount) -> dict:
    """The row's op columns: ``count`` (a forward of a step already begun) against ``vanilla``'s, what
    the patch added and by which ops, and what the step's first forward (``first``) added on top."""
    return {"aten_ops": count.total, "aten_ops_added": count.total - vanilla.total,
            "step_table_ops": first.total - count.total,
            "moved_mib": round(count.moved_mib, 2),
            "moved_mib_added": round(count.moved_mib - vanilla.moved_mib, 2),
            "host_syncs": count.syncs, "tome_calls": count.tome_calls,
            "ops_added_by_name": count.added_over(vanilla)}
