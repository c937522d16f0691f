"""Hooks registered only while a model call uses them: a call ToMe leaves whole runs no ToMe code in its blocks.

On a fast GPU a step is bound by launching kernels from Python, and a module with any hook takes PyTorch's slow
call path, so a hook that only returns is still paid in every block of every step. A patch therefore keeps its
block hooks here and registers them when a call reduces something (``attach``), removing them again when a call
reduces nothing (a level or a call shape the speed check left whole, a step outside the schedule). In a steady
sampling run every call does the same, so they are registered once.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Protocol, Tuple

import torch


class Removable(Protocol):
    """A hook handle, or anything else a patch adds that ``remove()`` takes away again."""

    def remove(self) -> None: ...


def _hook_dict(module: torch.nn.Module, kind: str):
    return module._forward_pre_hooks if kind.startswith("pre") else module._forward_hooks


class SwitchedHooks:
    """Hooks of some modules, registered while ``attached``.

    hooks: (module, hook, kind, earlier) with kind "pre" (a pre-hook taking kwargs), "pre-plain" (a pre-hook without
    them), "post", "post-always" (a forward hook that also runs when the forward raised) or "post-always-kwargs" (and
    takes the call's kwargs), and earlier the ids of the module's hooks of that kind that were there when the patch
    was applied: registered later, ToMe's hook still runs where it would have run had it stayed (after those, before
    any hook appended since; a hook prepended since stays first).
    """

    def __init__(self) -> None:
        self.hooks: List[Tuple[torch.nn.Module, Callable, str, frozenset]] = []
        self.handles: List[Removable] = []
        self.attached = False

    def add(self, module: torch.nn.Module, hook: Callable, kind: str) -> None:
        self.hooks.append((module, hook, kind, frozenset(_hook_dict(module, kind))))

    def switch(self, on: bool) -> None:
        """Registered iff ``on``; nothing is done where that is already so (the steady state)."""
        if on != self.attached:
            self.attach() if on else self.remove()

    def attach(self) -> None:
        for module, hook, kind, earlier in self.hooks:
            if kind in ("pre", "pre-plain"):
                handle = module.register_forward_pre_hook(hook, with_kwargs=kind == "pre")
            else:
                handle = module.register_forward_hook(hook, always_call=kind.startswith("post-always"),
                                                      with_kwargs=kind.endswith("kwargs"))
            self.handles.append(handle)
            # ToMe's hook goes where it stood when the patch was applied: right after the last of the hooks there
            # then; hooks added since after it, as they were, unless one was put first (``prepend``)
            hooks = _hook_dict(module, kind)
            keys = list(hooks)
            last = max((i for i, key in enumerate(keys) if key in earlier), default=-1)
            for key in keys[last + 1:]:
                if key != handle.id:
                    hooks.move_to_end(key)
        self.attached = True

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        self.attached = False


def enter_for(modes: Dict[int, Any], module: torch.nn.Module, mode: Any) -> None:
    """Enter a ``TorchFunctionMode`` for ``module``'s forward only (kept under its id until ``exit_for``)."""
    mode.__enter__()
    modes[id(module)] = mode


def exit_for(modes: Dict[int, Any], module: torch.nn.Module) -> Any:
    """Leave the mode entered for ``module``'s forward; returns it (None where none was entered)."""
    mode = modes.pop(id(module), None)
    if mode is not None:
        mode.__exit__(None, None, None)
    return mode
