"""Let PyPI's torchvision (a CUDA build) import under the CPU torch of .venv-invoke.

Its ``torchvision/_meta_registrations.py`` registers fake kernels for ``torchvision::nms`` and ``torchvision::qnms``
with ``torch.library.register_fake``; without the CUDA extension loaded those operators do not exist and the import
fails with ``RuntimeError: operator torchvision::nms does not exist``. transformers then refuses every model class
(``ModuleNotFoundError: Could not import module 'CLIPTextModel'``) and InvokeAI cannot encode a prompt. ``install``
wraps ``register_fake`` so that registering a fake kernel for a missing ``torchvision::`` operator is skipped
(the operator cannot be called anyway); everything else registers as before. Call it before torchvision is imported.
"""
from __future__ import annotations


def install() -> None:
    import torch.library

    real = torch.library.register_fake
    if getattr(real, "_tome_torchvision_guard", False):
        return

    def _missing(op, error: Exception) -> bool:
        return isinstance(op, str) and op.startswith("torchvision::") and "does not exist" in str(error)

    def register_fake(op, func=None, /, *args, **kwargs):
        if func is not None:
            try:
                return real(op, func, *args, **kwargs)
            except RuntimeError as error:
                if _missing(op, error):
                    return func
                raise
        decorate = real(op, None, *args, **kwargs)

        def guarded(fn):
            try:
                return decorate(fn)
            except RuntimeError as error:
                if _missing(op, error):
                    return fn
                raise

        return guarded

    register_fake._tome_torchvision_guard = True
    torch.library.register_fake = register_fake
