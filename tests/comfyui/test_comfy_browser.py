"""The frontend extension in a real headless browser, served by the tests' real ComfyUI server.

Debian's chromium opens the frontend this ComfyUI serves itself (the 2024 ComfyUI its bundled
frontend; ComfyUI 0.3.x PyPI's comfyui-frontend-package, which needs that server's /api routes),
loads the UI example workflow and reads what the ToMe node draws. Skips when chromium is not installed
(``apt-get install chromium``). Set TOME_BROWSER_SCREENSHOT=<file.png> to keep a screenshot.
"""
from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import pytest

from comfy_env import free_port

REPO = Path(__file__).resolve().parents[2]
CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
EXTENSION = "tome.ToMe.levels"


class DevTools:
    """The few Chrome DevTools Protocol calls the test needs, over aiohttp's websocket client."""

    def __init__(self, ws):
        self.ws, self.next_id, self.events = ws, 0, []

    async def call(self, method: str, **params):
        self.next_id += 1
        await self.ws.send_json({"id": self.next_id, "method": method, "params": params})
        while True:
            message = await asyncio.wait_for(self.ws.receive_json(), 60)
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise RuntimeError(message["error"])
                return message["result"]
            self.events.append(message)

    async def evaluate(self, expression: str):
        result = await self.call("Runtime.evaluate", expression=expression, awaitPromise=True, returnByValue=True)
        if "exceptionDetails" in result:
            raise RuntimeError(result["exceptionDetails"])
        return result["result"].get("value")

    async def wait_for(self, expression: str, seconds: float = 60):
        for _ in range(int(seconds * 4)):
            if await self.evaluate(expression):
                return
            await asyncio.sleep(0.25)
        raise TimeoutError(expression)


@contextlib.contextmanager
def headless_chromium():
    """Debian's chromium, headless, with a DevTools port and a fresh profile; yields (port, profile)."""
    debug_port = free_port()
    profile = tempfile.mkdtemp(prefix="tome-chromium-")
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         f"--remote-debugging-port={debug_port}", "--remote-allow-origins=*", f"--user-data-dir={profile}",
         "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        yield debug_port, Path(profile)
    finally:
        browser.terminate()
        browser.wait(30)
        shutil.rmtree(profile, ignore_errors=True)


READ_NODE = """(() => {
  const node = app.graph._nodes.find((n) => n.type === %s);
  const lines = [];
  node.onDrawForeground({ save() {}, restore() {}, fillText: (text) => lines.push(text) });
  return { lines, widgets: node.widgets.map((w) => [w.name, w.value]), size: node.size };
})()"""


async def browse(url: str, debug_port: int, workflow: dict, node_type: str, screenshot: Path, action=None):
    """Open the frontend, load ``workflow``, run ``await action(tools)`` if given, read the ToMe node."""
    import aiohttp

    async with aiohttp.ClientSession() as session:
        for _ in range(120):
            try:
                async with session.get(f"http://127.0.0.1:{debug_port}/json/list") as response:
                    pages = [p for p in await response.json() if p.get("type") == "page"]
                if pages:
                    break
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.25)
        async with session.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=0) as ws:
            tools = DevTools(ws)
            await tools.call("Runtime.enable")
            await tools.call("Page.enable")
            await tools.call("Emulation.setDeviceMetricsOverride", width=1400, height=900, deviceScaleFactor=1,
                             mobile=False)
            await tools.call("Page.navigate", url=url)
            await tools.wait_for(f"!!(window.app && app.graph && app.extensions && "
                                 f"app.extensions.some((e) => e.name === {json.dumps(EXTENSION)}))")
            await tools.evaluate(f"app.loadGraphData({json.dumps(workflow)})")
            await tools.wait_for(f"app.graph._nodes.some((n) => n.type === {json.dumps(node_type)})")
            await tools.call("Input.dispatchKeyEvent", type="keyDown", key="Escape", code="Escape",
                             windowsVirtualKeyCode=27)  # close a template dialog the newer frontend opens
            await tools.call("Input.dispatchKeyEvent", type="keyUp", key="Escape", code="Escape",
                             windowsVirtualKeyCode=27)
            if action is not None:
                await action(tools)
            await tools.evaluate("app.canvas.draw(true, true)")
            state = await tools.evaluate(READ_NODE % json.dumps(node_type))
            shot = await tools.call("Page.captureScreenshot", format="png")
            screenshot.write_bytes(base64.b64decode(shot["data"]))
            errors = [e for e in tools.events if e.get("method") == "Runtime.exceptionThrown"]
            return state, errors


