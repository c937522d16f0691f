"""ToMe under the 2026 TorchCompileModel, which drops every dynamo guard on ``transformer_options``.

ComfyUI 2026-08 (783545f6, ``comfy_extras/nodes_torch_compile.py: TorchCompileModel.execute``) calls
``set_torch_compile_wrapper(model=m, backend=backend, options={"guard_filter_fn": skip_torch_compile_dict})``, where
``skip_torch_compile_dict`` drops each guard whose name holds "transformer_options". ComfyUI 0.3.75 (CI) has the
helper but not the filter: ``compile_like_2026`` makes the 2026 node's call there (its filter mirrored by
``skip_transformer_options``), and uses the node's own ``skip_torch_compile_dict`` where the ComfyUI has it. One
process, one dynamo cache, in the orders a user meets: a graph compiled for one state must never run for another.

Each sample of a compiled clone is compared with the same clone's eager sample (``EXACT``: dynamo's "eager" backend
runs the traced graph on the same kernels; the guards, which this file is about, are dynamo's whatever the backend)
and, where ToMe reduces, with the unpatched model's (it must differ: ToMe was compiled in). The real node with
inductor runs in ``test_the_real_node_with_inductor`` (about a minute on two cores). The models: the tiny SD1.5 UNet
(cfg 5: cond and uncond in one call), Flux and Wan of ComfyUI's own classes (test_comfy_dit).
"""
from __future__ import annotations

import importlib

import pytest
import torch

import comfy_env
# the fixtures (a ComfyUI with TorchCompileModel's helper and the attention override; our nodes; dynamo reset around
# each test) and helpers of the file that runs the node without the filter
from test_comfy_compile import comfy, fresh_dynamo, rel, sd15 as sd15_patcher, tome_nodes, with_sdpa  # noqa: F401

EXACT = 1e-5  # relative L2; dynamo's eager backend: measured 0
STEPS = 2  # a compiled first step, then one that runs what it compiled


def skip_transformer_options(guard_entries):
    """comfy_extras/nodes_torch_compile.py (2026-08): ``skip_torch_compile_dict``."""
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def guard_filter():
    """The 2026 node's filter where this ComfyUI has it, else its mirror."""
    module = importlib.import_module("comfy_extras.nodes_torch_compile")
    return getattr(module, "skip_torch_compile_dict", skip_transformer_options)


def compile_like_2026(patcher, backend: str = "eager"):
    """TorchCompileModel.execute of the 2026 ComfyUI: a clone, compiled through the helper with the guard filter."""
    from comfy_api.torch_helpers import set_torch_compile_wrapper

    clone = patcher.clone()
    set_torch_compile_wrapper(model=clone, backend=backend, options={"guard_filter_fn": guard_filter()})
    return clone


def sd15(comfy, steps: int = STEPS):
    return sd15_patcher(comfy), lambda p: comfy_env.sample_tiny_sd15(comfy, p, steps)


def dit(comfy, family: str, steps: int = STEPS):
    import test_comfy_dit

    patcher, latent, cond, _ = getattr(test_comfy_dit, family)(comfy)
    return with_sdpa(comfy, patcher), lambda p: test_comfy_dit.sample(comfy, p, latent, cond, steps=steps)


MODELS = {"sd15": sd15, "flux": lambda comfy, **steps: dit(comfy, "flux", **steps),
          "wan": lambda comfy, **steps: dit(comfy, "wan", **steps)}


def tome(tome_nodes, patcher, mode: str = "merge", ratio: float = 0.5, start: float = 0.0):
    values = dict(ratio=ratio, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0, mode=mode,
                  merge_crossattn=False, start_percent=start, end_percent=1.0, min_tokens=0)
    return tome_nodes.ToMeAdvanced().patch(patcher, **values)["result"][0]


def check_states(states, sample, base):
    """Each (label, clone) compiled like the 2026 node and sampled in this order in one process: equal to its eager
    sample, and (ToMe's) apart from the unpatched model's."""
    plain = sample(base)
    for label, clone in states:
        eager = sample(clone)
        compiled = sample(compile_like_2026(clone))
        assert rel(compiled, eager) < EXACT, f"{label}: compiled differs from eager by {rel(compiled, eager):.3g}"
        if clone is not base:
            assert rel(eager, plain) > 1e-4, f"{label}: ToMe changed nothing"


@pytest.mark.parametrize("family", ["sd15", "flux", "wan"])
def test_tome_first_then_bypassed_then_another_ratio(comfy, tome_nodes, family):
    """The issue's KeyError (UNet) and wrong-ratio rows: ToMe compiled first, then the node bypassed, then another
    ratio."""
    base, sample = MODELS[family](comfy)
    check_states([("ToMe 0.5", tome(tome_nodes, base)), ("bypassed", base),
                  ("ToMe 0.25", tome(tome_nodes, base, ratio=0.25))], sample, base)


@pytest.mark.parametrize("family", ["sd15", "flux", "wan"])
def test_vanilla_first_then_tome_in_each_mode(comfy, tome_nodes, family):
    """The issue's silent row (UNet: the vanilla graph ran for ToMe) and its "reached no block" row (Flux, Wan)."""
    base, sample = MODELS[family](comfy)
    check_states([("vanilla", base), ("merge", tome(tome_nodes, base, "merge")),
                  ("kv", tome(tome_nodes, base, "kv"))], sample, base)


