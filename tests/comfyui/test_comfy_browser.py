"""The frontend extension in a real headless browser, served by the tests' real ComfyUI server.

Debian's chromium opens the frontend this ComfyUI serves itself (the 2024 ComfyUI its bundled
frontend; ComfyUI 0.3.x PyPI's comfyui-frontend-package, which needs that server's /api routes),
loads the UI example workflow and reads what the ToMe node draws. Skips when chromium is not installed
(``apt-get install chromium``). Set TOME_BROWSER_SCREENSHOT=<file.png> to keep a screenshot.
"""
from __future__ import annotations

import asyncio
import base64
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


READ_NODE = """(() => {
  const node = app.graph._nodes.find((n) => n.type === %s);
  const lines = [];
  node.onDrawForeground({ save() {}, restore() {}, fillText: (text) => lines.push(text) });
  return { lines, widgets: node.widgets.map((w) => [w.name, w.value]), size: node.size };
})()"""


async def browse(url: str, debug_port: int, workflow: dict, node_type: str, screenshot: Path):
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
            await tools.evaluate("app.canvas.draw(true, true)")
            state = await tools.evaluate(READ_NODE % json.dumps(node_type))
            shot = await tools.call("Page.captureScreenshot", format="png")
            screenshot.write_bytes(base64.b64decode(shot["data"]))
            errors = [e for e in tools.events if e.get("method") == "Runtime.exceptionThrown"]
            return state, errors


EXPECTED = {
    "ToMe_SD15_basic": ("TomeCoreToMe", ["512x512, first attention level 1x (SDXL: 2x)",
                                          "1x 64x64: 4096 -> 2048 tokens (-50%)", "2x 32x32: 1024 tokens, unchanged",
                                          "4x 16x16: 256 tokens, unchanged", "8x 8x8: 64 tokens, unchanged"]),
    "ToMe_SD15_advanced": ("TomeCoreToMeAdvanced", ["768x768, first attention level 1x (SDXL: 2x)",
                                                     "1x 96x96: 9216 -> 3687 tokens (-60%)",
                                                     "2x 48x48: 2304 -> 922 tokens (-60%)",
                                                     "4x 24x24: 576 tokens, unchanged", "8x 12x12: 144 tokens, unchanged",
                                                     "on from 0% to 80% of sampling"]),
}


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_the_extension_draws_token_counts_in_a_real_browser(comfy, name):
    node_type, expected_lines = EXPECTED[name]
    debug_port = free_port()
    profile = tempfile.mkdtemp(prefix="tome-chromium-")
    browser = subprocess.Popen(
        [CHROMIUM, "--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-extensions",
         f"--remote-debugging-port={debug_port}", "--remote-allow-origins=*", f"--user-data-dir={profile}",
         "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    keep = os.environ.get("TOME_BROWSER_SCREENSHOT")
    screenshot = Path(keep.replace(".png", f"_{name}.png")) if keep else Path(profile) / "screen.png"
    try:
        workflow = json.loads((REPO / "example_workflows" / f"{name}.json").read_text())
        state, errors = asyncio.run(browse(comfy.url + "/", debug_port, workflow, node_type, screenshot))
    finally:
        browser.terminate()
        browser.wait(30)
        shutil.rmtree(profile, ignore_errors=True)
    ours = [e for e in errors if "/extensions/" in json.dumps(e)]  # the frontend's own noise is not ours
    assert ours == [], ours
    inputs = comfy.object_info(node_type)["input"]
    widget_names = [n for n in dict(inputs["required"], **inputs.get("optional", {})) if n != "model"]
    assert [w[0] for w in state["widgets"]] == widget_names  # no seed control widget added by the frontend
    assert state["lines"] == expected_lines
