"""A headless client against ComfyUI's real web server (aiohttp on 127.0.0.1, in this process).

POST /prompt with a bad ToMe value answers HTTP 400 with ``node_errors`` before anything runs; a
good example workflow is queued, executed by a worker step that does what ComfyUI's main.py
prompt_worker does, and its image is fetched back through /history and /view. The frontend files
and node definitions the browser would load are served too.
"""
from __future__ import annotations

import asyncio
import io
import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

EXAMPLES = Path(__file__).resolve().parents[2] / "example_workflows" / "api"


def small(prompt: dict, checkpoint: str) -> dict:
    prompt = json.loads(json.dumps(prompt))
    for node in prompt.values():
        inputs = node["inputs"]
        if node["class_type"] == "CheckpointLoaderSimple":
            inputs["ckpt_name"] = checkpoint
        if node["class_type"] == "EmptyLatentImage":
            inputs.update(width=64, height=64)
        if node["class_type"] == "KSampler":
            inputs["steps"] = 1
        if node["class_type"] == "TomeCoreToMeAdvanced":
            inputs["min_tokens"] = 0
    return prompt


async def _session(comfy, checkpoint):
    from aiohttp.test_utils import TestClient, TestServer

    comfy.folder_paths.user_directory = str(comfy.workdir / "user")  # read by app.user_manager at import
    import server as comfy_server

    prompt_server = comfy_server.PromptServer(asyncio.get_running_loop())
    prompt_server.prompt_queue = comfy.execution.PromptQueue(prompt_server)
    prompt_server.add_routes()
    client = TestClient(TestServer(prompt_server.app, host="127.0.0.1"))
    await client.start_server()
    results = {}
    try:
        # The browser's view of the package: node definitions with tooltips, and our extension.
        info = await (await client.get("/object_info/TomeCoreToMeAdvanced")).json()
        results["object_info"] = info["TomeCoreToMeAdvanced"]
        results["extensions"] = await (await client.get("/extensions")).json()
        templates = await client.get("/workflow_templates")  # ComfyUI 0.3.x: the template browser's list
        results["templates"] = await templates.json() if templates.status == 200 else None
        script = await client.get("/extensions/comfyui-tome/tome.js")
        results["script_status"], results["script"] = script.status, await script.text()

        bad = small(json.loads((EXAMPLES / "ToMe_SD15_basic.api.json").read_text()), checkpoint)
        bad["10"]["inputs"]["ratio"] = 0.95
        response = await client.post("/prompt", json={"prompt": bad})
        results["bad_status"], results["bad_body"] = response.status, await response.json()
        results["queued_after_bad"] = prompt_server.prompt_queue.get_tasks_remaining()

        good = small(json.loads((EXAMPLES / "ToMe_SD15_advanced.api.json").read_text()), checkpoint)
        response = await client.post("/prompt", json={"prompt": good, "client_id": "headless"})
        results["good_status"], body = response.status, await response.json()
        prompt_id = body["prompt_id"]

        def worker_step():  # ComfyUI main.py's prompt_worker, one item
            item, item_id = prompt_server.prompt_queue.get(timeout=10)
            executor = comfy.execution.PromptExecutor(prompt_server)
            executor.execute(item[2], item[1], item[3], item[4])
            status = comfy.execution.PromptQueue.ExecutionStatus(
                status_str="success" if executor.success else "error", completed=executor.success,
                messages=executor.status_messages)
            # 2024 hands the UI outputs over, 0.3.x a ready history entry
            result = getattr(executor, "history_result", None) or executor.outputs_ui
            prompt_server.prompt_queue.task_done(item_id, result, status=status)
            return executor.success

        results["executed"] = await asyncio.get_running_loop().run_in_executor(None, worker_step)
        history = await (await client.get(f"/history/{prompt_id}")).json()
        image = history[prompt_id]["outputs"]["7"]["images"][0]
        view = await client.get("/view", params={"filename": image["filename"], "subfolder": image["subfolder"],
                                                 "type": image["type"]})
        results["view_status"], results["png"] = view.status, await view.read()
        results["tome_ui"] = history[prompt_id]["outputs"]["10"]["tome"][0]
    finally:
        await client.close()
    return results


@pytest.fixture(scope="module")
def http(comfy, checkpoint):
    return asyncio.run(_session(comfy, checkpoint))


def test_bad_value_is_an_http_400_with_node_errors_before_anything_runs(http):
    assert http["bad_status"] == 400
    errors = http["bad_body"]["node_errors"]["10"]
    assert errors["class_type"] == "TomeCoreToMe"
    assert any("ratio" in f"{e['message']} {e['details']}" for e in errors["errors"])
    assert http["queued_after_bad"] == 0


def test_example_workflow_runs_headless_through_post_prompt(http):
    assert http["good_status"] == 200 and http["executed"] is True
    assert http["view_status"] == 200
    image = np.asarray(Image.open(io.BytesIO(http["png"])).convert("RGB"))
    assert image.shape == (64, 64, 3) and image.std() > 1.0
    assert http["tome_ui"]["ratio"] == 0.6 and http["tome_ui"]["base_downsample"] == 1


def test_the_browser_gets_tooltips_and_the_extension(http):
    node = http["object_info"]
    assert node["display_name"] == "ToMe (advanced)" and node["category"] == "model_patches/unet"
    assert all(spec[1].get("tooltip") for spec in node["input"]["required"].values())
    assert "/extensions/comfyui-tome/tome.js" in http["extensions"]
    assert http["script_status"] == 200 and "registerExtension" in http["script"]


def test_the_template_browser_lists_the_ui_examples(http):
    if http["templates"] is None:
        pytest.skip("this ComfyUI has no /workflow_templates route (added in 2025)")
    assert sorted(http["templates"]["comfyui-tome"]) == ["ToMe_SD15_advanced", "ToMe_SD15_basic"]
