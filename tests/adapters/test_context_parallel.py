"""Mode kv under diffusers' context parallelism (Ulysses), in two real processes, and what ToMe refuses there.

``context_parallel_worker.py`` runs under ``torchrun --nproc_per_node 2`` (gloo, CPU, a 60 s timeout on every
collective; the run itself is bounded here): under ``ContextParallelConfig(ulysses_degree=2)`` each process reduces
the keys the one-process call keeps, found in the gathered sequence (``engine.slices``), so the output equals the
one-process ToMe output within float tolerance and every process keeps as many keys.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tome_core.engine.grid import TokenLayout
from tome_core.engine.slices import SequenceSlices

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]


def test_kept_keys_are_found_at_their_place_in_the_gathered_sequence():
    """[text, grid] split in two: the gathered order is [text_0, grid_0, text_1, grid_1]; each kept index lands on
    the same token there."""
    layout = TokenLayout((4, 4), prefix=6)
    tokens = torch.arange(layout.length)  # token ids in the one-process order
    text, grid = tokens[:6], tokens[6:]
    gathered = torch.cat([text[:3], grid[:8], text[3:], grid[8:]])  # what Ulysses attends over
    keep = torch.tensor([0, 4, 5, 6, 9, 13, 14, 21])
    where = SequenceSlices(world=2, rank=1).gathered(layout, keep)
    assert where.tolist() == sorted(where.tolist())
    assert sorted(gathered[where].tolist()) == keep.tolist()
    image_only = TokenLayout((4, 4))
    assert torch.equal(SequenceSlices(world=2, rank=0).gathered(image_only, keep[keep < 16]), keep[keep < 16])


def test_what_a_split_cannot_take_is_named():
    split = SequenceSlices(world=2, rank=0, setting="cp")
    assert "use mode 'kv'" in split.refusal("merge")
    assert "Ulysses" in SequenceSlices(2, 0, ring=True).refusal("kv")
    assert "ulysses_anything" in SequenceSlices(2, 0, uneven=True).refusal("kv")
    assert "49 image tokens do not split into 2" in split.refusal("kv", TokenLayout((7, 7), prefix=512))
    assert "reference" in split.refusal("kv", TokenLayout((4, 4), prefix=2, suffix=4))
    assert split.refusal("kv", TokenLayout((4, 4), prefix=2)) is None


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    if os.environ.get("CI") != "true":  # CI installs diffusers: there a missing one fails
        pytest.importorskip("diffusers")
    from diffusers import ContextParallelConfig  # noqa: F401 - diffusers 0.42's context parallelism

    out = tmp_path_factory.mktemp("cp") / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                          str(HERE / "context_parallel_worker.py"), str(out)],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0 and out.exists(), run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.mark.parametrize("family", ["flux", "qwen_image", "wan"])
def test_each_process_reduces_the_keys_of_the_one_process_call(two_processes, family):
    found = two_processes["families"][family]
    assert found["split_alone_vs_vanilla"] < 1e-6  # context parallelism alone
    assert found["split_tome_vs_split_alone"] > 1e-3  # ToMe acts under it
    assert found["split_tome_vs_one_process_tome"] < 1e-5  # as it acts on one process
    assert abs(found["split_tome_vs_split_alone"] - found["one_process_tome_vs_vanilla"]) < 1e-5
    counts = found["kept_keys_and_reduced_calls_per_rank"]
    assert len({tuple(c) for c in counts}) == 1 and counts[0][0] == found["one_process_kept_keys"] and counts[0][1] > 0
    assert found["ratio0_equals_split_alone"] and found["removed_equals_split_alone"]
    assert "mode merge merges each block's tokens" in found["merge_error"] and "use mode 'kv'" in found["merge_error"]
    assert found["default_mode"] == "kv"  # apply_patch without a mode: the one that follows the split


def test_what_tome_cannot_follow_is_refused_before_the_first_step(two_processes):
    refused = two_processes["refused"]
    assert "ring_degree=2" in refused["ring"] and "use Ulysses attention" in refused["ring"]
    assert "uneven chunks" in refused["uneven"] and "leave them off" in refused["uneven"]
    assert "LTX2VideoTransformer3DModel" in refused["unknown_split"] and "flux, qwen_image, wan" in \
        refused["unknown_split"]
    assert "512 text and 49 image tokens do not split into 2 equal chunks" in refused["odd_tokens"]
