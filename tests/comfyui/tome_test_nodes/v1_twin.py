"""The repository's V1 node classes under other ids, beside the V3 nodes the repository serves itself.

On a ComfyUI with ``comfy_api`` (V3), the repository registers its nodes through ``comfy_entrypoint``
only; test_comfy_v3.py compares the image of a V3 node with that of the same node's V1 class on one
server, so this test-only package registers the V1 classes (nodes/tome_nodes.py ``ToMe``,
``ToMeAdvanced``) as ``TomeTwinV1ToMe`` / ``TomeTwinV1ToMeAdvanced``, imported from the repository as
ComfyUI imports a custom node (a package of its own name). Nothing is registered on older ComfyUIs.
"""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]
PACKAGE = "tome_v1_twin_repo"
TWIN_IDS = {"TomeCoreToMe": "TomeTwinV1ToMe", "TomeCoreToMeAdvanced": "TomeTwinV1ToMeAdvanced"}


def _host_has_v3() -> bool:
    try:
        return importlib.util.find_spec("comfy_api.latest") is not None
    except ModuleNotFoundError:
        return False


def _v1_classes() -> dict:
    if PACKAGE not in sys.modules:
        spec = importlib.util.spec_from_file_location(PACKAGE, REPO / "__init__.py",
                                                      submodule_search_locations=[str(REPO)])
        module = importlib.util.module_from_spec(spec)
        sys.modules[PACKAGE] = module
        spec.loader.exec_module(module)
    nodes = importlib.import_module(f"{PACKAGE}.nodes.tome_nodes")
    return {TWIN_IDS["TomeCoreToMe"]: nodes.ToMe, TWIN_IDS["TomeCoreToMeAdvanced"]: nodes.ToMeAdvanced}


NODE_CLASS_MAPPINGS = _v1_classes() if _host_has_v3() else {}
