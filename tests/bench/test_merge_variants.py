"""The merged-token experiment (tome_bench/experiments/merged_token_use.py) and the variants it measures that the
engine does not take (merge_variants.py: soft merge/unmerge within a window, medoid destinations): sizes sum to the
token count, a one-hot soft merge is today's merge, soft shares stay within a window's kept tokens, medoids are each
window's most central token, every variant carries the same tokens, and the JSON leads with its device and commit.
Tiny-width models check the plumbing, not the errors."""
from __future__ import annotations

import json

import pytest
import torch

from tome_core.engine.grid import TokenLayout
from tome_core.engine.kv import pick_index_nd
from tome_core.engine.token_merge import match_grid, merge_window
from tome_bench.merge_variants import SoftMerge, medoid_destinations, soften, window_members


def matched(grid, ratio, prefix=3, suffix=2, seed=0):
    layout = TokenLayout(grid, prefix=prefix, suffix=suffix)
    x = torch.randn(2, layout.length, 8, generator=torch.Generator().manual_seed(seed))
    window = merge_window(grid, 2, 2)
    tokens = x[:, prefix:prefix + layout.grid_tokens]
    match = match_grid(tokens, grid, ratio, pick_index_nd(grid, window, torch.Generator().manual_seed(1)), window)
    return layout, x, tokens, window, match


@pytest.mark.parametrize("grid", [(6, 8), (5, 7), (3, 5, 7)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_soft_sizes_sum_to_the_token_count(grid, ratio):
    layout, _, tokens, window, match = matched(grid, ratio)
    merge = soften(match, tokens, grid, window, 0.1).on(layout)
    assert merge.slots == layout.length - match.removed
    assert merge.counts.sum().item() == pytest.approx(layout.length, abs=1e-4)
    assert torch.allclose(merge.weight.sum(1), torch.ones(layout.length))


def test_soft_merge_with_a_one_hot_assignment_is_todays_merge():
    """A soft merge whose every token has all its weight on its hard slot merges and unmerges exactly as the hard
    one, whatever its other candidate slots."""
    layout, x, _, _, match = matched((6, 8), 0.5)
    hard = match.on(layout)
    others = torch.randint(0, hard.slots, (layout.length, 3), generator=torch.Generator().manual_seed(3))
    weight = torch.zeros(layout.length, 4)
    weight[:, 0] = 1.0
    soft = SoftMerge(torch.cat([hard.group[:, None], others], 1), hard.kept, hard.counts, hard.length, weight)
    merged = hard.merge(x)
    assert torch.allclose(soft.merge(x), merged, atol=1e-6)
    out = merged + torch.randn_like(merged)
    assert torch.allclose(soft.unmerge_update(x, merged, out), hard.unmerge_update(x, merged, out), atol=1e-6)


def test_soft_shares_stay_among_their_windows_kept_tokens():
    """Each merged-away token's weight lies on kept tokens of its own window, kept tokens stay one-hot to
    themselves; a cold softmax puts it all on the window's most similar kept token."""
    grid = (4, 4)
    layout, _, tokens, window, match = matched(grid, 0.25, prefix=0, suffix=0, seed=5)
    soft = soften(match, tokens, grid, window, 0.1)
    members = window_members(grid, window, torch.device("cpu"))
    cell = {int(m): w for w, row in enumerate(members) for m in row if m >= 0}
    for i in range(16):
        on = soft.target[i][soft.weight[i] > 0]
        assert all(cell[int(t)] == cell[i] and not match.merged_away[t] for t in on)
        if not match.merged_away[i]:
            assert on.tolist() == [i] and soft.weight[i].max() == 1.0
    cold = soften(match, tokens, grid, window, 1e-6)
    unit = torch.nn.functional.normalize(tokens, dim=-1)
    for i in match.merged_away.nonzero().flatten().tolist():
        kept = [int(m) for m in members[cell[i]] if m >= 0 and not match.merged_away[m]]
        best = max(kept, key=lambda j: (unit[:, i] * unit[:, j]).sum(-1).mean().item())
        assert cold.target[i][cold.weight[i].argmax()] == best


def test_medoid_destinations_are_each_windows_most_central_token():
    grid = (2, 4)
    window = merge_window(grid, 2, 2)  # windows {0, 1, 4, 5} and {2, 3, 6, 7}
    tokens = torch.randn(1, 8, 16, generator=torch.Generator().manual_seed(6))
    tokens[:, 1] = tokens[:, 0] + tokens[:, 4] + tokens[:, 5]  # the one most like the others of its window
    tokens[:, 6] = tokens[:, 2] + tokens[:, 3] + tokens[:, 7]
    assert medoid_destinations(tokens, grid, window).tolist() == [1, 6]
    odd = (3, 5)
    members = window_members(odd, merge_window(odd, 2, 2), torch.device("cpu"))
    found = medoid_destinations(torch.randn(2, 15, 4), odd, merge_window(odd, 2, 2))
    assert all(int(d) in row.tolist() for d, row in zip(found, members))  # each inside its own (partial) window


@pytest.mark.parametrize("family", ["qwen_image", "wan"])
def test_every_variant_carries_the_same_tokens_and_ratio_zero_is_the_identity(family, tmp_path):
    pytest.importorskip("diffusers")
    pytest.importorskip("skimage")
    from tome_bench.experiments import merged_token_use as exp

    out = tmp_path / "use.json"
    assert exp.main(["--tiny", "--families", family, "--variants", "merge,prop,bal,soft,medoid,prop+soft+medoid",
                     "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["device"].startswith("cpu") and "commit" in result
    rows = result["errors"]
    assert {r["removed"] for r in rows} == {rows[0]["removed"]} and rows[0]["removed"] > 0
    assert {r["content"] for r in rows} == {"noise", "photo"} and all(r["err"] > 0 for r in rows)
    model = exp.build(family, 2, True, torch.float32)
    inputs = exp.inputs_for(model, family, exp.TINY[family], "noise", torch.float32)
    from tome_bench import dit_models
    reference = dit_models.forward(model, inputs)
    for variant in ("prop+soft+medoid", "bal"):
        out, removed = exp.patched_forward(model, inputs, variant, 0.0)
        assert removed == 0 and torch.equal(out, reference)


def test_the_docs_tables_are_the_jsons():
    """The README's, TRANSFORMERS.md's and CONTENT.md's merged-token tables are written from the results JSON
    (``python -m tome_bench.experiments.merged_token_use --docs``), and a changed figure shows."""
    from pathlib import Path

    from tome_bench.experiments import merged_token_use as exp

    repo = Path(__file__).resolve().parent.parent.parent
    result = json.loads((repo / "docs" / "results" / "merged_token_use_cpu.json").read_text())
    assert {"errors", "ops", "yardstick"} <= set(result) and result["device"].startswith("cpu")
    for name in exp.DOCS:
        text = (repo / name).read_text(encoding="utf-8")
        assert exp.BLOCK.search(text), name
        assert exp.rewrite(text, result) == text, f"{name}: python -m tome_bench.experiments.merged_token_use --docs"
    changed = dict(result, errors=[dict(r, err=r["err"] + 0.1) for r in result["errors"]])
    readme = (repo / "README.md").read_text(encoding="utf-8")
    assert exp.rewrite(readme, changed) != readme
