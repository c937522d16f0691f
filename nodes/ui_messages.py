"""Messages from a running prompt to the browser (ComfyUI's ``PromptServer.send_sync`` websocket).

The speed check decides each UNet level (or DiT call shape) at the first sampling step, after the ToMe node has
run, so its verdicts reach the node's text this way: the frontend extension (web/tome.js) listens for
``LEVELS_EVENT`` and draws them on the node whose id they carry. Each message holds the engine's lines (for the log
and older frontends), the patch's notes, and the verdicts as plain values (``verdict_records``), which the extension
words itself. Outside a ComfyUI server (tests, the WebUI) there is no ``server`` module and nothing is sent.
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


def message(node_id: Any, source: Any, lines: List[str]) -> dict:
    """What the node ``node_id`` is sent when ``source`` (a UNet plan, a DiT patch) has new verdicts or notes."""
    return {"node": str(node_id), "lines": list(lines), "notes": list(getattr(source, "notes", [])),
            "verdicts": source.verdict_records()}


def _sender(node_id: Any, source: Any):
    def send(lines: List[str]) -> None:
        server = _prompt_server()
        if server is not None:  # from the sampling thread: send_sync queues it on the server's loop
            server.send_sync(LEVELS_EVENT, message(node_id, source, lines), server.client_id)
    return send


def announce_levels(source: Any, node_id: Any) -> None:
    """Send ``source``'s verdicts (a UNet ``TokenMerger``, a DiT patch) to node ``node_id`` each time the speed
    check decides one, or a note is added."""
    if _prompt_server() is None:
        return
    source.listeners.append(_sender(node_id, source))