@pytest.mark.parametrize("family", ["sd15", "flux"])
def test_a_step_window_compiled_first(comfy, tome_nodes, family):
    """start_percent 0.5: the first steps are whole (ToMe's patches out of the call), the rest reduced, in one loop;
    the issue's silent (UNet) and KeyError 'tome_merge_call' (Flux) row. Then the same model without the window."""
    base, sample = MODELS[family](comfy, steps=4)  # the early steps whole, the later ones reduced
    check_states([("window", tome(tome_nodes, base, start=0.5)), ("no window", tome(tome_nodes, base))], sample, base)


def test_compile_node_before_tome(comfy, tome_nodes):
    """TorchCompileModel applied before ToMe (ToMe's wrapper added after the compile wrapper), after a vanilla run."""
    base, sample = sd15(comfy)
    compiled_first = compile_like_2026(base)
    plain = sample(compiled_first)
    assert rel(plain, sample(base)) < EXACT
    patched = tome(tome_nodes, compiled_first)
    result, eager = sample(patched), sample(tome(tome_nodes, base))
    assert rel(result, eager) < EXACT
    assert rel(result, plain) > 1e-4


def test_a_new_batch_after_compiling(comfy, tome_nodes):
    """A batch of two latents after a batch of one: the compiled ToMe model retraces for it, equal to eager."""
    import test_comfy_dit

    patcher, latent, cond, _ = test_comfy_dit.flux(comfy)
    patched = tome(tome_nodes, with_sdpa(comfy, patcher))
    compiled = compile_like_2026(patched)
    for batch in (1, 2):
        big = latent.repeat(batch, 1, 1, 1)
        assert rel(test_comfy_dit.sample(comfy, compiled, big, cond, steps=2),
                   test_comfy_dit.sample(comfy, patched, big, cond, steps=2)) < EXACT


def test_a_model_that_takes_no_extra_keywords_is_refused_by_name(comfy, tome_nodes):
    """HiDream I1's forward takes no **kwargs, so ToMe cannot key its compiled graphs: sampling stops at the first
    model call, naming TorchCompileModel, the model class and what works; eager ToMe on it is untouched."""
    import test_comfy_families

    patcher, latent, cond, _, _ = test_comfy_families.hidream(comfy)
    import test_comfy_dit

    patched = tome(tome_nodes, with_sdpa(comfy, patcher), "kv")
    test_comfy_dit.sample(comfy, patched, latent, cond)  # eager: runs
    with pytest.raises(RuntimeError, match=r"TorchCompileModel compiles this .*HiDreamImageTransformer2DModel.*"
                                           r"Use ToMe without TorchCompileModel"):
        test_comfy_dit.sample(comfy, compile_like_2026(patched), latent, cond)


def test_the_real_node_with_inductor(comfy, tome_nodes):
    """The node itself where it applies the filter (the 2026 ComfyUI), else its call on this one; inductor, as users
    compile: a vanilla graph first, then ToMe (the case that ran vanilla), then the node bypassed again."""
    module = importlib.import_module("comfy_extras.nodes_torch_compile")
    if hasattr(module, "skip_torch_compile_dict"):
        def node(patcher):
            return module.TorchCompileModel.execute(model=patcher, backend="inductor").result[0]
    else:
        def node(patcher):
            return compile_like_2026(patcher, "inductor")
    base, sample = sd15(comfy)
    patched = tome(tome_nodes, base)
    plain, eager = sample(base), sample(patched)
    assert rel(sample(node(base)), plain) < 1e-3
    result = sample(node(patched))
    assert rel(result, eager) < 1e-3 and rel(result, plain) > 1e-2
    assert rel(sample(node(base)), plain) < 1e-3


def test_every_family_takes_the_keyword(comfy, monkeypatch):
    """Each family's model calls as a compiled call runs them (ToMe's keyword passed, eager): the same sample as
    without it, in every mode the family has, so no family's forward chokes on the keyword; HiDream I1 is refused."""
    import test_comfy_dit
    import test_comfy_families

    from tome_core.adapters.model_patcher import dit_call
    from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher, resolve_dit
    from tome_core.engine.config import ToMeConfig

    builders = dict(test_comfy_families.FAMILIES, flux=test_comfy_dit.flux, wan=test_comfy_dit.wan,
                    sd3=test_comfy_dit.sd3)
    ran = []
    for name, build in builders.items():
        try:
            patcher, latent, cond = build(comfy)[:3]
        except pytest.skip.Exception:  # a class this ComfyUI lacks
            continue
        ran.append(name)
        for mode in ("kv", "merge") if resolve_dit(patcher).merges else ("kv",):
            patched = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode))
            expected = test_comfy_dit.sample(comfy, patched, latent, cond)
            with monkeypatch.context() as forced:
                forced.setattr(dit_call, "compiled_call", lambda options: True)
                if name == "hidream":
                    with pytest.raises(RuntimeError, match="HiDreamImageTransformer2DModel, whose forward takes no"):
                        test_comfy_dit.sample(comfy, patched, latent, cond)
                    continue
                assert torch.equal(test_comfy_dit.sample(comfy, patched, latent, cond), expected), (name, mode)
    assert {"flux", "wan", "sd3", "qwen_image", "hidream"} <= set(ran), ran
    print(f"families run: {ran}")
