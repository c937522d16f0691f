"""PyTorch module hooks on the model object itself: diffusers pipelines, UNets and DiTs, LDM/SGM UNets.

api (``apply_patch``, ``remove_patch``, ``describe``: the tomesd-compatible API), unet (the UNet hooks
and their patch state), dit (the diffusers DiT hooks, mode kv), targets (which modules of a pipeline
or an LDM model get patched), fused_kv (a key/value projection for fused attention processors) and
host_caches (diffusers' cache hooks ToMe cannot run beside).
"""
