"""Stand-in of Forge Neo's ``backend`` package (exo101/sd-webui-forge-neo-v3 @ de2193d9, ``webui/backend/``) for CI.

Forge Neo cannot be installed in CI, so this package re-implements, small, the parts of Neo's own modules that ToMe's
Neo binding relies on, under Neo's module paths and class names (the project matches classes by module and class
name). Put ``tests/webui/neo_standin`` on ``sys.path`` to import it as ``backend``. Each module's docstring names
the Neo file and line ranges it mirrors; ``neo_models.py`` (the factory) and ``neo_sampler.py`` (the per-pass
driver) live beside this package, outside it, since they are not Neo modules.
"""
