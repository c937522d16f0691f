"""Stand-in of Neo's ``backend/memory_management.py`` (de2193d9): ``current_loaded_models`` (424), ``module_size``
(427-433), ``LoadedModel`` (436-523), ``load_models_gpu`` (616-703), ``load_model_gpu`` (706-707),
``loaded_models`` (710-716), ``cleanup_models_gc`` (719-746, reduced) and ``cleanup_models`` (749-757).

What matters for ToMe is the object-patch path: every ``load_models_gpu`` of a patcher pops any loaded clone of the
same model (``is_clone``), then ``LoadedModel.model_load`` -> ``model_use_more_vram`` -> ``partially_load``, which
``unpatch_model``s (restoring the previous clone's object patches through the shared backup) and ``patch_model``s
the new one. Not modelled: free-memory accounting and unloading (``free_memory``, VRAM states, low-VRAM budgets:
everything is "fully loaded" on the CPU), GGUF baking, the leak warnings.
"""
import weakref

import torch

cpu = torch.device("cpu")
current_loaded_models = []  # memory_management.py:424


def module_size(module):
    """Mirrors memory_management.py:427-433: bytes of the state dict."""
    return sum(t.nelement() * t.element_size() for t in module.state_dict().values())


def get_torch_device():
    """Stand-in of memory_management.get_torch_device: the CPU."""
    return cpu


def unet_offload_device():
    """Stand-in of memory_management.unet_offload_device: the CPU."""
    return cpu


def cast_to_device(tensor, device, dtype, copy=False):
    """Mirrors memory_management.py:1021-1023 cast_to_device (a plain .to)."""
    return tensor.to(device=device, dtype=dtype, copy=copy)


class LoadedModel:
    """Mirrors memory_management.py:436-523 LoadedModel: a weak reference to the patcher (to its parent once dead)."""

    def __init__(self, model):
        self._set_model(model)
        self.device = model.load_device
        self.real_model = None
        self.currently_used = True
        self.model_finalizer = None
        self._patcher_finalizer = None

    def _set_model(self, model):
        self._model = weakref.ref(model)
        if model.parent is not None:
            self._parent_model = weakref.ref(model.parent)
            self._patcher_finalizer = weakref.finalize(model, self._switch_parent)
            self._patcher_finalizer.atexit = False

    def _switch_parent(self):
        model = self._parent_model()
        if model is not None:
            self._set_model(model)

    @property
    def model(self):
        return self._model()

    def model_memory_required(self, device):
        """Mirrors memory_management.py:470-474."""
        if device == self.model.current_loaded_device():
            return self.model.model_size() - self.model.loaded_size()
        return self.model.model_size()

    def model_load(self, lowvram_model_memory=0, force_patch_weights=False):
        """Mirrors memory_management.py:476-493: patches to the device/dtype, then partially_load."""
        self.model.model_patches_to(self.device)
        self.model.model_patches_to(self.model.model_dtype())
        use_more_vram = lowvram_model_memory if lowvram_model_memory != 0 else 1e32
        self.model_use_more_vram(use_more_vram, force_patch_weights=force_patch_weights)
        real_model = self.model.model
        self.real_model = weakref.ref(real_model)
        self.model_finalizer = weakref.finalize(real_model, cleanup_models)
        self.model_finalizer.atexit = False
        return real_model

    def model_unload(self, memory_to_free=None, unpatch_weights=True):
        """Mirrors memory_management.py:500-510 (no partial unload)."""
        self.model.detach(unpatch_weights)
        self.model_finalizer.detach()
        self.model_finalizer = None
        self.real_model = None
        return True

    def model_use_more_vram(self, extra_memory, force_patch_weights=False):
        """Mirrors memory_management.py:512-513."""
        return self.model.partially_load(self.device, extra_memory, force_patch_weights=force_patch_weights)

    def __eq__(self, other):
        return self.model is other.model

    def __del__(self):
        if self._patcher_finalizer is not None:
            self._patcher_finalizer.detach()

    def is_dead(self):
        """Mirrors memory_management.py:522-523."""
        return self.real_model is not None and self.real_model() is not None and self.model is None


def cleanup_models_gc(*, target=()):
    """Reduced memory_management.py:719-746: drop loaded entries whose patcher died (no gc.collect, no warnings)."""
    for i in reversed(range(len(current_loaded_models))):
        if current_loaded_models[i].is_dead():
            current_loaded_models.pop(i)


def cleanup_models():
    """Mirrors memory_management.py:749-757: drop entries whose model was collected."""
    for i in reversed(range(len(current_loaded_models))):
        real = current_loaded_models[i].real_model
        if real is None or real() is None:
            current_loaded_models.pop(i)


def load_models_gpu(models, memory_required=0, force_patch_weights=False, minimum_memory_required=None,
                    force_full_load=False):
    """Mirrors memory_management.py:616-703 load_models_gpu without the memory accounting (see module docstring)."""
    cleanup_models_gc(target=models)
    models_temp = set()
    for m in models:
        models_temp.add(m)
        for mm in m.model_patches_models():
            models_temp.add(mm)

    models_to_load = []
    for x in models_temp:
        loaded_model = LoadedModel(x)
        try:
            loaded_model_index = current_loaded_models.index(loaded_model)
        except ValueError:
            loaded_model_index = None
        if loaded_model_index is not None:
            loaded = current_loaded_models[loaded_model_index]
            loaded.currently_used = True
            models_to_load.append(loaded)
        else:
            models_to_load.append(loaded_model)

    for loaded_model in models_to_load:
        to_unload = []
        for i in range(len(current_loaded_models)):
            if loaded_model.model.is_clone(current_loaded_models[i].model):
                to_unload = [i] + to_unload
        for i in to_unload:
            model_to_unload = current_loaded_models.pop(i)
            model_to_unload.model.detach(unpatch_all=False)
            if model_to_unload.model_finalizer is not None:
                model_to_unload.model_finalizer.detach()

    for loaded_model in models_to_load:
        loaded_model.model_load(0, force_patch_weights=force_patch_weights)  # lowvram_model_memory 0: a full load
        current_loaded_models.insert(0, loaded_model)


def load_model_gpu(model):
    """Mirrors memory_management.py:706-707."""
    return load_models_gpu([model])


def loaded_models(only_currently_used=False):
    """Mirrors memory_management.py:710-716: the loaded patchers, newest first."""
    return [m.model for m in current_loaded_models if m.currently_used or not only_currently_used]
