"""diffusers' context parallelism as ToMe's engine sees it: the split of a call's sequence (``engine.slices``), read
from the model's own parallel config, and what ToMe refuses under it.

``enable_parallelism`` puts diffusers' split hooks (``_cp_plan``) inside the module's forward, so ToMe's forward
pre-hook on the transformer reads the whole, unsplit call on every process, and every process derives the same
layout and plan from it (mode merge: each process its own band, ``engine.slices``). The split is read from
``_parallel_config.context_parallel_config``: its flattened mesh is the group diffusers chunks the sequence over
(``EquipartitionSharder``), this process's chunk its local rank. It is read at every call (a model may be made
parallel after ``apply_patch``) and refused, naming the setting and what works, before any block of the first call
runs: never a silent no-op, a mid-run crash or a hang.
"""
from __future__ import annotations

from typing import Any, Callable, Optional

import torch

from ...catalogue.diffusers_lookup import bindings, family_of
from ...catalogue.families import family_of_binding
from ...engine.config import ToMeConfig
from ...engine.grid import TokenLayout
from ...engine.slices import SequenceSlices


def context_slices(model: torch.nn.Module) -> Optional[SequenceSlices]:
    """The split of ``model``'s calls across processes, None where it runs on one."""
    config = getattr(getattr(model, "_parallel_config", None), "context_parallel_config", None)
    mesh = getattr(config, "_flattened_mesh", None)
    if mesh is None or mesh.size() <= 1:
        return None
    ring, ulysses = config.ring_degree or 1, config.ulysses_degree or 1
    uneven = bool(getattr(config, "ulysses_anything", False) or getattr(config, "ring_anything", False))
    setting = f"context parallelism (ulysses_degree={ulysses}, ring_degree={ring}" + \
        (", uneven chunks)" if uneven else ")")
    return SequenceSlices(mesh.size(), mesh.get_local_rank(), ring=ring > 1, uneven=uneven, setting=setting,
                          ulysses=ulysses,
                          agree=_agreement(mesh.get_group(), model))


def _agreement(group: Any, model: torch.nn.Module) -> Callable[[float, str], float]:
    """The split's collective for the speed check: a value's max or min over the group's processes (one all-reduce
    of one number, on the model's device: NCCL takes CUDA tensors only; asked only while the speed check decides)."""
    import torch.distributed as dist

    def agree(value: float, how: str) -> float:
        found = torch.full((1,), float(value), dtype=torch.float64, device=next(model.parameters()).device)
        dist.all_reduce(found, op=dist.ReduceOp.MAX if how == "max" else dist.ReduceOp.MIN, group=group)
        return float(found.item())
    return agree


def context_parallel_names() -> str:
    """The diffusers families ToMe reduces under context parallelism, for messages."""
    return ", ".join(binding.name for binding in bindings() if binding.context_parallel)


def refuse(model: torch.nn.Module, config: ToMeConfig, layout: Any = None) -> Optional[SequenceSlices]:
    """The split of ``model``'s calls (None: one process), after refusing what ToMe cannot reduce under it: a family
    whose split ToMe does not know, a mode or attention it cannot follow, a ``layout`` (where read) that does not
    split evenly."""
    slices = context_slices(model)
    if slices is None or not config.enabled:
        return slices
    family, name = family_of(model), type(model).__name__
    heads = slices.heads_refusal(getattr(getattr(model, "config", None), "num_attention_heads", None))
    if heads:
        raise ValueError(f"ToMe: {name} under {slices.setting}: {heads}.")
    if family is None or not family.context_parallel:
        why = (f"ToMe does not know how it splits {name}'s tokens; under context parallelism ToMe reduces "
               f"{context_parallel_names()}")
    elif config.mode == "merge":
        stream = None if layout is None else TokenLayout(layout.grid, prefix=layout.before, suffix=layout.after)
        text = 0 if layout is None or family.text == "separate" else layout.text  # Wan's text is not split
        why = slices.refusal("merge", stream, text, (config.sy, config.sx),
                             family_of_binding(family).attention_for(config))
    else:
        why = slices.refusal(config.mode, layout if isinstance(layout, TokenLayout) else None)
    if why:
        raise ValueError(f"ToMe: {name} under {slices.setting}: {why}; or remove_patch() to run it without ToMe.")
    return slices
