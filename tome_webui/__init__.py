"""WebUI (AUTOMATIC1111 / Forge / reForge) glue for tome_core; the entry point is scripts/tome.py.

Host-free modules (``options``, ``runner``, ``settings``, ``xyz``) hold the logic; ``ui`` builds
the gradio controls. Nothing here imports ``modules`` (the WebUI) at import time.
"""
