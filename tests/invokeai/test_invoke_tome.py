"""ToMe's SD1.5/SDXL denoise node in a real InvokeAI, driven as users drive it: graphs through the REST queue.

The promises: left at the model's defaults the node reduces (tomesd's merge 0.5 on a UNet, said in the server log);
the model in InvokeAI's cache is ToMe's only for the job that asked (a later job without ToMe, also after a failed
ToMe job, renders bit for bit what it rendered before any); a bad value fails the job with ToMe's message, or is
refused by InvokeAI's own validation at enqueue, and the server keeps serving.
"""
from __future__ import annotations

import json
import re
import subprocess

import numpy as np
import pytest

from invoke_env import REPO, TOME_DENOISE, InvokeError, sd15_txt2img_graph, tome_fields

SIZE = 128  # 16x16 latent tokens at the first level: enough for the 2x2 cells to merge


def _graph(model, seed, **fields):
    extra = {} if not fields else {"denoise_type": TOME_DENOISE, "denoise_fields": tome_fields(**fields)}
    return sd15_txt2img_graph(model, seed=seed, width=SIZE, height=SIZE, **extra)


def _differs(a, b) -> float:
    return float(np.abs(a.astype(int) - b.astype(int)).mean())


def test_the_defaults_reduce_and_the_log_says_what_ran(invoke, sd15_model):
    plain = invoke.run_image(_graph(sd15_model, 11))
    tome = invoke.run_image(_graph(sd15_model, 11, ratio=-1.0, mode="default"))
    assert _differs(plain, tome) > 0.0
    log = invoke.log_path.read_text(errors="replace")
    assert "ToMe merge r=0.5 on UNet" in log, invoke.log_tail()


def test_kv_mode_and_the_step_window_each_change_the_image_their_way(invoke, sd15_model):
    plain = invoke.run_image(_graph(sd15_model, 12))
    kv = invoke.run_image(_graph(sd15_model, 12, ratio=0.5, mode="kv"))
    merge = invoke.run_image(_graph(sd15_model, 12, ratio=0.5, mode="merge"))
    late = invoke.run_image(_graph(sd15_model, 12, ratio=0.5, mode="merge", start=0.5))  # the second step only
    assert min(_differs(plain, kv), _differs(plain, merge), _differs(plain, late)) > 0.0
    assert not np.array_equal(kv, merge) and not np.array_equal(late, merge)


def test_a_later_job_without_tome_renders_what_it_rendered_before_any(invoke, sd15_model):
    before = invoke.run_image(_graph(sd15_model, 13))
    invoke.run_image(_graph(sd15_model, 13, ratio=0.6, mode="merge", max_downsample=2))
    after = invoke.run_image(_graph(sd15_model, 13))
    assert np.array_equal(before, after)


@pytest.mark.parametrize("fields, words", [
    (dict(ratio=-0.5), "ToMe: ratio = -0.5: use -1 for the model's default ratio"),
    (dict(ratio=0.5, start=0.8, end=0.2), "start_percent"),
    (dict(ratio=0.5, max_downsample=3), "max_downsample"),
])
def test_a_bad_value_fails_the_job_with_tomes_message_and_the_server_serves_on(invoke, sd15_model, fields, words):
    before = invoke.run_image(_graph(sd15_model, 14))
    failed = invoke.run(_graph(sd15_model, 14, **fields))
    assert failed.status == "failed", failed.describe()
    assert words in (failed.error_message or ""), failed.describe()
    assert np.array_equal(before, invoke.run_image(_graph(sd15_model, 14)))  # the model left as it was


def test_invokeais_own_validation_refuses_a_ratio_out_of_range_at_enqueue(invoke, sd15_model):
    with pytest.raises(InvokeError) as refused:
        invoke.enqueue(_graph(sd15_model, 15, ratio=0.9))
    assert refused.value.status == 422 and b"tome_ratio" in refused.value.body


def test_hidiffusion_beside_tome_is_refused_naming_it_and_the_way_out(invoke, sd15_model):
    graph = _graph(sd15_model, 16, ratio=0.5, mode="merge")
    graph["nodes"]["denoise"]["hidiffusion"] = True
    failed = invoke.run(graph)
    assert failed.status == "failed" and "HiDiffusion" in (failed.error_message or "") \
        and "turn hidiffusion off" in failed.error_message, failed.describe()


WORKFLOWS = REPO / "tome_invokeai" / "workflows"


def test_the_shipped_workflow_matches_the_servers_nodes_and_their_versions(invoke):
    """The workflow InvokeAI's node pack installer imports into the library (every JSON of the pack with "nodes" and
    "edges"): each node's type is offered, at the version the server gives it (the workflow editor refuses a node
    version that is not X.Y.Z, and asks to update a node whose version differs), each input it sets exists, and each
    edge joins two of its nodes. The node version is plain X.Y.Z: a "+build" suffix fails every saved workflow."""
    (path,) = sorted(WORKFLOWS.glob("*.json"))
    workflow = json.loads(path.read_text(encoding="utf-8"))
    ids = {node["id"] for node in workflow["nodes"]}
    for node in workflow["nodes"]:
        data = node["data"]
        schema = invoke.invocation_schema(data["type"])
        assert schema is not None, data["type"]
        assert data["version"] == schema["version"] and re.fullmatch(r"\d+\.\d+\.\d+", schema["version"]), data
        assert set(data["inputs"]) <= set(schema["properties"]), (data["type"], set(data["inputs"]) - set(schema["properties"]))
    assert {edge["source"] for edge in workflow["edges"]} | {edge["target"] for edge in workflow["edges"]} <= ids
    tome = next(node["data"] for node in workflow["nodes"] if node["data"]["type"] == TOME_DENOISE)
    assert tome["inputs"]["tome_ratio"]["value"] == -1 and tome["inputs"]["tome_mode"]["value"] == "default"


def test_the_pack_holds_no_other_json_that_invokeais_installer_would_import_as_a_workflow():
    """InvokeAI's node pack installer imports every *.json of the pack with top-level "nodes" and "edges" into the
    workflow library (``custom_nodes.py``, ``_import_workflows_from_pack``): only the shipped workflows may look so."""
    tracked = subprocess.run(["git", "ls-files", "-z", "*.json"], cwd=REPO, capture_output=True, text=True,
                             check=True).stdout.split("\0")[:-1]
    found = []
    for name in tracked:
        data = json.loads((REPO / name).read_text(encoding="utf-8"))
        if isinstance(data, dict) and "nodes" in data and "edges" in data:
            found.append(name)
    assert found and all(name.startswith("tome_invokeai/workflows/") for name in found), found
