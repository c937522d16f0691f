"""Stand-in of Neo's ``backend/patcher/base.py`` (de2193d9; ported by Neo from ComfyUI v0.27.1 model_patcher.py).

Mirrored: ``set_model_options_patch_replace`` and the pre/post cfg helpers (42-75), ``ModelPatcher.__init__``
(170-199), ``model_size``/``loaded_size`` (209-217), ``clone`` (221-241), ``is_clone``/``clone_has_same_weights``
(243-256), the ``set_model_*`` setters (262-340), ``add_object_patch`` (342-343), ``get_model_object`` (355-363),
``model_patches_to``/``model_patches_models`` (365-408), ``patch_model`` (678-691), the object-patch part of
``unpatch_model`` (693-730), ``partially_load`` (810-833), ``detach`` (836-840), ``current_device`` (842-847).
Not modelled: weight (LoRA) patches, low-VRAM loading, pinning, weight wrappers' effect; ``load`` only moves the
model and records it as loaded (base.py:542-676 does the real work); no ``__del__`` (Neo's detaches at GC).
"""
import inspect
import uuid

from backend import memory_management, utils


def set_model_options_patch_replace(model_options, patch, name, block_name, number, transformer_index=None):
    """Mirrors base.py:42-62: copy-on-write of transformer_options, patches_replace and patches_replace[name]."""
    to = model_options["transformer_options"].copy()
    to["patches_replace"] = to["patches_replace"].copy() if "patches_replace" in to else {}
    to["patches_replace"][name] = to["patches_replace"][name].copy() if name in to["patches_replace"] else {}
    block = (block_name, number, transformer_index) if transformer_index is not None else (block_name, number)
    to["patches_replace"][name][block] = patch
    model_options["transformer_options"] = to
    return model_options


def set_model_options_post_cfg_function(model_options, post_cfg_function, disable_cfg1_optimization=False):
    """Mirrors base.py:65-69."""
    functions = model_options.get("sampler_post_cfg_function", [])
    model_options["sampler_post_cfg_function"] = functions + [post_cfg_function]
    if disable_cfg1_optimization:
        model_options["disable_cfg1_optimization"] = True
    return model_options


def set_model_options_pre_cfg_function(model_options, pre_cfg_function, disable_cfg1_optimization=False):
    """Mirrors base.py:72-76."""
    model_options["sampler_pre_cfg_function"] = model_options.get("sampler_pre_cfg_function", []) + [pre_cfg_function]
    if disable_cfg1_optimization:
        model_options["disable_cfg1_optimization"] = True
    return model_options


