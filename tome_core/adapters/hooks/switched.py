"""Hooks registered only while a model call uses them: a call ToMe leaves whole runs no ToMe code in its blocks.

On a fast GPU a step is bound by launching kernels from Python, and a module with any hook takes PyTorch's slow
call path, so a hook that only returns is still paid in every block of every step. A patch therefore keeps its
block hooks here and registers them when a call reduces something (``attach``), removing them again when a call
reduces nothing (a level or a call shape the speed check left whole, a step outside the schedule). In a steady
sampling run every call does the same, so they are registered once.

Under torch.compile, dynamo does not guard the hooks of a module it inlines (``skip_nnmodule_hook_guards``): a graph
traced with ToMe's block hooks would run on after they were removed, and one traced without them would ignore them.
It does guard a module's instance ``forward`` (whether there is one, its code and what its closure holds). So while
its hooks are registered, each hooked module holds a ``forward`` of ToMe's that calls the one it had and reads the
patch's serial (``_Marked``; one Python call per hooked module, only in calls ToMe reduces): a compiled model retraces
when ToMe's hooks come or go or another patch replaces them, and keeps the graph of each state it has seen (switching
back costs nothing).
"""
from __future__ import annotations

import functools
import itertools
import types
from typing import Any, Callable, Dict, List, Optional, Protocol, Tuple

import torch

