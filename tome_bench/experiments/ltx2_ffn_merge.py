"""Would merging LTX-2's video tokens before its feed-forward buy speed more cheaply than a higher kv ratio?

kv shortens only the video self-attention's keys; LTX-2's feed-forward (4096 -> 16384 -> 4096) is a quarter of its
block's time and does not shrink. ToMe's bipartite soft matching (``tome_core.engine.merge``, a 2x2 strided partition over
the frames' rows) could merge a share of the video tokens before it and copy the result back after. This script
measures that on the benchmark's seeded full-width model (2 blocks, 512x768 x 25 frames, bf16, [uncond; cond] pair,
peaked x3): the errors of kv r=0.5 with a quarter or half of the feed-forward's tokens merged, against kv r=0.5
and r=0.75 alone. It is a measurement, not a mode ToMe offers.
Run: python -m tome_bench.experiments.ltx2_ffn_merge   (from the repository root: writes docs/results/ltx2_ffn_merge.json; README "Transformer models")
"""
import sys
import json
import pathlib

import torch

import tome_core
from tome_core.engine import merge
from tome_bench import dit_models as dm

from . import results_path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv

    CFG = 3.0  # LTX2Pipeline's guidance
    FRAMES, HEIGHT, WIDTH = 4, 16, 24  # latent of 25 frames at 512x768 (LTX-2: / 8 in time, / 32 in space)
    model = dm.build_dit("ltx2", blocks=2, dtype=torch.bfloat16)
    inputs = dm.make_dit_inputs(model, "ltx2", 2, 512, 768, frames=25, dtype=torch.bfloat16)
    tokens = FRAMES * HEIGHT * WIDTH


    def merged_feed_forward(share: float):
        """Pre- and forward hooks on each block's ``ff`` that merge ``share`` of the video tokens and unmerge after."""
        plans = {}

        def before(module, args):
            (x,) = args
            if x.shape[1] != tokens:
                return None
            choice = torch.randint(0, 4, (FRAMES * HEIGHT // 2, WIDTH // 2), generator=torch.Generator().manual_seed(0))
            partition = merge.make_partition(FRAMES * HEIGHT, WIDTH, 2, 2, choice, device=x.device)
            merge_fn, unmerge_fn = merge.bipartite_soft_matching(x, partition, int(share * tokens))
            plans[id(module)] = unmerge_fn
            return (merge_fn(x),)

        def after(module, args, output):
            unmerge_fn = plans.pop(id(module), None)
            return output if unmerge_fn is None else unmerge_fn(output)

        return [h for block in model.transformer_blocks
                for h in (block.ff.register_forward_pre_hook(before), block.ff.register_forward_hook(after))]


    def cfg_error(actual, expected):
        return round(dm.relative_error(dm.guided(actual, "ltx2", CFG), dm.guided(expected, "ltx2", CFG)), 4)


    rows = []
    with dm.peaked_attention(model, 3.0):
        reference = dm.forward(model, inputs)
        for ratio, share in ((0.5, 0.0), (0.75, 0.0), (0.5, 0.25), (0.5, 0.5)):
            handles = merged_feed_forward(share) if share else []
            tome_core.apply_patch(model, ratio=ratio, mode="kv")
            output = dm.forward(model, inputs)
            tome_core.remove_patch(model)
            for handle in handles:
                handle.remove()
            rows.append({"kv_ratio": ratio, "feed_forward_merged": share,
                         "err_peaked": round(dm.relative_error(output, reference), 4),
                         "cfg_err_peaked": cfg_error(output, reference)})
            print(rows[-1], flush=True)
    out = results_path("ltx2_ffn_merge.json")
    out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
