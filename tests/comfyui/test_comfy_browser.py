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

    async def click(self, x: float, y: float, count: int = 1):
        """A left click at (x, y) in the page, as the mouse sends it."""
        for kind in ("mouseMoved", "mousePressed", "mouseReleased"):
            await self.call("Input.dispatchMouseEvent", type=kind, x=x, y=y, clickCount=count,
                            button="none" if kind == "mouseMoved" else "left")

    async def key(self, key: str, code: int):
        for kind in ("keyDown", "keyUp"):
            await self.call("Input.dispatchKeyEvent", type=kind, key=key, code=key, windowsVirtualKeyCode=code)

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


# The node's lines as drawn: onDrawForeground on a real 2D context (the extension sets its font and wraps to the node's
# width), each fillText recorded with its measured width; the ratio widget's text as the frontend draws it.
READ_NODE = """(() => {
  const node = app.graph._nodes.find((n) => n.type === %s);
  const real = document.createElement("canvas").getContext("2d");
  const lines = [];
  const ctx = new Proxy(real, { get(target, key) {
    if (key === "fillText") return (text, x) => lines.push({ text, x, width: target.measureText(text).width });
    const value = target[key];
    return typeof value === "function" ? value.bind(target) : value;
  }, set(target, key, value) { target[key] = value; return true; } });
  node.onDrawForeground(ctx);
  const shown = (w) => ("_displayValue" in w ? w._displayValue : null);
  return { lines: lines.map((l) => l.text), widths: lines.map((l) => l.x + l.width),
           widgets: node.widgets.map((w) => [w.name, w.value]), shown: node.widgets.map(shown),
           labels: node.widgets.map((w) => w.label ?? null), size: [node.size[0], node.size[1]] };
})()"""


def flat(lines) -> str:
    """Lines wrapped anywhere read the same joined: the drawn lines against the logical ones."""
    return " ".join(" ".join(lines).split())


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
            await asyncio.sleep(1.5)  # a new user's first page: the newer frontend opens its template dialog
            for _ in range(20):  # close it as a user does, until none is left
                if not await tools.evaluate("!!document.querySelector('[role=dialog]')"):
                    break
                await tools.key("Escape", 27)
                await asyncio.sleep(0.25)
            if workflow is None:  # an empty graph: the action adds the node
                await tools.evaluate("app.graph.clear()")
            else:
                await tools.evaluate(f"app.loadGraphData({json.dumps(workflow)})")
                await tools.wait_for(f"app.graph._nodes.some((n) => n.type === {json.dumps(node_type)})")
            await asyncio.sleep(0.5)
            if action is not None:
                await action(tools)
            await tools.evaluate("app.canvas.draw(true, true)")
            state = await tools.evaluate(READ_NODE % json.dumps(node_type))
            shot = await tools.call("Page.captureScreenshot", format="png")
            screenshot.write_bytes(base64.b64decode(shot["data"]))
            errors = [e for e in tools.events if e.get("method") == "Runtime.exceptionThrown"]
            return state, errors


SPEED_CHECK = ("speed check auto: timed at the first step on a GPU (the result is shown here); the CPU is not "
               "timed")
EXPECTED = {
    "ToMe_SD15_basic": ("TomeCoreToMe", [
        "512x512 px", "ratio: model default (drawn at 0.5, SD1.5's; a transformer's own is shown after the run)",
        "level 1 · 64x64 tokens: 4096 → 2048 (-50%)", "level 2 · 32x32 tokens: 1024, unchanged",
        "level 4 · 16x16 tokens: 256, unchanged", "level 8 · 8x8 tokens: 64, unchanged", SPEED_CHECK]),
    "ToMe_SD15_advanced": ("TomeCoreToMeAdvanced", [
        "768x768 px", "merge 0.6 (levels as on SD1.5)", "level 1 · 96x96 tokens: 9216 → 3687 (-60%)",
        "level 2 · 48x48 tokens: 2304 → 922 (-60%)", "level 4 · 24x24 tokens: 576, unchanged",
        "level 8 · 12x12 tokens: 144, unchanged", "on from 0% to 80% of sampling", SPEED_CHECK]),
}


def fits(state) -> bool:
    """Every drawn line ends inside the node (the extension wraps them to its width)."""
    return all(right <= state["size"][0] + 0.5 for right in state["widths"])


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
    assert flat(state["lines"]) == flat(expected_lines)
    assert len(state["lines"]) > len(expected_lines) and fits(state), state  # wrapped within the node


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
        # the verdicts arrive level by level, each message with those decided so far: wait for both levels
        await tools.wait_for('(app.graph._nodes.find((n) => n.type === "TomeCoreToMeAdvanced").tomeMessage?.verdicts '
                             '|| []).length >= 2', seconds=300)

    with headless_chromium() as (debug_port, profile):
        workflow = json.loads((REPO / "example_workflows" / "ToMe_SD15_advanced.json").read_text())
        state, errors = asyncio.run(browse(comfy.url + "/", debug_port, workflow, "TomeCoreToMeAdvanced",
                                           profile / "screen.png", queue_and_wait))
    assert [e for e in errors if "/extensions/" in json.dumps(e)] == []
    # the example merges two levels (max_downsample 2); only level 1 (8x8 tokens here) is forced slower
    assert flat(state["lines"]).endswith("level 1: left whole · ToMe measured 0.86x (slower) on CPU "
                                         "level 2: reduced · 1.40x faster on CPU"), state["lines"]
    assert fits(state)


