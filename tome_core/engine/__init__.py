"""The engine: token reduction as torch code that knows no host and no library by name.

config (the validated settings), merge (bipartite soft matching, merge/unmerge, kv picks and pooling),
plan (what each block does at each step: ``TokenMerger``), levels (a UNet level's token grid),
grid and kv (a DiT call's token layout and its kept keys), call_plan (one DiT model call, decided and planned
alike in every host), schedule (progress through sampling from a timestep or a sigma), blocks (a DiT's block
range), speed_check (whether reducing a level pays on this device). It imports torch and itself
only; the catalogue and the adapters build on it, never the other way round.
"""
