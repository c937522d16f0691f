"""Smoke check of the Forge Neo stand-in (a script, not a pytest file): run it with the WebUI test venv,
``.venv-webui/bin/python tests/webui/neo_standin/smoke_check.py``; it exits non-zero on the first failed check.

For every family of ``neo_models`` it runs a 2-step Euler pass at cfg 2 through ``sampling_function`` and checks:
finite, deterministic outputs; the ``model_function_wrapper`` contract (sampling_function.py:270-273); the
``patches_replace["dit"]`` args per DiT (flux.py:500-552, chroma.py:189-228, qwen.py:441-463, wan.py:364-380,
svdq.py:686-720); which module global each DiT's attention goes through; Z-Image's object patch applied by
``load_models_gpu`` and restored by the next load (base.py:678-730, 810-833), also under a ``NunchakuPatcher``;
clones never touching their parent's ``model_options`` (base.py:221-241, 42-62).
"""
import gc
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
torch.set_num_threads(1)  # as tests/webui/conftest.py: tiny models, shared cores

import neo_models  # noqa: E402
import neo_sampler  # noqa: E402
from backend import memory_management  # noqa: E402
from backend.modules.k_model import KModel  # noqa: E402

CFG, STEPS = 2.0, 2
CALL_KEYS = {"input", "timestep", "c", "cond_or_uncond"}
PER_CALL_KEYS = {"cond_or_uncond", "sigmas", "cond_mark", "cond_indices", "uncond_indices", "sampling_sigmas"}
FLUX_ARGS = {("double_block", 0): {"img", "txt", "vec", "pe", "attn_mask", "transformer_options"},
             ("single_block", 1): {"img", "vec", "pe", "attn_mask", "transformer_options"}}
REPLACES = {
    "flux": FLUX_ARGS, "chroma": FLUX_ARGS,
    "qwen_image": {("double_block", 1): {"img", "txt", "vec", "pe"}},
    "nunchaku_qwen": {("double_block", 1): {"img", "txt", "vec", "pe"}},
    "wan": {("double_block", 1): {"img", "txt", "vec", "pe", "transformer_options"}},
}
REPORTS = {"flux": {("double_block", 0): ("double", 0), ("single_block", 1): ("single", 1)},
           "wan": {("double_block", 1): ("double", 1)}}
REPORTS["chroma"] = REPORTS["flux"]
PE_TOKEN_AXIS = {"flux": 2, "chroma": 2, "qwen_image": 1, "nunchaku_qwen": 1, "wan": 1}
# family: (module, global, calls per model call): 2+2 Flux/Chroma blocks; Qwen's 2 blocks; Wan's 2 self-attentions only
# (``wan.attention``); Z-Image's context refiner, noise refiner and 2 layers; SVDQ Flux never reaches flux's global.
ATTENTION_GLOBALS = {"flux": ("backend.nn.flux", "attention_function", 4),
                     "chroma": ("backend.nn.flux", "attention_function", 4),
                     "qwen_image": ("backend.nn.qwen", "attention_function", 2),
                     "wan": ("backend.nn.wan", "attention", 2),
                     "z_image": ("backend.nn.lumina", "attention_function", 4),
                     "svdq_flux": ("backend.nn.flux", "attention_function", 0),
                     "nunchaku_qwen": ("backend.nn.svdq", "attention_function", 2)}


def run(unet, make_conds, family, cfg=CFG, seed=7):
    """One Neo pass of the family's patcher (or a clone of it) on seeded noise."""
    noise = torch.randn(neo_models.latent_shape(family), generator=torch.Generator().manual_seed(seed))
    cond, uncond = make_conds(1)
    return neo_sampler.sample(unet, noise, neo_sampler.simple_sigmas(unet.model.predictor, STEPS), cond, uncond, cfg)


def check_pass(family):
    """A 2-step cfg-2 pass: finite, identical for the same seed, different for another seed."""
    unet, make_conds = neo_models.build_patcher(family, seed=0)
    out = run(unet, make_conds, family)
    assert torch.isfinite(out).all(), family
    again = run(*neo_models.build_patcher(family, seed=0), family)
    assert torch.equal(out, again), f"{family}: not deterministic"
    assert not torch.equal(out, run(*neo_models.build_patcher(family, seed=1), family)), f"{family}: seed ignored"
    return unet, make_conds, out


