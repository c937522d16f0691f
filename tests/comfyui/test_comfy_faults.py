"""Faults in a ComfyUI graph with ToMe, over the real server: nothing of a failed prompt leaks into the next.

A node after the sampler raises, or the model call raises in the middle of sampling (a wrapper of
another node, after ToMe's patches ran on earlier calls), and ToMe sits before or after the faulty
node. The prompt ends as ComfyUI's execution error naming the faulty node, and the next ToMe prompt,
and a plain one, give exactly the image they gave before any fault (which the first test checks is a
fresh executor's image: POST /free, then a run with nothing taken from the cache).
"""
from __future__ import annotations

import numpy as np
import pytest

from comfy_env import advanced, api_prompt, pixels

TOME_SETTINGS = {
    "basic": {"class_type": "TomeCoreToMe", "inputs": {"ratio": 0.5, "max_downsample": 1}},
    "kv": advanced(mode="kv", ratio=0.75),
}
FAIL_MID_SAMPLING = {"class_type": "TomeTestFailMidSampling", "inputs": {"fail_at_call": 2}}


@pytest.fixture(scope="module")
def before(comfy, checkpoint):
    """Each setting's image (and the plain one) on a fresh executor, before any fault."""
    images = {}
    for name, tome in [("plain", None), *TOME_SETTINGS.items()]:
        result = comfy.run_fresh(api_prompt(tome, prefix=f"fault_ref_{name}"))
        assert result.success, result.error_message()
        images[name] = pixels(result.images[0])
    return images


def assert_next_runs_equal(comfy, before, label: str, last: str) -> None:
    """Run the plain graph, then the faulty prompt's ToMe setting ``last`` without the fault; the plain run
    between them means no sampler output can come from ComfyUI's cache (which keeps the previous prompt's
    nodes): both are sampled anew."""
    order = ["plain", last]
    for name in order:
        result = comfy.run(api_prompt(TOME_SETTINGS.get(name), prefix=f"after_{name}"))
        assert result.success, result.error_message()
        assert "5" not in result.cached_nodes(), f"{name}: the sampler's output came from the cache"
        assert np.array_equal(pixels(result.images[0]), before[name]), \
            f"{name} after {label} differs from before the fault"


def test_the_references_are_tomes_images(before):
    assert not np.array_equal(before["basic"], before["plain"])
    assert not np.array_equal(before["kv"], before["plain"])


@pytest.mark.parametrize("setting", list(TOME_SETTINGS))
def test_a_node_after_the_sampler_raises(comfy, before, setting):
    prompt = api_prompt(TOME_SETTINGS[setting], prefix="fault_after")
    prompt["8"] = {"class_type": "TomeTestRaiseOnImage", "inputs": {"images": ["6", 0], "label": setting}}
    result = comfy.run(prompt)
    assert not result.success
    error = result.error_message()
    assert error["node_id"] == "8" and "injected fault after the sampler" in error["exception_message"], error
    assert_next_runs_equal(comfy, before, f"a fault after the sampler ({setting})", setting)


@pytest.mark.parametrize("setting, order", [("basic", "tome_then_faulty"), ("kv", "faulty_then_tome")])
def test_the_model_call_raises_mid_sampling(comfy, before, setting, order):
    tome = TOME_SETTINGS[setting]
    chain = [tome, FAIL_MID_SAMPLING] if order == "tome_then_faulty" else [FAIL_MID_SAMPLING, tome]
    result = comfy.run(api_prompt(chain[-1], pre_nodes=chain[:-1], prefix="fault_mid"))
    assert not result.success
    error = result.error_message()
    assert error["node_id"] == "5" and "injected fault in model call 2" in error["exception_message"], error
    assert_next_runs_equal(comfy, before, f"a fault mid-sampling ({setting}, {order})", setting)