class ModelPatcher:
    """Mirrors base.py:169-851 ModelPatcher (the parts listed in the module docstring)."""

    def __init__(self, model, load_device, offload_device, size=0, *, current_device=None, weight_inplace_update=False):
        self.size = size
        self.model = model
        self.model.device = current_device
        self.patches = {}
        self.backup = {}
        self.backup_buffers = {}
        self.object_patches = {}
        self.object_patches_backup = {}
        self.weight_wrapper_patches = {}
        self.model_options = {"transformer_options": {}}
        self.load_device = load_device
        self.offload_device = offload_device
        self.weight_inplace_update = weight_inplace_update
        self.force_cast_weights = False
        self.patches_uuid = uuid.uuid4()
        self.parent = None
        self.pinned = set()
        for name, default in (("model_loaded_weight_memory", 0), ("lowvram_patch_counter", 0), ("model_lowvram", False),
                              ("current_weight_patches_uuid", None), ("model_offload_buffer_memory", 0)):
            if not hasattr(self.model, name):
                setattr(self.model, name, default)

    def has_online_lora(self):
        """Mirrors base.py:201-202 (no weight patches here: always False)."""
        return any(any(patch[-1] for patch in patches) for patches in self.patches.values())

    def model_size(self):
        """Mirrors base.py:209-213."""
        if self.size > 0:
            return self.size
        self.size = memory_management.module_size(self.model)
        return self.size

    def loaded_size(self):
        """Mirrors base.py:215-216."""
        return self.model.model_loaded_weight_memory

    def clone(self):
        """Mirrors base.py:221-241: same model, copied (object) patches, deepcopy_ of model_options, SHARED backups."""
        n = self.__class__(self.model, self.load_device, self.offload_device, self.model_size(),
                           current_device=self.current_device, weight_inplace_update=self.weight_inplace_update)
        n.patches = {k: self.patches[k][:] for k in self.patches}
        n.patches_uuid = self.patches_uuid
        n.object_patches = self.object_patches.copy()
        n.weight_wrapper_patches = self.weight_wrapper_patches.copy()
        n.model_options = utils.deepcopy_(self.model_options)
        n.parent = self
        n.force_cast_weights = self.force_cast_weights
        n.backup = self.backup
        n.backup_buffers = self.backup_buffers
        n.object_patches_backup = self.object_patches_backup
        n.pinned = self.pinned
        return n

    def is_clone(self, other):
        """Mirrors base.py:243-244."""
        return self.model is getattr(other, "model", None)

    def clone_has_same_weights(self, clone):
        """Mirrors base.py:246-256."""
        if not self.is_clone(clone):
            return False
        if len(self.patches) == 0 and len(clone.patches) == 0:
            return True
        return self.patches_uuid == clone.patches_uuid and len(self.patches) == len(clone.patches)

    def memory_required(self, input_shape):
        """Mirrors base.py:259-260."""
        return self.model.memory_required(input_shape=input_shape)

    def disable_model_cfg1_optimization(self):
        """Mirrors base.py:262-263."""
        self.model_options["disable_cfg1_optimization"] = True

    def set_model_sampler_cfg_function(self, sampler_cfg_function, disable_cfg1_optimization=False):
        """Mirrors base.py:265-271."""
        if len(inspect.signature(sampler_cfg_function).parameters) == 3:
            self.model_options["sampler_cfg_function"] = lambda args: sampler_cfg_function(args["cond"], args["uncond"],
                                                                                           args["cond_scale"])
        else:
            self.model_options["sampler_cfg_function"] = sampler_cfg_function
        if disable_cfg1_optimization:
            self.disable_model_cfg1_optimization()

    def set_model_sampler_post_cfg_function(self, post_cfg_function, disable_cfg1_optimization=False):
        """Mirrors base.py:273-274."""
        self.model_options = set_model_options_post_cfg_function(self.model_options, post_cfg_function,
                                                                 disable_cfg1_optimization)

    def set_model_sampler_pre_cfg_function(self, pre_cfg_function, disable_cfg1_optimization=False):
        """Mirrors base.py:276-277."""
        self.model_options = set_model_options_pre_cfg_function(self.model_options, pre_cfg_function,
                                                                disable_cfg1_optimization)

    def set_model_unet_function_wrapper(self, unet_wrapper_function):
        """Mirrors base.py:282-283: the one model_function_wrapper slot (last writer wins)."""
        self.model_options["model_function_wrapper"] = unet_wrapper_function

    def set_model_patch(self, patch, name):
        """Mirrors base.py:288-292: append to transformer_options["patches"][name] (a new list)."""
        to = self.model_options["transformer_options"]
        if "patches" not in to:
            to["patches"] = {}
        to["patches"][name] = to["patches"].get(name, []) + [patch]

    def set_model_patch_replace(self, patch, name, block_name, number, transformer_index=None):
        """Mirrors base.py:294-295."""
        self.model_options = set_model_options_patch_replace(self.model_options, patch, name, block_name, number,
                                                             transformer_index=transformer_index)

    def set_model_attn1_patch(self, patch):
        """Mirrors base.py:297-298 (the UNet's attn1 slots; no DiT of Neo calls them)."""
        self.set_model_patch(patch, "attn1_patch")

    def set_model_attn1_output_patch(self, patch):
        """Mirrors base.py:309-310."""
        self.set_model_patch(patch, "attn1_output_patch")

    def set_model_attn2_patch(self, patch):
        """Mirrors base.py:300-301."""
        self.set_model_patch(patch, "attn2_patch")

    def set_model_attn2_output_patch(self, patch):
        """Mirrors base.py:312-313."""
        self.set_model_patch(patch, "attn2_output_patch")

    def set_model_input_block_patch(self, patch):
        """Mirrors base.py:315-316."""
        self.set_model_patch(patch, "input_block_patch")

    def set_model_double_block_patch(self, patch):
        """Mirrors base.py:330-331."""
        self.set_model_patch(patch, "double_block")

    def set_model_post_input_patch(self, patch):
        """Mirrors base.py:333-334."""
        self.set_model_patch(patch, "post_input")

    def add_object_patch(self, name, obj):
        """Mirrors base.py:342-343: a dotted path from the KModel (e.g. "diffusion_model.layers.3")."""
        self.object_patches[name] = obj

    def get_model_object(self, name):
        """Mirrors base.py:355-363: the object patch, else the saved original, else the model's attribute."""
        if name in self.object_patches:
            return self.object_patches[name]
        if name in self.object_patches_backup:
            return self.object_patches_backup[name]
        return utils.get_attr(self.model, name)

    def _option_patches(self):
        """The patch containers model_patches_to / model_patches_models walk (base.py:366-384, 387-406)."""
        to = self.model_options["transformer_options"]
        lists = [(patch_list, range(len(patch_list))) for patch_list in to.get("patches", {}).values()]
        return lists + [(patch_dict, list(patch_dict)) for patch_dict in to.get("patches_replace", {}).values()]

    def model_patches_to(self, device):
        """Mirrors base.py:365-387: .to(device) every patch and the model_function_wrapper that have one."""
        for container, keys in self._option_patches():
            for k in keys:
                if hasattr(container[k], "to"):
                    container[k] = container[k].to(device)
        wrap_func = self.model_options.get("model_function_wrapper")
        if hasattr(wrap_func, "to"):
            self.model_options["model_function_wrapper"] = wrap_func.to(device)

    def model_patches_models(self):
        """Mirrors base.py:386-408: the extra patchers the patches and the wrapper ask to be loaded."""
        models = []
        for container, keys in self._option_patches():
            for k in keys:
                if hasattr(container[k], "models"):
                    models += container[k].models()
        wrap_func = self.model_options.get("model_function_wrapper")
        if hasattr(wrap_func, "models"):
            models += wrap_func.models()
        return models

    def model_dtype(self):
        """Mirrors base.py:410-412."""
        if hasattr(self.model, "get_dtype"):
            return self.model.get_dtype()

    def unpin_all_weights(self):
        """Mirrors base.py:508-510 (nothing is pinned here)."""
        self.pinned.clear()

    def load(self, device_to=None, lowvram_model_memory=0, force_patch_weights=False, full_load=False):
        """Simplified base.py:542-676 load: move to device_to and record the weights as loaded."""
        if device_to is not None:
            self.model.to(device_to)
        self.model.device = device_to
        self.model.model_loaded_weight_memory = self.model_size()
        self.model.current_weight_patches_uuid = self.patches_uuid

    def patch_model(self, device_to=None, lowvram_model_memory=0, load_weights=True, force_patch_weights=False):
        """Mirrors base.py:678-691: set every object patch, saving the FIRST original in the shared backup."""
        for k in self.object_patches:
            old = utils.set_attr_raw(self.model, k, self.object_patches[k])
            if k not in self.object_patches_backup:
                self.object_patches_backup[k] = old
        if load_weights:
            self.load(device_to, lowvram_model_memory=lowvram_model_memory, force_patch_weights=force_patch_weights,
                      full_load=lowvram_model_memory == 0)
        return self.model

    def unpatch_model(self, device_to=None, unpatch_weights=True):
        """Mirrors base.py:693-730 (weights: only the bookkeeping); restores and clears every object-patch backup."""
        if unpatch_weights:
            self.unpin_all_weights()
            for k, bk in list(self.backup.items()):
                utils.set_attr(self.model, k, bk.weight)
            self.model.current_weight_patches_uuid = None
            self.backup.clear()
            if device_to is not None:
                self.model.to(device_to)
                self.model.device = device_to
            self.model.model_loaded_weight_memory = 0
            self.model.model_offload_buffer_memory = 0
        for k in list(self.object_patches_backup.keys()):
            utils.set_attr_raw(self.model, k, self.object_patches_backup[k])
        self.object_patches_backup.clear()

    def partially_load(self, device_to, extra_memory=0, force_patch_weights=False):
        """Mirrors base.py:810-833: unpatch_model (the previous clone's object patches undone), patch_model, load."""
        current_uuid = self.model.current_weight_patches_uuid
        unpatch_weights = current_uuid is not None and (current_uuid != self.patches_uuid or force_patch_weights)
        self.unpatch_model(self.offload_device, unpatch_weights=unpatch_weights)
        self.patch_model(load_weights=False)
        if self.model.model_lowvram is False and self.model.model_loaded_weight_memory > 0:
            return 0
        current_used = self.model.model_loaded_weight_memory
        self.load(device_to, lowvram_model_memory=current_used + extra_memory, force_patch_weights=force_patch_weights,
                  full_load=True)
        return self.model.model_loaded_weight_memory - current_used

    def detach(self, unpatch_all=True):
        """Mirrors base.py:836-840."""
        self.model_patches_to(self.offload_device)
        if unpatch_all:
            self.unpatch_model(self.offload_device, unpatch_weights=unpatch_all)
        return self.model

    def current_loaded_device(self):
        """Mirrors base.py:842-843."""
        return self.model.device

    @property
    def current_device(self):
        """Mirrors base.py:845-847."""
        return self.model.device
