"""The catalogue of model families: facts about the models ToMe reaches, and their hosts' names for them.

unets (SD1.x, SD2.x, SDXL: where their attention blocks and levels sit, by the names diffusers, LDM/SGM
and ComfyUI share), diffusers_dits (+ token_readers: the diffusers DiT classes, their token layouts,
blocks and timesteps) and comfy_dits (ComfyUI's DiT classes, by module and class name, and how their
calls lay out tokens). Data and the readers of it; it builds on the engine and imports no host.
"""
