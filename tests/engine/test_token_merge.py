"""The DiT merge engine (tome_core.engine.token_merge): which tokens merge, where they go, and exact means."""
from __future__ import annotations

import math

import pytest
import torch

from tome_core.engine.grid import TokenLayout
from tome_core.engine.kv import pick_index_nd
from tome_core.engine.token_merge import biased_mask, key_bias, match_grid, merge_window


def planned(layout: TokenLayout, ratio: float, batch: int = 2, seed: int = 0, generator_seed=None):
    x = torch.randn(batch, layout.length, 8, generator=torch.Generator().manual_seed(seed))
    window = merge_window(layout.grid, 2, 2)
    generator = None if generator_seed is None else torch.Generator().manual_seed(generator_seed)
    destinations = pick_index_nd(layout.grid, window, generator)
    tokens = x[:, layout.prefix:layout.prefix + layout.grid_tokens]
    return x, window, destinations, match_grid(tokens, layout.grid, ratio, destinations, window).on(layout)


@pytest.mark.parametrize("grid", [(6, 8), (5, 7), (3, 5, 7)])
@pytest.mark.parametrize("ratio", [0.0, 0.25, 0.5, 0.75])
def test_merges_int_ratio_tokens_within_their_own_window(grid, ratio):
    layout = TokenLayout(grid, prefix=3, suffix=2)
    x, window, destinations, merge = planned(layout, ratio, generator_seed=4)
    n = layout.grid_tokens
    removed = min(int(ratio * n), n - destinations.numel())
    assert merge.slots == layout.length - removed and merge.counts.sum() == layout.length
    group, kept = merge.group, merge.kept
    assert torch.equal(kept, kept.unique())  # ascending, distinct
    assert torch.equal(group[kept], torch.arange(merge.slots))  # each representative carried in its own slot
    # text and tokens after the grid are never merged
    outside = torch.cat([torch.arange(3), torch.arange(layout.length - 2, layout.length)])
    assert (merge.counts[group[outside]] == 1).all()
    # a merged token's representative is a destination in the same window (same frame, same window cell)
    coords = torch.stack(torch.meshgrid(*[torch.arange(s) for s in grid], indexing="ij"), -1).reshape(-1, len(grid))
    cell = coords // torch.tensor(window)
    merged_away = [i for i in range(n) if kept[group[3 + i]] != 3 + i]
    assert len(merged_away) == removed
    for i in merged_away:
        target = int(kept[group[3 + i]]) - 3
        assert target in destinations.tolist() and torch.equal(cell[i], cell[target])


def test_merge_is_the_mean_and_unmerge_adds_each_slots_update():
    layout = TokenLayout((4, 6), prefix=2)
    x, _, _, merge = planned(layout, 0.5)
    merged = merge.merge(x)
    for slot in range(merge.slots):
        members = (merge.group == slot).nonzero().flatten()
        assert torch.allclose(merged[:, slot], x[:, members].mean(1), atol=1e-6)
    update = torch.randn(merged.shape, generator=torch.Generator().manual_seed(1))  # not the global RNG: any order
    out = merge.unmerge_update(x, merged, merged + update)
    assert torch.allclose(out, x + update[:, merge.group], atol=1e-6)  # (m + u) - m is u to float32's rounding
    assert torch.equal(merge.unmerge_update(x, merged, merged), x)  # a block that changes nothing changes nothing


def test_one_matching_for_the_batch_from_the_summed_similarity():
    """Similar pairs in every sample merge first; the matching is one for the batch (a table without a batch axis,
    diffusers' RoPE, is cut with one index)."""
    grid = (2, 4)
    window = merge_window(grid, 2, 2)
    destinations = torch.tensor([0, 2])  # windows {0, 1, 4, 5} and {2, 3, 6, 7}
    tokens = torch.randn(3, 8, 16, generator=torch.Generator().manual_seed(1))
    tokens[:, 5] = tokens[:, 0] * 2  # same direction as its destination in every sample
    tokens[:, 7] = tokens[:, 2] + 0.01
    match = match_grid(tokens, grid, 0.25, destinations, window)
    assert match.removed == 2 and sorted(match.merged_away.nonzero().flatten().tolist()) == [5, 7]
    assert match.target.tolist() == [0, 1, 2, 3, 4, 0, 6, 2]


def test_take_cuts_a_table_to_the_merged_stream():
    layout = TokenLayout((4, 4))
    _, _, _, merge = planned(layout, 0.5)
    table = torch.arange(5 + 16).float()[:, None]  # 5 text rows, then the stream's
    cut = merge.take(table, 0, offset=5, before=5)
    assert torch.equal(cut[:5, 0], torch.arange(5.0)) and torch.equal(cut[5:, 0], merge.kept.float() + 5)


def test_ratio_zero_merges_nothing():
    layout = TokenLayout((4, 4), prefix=1)
    x, _, _, merge = planned(layout, 0.0)
    assert merge.slots == layout.length and torch.equal(merge.merge(x), x)