ADD_NODE = """(() => {
  const node = LiteGraph.createNode(%s);
  const rect = app.canvas.canvas.getBoundingClientRect();
  const ds = app.canvas.ds;  // page = (canvas + offset) * scale (litegraph's method names swapped between versions)
  node.pos = [rect.width / 3 / ds.scale - ds.offset[0], rect.height / 4 / ds.scale - ds.offset[1]];
  app.graph.add(node);
  app.canvas.draw(true, true);
  return node.id;
})()"""
# The page position of a widget's left or right arrow (litegraph: a click within 40 px of the node's edge steps).
WIDGET_ARROW = """(() => {
  const node = app.graph._nodes.find((n) => n.type === %s);
  const widget = node.widgets.find((w) => w.name === %s);
  const rect = app.canvas.canvas.getBoundingClientRect();
  const y = node.pos[1] + (widget.y ?? widget.last_y) + LiteGraph.NODE_WIDGET_HEIGHT / 2;
  const x = node.pos[0] + (%s ? node.size[0] - 24 : 24);
  const ds = app.canvas.ds;
  return [rect.left + (x + ds.offset[0]) * ds.scale, rect.top + (y + ds.offset[1]) * ds.scale];
})()"""
WIDGET = """(() => { const w = app.graph._nodes.find((n) => n.type === %s).widgets.find((w) => w.name === %s);
  return { value: w.value, shown: "_displayValue" in w ? w._displayValue : null, label: w.label ?? null }; })()"""


VIEW = "JSON.stringify([app.canvas.ds.scale, ...app.canvas.ds.offset])"


async def settled(tools) -> None:
    """Until the canvas view stops moving (the newer frontend animates its view to fit a changed graph)."""
    last = None
    for _ in range(40):
        view = await tools.evaluate(VIEW)
        if view == last:
            return
        last = view
        await asyncio.sleep(0.3)


async def click_arrow(tools, node_type: str, widget: str, right: bool) -> dict:
    await settled(tools)
    x, y = await tools.evaluate(WIDGET_ARROW % (json.dumps(node_type), json.dumps(widget), json.dumps(right)))
    await tools.click(x, y)
    await asyncio.sleep(0.3)
    await tools.evaluate("app.canvas.draw(true, true)")
    return await tools.evaluate(WIDGET % (json.dumps(node_type), json.dumps(widget)))


