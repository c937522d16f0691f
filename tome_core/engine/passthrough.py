"""How ToMe's ``TorchFunctionMode``s hand on the torch calls they do not change, so torch.compile traces them whole.

Inside a mode, a tensor method that torch implements in Python (``Tensor.unflatten``, in ``torch/_tensor.py``) reaches
``__torch_function__`` as that Python function; calling it there makes dynamo trace its body, whose
``super().unflatten`` it cannot follow: the graph breaks and the model's forward falls back to eager. Called as the
tensor's own method instead, dynamo records it as the one op it is, and eager code runs the very same function. Each
mode writes the test inline (no Python call of ToMe's per op in eager code), as a dict look-up by name, which dynamo
folds to a constant (it does not look into a set of functions)::

    if PYTHON_METHODS.get(getattr(func, "__name__", None)) is func and args and type(args[0]) is torch.Tensor:
        return getattr(args[0], func.__name__)(*args[1:], **kwargs)
    return func(*args, **kwargs)
"""
from __future__ import annotations

import types

import torch

# torch.Tensor's methods written in Python (unflatten, split, __format__, ...), by name
PYTHON_METHODS = {name: f for name, f in vars(torch.Tensor).items() if isinstance(f, types.FunctionType)}
