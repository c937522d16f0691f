"""The speed check in a real ComfyUI server: a level measured slower is left whole, and the node is told.

Driven as the browser drives it: a websocket client (``/ws?clientId=...``) and ``POST /prompt`` with
that client id. The verdicts arrive as ``tome.levels`` messages naming the ToMe node (web/tome.js
draws them on it). Timings are forced by the test-only node ``TomeTestForceSpeedups``
(tome_test_nodes/speed_nodes.py) inside the server: nothing here is decided by the clock.
"""
from __future__ import annotations

import asyncio
import json

import pytest

import comfy_env
from comfy_env import advanced, api_prompt, pixels

LEVELS_EVENT = "tome.levels"
CLIENT_ID = "tome-tests"


def run_listening(server, prompt):
    """Queue ``prompt`` with a websocket open as the browser has it; (result, every message received)."""
    aiohttp = pytest.importorskip("aiohttp")

    async def listen():
        url = server.url.replace("http://", "ws://") + f"/ws?clientId={CLIENT_ID}"
        async with aiohttp.ClientSession() as session, session.ws_connect(url) as ws:
            prompt_id = await asyncio.to_thread(server.queue, prompt)
            messages = []
            while True:
                message = await ws.receive(timeout=600)
                if message.type != aiohttp.WSMsgType.TEXT:
                    continue
                data = json.loads(message.data)
                messages.append(data)
                body = data.get("data") or {}
                finished = data["type"] == "executing" and body.get("node") is None
                if body.get("prompt_id") == prompt_id and (finished or data["type"] == "execution_error"):
                    return prompt_id, messages

    prompt_id, messages = asyncio.run(listen())
    return server.wait(prompt_id), messages


def forced(speedups):
    return {"class_type": "TomeTestForceSpeedups", "inputs": {"speedups": speedups}}


def levels_sent(messages, node_id):
    return [m["data"]["lines"] for m in messages if m["type"] == LEVELS_EVENT and m["data"]["node"] == node_id]


@pytest.fixture(scope="module")
def plain_image(comfy, checkpoint):
    result = comfy.run(api_prompt(prefix="speed_plain"))
    assert result.success, result.error_message()
    return pixels(result.images[0])


def test_a_level_measured_slower_is_left_whole_and_the_node_is_told(comfy, plain_image):
    # 64 px -> an 8x8 latent: level 1 is 8x8 tokens; the tiny checkpoint has one ResBlock per level, so
    # 3 transformer blocks there (1 down, 2 up)
    prompt = api_prompt(advanced(speed_check="on"), pre_nodes=[forced("8x8=0.86")], prefix="speed_whole")
    result, messages = run_listening(comfy, prompt)
    assert result.success, result.error_message()
    assert (pixels(result.images[0]) == plain_image).all()  # left whole: the plain image
    sent = levels_sent(messages, "11")  # the ToMe node follows the forcing node (ids 10, 11)
    assert sent, [m["type"] for m in messages]
    assert any(line.startswith("level 1 (8x8 tokens, 3 blocks) at 64x64 px: left whole: ") and
               line.endswith("with merging measured 0.86x on cpu") for line in sent[-1]), sent
    # what was timed: the model call, repeated through ToMe's APPLY_MODEL wrapper (0.3.x) or its
    # model_function_wrapper (the 2024 ComfyUI, which has no model wrappers)
    assert any("left whole: the model call with merging" in line for line in sent[-1]), sent


def test_a_level_measured_faster_is_reduced_and_the_node_is_told(comfy, plain_image):
    prompt = api_prompt(advanced(speed_check="on", mode="kv", ratio=0.75), pre_nodes=[forced("*=1.3")],
                        prefix="speed_reduced")
    result, messages = run_listening(comfy, prompt)
    assert result.success, result.error_message()
    assert (pixels(result.images[0]) != plain_image).any()
    assert any("at 64x64 px: reduced: " in line and "with kv measured 1.30x on cpu" in line for line in levels_sent(messages, "11")[-1])


def test_the_basic_node_on_the_cpu_is_not_timed_and_says_so(comfy, plain_image):
    tome = {"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.5, "max_downsample": 1}}
    result, messages = run_listening(comfy, api_prompt(tome, pre_nodes=[forced("*=0.5")], prefix="speed_auto"))
    assert result.success, result.error_message()
    assert (pixels(result.images[0]) != plain_image).any()  # "auto" does not time the CPU: reduced
    assert any("reduced (not timed on cpu)" in line for line in levels_sent(messages, "11")[-1])
    info = result.outputs["11"]["tome"][0]
    assert info["speed_check"] == "auto" and info["matching"] == "level"


def test_speed_check_off_sends_nothing(comfy):
    result, messages = run_listening(comfy, api_prompt(advanced(speed_check="off"), prefix="speed_off"))
    assert result.success, result.error_message()
    assert levels_sent(messages, "10") == []


def test_the_advanced_node_offers_matching_and_speed_check_as_optional_inputs(comfy):
    optional = comfy.object_info("TomeCoreToMeAdvanced")["input"]["optional"]

    def options(entry):  # a V3 io.Combo serializes as "COMBO" + options, a V1 list combo as the list itself
        return entry[1]["options"] if entry[0] == "COMBO" else entry[0]

    assert options(optional["speed_check"]) == ["off", "auto", "on"] and optional["speed_check"][1]["default"] == "auto"
    assert options(optional["matching"]) == ["block", "level"] and optional["matching"][1]["default"] == "level"
    assert optional["match_every"][0] == "INT" and optional["match_every"][1]["default"] == 1
    assert (optional["match_every"][1]["min"], optional["match_every"][1]["max"]) == (1, 10)
    assert comfy_env.ADVANCED_DEFAULTS.keys().isdisjoint({"speed_check", "matching", "match_every"})  # older workflows
