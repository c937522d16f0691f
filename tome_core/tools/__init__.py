"""Tools for users, built on tome_core's public API only (``apply_patch``, ``remove_patch``, ``describe``).

compare: ``python -m tome_core compare``, plain against ToMe settings on the user's own diffusers pipeline. Nothing in
the engine, the catalogue or the adapters imports this room (``tests/test_architecture.py``).
"""
