"""The two processes of ``test_context_parallel.py`` (not a test file): run under ``torchrun --nproc_per_node 2``
(gloo, CPU); rank 0 writes what both saw as JSON to ``argv[1]``. Every collective has a 60 s timeout, so a hang
fails the test instead of stalling the suite.

Per family (diffusers' tiny Flux, Qwen-Image and Wan, 128x128, Wan 5 frames, batch 2): the one-process model
without and with ToMe (mode kv, ratio 0.5), then the same weights under ``ContextParallelConfig(ulysses_degree=2)``
alone, with ToMe, at ratio 0 and after ``remove_patch``, each rank's kept key count; the same for mode merge against
one process merging the same bands (and Wan with 3 latent frames: bands of rows across frames); mode merge under
Ring attention (``ring_degree=2``, diffusers' ring with the CPU's flash kernel per step); Flux.2 in both modes; then
the settings ToMe
refuses before the first step. With a second argument ``both`` (four processes): mode merge under Ulysses and Ring
together (``ulysses_degree=2, ring_degree=2``).
"""
import datetime
import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist


def rel(a, b):
    return float((a - b).norm() / b.norm())


def error_of(run):
    try:
        run()
    except ValueError as error:
        return str(error)
    return None


def merge_under_split(local, split, inputs, alone, vanilla):
    """Mode merge (ratio 0.5) on ``split`` (made context parallel) against one process merging the same bands
    (``bands = 2``) on ``local`` (the same weights): outputs, each rank's merged token count, ratio 0, removal."""
    import tome_core
    from tome_bench.dit_models import forward

    tome_core.apply_patch(local, ratio=0.5, mode="merge")
    whole = forward(local, inputs)
    local.__dict__["_tome_dit"].bands = 2
    banded = forward(local, inputs)
    tome_core.remove_patch(local)
    tome_core.apply_patch(split, ratio=0.5, mode="merge")
    reduced = forward(split, inputs)
    state = split.__dict__["_tome_dit"]
    counts = [None] * dist.get_world_size()
    dist.all_gather_object(counts, (int(state.current.merge.slots), int(state.current.merge.length),
                                    state.reduced_calls))
    described = tome_core.describe(split)
    tome_core.apply_patch(split, ratio=0.0, mode="merge")
    zero = forward(split, inputs)
    tome_core.remove_patch(split)
    removed = forward(split, inputs)
    return {"one_process_tome_vs_vanilla": rel(whole, vanilla), "one_process_bands_vs_vanilla": rel(banded, vanilla),
            "split_tome_vs_split_alone": rel(reduced, alone), "split_tome_vs_one_process_bands": rel(reduced, banded),
            "ratio0_equals_split_alone": bool(torch.equal(zero, alone)),
            "removed_equals_split_alone": bool(torch.equal(removed, alone)),
            "slots_length_reduced_calls_per_rank": counts, "described": described}


def flux2_under_split():
    """Flux.2 (the catalogue tests' tiny model, an 8x8 grid, 6 text tokens, batch 2, ids batched as Flux2Pipeline
    passes them): modes kv and merge (its single blocks take the joint [text, image]; balanced attention) under
    Ulysses against one process (merge: the same bands)."""
    tests = Path(__file__).resolve().parents[1]  # the catalogue tests' builders (and the conftest they import)
    sys.path[:0] = [str(tests / "catalogue"), str(tests)]
    import tome_core
    from diffusers import ContextParallelConfig
    from test_dit_families import flux2

    (local, inputs, _), (split, _, _) = flux2(h=8, w=8, batch=2, text=6), flux2(h=8, w=8, batch=2, text=6)
    for key in ("img_ids", "txt_ids"):
        inputs[key] = inputs[key].unsqueeze(0).expand(2, -1, -1).contiguous()

    def out(model):
        return model(**inputs, return_dict=False)[0]

    vanilla = out(local)
    split.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
    alone = out(split)
    found = {"split_alone_vs_vanilla": rel(alone, vanilla)}
    for mode in ("kv", "merge"):
        tome_core.apply_patch(local, ratio=0.5, mode=mode, merge_attention="balanced" if mode == "merge" else None)
        local.__dict__["_tome_dit"].bands = 2 if mode == "merge" else 1
        one = out(local)
        tome_core.remove_patch(local)
        tome_core.apply_patch(split, ratio=0.5, mode=mode, merge_attention="balanced" if mode == "merge" else None)
        reduced = out(split)
        calls = [None] * dist.get_world_size()
        dist.all_gather_object(calls, split.__dict__["_tome_dit"].reduced_calls)
        tome_core.remove_patch(split)
        found[mode] = {"split_tome_vs_one_process": rel(reduced, one), "split_tome_vs_split_alone": rel(reduced, alone),
                       "reduced_calls_per_rank": calls}
    return found


