"""Stand-in of Neo's ``backend/patcher/unet.py`` (de2193d9): ``UnetPatcher.from_model`` (13-19), ``__init__``
(21-26), ``clone`` (28-34), the extra-memory/patcher helpers (36-42), controlnet linking (60-70), the
model/transformer option helpers (72-109), and ``NunchakuPatcher`` (142-148).

Not modelled: ``add_extra_torch_module_during_sampling``, ``set_model_replace_all`` (UNet attn1 replaces),
``load_frozen_patcher`` (LoRA), the group-norm/controlnet wrappers' setters.
"""
from backend.modules.k_model import KModel
from backend.patcher.base import ModelPatcher

try:  # unet.py:6-9
    from backend.nn.svdq import NunchakuModelMixin
except ImportError:
    NunchakuModelMixin = type(None)


class UnetPatcher(ModelPatcher):
    """Mirrors unet.py:12-139 UnetPatcher (the parts listed in the module docstring)."""

    @classmethod
    def from_model(cls, model, diffusers_scheduler, config, *, k_predictor=None):
        """Mirrors unet.py:13-19: wrap the DiT in a KModel; a Nunchaku model gets a NunchakuPatcher."""
        model = KModel(model=model, diffusers_scheduler=diffusers_scheduler, k_predictor=k_predictor, config=config)
        dit = model.diffusion_model
        patcher = NunchakuPatcher if isinstance(dit, NunchakuModelMixin) else UnetPatcher
        return patcher(model, load_device=dit.load_device, offload_device=dit.offload_device,
                       current_device=dit.initial_device)

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.controlnet_linked_list = None
        self.extra_preserved_memory_during_sampling = 0
        self.extra_model_patchers_during_sampling = []
        self.extra_concat_condition = None

    def clone(self):
        """Mirrors unet.py:28-34."""
        n = super().clone()
        n.controlnet_linked_list = self.controlnet_linked_list
        n.extra_preserved_memory_during_sampling = self.extra_preserved_memory_during_sampling
        n.extra_model_patchers_during_sampling = self.extra_model_patchers_during_sampling.copy()
        n.extra_concat_condition = self.extra_concat_condition
        return n

    def add_extra_preserved_memory_during_sampling(self, memory_in_bytes):
        """Mirrors unet.py:36-38."""
        self.extra_preserved_memory_during_sampling += memory_in_bytes

    def add_extra_model_patcher_during_sampling(self, model_patcher):
        """Mirrors unet.py:40-42."""
        self.extra_model_patchers_during_sampling.append(model_patcher)

    def add_patched_controlnet(self, cnet):
        """Mirrors unet.py:60-62."""
        cnet.set_previous_controlnet(self.controlnet_linked_list)
        self.controlnet_linked_list = cnet

    def list_controlnets(self):
        """Mirrors unet.py:64-70."""
        results, pointer = [], self.controlnet_linked_list
        while pointer is not None:
            results.append(pointer)
            pointer = pointer.previous_controlnet
        return results

    def append_model_option(self, k, v, ensure_uniqueness=False):
        """Mirrors unet.py:72-77."""
        if k not in self.model_options:
            self.model_options[k] = []
        if ensure_uniqueness and v in self.model_options[k]:
            return
        self.model_options[k].append(v)

    def append_transformer_option(self, k, v, ensure_uniqueness=False):
        """Mirrors unet.py:79-87."""
        if "transformer_options" not in self.model_options:
            self.model_options["transformer_options"] = {}
        to = self.model_options["transformer_options"]
        if k not in to:
            to[k] = []
        if ensure_uniqueness and v in to[k]:
            return
        to[k].append(v)

    def set_transformer_option(self, k, v):
        """Mirrors unet.py:89-92."""
        if "transformer_options" not in self.model_options:
            self.model_options["transformer_options"] = {}
        self.model_options["transformer_options"][k] = v

    def add_conditioning_modifier(self, modifier, ensure_uniqueness=False):
        """Mirrors unet.py:94-95."""
        self.append_model_option("conditioning_modifiers", modifier, ensure_uniqueness)

    def add_sampler_pre_cfg_function(self, modifier, ensure_uniqueness=False):
        """Mirrors unet.py:97-98."""
        self.append_model_option("sampler_pre_cfg_function", modifier, ensure_uniqueness)

    def add_block_modifier(self, modifier, ensure_uniqueness=False):
        """Mirrors unet.py:103-104."""
        self.append_transformer_option("block_modifiers", modifier, ensure_uniqueness)


class NunchakuPatcher(UnetPatcher):
    """Mirrors unet.py:142-148: load/detach only move the model; partially_load (base) still runs patch_model."""

    def load(self, device_to=None, *args, **kwargs):
        self.model.diffusion_model.to(device_to)

    def detach(self, *args, **kwargs):
        self.model.diffusion_model.to(self.offload_device)