@pytest.mark.parametrize("grid", [(6, 8), (5, 7), (3, 5, 7)])
@pytest.mark.parametrize("ratio", [0.25, 0.5, 0.75])
def test_sizes_sum_to_the_token_count(grid, ratio):
    """Every token is carried once: the slots' sizes sum to the stream's length, and their logs are the bias."""
    layout = TokenLayout(grid, prefix=3, suffix=2)
    _, _, _, merge = planned(layout, ratio, generator_seed=1)
    assert merge.counts.sum().item() == layout.length
    assert torch.allclose(merge.log_sizes().exp(), merge.counts[:, 0])


def test_proportional_bias_is_the_log_size_of_each_key_and_zero_where_nothing_merged():
    layout = TokenLayout((4, 6), prefix=2)
    _, _, _, merge = planned(layout, 0.5)
    bias = key_bias(merge, layout, merge.slots, how="proportional")
    assert torch.allclose(bias.exp(), merge.counts[:, 0])
    joint = key_bias(merge, layout, merge.slots + 5, text=5, how="proportional")
    assert torch.equal(joint[:5], torch.zeros(5)) and torch.equal(joint[5:], bias)
    assert torch.equal(key_bias(merge, layout, merge.slots + 5, text=5, text_first=False, how="proportional")[-5:],
                       torch.zeros(5))
    assert key_bias(merge, layout, merge.slots + 1, how="proportional") is None  # not the stream's keys
    assert key_bias(merge, layout, merge.slots, how="plain") is None
    _, _, _, whole = planned(layout, 0.0)
    assert torch.equal(key_bias(whole, layout, whole.slots, how="proportional"), torch.zeros(whole.slots))


def test_balanced_bias_weighs_the_merged_grid_as_its_tokens_against_the_keys_carried_whole():
    """One value, log(grid tokens / grid slots), on every merged grid key, 0 on the text and the tokens outside the
    grid; none where every key is a grid key (one value on every key changes no softmax)."""
    layout = TokenLayout((4, 6), prefix=2, suffix=1)
    _, _, _, merge = planned(layout, 0.5)
    bias = key_bias(merge, layout, merge.slots + 3, text=3)
    grid_slots = merge.slots - 3
    assert torch.equal(bias[:3 + 2], torch.zeros(5)) and bias[-1] == 0  # text, prefix, suffix
    assert torch.allclose(bias[5:-1], torch.full((grid_slots,), math.log(24 / grid_slots)))
    image = TokenLayout((4, 6))
    _, _, _, alone = planned(image, 0.5)
    assert key_bias(alone, image, alone.slots) is None  # an image-only self-attention: unchanged
    assert torch.allclose(key_bias(alone, image, alone.slots + 4, text=4)[4:], torch.tensor(math.log(2.0)))
    # equal to proportional where every slot holds as many tokens (here: 2 each)
    q, k, v = (torch.randn(1, 2, 3, 4) for _ in range(3))
    attention = torch.nn.functional.scaled_dot_product_attention
    sizes = torch.tensor([1.0, 2.0, 2.0])  # one text key, two merged keys of two tokens each
    assert torch.allclose(attention(q, k, v, attn_mask=biased_mask(None, sizes.log(), q.dtype, 4)),
                          attention(q, k[:, :, [0, 1, 1, 2, 2]], v[:, :, [0, 1, 1, 2, 2]]), atol=1e-5)


def test_proportional_attention_with_every_size_one_is_plain_attention():
    """A bias of log 1 = 0 on every key (nothing merged) changes no attention; a boolean mask keeps its masked keys."""
    q, k, v = (torch.randn(2, 3, 10, 8, generator=torch.Generator().manual_seed(s)) for s in range(3))
    zeros = torch.zeros(10)
    plain = torch.nn.functional.scaled_dot_product_attention(q, k, v)
    biased = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=biased_mask(None, zeros, q.dtype, 4))
    assert torch.allclose(biased, plain, atol=1e-6)
    keep = torch.rand(2, 1, 1, 10, generator=torch.Generator().manual_seed(4)) > 0.3
    masked = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=keep)
    assert torch.allclose(torch.nn.functional.scaled_dot_product_attention(
        q, k, v, attn_mask=biased_mask(keep, zeros, q.dtype, 4)), masked, atol=1e-6)
    # a key of size s weighs as s copies of it: attention over [a, b] with b of size 3 is attention over [a, b, b, b]
    k2, v2 = k[:, :, :2], v[:, :, :2]
    sized = torch.nn.functional.scaled_dot_product_attention(
        q, k2, v2, attn_mask=biased_mask(None, torch.tensor([1.0, 3.0]).log(), q.dtype, 4))
    copies = torch.nn.functional.scaled_dot_product_attention(q, k2[:, :, [0, 1, 1, 1]], v2[:, :, [0, 1, 1, 1]])
    assert torch.allclose(sized, copies, atol=1e-5)
