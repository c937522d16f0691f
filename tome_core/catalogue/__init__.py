"""The catalogue of model families: facts about the models ToMe reaches, and their hosts' names for them.

families (one entry per DiT family, one name, with its diffusers and ComfyUI bindings), the binding
types and their lookups (diffusers_dits + token_readers, comfy_dits) and unets (SD1.x, SD2.x, SDXL: where
their attention blocks and levels sit, by the names diffusers, LDM/SGM and ComfyUI share). Data and the
readers of it; it builds on the engine and imports no host.
"""