def check_wrapper(family, unet, make_conds, reference):
    """The model_function_wrapper contract of sampling_function.py:270-273, and cond_or_uncond [1, 0] / [0]."""
    calls = []
    clone = unet.clone()

    def wrapper(apply_model, args):
        assert set(args) == CALL_KEYS, set(args)
        assert isinstance(apply_model.__self__, KModel) and apply_model.__self__ is clone.model
        assert apply_model.__func__ is KModel.apply_model
        c, to = args["c"], args["c"]["transformer_options"]
        assert to is not clone.model_options["transformer_options"] and PER_CALL_KEYS <= set(to), set(to)
        assert to["cond_or_uncond"] == args["cond_or_uncond"] and args["input"].shape[0] == len(args["cond_or_uncond"])
        assert args["timestep"].shape == (len(args["cond_or_uncond"]),) and to["sigmas"].shape == (1,)
        assert to["cond_indices"] == [i for i, v in enumerate(args["cond_or_uncond"]) if v == 0]
        assert to["sampling_sigmas"].shape == (STEPS + 1,) and float(to["sigmas"][0]) in to["sampling_sigmas"].tolist()
        flux_like = family in ("flux", "svdq_flux")
        expected = {"c_crossattn", "transformer_options"} | ({"y", "guidance"} if flux_like else set())
        assert set(c) == expected, set(c)
        calls.append(list(args["cond_or_uncond"]))
        out = apply_model(args["input"], args["timestep"], **c)
        # Flux, Chroma and Wan leave their block reports in the per-call dict (forward_orig makes no copy);
        # Qwen and Z-Image write none
        assert ("block_type" in to) == (family in REPORTS) and out.shape == args["input"].shape, (family, set(to))
        return out

    clone.set_model_unet_function_wrapper(wrapper)
    assert torch.equal(run(clone, make_conds, family), reference), f"{family}: the wrapper changed the result"
    assert calls == [[1, 0]] * STEPS, calls
    calls.clear()
    run(clone, make_conds, family, cfg=1.0)
    assert calls == [[0]] * STEPS, calls  # cfg 1: no uncond (sampling_function.py:295-298)


def check_replace(family, unet, make_conds, reference):
    """patches_replace["dit"]: keys, args, extra, block reports and pe layout as each Neo DiT passes them."""
    seen = {}
    clone = unet.clone()
    for key, keys in REPLACES.get(family, {}).items():

        def patch(args, extra, key=key, keys=keys):
            assert set(args) == keys and set(extra) == {"original_block"}, (key, set(args), set(extra))
            to = args.get("transformer_options")
            if family in REPORTS:
                assert (to["block_type"], to["block_index"]) == REPORTS[family][key], (key, to.get("block_type"))
            tokens = args["img"].shape[1] + (0 if family == "wan" or key[0] == "single_block" else args["txt"].shape[1])
            pe, axis = args["pe"], PE_TOKEN_AXIS[family]  # [B, 1, L, D/2, 2, 2] (Flux, Chroma), [B, L, 1, ...] (others)
            assert pe.shape[-2:] == (2, 2) and pe.shape[axis] == tokens and pe.shape[3 - axis] == 1, (key, pe.shape)
            seen[key] = seen.get(key, 0) + 1
            return extra["original_block"](args)

        clone.set_model_patch_replace(patch, "dit", key[0], key[1])
    if family in ("svdq_flux", "z_image"):  # no replace patches in these forwards
        def never(args, extra):
            raise AssertionError(f"{family}: a dit replace was called")

        clone.set_model_patch_replace(never, "dit", "double_block", 0)
    assert torch.equal(run(clone, make_conds, family), reference), f"{family}: block_wrap changed the result"
    assert seen == {k: STEPS for k in REPLACES.get(family, {})}, (family, seen)
    if family == "qwen_image":  # Qwen: the per-block patches["double_block"] callbacks (qwen.py:465-470)
        hits = []
        clone.set_model_double_block_patch(lambda a: hits.append(a["block_index"]) or {"img": a["img"],
                                                                                       "txt": a["txt"]})
        run(clone, make_conds, family)
        assert hits == [0, 1] * STEPS, hits


def check_attention_global(family, unet, make_conds):
    """The attention each DiT calls is a module global (Neo has no override hook): a swap is seen, per module."""
    module_name, name, expected = ATTENTION_GLOBALS[family]
    module = sys.modules[module_name]
    original, shapes = getattr(module, name), []

    def counting(*args, **kwargs):
        shapes.append(tuple(args[0].shape))
        return original(*args, **kwargs)

    setattr(module, name, counting)
    try:
        run(unet, make_conds, family)
    finally:
        setattr(module, name, original)
    assert len(shapes) == expected * STEPS, (family, shapes)
    return expected