def cpu_flash_forward_op(ctx, query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                         enable_gqa=False, return_lse=False, _save_ctx=True, _parallel_config=None):
    """A stand-in for diffusers' per-step Ring kernels, which are CUDA's (flash, cuDNN): torch's CPU flash kernel,
    returning the log-sum-exp the ring combines its steps with. Mirrors the signature and (B, S, H, D) / (B, S, H)
    layouts of diffusers 0.42.1 attention_dispatch ``_native_flash_attention_forward_op``."""
    q, k, v = (x.transpose(1, 2) for x in (query, key, value))
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, dropout_p, is_causal,
                                                                         attn_mask=attn_mask, scale=scale)
    out, lse = out.transpose(1, 2).contiguous(), lse.transpose(1, 2).contiguous()
    return (out, lse) if return_lse else out


def ring_merge(**degrees):
    """Mode merge under diffusers' real Ring attention (``degrees``: ring_degree, and ulysses_degree for both), its
    per-step kernel the CPU's (``cpu_flash_forward_op``): each family against one process merging the same bands,
    plain attention (the ring's kernel takes no bias: balanced attention runs plain there, and says so)."""
    import diffusers.models.attention_dispatch as dispatch
    import tome_core
    from diffusers import ContextParallelConfig
    from tome_bench.dit_models import build_dit, forward, make_dit_inputs

    native, dispatch._native_attention_forward_op = dispatch._native_attention_forward_op, cpu_flash_forward_op
    found = {}
    try:
        for family in ("flux", "qwen_image", "wan"):
            local, split = build_dit(family, scale="tiny"), build_dit(family, scale="tiny")
            inputs = make_dit_inputs(local, family, 2, 128, 128, frames=5 if family == "wan" else 1)
            vanilla = forward(local, inputs)
            tome_core.apply_patch(local, ratio=0.5, mode="merge", merge_attention="plain")
            local.__dict__["_tome_dit"].bands = dist.get_world_size()
            banded = forward(local, inputs)
            split.enable_parallelism(config=ContextParallelConfig(**degrees))
            alone = forward(split, inputs)
            tome_core.apply_patch(split, ratio=0.5, mode="merge", merge_attention="plain")
            reduced = forward(split, inputs)
            slots = [None] * dist.get_world_size()
            dist.all_gather_object(slots, int(split.__dict__["_tome_dit"].current.merge.slots))
            tome_core.apply_patch(split, ratio=0.5, mode="merge")  # the family's attention: Qwen-Image's balanced
            forward(split, inputs)
            notes = [line for line in tome_core.describe(split).splitlines() if "ignores masks" in line]
            tome_core.remove_patch(split)
            found[family] = {"split_alone_vs_vanilla": rel(alone, vanilla), "split_tome_vs_split_alone":
                             rel(reduced, alone), "split_tome_vs_one_process_bands": rel(reduced, banded),
                             "removed_equals_split_alone": bool(torch.equal(forward(split, inputs), alone)),
                             "slots_per_rank": slots, "default_attention_notes": notes}
    finally:
        dispatch._native_attention_forward_op = native
    return found


