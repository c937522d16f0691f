"""ToMe under diffusers' context parallelism (Ulysses, Ring), in two real processes, and what it refuses there.

``context_parallel_worker.py`` runs under ``torchrun --nproc_per_node 2`` (gloo, CPU, a 60 s timeout on every
collective; the run itself is bounded here): under ``ContextParallelConfig(ulysses_degree=2)`` each process reduces
the keys the one-process call keeps, found in the gathered sequence (``engine.slices``), so the output equals the
one-process ToMe output within float tolerance and every process keeps as many keys; in mode merge each process
merges its own band of rows, equal to one process merging the same bands (``bands``), as many tokens on each.
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
    assert split.refusal("merge") is None and split.refusal("merge", TokenLayout((8, 8)), text=6) is None
    assert "7 text tokens do not split" in split.refusal("merge", TokenLayout((8, 8)), text=7)
    assert "reference" in split.refusal("merge", TokenLayout((8, 8), suffix=4))
    assert "proportional" in split.refusal("merge", attention="proportional")
    assert "latent frames divide by 2" in split.refusal("merge", TokenLayout((3, 5, 8)))
    ulysses = SequenceSlices(world=4, rank=0, ulysses=4)
    assert "ulysses_degree=4 does not divide its 6 attention heads" in ulysses.heads_refusal(6)
    assert ulysses.heads_refusal(8) is None and SequenceSlices(4, 0, ring=True).heads_refusal(6) is None
    assert "Ulysses" in SequenceSlices(2, 0, ring=True).refusal("kv")
    assert "ulysses_anything" in SequenceSlices(2, 0, uneven=True).refusal("kv")
    assert "49 image tokens do not split into 2" in split.refusal("kv", TokenLayout((7, 7), prefix=512))
    assert "reference" in split.refusal("kv", TokenLayout((4, 4), prefix=2, suffix=4))
    assert split.refusal("kv", TokenLayout((4, 4), prefix=2)) is None


def test_a_band_is_whole_rows_and_merge_windows_stay_in_one_frame():
    split = SequenceSlices(world=2, rank=1)
    assert split.local_grid((8, 6)) == (4, 6) and split.local_grid((7, 6)) is None
    assert split.local_grid((4, 8, 6)) == (2, 8, 6)  # whole frames
    assert split.local_grid((3, 8, 6)) == (12, 6)  # 12 rows: 8 of frame 1 and 4 of frame 2, 2-row windows
    assert split.local_grid((3, 6, 6)) is None  # 9 rows a band: a 2-row window would straddle a frame
    assert split.local_grid((3, 5, 6)) is None  # 5-row frames: windows straddle frames
    x = torch.arange(24.0).view(1, 6, 4)
    assert torch.equal(split.own(x, 1), x[:, 3:])
    carried = split.carrier(x[:, :2], 1)
    assert carried.shape == (1, 4, 4) and torch.equal(split.own(carried, 1), x[:, :2]) and not carried[:, :2].any()


def test_one_process_bands_match_each_band_alone():
    """``match_bands``: the grid's two bands matched apart, as two processes each match their own."""
    from tome_core.engine.kv import pick_index_nd
    from tome_core.engine.token_merge import match_bands, match_grid

    tokens = torch.randn(2, 64, 8, generator=torch.Generator().manual_seed(0))
    band, window = (4, 8), (2, 2)
    destinations = pick_index_nd(band, window, torch.Generator().manual_seed(1))
    whole = match_bands(tokens, band, 2, 0.5, destinations, window)
    parts = [match_grid(tokens[:, i * 32:(i + 1) * 32], band, 0.5, destinations, window) for i in range(2)]
    assert whole.removed == sum(part.removed for part in parts) == 32
    assert torch.equal(whole.merged_away, torch.cat([part.merged_away for part in parts]))
    assert torch.equal(whole.target, torch.cat([parts[0].target, parts[1].target + 32]))
    assert bool((whole.target[:32] < 32).all()) and bool((whole.target[32:] >= 32).all())  # never across bands