def says_model_default(widget: dict) -> bool:
    """The widget's -1 in words: its drawn text where the frontend draws ``_displayValue`` (1.x), else its label."""
    return widget["value"] == -1 and ("model default" in (widget["shown"] or widget["label"] or ""))


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_a_fresh_node_offers_the_models_default_and_one_click_leaves_it_for_a_valid_value(comfy):
    """Added fresh, the advanced node's ratio and block_start read "model default"; one click on the right arrow gives
    an explicit valid value (ratio 0.5, block_start 0), one click left of 0 gives the default back: no value between
    them that Run would refuse. Clicks are real mouse events on the widgets' arrows."""
    node_type, seen = "TomeCoreToMeAdvanced", {}

    async def add_and_click(tools):
        await tools.evaluate(ADD_NODE % json.dumps(node_type))
        for name in ("ratio", "block_start"):
            seen[name] = [await tools.evaluate(WIDGET % (json.dumps(node_type), json.dumps(name)))]
            seen[name].append(await click_arrow(tools, node_type, name, right=True))
            await tools.evaluate(f"app.graph._nodes[0].widgets.find((w) => w.name === {json.dumps(name)}).value = 0")
            seen[name].append(await click_arrow(tools, node_type, name, right=False))

    keep = os.environ.get("TOME_BROWSER_SCREENSHOT")
    with headless_chromium() as (debug_port, profile):
        screenshot = Path(keep.replace(".png", "_fresh_node.png")) if keep else profile / "screen.png"
        state, errors = asyncio.run(browse(comfy.url + "/", debug_port, None, node_type, screenshot, add_and_click))
    assert [e for e in errors if "/extensions/" in json.dumps(e)] == []
    for name, explicit in (("ratio", 0.5), ("block_start", 0)):
        fresh, right, left = seen[name]
        assert says_model_default(fresh), (name, fresh)
        assert right["value"] == pytest.approx(explicit), (name, right)
        assert says_model_default(left), (name, left)
    assert fits(state)


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_the_sd15_template_run_from_the_run_button_says_what_tome_did(comfy, checkpoint):
    """The SD1.5 basic template as a user runs it (its checkpoint swapped for the tests' tiny one, 64 px, 2 steps) from
    the frontend's Run (or Queue Prompt) button: the node then names the model as users know it, the ratio the model's
    default gave, the tokens of each level, and the speed check's verdict (on this CPU: not timed, and why)."""
    node_type, shown = "TomeCoreToMe", {}
    workflow = json.loads((REPO / "example_workflows" / "ToMe_SD15_basic.json").read_text())
    for node in workflow["nodes"]:
        if node["type"] == "CheckpointLoaderSimple":
            node["widgets_values"][0] = checkpoint
        elif node["type"] == "EmptyLatentImage":
            node["widgets_values"][:2] = [64, 64]
        elif node["type"] == "KSampler":
            node["widgets_values"][2] = 2  # seed, control, steps, ...

    async def run_from_button(tools):
        await settled(tools)
        box = await tools.evaluate("""(() => {
          const button = [...document.querySelectorAll("button")].find((b) => /^(Run|Queue Prompt|Queue)$/.test(
            b.innerText.trim()) && b.getBoundingClientRect().width > 0);  // the one shown (not a hidden legacy menu)
          const r = button.getBoundingClientRect();
          return [r.left + r.width / 2, r.top + r.height / 2, button.innerText.trim()];
        })()""")
        await tools.click(box[0], box[1])
        await tools.wait_for(f'(() => {{ const n = app.graph._nodes.find((n) => n.type === {json.dumps(node_type)}); '
                             'return !!(n.tomeLastRun && n.tomeMessage?.verdicts?.length); })()', seconds=300)
        shown.update(await tools.evaluate(WIDGET % (json.dumps(node_type), json.dumps("ratio"))), button=box[2])

    keep = os.environ.get("TOME_BROWSER_SCREENSHOT")
    with headless_chromium() as (debug_port, profile):
        screenshot = Path(keep.replace(".png", "_after_run.png")) if keep else profile / "screen.png"
        state, errors = asyncio.run(browse(comfy.url + "/", debug_port, workflow, node_type, screenshot,
                                           run_from_button))
    assert [e for e in errors if "/extensions/" in json.dumps(e)] == []
    text = flat(state["lines"])
    assert text.startswith("SD1.5 · merge 0.5 (model default) · 64x64 px level 1 · 8x8 tokens: 64 → 32 (-50%) "), text
    assert text.endswith(" level 1: reduced · not timed: CPU"), text
    assert fits(state), state
    assert shown["value"] == -1 and shown["shown"] in (None, "merge 0.5 (SD1.5 default)"), shown


SEARCH_RESULTS = """[...document.querySelectorAll("[role=option]")].map((e) => e.innerText.replace(/\\s+/g, " ").trim())"""


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
def test_typing_tome_or_token_merging_in_the_node_search_finds_our_node_first(comfy):
    """The node search as a user opens it (a double click on the canvas): "tome" lists ToMe first, before core's
    TomePatchModel, and Enter adds it; "token merging" (a search alias) lists it first among the installed packs."""
    if "search_aliases" not in comfy.object_info("TomeCoreToMe"):
        pytest.skip("this ComfyUI sends no search_aliases (the 2026 ComfyUI and frontend do)")
    node_type, found = "TomeCoreToMe", {}

    async def search(tools):
        rect = await tools.evaluate("(() => { const r = app.canvas.canvas.getBoundingClientRect(); "
                                    "return [r.left + r.width / 2, r.top + r.height / 2]; })()")
        for query in ("token merging", "tome"):
            await settled(tools)
            await tools.click(*rect)
            await tools.click(*rect, count=2)
            await tools.wait_for("document.activeElement?.tagName === 'INPUT'", seconds=20)
            await tools.call("Input.insertText", text=query)
            await tools.wait_for(f"{SEARCH_RESULTS}.length > 0", seconds=20)
            await asyncio.sleep(1)
            found[query] = await tools.evaluate(SEARCH_RESULTS)
            if query == "tome":
                await tools.key("Enter", 13)
                await tools.wait_for(f"app.graph._nodes.some((n) => n.type === {json.dumps(node_type)})", seconds=20)
            else:
                await tools.key("Escape", 27)

    keep = os.environ.get("TOME_BROWSER_SCREENSHOT")
    with headless_chromium() as (debug_port, profile):
        screenshot = Path(keep.replace(".png", "_search.png")) if keep else profile / "screen.png"
        asyncio.run(browse(comfy.url + "/", debug_port, None, node_type, screenshot, search))
    assert found["tome"][0].startswith("ToMe tome-diffusion"), found["tome"][:3]
    installed = [text for text in found["token merging"] if "tome_test_nodes" not in text]  # the tests' own pack
    assert installed[0].startswith("ToMe tome-diffusion"), found["token merging"][:3]
