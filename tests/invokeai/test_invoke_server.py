"""The InvokeAI harness itself: a real invokeai-web starts with this repository as a node pack, the tiny SD1.5
single-file checkpoint installs through the REST API, and a text-to-image graph runs, deterministically."""
from __future__ import annotations

import numpy as np
import pytest

import invoke_env
from invoke_env import TOME_DENOISE, sd15_txt2img_graph, tome_fields

TOME_FIELDS = {"tome_ratio", "tome_mode", "tome_max_downsample", "tome_start", "tome_end", "tome_speed_check"}


def test_the_server_answers_and_loads_this_repository_as_a_node_pack(invoke):
    assert invoke.get_json("/api/v1/app/version")["version"].startswith("6.")
    log = invoke.log_path.read_text(errors="replace")
    name = invoke_env.NODE_PACK_NAME
    assert f"Loading node pack {name}" in log, invoke.log_tail()
    assert f"Failed to load node pack {name}" not in log, invoke.log_tail()
    assert f"node pack from {invoke.root / 'nodes'}: {name}" in log, invoke.log_tail()


def test_the_tiny_checkpoint_installs_as_an_sd1_main_checkpoint(sd15_model, invoke):
    assert (sd15_model["base"], sd15_model["type"], sd15_model["format"]) == ("sd-1", "main", "checkpoint")
    assert sd15_model["variant"] == "normal" and sd15_model["prediction_type"] == "epsilon"
    assert sd15_model["key"] in {model["key"] for model in invoke.models()}


def test_a_plain_sd15_graph_renders_the_same_image_twice_and_another_for_another_seed(invoke, sd15_model):
    first = invoke.run_image(sd15_txt2img_graph(sd15_model, seed=3, width=64, height=64, steps=2))
    again = invoke.run_image(sd15_txt2img_graph(sd15_model, seed=3, width=64, height=64, steps=2))
    other = invoke.run_image(sd15_txt2img_graph(sd15_model, seed=4, width=64, height=64, steps=2))
    assert first.shape == (64, 64, 3) and first.dtype == np.uint8
    assert first.std() > 2.0  # an image, not a flat colour
    assert np.array_equal(first, again)
    assert np.abs(first.astype(int) - other.astype(int)).mean() > 1.0


def test_a_failing_graph_reports_its_error(invoke, sd15_model):
    """The harness hands back InvokeAI's error fields (here: a model key that is not installed)."""
    graph = sd15_txt2img_graph(dict(sd15_model, key="no-such-model"))
    result = invoke.run(graph)
    assert result.status == "failed" and result.error_type and result.error_message, result.describe()


def test_the_tome_denoise_node_is_listed_with_denoise_latents_inputs_and_the_tome_fields(invoke):
    types = invoke.invocation_types()
    assert TOME_DENOISE in types, f"{TOME_DENOISE} is not among the server's invocations ({len(types)} listed)"
    tome = invoke.invocation_schema(TOME_DENOISE)["properties"]
    plain = invoke.invocation_schema("denoise_latents")["properties"]
    assert set(tome) == (set(plain) | TOME_FIELDS), sorted(set(tome) ^ (set(plain) | TOME_FIELDS))
    assert tome["tome_ratio"]["default"] == -1 and tome["tome_ratio"]["minimum"] == -1
    assert tome["tome_ratio"]["maximum"] == 0.75
    assert set(tome["tome_mode"]["enum"]) == {"default", "merge", "kv"}
    assert set(tome["tome_speed_check"]["enum"]) == {"off", "auto", "on"}


@pytest.mark.parametrize("size", [64])
def test_tome_denoise_at_ratio_zero_renders_the_plain_image(invoke, sd15_model, size):
    assert TOME_DENOISE in invoke.invocation_types(), f"the node pack offers no {TOME_DENOISE}"
    plain = invoke.run_image(sd15_txt2img_graph(sd15_model, seed=5, width=size, height=size))
    zero = invoke.run_image(sd15_txt2img_graph(sd15_model, seed=5, width=size, height=size, denoise_type=TOME_DENOISE,
                                               denoise_fields=tome_fields(ratio=0.0, mode="merge")))
    assert np.array_equal(plain, zero)


def test_tome_denoise_merging_changes_the_image(invoke, sd15_model):
    assert TOME_DENOISE in invoke.invocation_types(), f"the node pack offers no {TOME_DENOISE}"
    plain = invoke.run_image(sd15_txt2img_graph(sd15_model, seed=6, width=128, height=128))
    merged = invoke.run_image(sd15_txt2img_graph(sd15_model, seed=6, width=128, height=128, denoise_type=TOME_DENOISE,
                                                 denoise_fields=tome_fields(ratio=0.5, mode="merge")))
    assert merged.shape == plain.shape and not np.array_equal(plain, merged)
