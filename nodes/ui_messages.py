"""Messages from a running prompt to the browser (ComfyUI's ``PromptServer.send_sync`` websocket).

The speed check decides each UNet level at the first sampling step, after the ToMe node has run, so
its verdicts reach the node's text this way: the frontend extension (web/tome.js) listens for
``LEVELS_EVENT`` and draws the lines on the node whose id they carry. Outside a ComfyUI server
(tests, the WebUI) there is no ``server`` module and nothing is sent.
"""
from __future__ import annotations

from typing import Any, List

LEVELS_EVENT = "tome.levels"


def _prompt_server() -> Any:
    try:
        from server import PromptServer  # ComfyUI's own module, present in its server process
    except ImportError:
        return None
    return getattr(PromptServer, "instance", None)


def _sender(node_id: Any):
    def send(lines: List[str]) -> None:
        server = _prompt_server()
        if server is not None:  # from the sampling thread: send_sync queues it on the server's loop
            server.send_sync(LEVELS_EVENT, {"node": str(node_id), "lines": list(lines)}, server.client_id)
    return send


def announce_levels(merger: Any, node_id: Any) -> None:
    """Send ``merger``'s description to node ``node_id`` each time the speed check decides a level."""
    if merger.config.speed_check == "off" or _prompt_server() is None:
        return
    merger.listeners.append(_sender(node_id))


def announce_notes(patch: Any, node_id: Any) -> None:
    """Send a DiT merge patch's notes (``DiTMergePatch.notes``: what its first model calls found, e.g. "balanced
    attention needs a mask; ... ignores masks: plain") to node ``node_id`` each time one is added."""
    if _prompt_server() is not None:
        patch.listeners.append(_sender(node_id))