def check_object_patch():
    """Z-Image: an object patch of diffusion_model.layers.0 is set per pass by load_models_gpu, undone by the next."""
    unet, make_conds = neo_models.build_patcher("z_image", seed=0)
    reference = run(unet, make_conds, "z_image")
    original = unet.model.diffusion_model.layers[0]
    calls = []

    class Counting(torch.nn.Module):
        """A block that counts its calls (the tokens it sees) and runs the original."""

        def __init__(self, block):
            super().__init__()
            self.block = block

        def forward(self, x, mask, freqs_cis, adaln_input=None, transformer_options={}):
            calls.append(x.shape[1])
            return self.block(x, mask, freqs_cis, adaln_input, transformer_options=transformer_options)

    clone = unet.clone()
    patched = Counting(original)
    clone.add_object_patch("diffusion_model.layers.0", patched)
    name = "diffusion_model.layers.0"
    assert clone.get_model_object(name) is patched and unet.get_model_object(name) is original
    memory_management.load_models_gpu([clone])
    assert unet.model.diffusion_model.layers[0] is patched and unet.object_patches_backup[name] is original
    assert unet.get_model_object(name) is original  # the parent reads the saved original
    assert torch.equal(run(clone, make_conds, "z_image"), reference)
    assert calls == [32 + 64] * STEPS, calls  # caption padded to 32, then 64 image tokens
    assert unet.model.diffusion_model.layers[0] is patched  # stays set after the pass (until the next load)
    memory_management.load_models_gpu([unet])
    assert unet.model.diffusion_model.layers[0] is original and not unet.object_patches_backup
    memory_management.load_models_gpu([clone])
    del clone, patched
    gc.collect()  # the LoadedModel switches to the parent; the parent's next pass restores the module
    assert torch.equal(run(unet, make_conds, "z_image"), reference) and unet.model.diffusion_model.layers[0] is original


def check_nunchaku_object_patch():
    """NunchakuPatcher overrides load/detach only: partially_load still applies object patches (unet.py:142-148)."""
    unet, _ = neo_models.build_patcher("nunchaku_qwen", seed=0)
    original, patched = unet.model.diffusion_model.transformer_blocks[0], torch.nn.Identity()
    clone = unet.clone()
    clone.add_object_patch("diffusion_model.transformer_blocks.0", patched)
    memory_management.load_models_gpu([clone])
    assert type(clone).__name__ == "NunchakuPatcher" and unet.model.diffusion_model.transformer_blocks[0] is patched
    memory_management.load_models_gpu([unet])
    assert unet.model.diffusion_model.transformer_blocks[0] is original


def check_clone_isolation():
    """Whatever a clone (and its clone) sets, the parent's model_options stay as they were."""
    unet, make_conds = neo_models.build_patcher("flux", seed=0)
    unet.set_model_patch_replace(lambda a, e: e["original_block"](a), "dit", "double_block", 1)
    before = {k: (v, dict(v) if isinstance(v, dict) else None) for k, v in unet.model_options.items()}
    inner = unet.model_options["transformer_options"]
    snapshot = (dict(inner), dict(inner["patches_replace"]), dict(inner["patches_replace"]["dit"]))
    clone = unet.clone()
    clone.set_model_unet_function_wrapper(lambda apply_model, a: apply_model(a["input"], a["timestep"], **a["c"]))
    held = clone.model_options["transformer_options"]["patches_replace"]["dit"]  # e.g. what a per-call copy shares
    clone.set_model_patch_replace(lambda a, e: e["original_block"](a), "dit", "single_block", 0)
    assert ("single_block", 0) not in held  # copy-on-write (base.py:42-62)
    assert clone.model_options["transformer_options"]["patches_replace"]["dit"] is not held
    clone.set_model_patch(lambda a: a, "post_input")
    clone.add_object_patch("diffusion_model.final_layer", unet.model.diffusion_model.final_layer)
    clone.model_options["transformer_options"]["tome"] = "clone only"
    run(clone, make_conds, "flux")  # writes sampling_sigmas into the clone's transformer_options
    grandchild = clone.clone()
    grandchild.set_model_patch_replace(lambda a, e: e["original_block"](a), "dit", "double_block", 0)
    assert {k: (v, dict(v) if isinstance(v, dict) else None) for k, v in unet.model_options.items()} == before
    assert unet.model_options["transformer_options"] is inner
    assert (dict(inner), dict(inner["patches_replace"]), dict(inner["patches_replace"]["dit"])) == snapshot
    assert not unet.object_patches and "sampling_sigmas" not in inner
    assert "sampling_sigmas" in clone.model_options["transformer_options"]
    assert ("double_block", 0) not in clone.model_options["transformer_options"]["patches_replace"]["dit"]


def main():
    """Every check, every family; prints a line per family and the total time."""
    start = time.perf_counter()
    for family in neo_models.FAMILIES:
        t = time.perf_counter()
        unet, make_conds, reference = check_pass(family)
        check_wrapper(family, unet, make_conds, reference)
        check_replace(family, unet, make_conds, reference)
        per_step = check_attention_global(family, unet, make_conds)
        dit = type(unet.model.diffusion_model)
        print(f"{family:14s} {type(unet).__name__:15s} {dit.__module__}.{dit.__name__}: out {tuple(reference.shape)}, "
              f"attention-global calls per step {per_step}, {time.perf_counter() - t:.2f} s")
    check_object_patch()
    print("z_image object patch of diffusion_model.layers.0: applied by load_models_gpu, restored by the next load")
    check_nunchaku_object_patch()
    print("NunchakuPatcher: object patches applied and restored the same way")
    check_clone_isolation()
    print("clones leave their parent's model_options untouched")
    print(f"smoke check passed in {time.perf_counter() - start:.2f} s")


if __name__ == "__main__":
    main()
