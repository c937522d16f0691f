"""Stand-in of Neo's ``backend/args.py`` (de2193d9): the process-global ``dynamic_args`` (134-200), reduced to the
fields the DiT stand-ins read: ``ref_latents`` (Flux Kontext / Qwen edit references, read by flux.py:588 and
qwen.py:399 when the call passes none), ``concat_latent`` (Wan i2v, wan.py:392-398), ``context_handler``
(sampling_function.py:303). The command-line ``args`` namespace is not modelled.
"""


class _DynamicArgsMeta(type):
    """Mirrors args.py:134-145 _DynamicArgsMeta: dict-style access to the class attributes."""

    def get(cls, key, default=None):
        return getattr(cls, key, default)

    def __getitem__(cls, key):
        return getattr(cls, key, None)

    def __setitem__(cls, key, value):
        setattr(cls, key, value)

    def __contains__(cls, key):
        return hasattr(cls, key)


class dynamic_args(metaclass=_DynamicArgsMeta):
    """Mirrors args.py:148-200 dynamic_args (the fields named in the module docstring) and its reset()."""

    ref_latents = []
    concat_latent = None
    context_handler = None

    @classmethod
    def reset(cls):
        cls.ref_latents.clear()
        cls.concat_latent = None
        cls.context_handler = None