SPEED_CHECK = "speed check auto: levels are timed at the first step (shown here after the run)"
EXPECTED = {
    "ToMe_SD15_basic": ("TomeCoreToMe", ["512x512, first attention level 1x (SDXL: 2x)",
                                          "1x 64x64: 4096 -> 2048 tokens (-50%)", "2x 32x32: 1024 tokens, unchanged",
                                          "4x 16x16: 256 tokens, unchanged", "8x 8x8: 64 tokens, unchanged",
                                          SPEED_CHECK]),
    "ToMe_SD15_advanced": ("TomeCoreToMeAdvanced", ["768x768, first attention level 1x (SDXL: 2x)",
                                                     "1x 96x96: 9216 -> 3687 tokens (-60%)",
                                                     "2x 48x48: 2304 -> 922 tokens (-60%)",
                                                     "4x 24x24: 576 tokens, unchanged", "8x 12x12: 144 tokens, unchanged",
                                                     "on from 0% to 80% of sampling", SPEED_CHECK]),
}


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_extension_draws_token_counts_in_a_real_browser(comfy, name):
    node_type, expected_lines = EXPECTED[name]
    keep = os.environ.get("TOME_BROWSER_SCREENSHOT")
    with headless_chromium() as (debug_port, profile):
        screenshot = Path(keep.replace(".png", f"_{name}.png")) if keep else profile / "screen.png"
        workflow = json.loads((REPO / "example_workflows" / f"{name}.json").read_text())
        state, errors = asyncio.run(browse(comfy.url + "/", debug_port, workflow, node_type, screenshot))
    ours = [e for e in errors if "/extensions/" in json.dumps(e)]  # the frontend's own noise is not ours
    assert ours == [], ours
    inputs = comfy.object_info(node_type)["input"]
    widget_names = [n for n in dict(inputs["required"], **inputs.get("optional", {})) if n != "model"]
    assert [w[0] for w in state["widgets"]] == widget_names  # no seed control widget added by the frontend
    assert state["lines"] == expected_lines


def _api_prompt_for_the_advanced_example(checkpoint: str) -> dict:
    """The advanced example's API graph, small enough for the CPU (64 px, 2 steps, the tests' checkpoint),
    with ToMe's timings forced (test-only node 90) and its speed check on."""
    prompt = json.loads((REPO / "example_workflows" / "api" / "ToMe_SD15_advanced.api.json").read_text())
    tome_id = next(k for k, v in prompt.items() if v["class_type"] == "TomeCoreToMeAdvanced")
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = checkpoint
        elif node["class_type"] == "EmptyLatentImage":
            inputs.update(width=64, height=64, batch_size=1)
        elif node["class_type"] == "KSampler":
            inputs["steps"] = 2
    prompt["90"] = {"class_type": "TomeTestForceSpeedups",
                    "inputs": {"model": prompt[tome_id]["inputs"]["model"], "speedups": "8x8=0.86"}}
    prompt[tome_id]["inputs"].update(model=["90", 0], speed_check="on", min_tokens=0)
    return prompt


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_speed_checks_verdict_appears_on_the_node_in_a_real_browser(comfy, checkpoint):
    """A prompt queued for this browser's client id: the server sends the verdict during sampling
    (nodes/ui_messages.py), the extension draws it on the node with that id."""
    prompt = _api_prompt_for_the_advanced_example(checkpoint)

    async def queue_and_wait(tools):
        client_id = await tools.evaluate('import("/scripts/api.js").then((m) => m.api.clientId)')
        status, raw = await asyncio.to_thread(comfy.request, "POST", "/prompt",
                                              {"prompt": prompt, "client_id": client_id})
        assert status == 200, raw
        # the verdicts arrive level by level, each message with the lines decided so far: wait for both levels
        await tools.wait_for('(app.graph._nodes.find((n) => n.type === "TomeCoreToMeAdvanced").tomeLevels '
                             '|| []).filter((line) => line.startsWith("level ")).length >= 2', seconds=300)

    with headless_chromium() as (debug_port, profile):
        workflow = json.loads((REPO / "example_workflows" / "ToMe_SD15_advanced.json").read_text())
        state, errors = asyncio.run(browse(comfy.url + "/", debug_port, workflow, "TomeCoreToMeAdvanced",
                                           profile / "screen.png", queue_and_wait))
    assert [e for e in errors if "/extensions/" in json.dumps(e)] == []
    # the example merges two levels (max_downsample 2); only level 1 (8x8 tokens here) is forced slower
    first, second = state["lines"][-2:]
    assert first.startswith("level 1 (8x8 tokens, 3 blocks) at 64x64 px: left whole: ")
    assert first.endswith(" with merging measured 0.86x on cpu")
    assert second.startswith("level 2 (4x4 tokens, 4 blocks) at 64x64 px: reduced: ")
    assert second.endswith(" with merging measured 1.40x on cpu")
