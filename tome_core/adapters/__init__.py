"""Host adapters: one per host mechanism, each translating its host's signals into what the engine needs.

hooks: PyTorch module hooks on a model object (diffusers UNets and DiTs, LDM/SGM UNets as the
A1111 WebUI holds them): ``apply_patch`` / ``remove_patch``. model_patcher: a ComfyUI-style
``ModelPatcher`` (ComfyUI, and Forge's UNet patcher): attention patches and wrappers on a clone.
Adapters import the engine and the catalogue, never each other; the host entry points (nodes/,
tome_webui/, scripts/) import the adapters.
"""
