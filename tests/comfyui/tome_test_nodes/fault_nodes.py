"""Test-only nodes that fail on purpose (test_comfy_faults.py): a node after the sampler that raises, and
a MODEL -> MODEL node whose model wrapper raises in the middle of sampling, as a faulty node or callback
of another package would."""
from __future__ import annotations


class TomeTestRaiseOnImage:
    """An output node downstream of the sampler that raises once it gets the decoded image."""

    RETURN_TYPES = ()
    FUNCTION = "fail"
    OUTPUT_NODE = True
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"images": ("IMAGE",), "label": ("STRING", {"default": ""})}}

    def fail(self, images, label):
        raise RuntimeError(f"injected fault after the sampler ({label})")


class TomeTestFailMidSampling:
    """Wraps the model call (``set_model_unet_function_wrapper``, the hook sampler add-ons use) and raises
    on model call number ``fail_at_call`` (counted per prompt), after ToMe has run in earlier calls."""

    RETURN_TYPES = ("MODEL",)
    FUNCTION = "patch"
    CATEGORY = "testing"

    @classmethod
    def INPUT_TYPES(cls):
        return {"required": {"model": ("MODEL",), "fail_at_call": ("INT", {"default": 2, "min": 1, "max": 100})}}

    def patch(self, model, fail_at_call):
        calls = {"n": 0}

        def wrapper(apply_model, args):
            calls["n"] += 1
            if calls["n"] >= fail_at_call:
                raise RuntimeError(f"injected fault in model call {calls['n']}")
            return apply_model(args["input"], args["timestep"], **args["c"])

        patched = model.clone()
        patched.set_model_unet_function_wrapper(wrapper)
        return (patched,)


# dict(...), not a literal: ComfyUI-Manager's scanner reads literal mappings in every .py of the repository,
# and these test nodes are not the pack's (tests/test_registry.py).
NODE_CLASS_MAPPINGS = dict(TomeTestRaiseOnImage=TomeTestRaiseOnImage, TomeTestFailMidSampling=TomeTestFailMidSampling)