def run_worker(tmp_path_factory, processes, *what):
    if os.environ.get("CI") != "true":  # CI installs diffusers: there a missing one fails
        pytest.importorskip("diffusers")
    from diffusers import ContextParallelConfig  # noqa: F401 - diffusers 0.42's context parallelism

    out = tmp_path_factory.mktemp("cp") / "results.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node",
                          str(processes), str(HERE / "context_parallel_worker.py"), str(out), *what],
                         capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert run.returncode == 0 and out.exists(), run.stderr[-4000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def two_processes(tmp_path_factory):
    return run_worker(tmp_path_factory, 2)


@pytest.fixture(scope="module")
def four_processes(tmp_path_factory):
    return run_worker(tmp_path_factory, 4, "both")


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
    assert "under context parallelism (ulysses_degree=2, ring_degree=1): each of the 2 processes keeps the keys one " \
        "process would" in found["described"]
    assert found["default_mode"] == "merge"  # apply_patch without a mode: the family's, which follows the split
    # speed_check "on": every process times the call together (its repeats run their collectives) and takes the
    # same verdict, the slowest process's speed-up; the run goes on (no hang: each collective has a 60 s timeout)
    verdicts = found["speed_check_on_per_rank"]
    assert verdicts[0] == verdicts[1] and len(verdicts[0]) == 1, verdicts
    assert "tokens, batch 2: " in verdicts[0][0] and "measured" in verdicts[0][0] and \
        "on cpu (every process of the split, the slowest)" in verdicts[0][0]
    assert found["speed_check_repeatable"]


@pytest.mark.parametrize("family", ["flux", "qwen_image", "wan", "wan_3_frames", "wan_step_per_token"])
def test_each_process_merges_its_own_band(two_processes, family):
    """Mode merge under Ulysses: each process merges its band alone, as many tokens on each, and the output equals
    one process merging the same bands (Qwen-Image: balanced attention, its bias over the gathered keys; Wan 2.2
    ti2v's step per token: its per-token modulation split and cut alike)."""
    found = two_processes["families"][family]["merge"]
    assert found["split_tome_vs_split_alone"] > 1e-3  # ToMe acts under it
    assert found["split_tome_vs_one_process_bands"] < 1e-5
    assert abs(found["split_tome_vs_split_alone"] - found["one_process_bands_vs_vanilla"]) < 1e-5
    # merging bands costs little against merging the whole grid
    assert found["one_process_bands_vs_vanilla"] < 1.1 * found["one_process_tome_vs_vanilla"]
    counts = found["slots_length_reduced_calls_per_rank"]
    assert len({tuple(c) for c in counts}) == 1 and counts[0][0] == counts[0][1] // 2 and counts[0][2] > 0
    assert found["ratio0_equals_split_alone"] and found["removed_equals_split_alone"]
    assert "each of the 2 processes merges its own band" in found["described"]


@pytest.mark.parametrize("mode", ["kv", "merge"])
def test_flux2_follows_the_split_in_both_modes(two_processes, mode):
    """Flux.2: its single blocks take the joint [text, image], each process's own [text_r, band_r] under Ulysses."""
    found = two_processes["families"]["flux2"]
    assert found["split_alone_vs_vanilla"] < 1e-6
    assert found[mode]["split_tome_vs_one_process"] < 1e-5 and found[mode]["split_tome_vs_split_alone"] > 1e-3
    calls = found[mode]["reduced_calls_per_rank"]
    assert calls[0] == calls[1] > 0


@pytest.mark.parametrize("both", [False, True], ids=["ring", "ulysses_and_ring"])
@pytest.mark.parametrize("family", ["flux", "qwen_image", "wan"])
def test_mode_merge_follows_ring_attention(request, family, both):
    """Mode merge under diffusers' Ring attention, alone (2 processes) and with Ulysses (2 x 2 processes), its
    per-step kernel the CPU's flash kernel: each process's band merged, the ring passing the merged chunks, equal to
    one process merging the same bands; balanced attention, whose bias the ring's kernel cannot take, says it runs
    plain."""
    found = request.getfixturevalue("four_processes")[family] if both else \
        request.getfixturevalue("two_processes")["families"]["ring"][family]
    assert found["split_alone_vs_vanilla"] < 1e-6
    assert found["split_tome_vs_split_alone"] > 1e-3
    assert found["split_tome_vs_one_process_bands"] < 1e-5
    assert len(set(found["slots_per_rank"])) == 1 and found["slots_per_rank"][0] > 0
    assert found["removed_equals_split_alone"]
    if family == "qwen_image":
        assert found["default_attention_notes"] == [
            "balanced attention needs a mask; QwenDoubleStreamAttnProcessor2_0 ignores masks: plain"]


def test_what_tome_cannot_follow_is_refused_before_the_first_step(two_processes):
    refused = two_processes["refused"]
    assert "ring_degree=2" in refused["ring"] and "use Ulysses attention" in refused["ring"] and \
        "or mode 'merge'" in refused["ring"]
    assert "uneven chunks" in refused["uneven"] and "leave them off" in refused["uneven"]
    assert "would merge a different number of tokens" in refused["uneven_merge"]
    assert "ulysses_degree=2" in refused["proportional"] and "use merge_attention 'balanced' or 'plain'" in \
        refused["proportional"]
    assert "7x7 token grid's 7 rows do not split into 2 bands" in refused["odd_rows"] and "or mode 'kv'" in \
        refused["odd_rows"]
    assert "ulysses_degree=2 does not divide its 3 attention heads" in refused["heads"]
    assert "LTX2VideoTransformer3DModel" in refused["unknown_split"] and "flux, flux2, qwen_image, wan" in \
        refused["unknown_split"]
    assert "512 text and 49 image tokens do not split into 2 equal chunks" in refused["odd_tokens"]
