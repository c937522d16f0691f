"""A DiT family's reading of a model call, remembered while the call's inputs stay the same objects.

Reading where the image tokens sit can copy small device tensors to the host (Flux's ``img_ids``, Flux.2's,
LongCat's, Krea 2's and Ideogram 4's position ids): a host sync per model call. A pipeline passes the same ids
tensor at every step, so the reading is remembered, keyed by every argument: the identity, version and shape
of each tensor (only the shape of those that change every step without being read: the latents and the
timestep), the value of each plain argument, and the same, element by element, inside lists, tuples and dicts
(Z-Image passes its latents and captions as lists). Any other object is keyed by its identity and type, never
by its text: ``repr`` of a list of CUDA tensors formats their values, which copies them to the host and syncs
(Z-Image lost 3x per call on an H200 to exactly that, invisible to a dispatch-mode op count because tensor
formatting disables the current dispatch modes).
"""
from __future__ import annotations

from typing import Any, Callable, Optional, Tuple

import torch

_PLAIN = (int, float, complex, str, bytes, bool, type(None), torch.dtype, torch.device)


def _part(name: Any, value: Any, by_shape: bool) -> Tuple:
    """The key of one argument: never reads a tensor's values."""
    if isinstance(value, torch.Tensor):
        return (name, tuple(value.shape), value.dtype) if by_shape else \
            (name, id(value), value._version, tuple(value.shape))
    if isinstance(value, _PLAIN):
        return (name, value)
    if isinstance(value, (list, tuple)):
        return (name, type(value).__name__, len(value)) + tuple([_part(i, v, by_shape) for i, v in enumerate(value)])
    if isinstance(value, dict):
        return (name, "dict", len(value)) + tuple([_part(k, v, by_shape) for k, v in value.items()])
    return (name, id(value), type(value).__qualname__)


class CallMemo:
    """The last call's key and reading; ``read(args, kwargs, compute)`` returns ``compute()`` or the memo."""

    __slots__ = ("key", "value", "held")

    def __init__(self) -> None:
        self.key: Optional[Tuple] = None
        self.value: Any = None
        self.held: Tuple = ()  # the arguments, so that the identities in ``key`` stay theirs

    def read(self, args: tuple, kwargs: dict, shape_only: Tuple[Any, ...], compute: Callable[[], Any]) -> Any:
        """shape_only: positions and names of the arguments keyed by shape alone (hidden states, timestep)."""
        # list comprehensions, not generators: a generator is a Python call per item (3.11), paid in every step
        key = tuple([_part(i, v, i in shape_only) for i, v in enumerate(args)] +
                    [_part(k, v, k in shape_only) for k, v in sorted(kwargs.items())])
        if key != self.key:
            self.value, self.key, self.held = compute(), key, (args, dict(kwargs))
        return self.value