def main(out_path):
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.accelerator.device_count = lambda: 1  # diffusers' _resolve_parallel_config divides by it: 0 on a CPU
    torch.set_num_threads(1)
    import tome_core
    from diffusers import ContextParallelConfig
    from tome_bench.dit_models import build_dit, forward, make_dit_inputs

    results = {}
    with torch.no_grad():
        for family in ("flux", "qwen_image", "wan"):
            local, split = build_dit(family, scale="tiny"), build_dit(family, scale="tiny")
            inputs = make_dit_inputs(local, family, 2, 128, 128, frames=5 if family == "wan" else 1)
            vanilla = forward(local, inputs)
            tome_core.apply_patch(local, ratio=0.5, mode="kv")
            one = forward(local, inputs)
            one_kept = local.__dict__["_tome_dit"].current
            one_kept = int((one_kept.keep if one_kept.image_keep is None else one_kept.image_keep).numel())
            tome_core.remove_patch(local)
            split.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
            alone = forward(split, inputs)
            tome_core.apply_patch(split, ratio=0.5, mode="kv")
            reduced = forward(split, inputs)
            kv_described = tome_core.describe(split)
            state = split.__dict__["_tome_dit"]
            call = state.current
            kept = int((call.keep if call.image_keep is None else call.image_keep).numel())
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, (kept, state.reduced_calls))
            tome_core.apply_patch(split, ratio=0.0, mode="kv")
            zero = forward(split, inputs)
            tome_core.remove_patch(split)
            removed = forward(split, inputs)
            tome_core.apply_patch(split, ratio=0.5)  # no mode: the family's mode under the split
            default_mode = split.__dict__["_tome_dit"].config.mode
            tome_core.remove_patch(split)
            tome_core.apply_patch(split, ratio=0.5, speed_check="on")  # asked to time: not alone under the split
            timed_once = torch.equal(forward(split, inputs), forward(split, inputs))
            speed_check = [None] * dist.get_world_size()
            dist.all_gather_object(speed_check, [line for line in tome_core.describe(split).splitlines()
                                                 if "tokens, batch" in line])
            tome_core.remove_patch(split)
            merged = merge_under_split(local, split, inputs, alone, vanilla)
            results[family] = {
                "one_process_tome_vs_vanilla": rel(one, vanilla), "split_alone_vs_vanilla": rel(alone, vanilla),
                "split_tome_vs_split_alone": rel(reduced, alone), "split_tome_vs_one_process_tome": rel(reduced, one),
                "ratio0_equals_split_alone": bool(torch.equal(zero, alone)),
                "removed_equals_split_alone": bool(torch.equal(removed, alone)),
                "kept_keys_and_reduced_calls_per_rank": counts, "one_process_kept_keys": one_kept,
                "described": kv_described,
                "default_mode": default_mode, "merge": merged, "speed_check_on_per_rank": speed_check,
                "speed_check_repeatable": timed_once}
        wan = build_dit("wan", scale="tiny"), build_dit("wan", scale="tiny")  # 3 latent frames: bands of 12 rows
        odd = make_dit_inputs(wan[0], "wan", 2, 128, 128, frames=9)
        wan[1].enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        results["wan_3_frames"] = {"merge": merge_under_split(wan[0], wan[1], odd, forward(wan[1], odd),
                                                              forward(wan[0], odd))}
        ti2v = make_dit_inputs(wan[0], "wan", 2, 128, 128, frames=5)  # Wan 2.2 ti2v: a step per token, split too
        ti2v["timestep"] = torch.linspace(100.0, 900.0, 2 * 8 * 8).expand(2, -1).contiguous()
        results["wan_step_per_token"] = {"merge": merge_under_split(wan[0], wan[1], ti2v, forward(wan[1], ti2v),
                                                                    forward(wan[0], ti2v))}
        results["ring"] = ring_merge(ring_degree=2)
        results["flux2"] = flux2_under_split()
        refused = {}
        for name, config, mode in (("ring", dict(ring_degree=2), "kv"),
                                   ("uneven", dict(ulysses_degree=2, ulysses_anything=True), "kv"),
                                   ("uneven_merge", dict(ulysses_degree=2, ulysses_anything=True), "merge")):
            model = build_dit("flux", scale="tiny")
            model.enable_parallelism(config=ContextParallelConfig(**config))
            refused[name] = error_of(lambda: tome_core.apply_patch(model, ratio=0.5, mode=mode))
        model = build_dit("flux", scale="tiny")
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        refused["proportional"] = error_of(lambda: tome_core.apply_patch(model, ratio=0.5, mode="merge",
                                                                          merge_attention="proportional"))
        config = dict(build_dit("flux", scale="tiny").config, num_attention_heads=3)  # Ulysses splits the heads
        model = type(build_dit("flux", scale="tiny")).from_config(config)
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        refused["heads"] = error_of(lambda: tome_core.apply_patch(model, ratio=0.5))
        model = build_dit("ltx2", scale="tiny")
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        refused["unknown_split"] = error_of(lambda: tome_core.apply_patch(model, ratio=0.5, mode="kv"))
        model = build_dit("flux", scale="tiny")  # made parallel after apply_patch: refused at the first call
        tome_core.apply_patch(model, ratio=0.5, mode="kv")
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        odd = make_dit_inputs(model, "flux", 2, 112, 112)  # a 7x7 grid: 49 image tokens
        refused["odd_tokens"] = error_of(lambda: forward(model, odd))
        tome_core.apply_patch(model, ratio=0.5, mode="merge")
        refused["odd_rows"] = error_of(lambda: forward(model, odd))
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump({"families": results, "refused": refused}, handle, indent=1)
    dist.destroy_process_group()


def both(out_path):
    """Four processes: Ulysses and Ring together (ulysses_degree=2, ring_degree=2), mode merge."""
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=60))
    torch.accelerator.device_count = lambda: 1
    torch.set_num_threads(1)
    with torch.no_grad():
        found = ring_merge(ulysses_degree=2, ring_degree=2)
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump(found, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    both(sys.argv[1]) if sys.argv[2:] == ["both"] else main(sys.argv[1])
