"""Is it sound to cut LTX-2's video-to-audio keys too? The errors of the video and the audio prediction.

LTX-2's video-to-audio cross-attention (audio queries, video keys) has keys on the same video grid as the video
self-attention, so mode kv could hand it the same kept video tokens. ToMe does not: this script measures why.
Same seeded full-width model as the benchmark (2 blocks, 512x768 x 25 frames, bf16, [uncond; cond] pair), peaked
(x3 on the q/k norms of the video self-attention and, here, of the video-to-audio attention as well), kv at
r=0.5 and 0.75 on the video self-attention alone (what ToMe does) and with the video-to-audio keys cut as well (a
pre-hook in this script hands that attention the kept video tokens and their RoPE).
Run: python -m tome_bench.experiments.ltx2_audio_keys   (from the repository root: writes docs/results/ltx2_audio_keys.json; README "Transformer models")
"""
import sys
import json
import pathlib

import torch

import tome_core
from tome_bench import dit_models as dm

from . import results_path


def main(argv=None) -> None:
    argv = sys.argv[1:] if argv is None else argv

    CFG = 3.0  # LTX2Pipeline's guidance
    torch.manual_seed(0)
    model = dm.build_dit("ltx2", blocks=2, dtype=torch.bfloat16)
    inputs = dm.make_dit_inputs(model, "ltx2", 2, 512, 768, frames=25, dtype=torch.bfloat16)
    v2a = [block.video_to_audio_attn for block in model.transformer_blocks]


    def predictions():
        with torch.inference_mode():
            video, audio = model(**inputs, return_dict=False)[:2]
        return video, audio


    def cut_video_keys(module, args, kwargs):
        """Hand the video-to-audio attention only the kept video tokens (keys' source and RoPE), as for attn1."""
        state = model.__dict__.get("_tome_dit")
        if state is None or state.current is None:
            return None
        _, keep = state.current["image"]
        rope = kwargs["key_rotary_emb"]
        seq = 2 if rope[0].ndim == 4 else 1
        kwargs = dict(kwargs, encoder_hidden_states=kwargs["encoder_hidden_states"].index_select(1, keep),
                      key_rotary_emb=tuple(part.index_select(seq, keep) for part in rope))
        return args, kwargs


    def errors(actual, expected):
        return {"raw": round(dm.relative_error(actual, expected), 4),
                "cfg": round(dm.relative_error(dm.guided(actual, "ltx2", CFG), dm.guided(expected, "ltx2", CFG)), 4)}


    rows = []
    with dm.peaked_attention(model, 3.0), torch.no_grad():
        saved = [(n.weight, n.weight.detach().clone()) for a in v2a for n in (a.norm_q, a.norm_k)]
        for weight, _ in saved:
            weight.mul_(3.0)
        reference = predictions()
        for ratio in (0.5, 0.75):
            for cut in (False, True):
                handles = [a.register_forward_pre_hook(cut_video_keys, with_kwargs=True) for a in v2a] if cut else []
                tome_core.apply_patch(model, ratio=ratio, mode="kv")
                video, audio = predictions()
                tome_core.remove_patch(model)
                for handle in handles:
                    handle.remove()
                rows.append({"ratio": ratio, "video_to_audio_keys": "cut" if cut else "all kept",
                             "video": errors(video, reference[0]), "audio": errors(audio, reference[1])})
                print(rows[-1], flush=True)
        for weight, original in saved:
            weight.copy_(original)
    out = results_path("ltx2_audio_keys.json")
    out.write_text(json.dumps({"torch": torch.__version__, "rows": rows}, indent=2) + "\n")
    print("wrote", out)


if __name__ == "__main__":
    main()
