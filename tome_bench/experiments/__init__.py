"""Named, reproducible measurements behind figures the README quotes, beyond the benchmark's table.

Each is a module run as ``python -m tome_bench.experiments.<name>`` from the repository root (results go
to ``docs/results/<name>.json`` there, else to the current folder):

- ``kv_vs_tomesd_seeds``: kv 3x3 (r=0.88) against tomesd (r=0.5) over ToMe's own random choices, SD1.5.
- ``math_attention_memory``: peak memory under PyTorch's math attention where vanilla does not fit.
- ``ltx2_audio_keys``: whether cutting LTX-2's video-to-audio keys is sound (it is not).
- ``ltx2_ffn_merge``: merging LTX-2's video tokens before the feed-forward against a higher kv ratio.
- ``fixed_cost``: host syncs, ATen ops and Python calls into tome_core one SD1.5 forward adds, per kind of patch;
  on CUDA also its time, vanilla and each patch alternated.
- ``speed_check_accuracy``: the speed check's verdict against the bench's steady ratio, per case.
- ``dit_merge_error``: DiT merge's error at equal token counts: matching features, video windows, block ranges, noise levels.
- ``matching_reuse``: the error and the work of keeping a merge's matching for N model calls (``match_every``).
- ``merged_token_use``: how a merged token is used and chosen on DiTs, at equal tokens: proportional and balanced
  attention, soft merge/unmerge, medoid destinations (``tome_bench.merge_variants``), noise and photo.
- ``frontier``: each merging family's largest ratio at tomesd's quality (tomesd r=0.5 on SD1.5 1024² in the same run),
  noise and photo, with its wall and GPU-time speed-ups; ``--device cuda --depth released`` on a GPU.
- ``step_caches``: ToMe stacked with the step caches diffusers users run (diffusers' FirstBlockCache, SeaCache,
  TaylorSeer lite; cache-dit's DBCache): vanilla, the cache alone, ToMe alone and both, whole sampling loops.
- ``context_parallel``: vanilla-CP against ToMe-CP (mode kv) under diffusers' Ulysses context parallelism, in N
  processes it starts itself, with the all-to-all bytes per forward.
"""
from pathlib import Path

RESULTS = Path("docs") / "results"


def results_path(name: str) -> Path:
    """Where an experiment writes ``name``: docs/results when run from the repository, else here."""
    return RESULTS / name if RESULTS.is_dir() else Path(name)