from .host_caches import cache_slot


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

    kind "around": hook is (pre, post), run by the module's marked ``forward`` itself around its own, not registered
    with torch: pre(module, args, kwargs) may return new (args, kwargs); post(module, args, output) may return a new
    output, and runs also when the forward raised (output None). What the DiT patches use: torch's own hook dispatch
    looks a kwargs or always-called hook up by its handle's id, a guard of dynamo's that differs in every block
    instance (under diffusers' regional recipe, one graph per instance, past dynamo's recompile limit at released
    depth), and a block that diffusers' regional recipe compiles runs its torch hooks outside the compiled graph
    (torch.nn's call path is not traced), each a graph of its own; the marked forward is traced with the block.
    """

    def __init__(self) -> None:
        self.hooks: List[Tuple[torch.nn.Module, Callable, str, frozenset]] = []
        self.handles: List[Removable] = []
        self.attached = False
        self.marks: Dict[int, _Marked] = {}  # id(module) -> its marked forward while attached
        self.serial = next(_SERIALS)
        self._put: Optional[List[_Marked]] = None  # the marks ``attach`` puts (``_outermost``)

    def add(self, module: torch.nn.Module, hook: Any, kind: str) -> None:
        mark = self.marks.setdefault(id(module), _Marked(module, self.serial))
        self._put = None
        if kind == "around":
            mark.around = hook
            return
        self.hooks.append((module, hook, kind, frozenset(_hook_dict(module, kind))))

    def _outermost(self) -> List[_Marked]:
        """The marks to put: a mark that only tells dynamo the hooks changed is left off a module inside another
        marked module of these hooks (its hooks come and go with that one's, whose mark dynamo guards where it traces
        the inner module's hooks): a UNet block's attn1 costs no call of its own. A mark that runs hooks stays."""
        if self._put is None:
            inner = {id(sub) for mark in self.marks.values() for sub in mark.module.modules() if sub is not mark.module}
            self._put = [mark for key, mark in self.marks.items() if mark.around is not None or key not in inner]
        return self._put

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
        for mark in self._outermost():
            mark.put()
        self.attached = True

    def remove(self) -> None:
        for handle in self.handles:
            handle.remove()
        self.handles.clear()
        for mark in self.marks.values():
            mark.take()
        self.attached = False


def compiled_with_fullgraph(module: torch.nn.Module) -> bool:
    """Whether ``module.compile(fullgraph=True)`` compiled ``module`` itself (read from its compile context, duck typed:
    the closure object that carries ``fullgraph``)."""
    compiled = module.__dict__.get("_compiled_call_impl")
    for cell in getattr(compiled, "__closure__", None) or ():
        try:
            if getattr(cell.cell_contents, "fullgraph", None) is True:
                return True
        except ValueError:  # an empty cell
            continue
    return False


_NONE = object()
_SERIALS = itertools.count(1)  # one per SwitchedHooks, never reused (object ids are, once an object is freed)


def _marked_forward(serial: int, call: Callable, module: torch.nn.Module,
                    around: Optional[Tuple[Callable, Callable]]) -> Callable:
    """A ``forward`` that calls ``call`` (the module's own), with ``around``'s pre and post about it where given; it
    reads ``serial``, so dynamo guards the serial's value (never an id), and shows ``call``'s name and signature
    (``inspect.signature`` follows ``__wrapped__``)."""
    if around is None:
        def forward(*args: Any, **kwargs: Any) -> Any:
            if serial:
                return call(*args, **kwargs)
            return None
    else:
        pre, post = around

        def forward(*args: Any, **kwargs: Any) -> Any:
            if not serial:  # never: read so that dynamo guards the serial (two patches' hooks share their code)
                return call(*args, **kwargs)
            changed = pre(module, args, kwargs)
            if changed is not None:
                args, kwargs = changed
            try:
                output = call(*args, **kwargs)
            except BaseException:
                post(module, args, None)
                raise
            result = post(module, args, output)
            return output if result is None else result

    return functools.update_wrapper(forward, call)


class _Marked:
    """One module's marked ``forward`` while a patch's hooks are on it: made once per patch and module, and made again
    at an attach where the module's own ``forward`` changed since (an instance forward set or removed by another
    library, or its class's swapped: the WebUI swaps ``CrossAttention.forward`` on the class when its attention
    optimisation changes, between generations, while the extension patches per generation). Taken away only while it
    is still the module's (a wrapper another library set over it since keeps calling it, which changes nothing).

    Dynamo guards an instance ``forward`` by its code and closure: the serial tells this patch's graphs from those of
    a patch applied before (two patches' hook functions share their code), and a graph traced without ToMe's hooks
    (no instance ``forward``) from one traced with them. The call is a bound method captured here, which dynamo
    traces into (a class attribute looked up at each call would break its graph).
    """

    def __init__(self, module: torch.nn.Module, serial: int) -> None:
        self.module, self.serial = module, serial
        self.under: Any = _NONE  # what the mark calls, as it was where the mark went (_NONE: the class's forward)
        self.function: Any = None  # its class's forward when the mark was made
        self.mark: Any = None
        self.around: Optional[Tuple[Callable, Callable]] = None  # (pre, post) the mark runs about the forward

    def put(self) -> None:
        """The mark as the module's ``forward``; or, where a diffusers step cache hooks the module, under that hook
        in diffusers' chain (``host_caches.cache_slot``), so the cache sees the module's own inputs and outputs."""
        module = self.module
        slot = cache_slot(module)
        if slot is not None:
            holder, attr = slot
            current = getattr(holder, attr)
            if current is self.mark and current is not None:
                return
            if self.mark is None or current is not self.under:
                self.under, self.function = current, None
                self.mark = _marked_forward(self.serial, current, module, self.around)
            setattr(holder, attr, self.mark)
            return
        own = module.__dict__.get("forward", _NONE)
        if own is self.mark and own is not None:
            return
        function = type(module).forward
        if self.mark is None or own is not self.under or (own is _NONE and function is not self.function):
            self.under, self.function = own, function
            call = types.MethodType(function, module) if own is _NONE else own
            self.mark = _marked_forward(self.serial, call, module, self.around)
        module.forward = self.mark

    def take(self) -> None:
        """The mark taken out wherever it still is: the module's ``forward``, or a reference in diffusers' hook chain
        (where a cache hook registered over it, or removed from over it, left it)."""
        module, mark = self.module, self.mark
        if mark is None:
            return
        if module.__dict__.get("forward") is mark:
            if self.under is _NONE:
                del module.forward
            else:
                module.forward = self.under
            return
        for ref in getattr(module.__dict__.get("_diffusers_hook"), "_fn_refs", None) or ():
            for attr in ("original_forward", "forward"):
                if getattr(ref, attr, None) is mark:
                    setattr(ref, attr, types.MethodType(type(module).forward, module) if self.under is _NONE
                            else self.under)
                    return


def enter_for(modes: List[Any], mode: Any) -> None:
    """Enter a ``TorchFunctionMode`` for one module's forward only (kept on ``modes`` until ``exit_for``). A stack, not
    a map by module: the modules it serves never nest, and a module's id read in a hook would be a guard of dynamo's,
    one graph per block instance under regional compilation."""
    mode.__enter__()
    modes.append(mode)


def exit_for(modes: List[Any]) -> Any:
    """Leave the mode ``enter_for`` entered last; returns it (None where none was entered)."""
    if not modes:
        return None
    mode = modes.pop()
    mode.__exit__(None, None, None)
    return mode
