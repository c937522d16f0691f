"""The two processes of ``test_context_parallel.py`` (not a test file): run under ``torchrun --nproc_per_node 2``
(gloo, CPU); rank 0 writes what both saw as JSON to ``argv[1]``. Every collective has a 60 s timeout, so a hang
fails the test instead of stalling the suite.

Per family (diffusers' tiny Flux, Qwen-Image and Wan, 128x128, Wan 5 frames, batch 2): the one-process model
without and with ToMe (mode kv, ratio 0.5), then the same weights under ``ContextParallelConfig(ulysses_degree=2)``
alone, with ToMe, at ratio 0 and after ``remove_patch``, each rank's kept key count, and mode merge's refusal; then
the settings ToMe refuses before the first step.
"""
import datetime
import json
import sys

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
            state = split.__dict__["_tome_dit"]
            call = state.current
            kept = int((call.keep if call.image_keep is None else call.image_keep).numel())
            counts = [None] * dist.get_world_size()
            dist.all_gather_object(counts, (kept, state.reduced_calls))
            tome_core.apply_patch(split, ratio=0.0, mode="kv")
            zero = forward(split, inputs)
            tome_core.remove_patch(split)
            removed = forward(split, inputs)
            merge = error_of(lambda: (tome_core.apply_patch(split, ratio=0.5, mode="merge"), forward(split, inputs)))
            tome_core.apply_patch(split, ratio=0.5)  # no mode: the family's mode under the split
            default_mode = split.__dict__["_tome_dit"].config.mode
            tome_core.remove_patch(split)
            results[family] = {
                "one_process_tome_vs_vanilla": rel(one, vanilla), "split_alone_vs_vanilla": rel(alone, vanilla),
                "split_tome_vs_split_alone": rel(reduced, alone), "split_tome_vs_one_process_tome": rel(reduced, one),
                "ratio0_equals_split_alone": bool(torch.equal(zero, alone)),
                "removed_equals_split_alone": bool(torch.equal(removed, alone)),
                "kept_keys_and_reduced_calls_per_rank": counts, "one_process_kept_keys": one_kept,
                "merge_error": merge, "default_mode": default_mode}
        refused = {}
        for name, config in (("ring", dict(ring_degree=2)), ("uneven", dict(ulysses_degree=2, ulysses_anything=True))):
            model = build_dit("flux", scale="tiny")
            model.enable_parallelism(config=ContextParallelConfig(**config))
            refused[name] = error_of(lambda: tome_core.apply_patch(model, ratio=0.5, mode="kv"))
        model = build_dit("ltx2", scale="tiny")
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        refused["unknown_split"] = error_of(lambda: tome_core.apply_patch(model, ratio=0.5, mode="kv"))
        model = build_dit("flux", scale="tiny")  # made parallel after apply_patch: refused at the first call
        tome_core.apply_patch(model, ratio=0.5, mode="kv")
        model.enable_parallelism(config=ContextParallelConfig(ulysses_degree=2))
        odd = make_dit_inputs(model, "flux", 2, 112, 112)  # a 7x7 grid: 49 image tokens
        refused["odd_tokens"] = error_of(lambda: forward(model, odd))
    if dist.get_rank() == 0:
        with open(out_path, "w") as handle:
            json.dump({"families": results, "refused": refused}, handle, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
