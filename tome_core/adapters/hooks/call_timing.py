"""The speed check's view of a diffusers transformer call: the call in progress, repeated."""
from __future__ import annotations

from typing import Callable, Optional

import torch


def repeat_call(model: torch.nn.Module, args: tuple, kwargs: dict) -> Optional[Callable[[], None]]:
    """The model call in progress once more (``forward``, without the model's own hooks), or None where another
    diffusers hook sits on the model itself (a step cache would count the repeats as steps)."""
    if getattr(model.__dict__.get("_diffusers_hook"), "hooks", None):
        return None

    def again() -> None:
        with torch.no_grad():
            model.forward(*args, **kwargs)

    return again
