"""Community speed packs beside ToMe on ComfyUI's own Flux and Wan: both act, or the prompt stops naming the pack.

None of these packs is on PyPI, so each is mirrored here by a stand-in of the pack's own function (file, function and
commit in its docstring), with its module named as ComfyUI's ``nodes.load_custom_node`` names a pack's modules
("<ComfyUI>/custom_nodes/<folder>.<module>"), which is what ToMe's error names.

- ComfyUI-TeaCache (welltop-cn/ComfyUI-TeaCache 91dff8e, nodes.py) and Comfy-WaveSpeed's First Block Cache
  (chengzeyi/Comfy-WaveSpeed 8253745, first_block_cache.py) install a ``model_function_wrapper`` that swaps
  ``diffusion_model.forward_orig`` for their own copy for each call (``unittest.mock.patch``); the copy calls the
  blocks without ``transformer_options``, so ComfyUI's attention override (mode kv) never reaches them: the first
  model call stops the prompt naming the pack. Where the copy hands ``transformer_options`` to the "dit" block
  replace patches in their extra dict (WaveSpeed's Flux copy, TeaCache's Wan copy), mode merge reaches the blocks
  and both act; TeaCache's Flux copy hands it nowhere, so both modes stop.
- ComfyUI-KJNodes (kijai/ComfyUI-KJNodes 3f20054, nodes/model_optimization_nodes.py): its Sage attention patch sets
  ``optimized_attention_override`` on the model options, which ToMe chains; its torch.compile node swaps compiled
  blocks in from an APPLY_MODEL wrapper, and the compiled blocks still get transformer_options: both act.
"""
from __future__ import annotations

import contextlib
import logging
import re
import unittest.mock

import pytest
import torch

from test_comfy_dit import comfy, flux, sample, wan  # noqa: F401

from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
from tome_core.engine.config import ToMeConfig

CUSTOM_NODES = "/opt/ComfyUI/custom_nodes"  # nodes.load_custom_node names modules after the pack's folder path
TEACACHE_MODULE = f"{CUSTOM_NODES}/ComfyUI-TeaCache.nodes"
WAVESPEED_MODULE = f"{CUSTOM_NODES}/Comfy-WaveSpeed.first_block_cache"
WAVESPEED_NODES = f"{CUSTOM_NODES}/Comfy-WaveSpeed.fbcache_nodes"


# ComfyUI-TeaCache (welltop-cn/ComfyUI-TeaCache 91dff8e, nodes.py) ---------------------------------------------------

SUPPORTED_MODELS_COEFFICIENTS = {  # nodes.py, the two model types used here
    "flux": [4.98651651e+02, -2.83781631e+02, 5.58554382e+01, -3.82021401e+00, 2.64230861e-01],
    "wan2.1_t2v_14B": [-5784.54975374, 5449.50911966, -1811.16591783, 256.27178429, -13.02252404],
}


def poly1d(coefficients, x):
    result = torch.zeros_like(x)
    for i, coeff in enumerate(coefficients):
        result += coeff * (x ** (len(coefficients) - 1 - i))
    return result


def teacache_flux_forward(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, control=None,
                          transformer_options={}, attn_mask=None, **kwargs):  # noqa: B006 - mirrors the pack
    """ComfyUI-TeaCache's ``teacache_flux_forward``: Flux's forward with the blocks (and the dit replace patches)
    called without transformer_options (its caching, which starts after the first step, left out). ``**kwargs``:
    the 2026 ComfyUI also passes ``timestep_zero_index``, which the pack's own signature lacks (its issue #187)."""
    from comfy.ldm.flux.layers import timestep_embedding

    patches_replace = transformer_options.get("patches_replace", {})
    img = self.img_in(img)
    vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
    if self.params.guidance_embed:
        vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
    vec = vec + self.vector_in(y[:, :self.params.vec_in_dim])
    txt = self.txt_in(txt)
    pe = self.pe_embedder(torch.cat((txt_ids, img_ids), dim=1))
    blocks_replace = patches_replace.get("dit", {})
    for i, block in enumerate(self.double_blocks):
        if ("double_block", i) in blocks_replace:
            def block_wrap(args, block=block):
                out = {}
                out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                               attn_mask=args.get("attn_mask"))
                return out
            out = blocks_replace[("double_block", i)]({"img": img, "txt": txt, "vec": vec, "pe": pe,
                                                       "attn_mask": attn_mask}, {"original_block": block_wrap})
            txt, img = out["txt"], out["img"]
        else:
            img, txt = block(img=img, txt=txt, vec=vec, pe=pe, attn_mask=attn_mask)
    img = torch.cat((txt, img), 1)
    for i, block in enumerate(self.single_blocks):
        if ("single_block", i) in blocks_replace:
            def block_wrap(args, block=block):
                return {"img": block(args["img"], vec=args["vec"], pe=args["pe"], attn_mask=args.get("attn_mask"))}
            img = blocks_replace[("single_block", i)]({"img": img, "vec": vec, "pe": pe, "attn_mask": attn_mask},
                                                      {"original_block": block_wrap})["img"]
        else:
            img = block(img, vec=vec, pe=pe, attn_mask=attn_mask)
    img = img[:, txt.shape[1]:, ...]
    return self.final_layer(img, vec)


def teacache_wanmodel_forward(self, x, t, context, clip_fea=None, freqs=None, transformer_options={},
                              **kwargs):  # noqa: B006 - mirrors the pack
    """ComfyUI-TeaCache's ``teacache_wanmodel_forward``, caching included: the blocks are called without
    transformer_options, but a "dit" replace patch gets it in its extra dict (beside ``original_block``)."""
    from comfy.ldm.wan.model import sinusoidal_embedding_1d

    patches_replace = transformer_options.get("patches_replace", {})
    rel_l1_thresh = transformer_options.get("rel_l1_thresh")
    coefficients = transformer_options.get("coefficients")
    cond_or_uncond = transformer_options.get("cond_or_uncond")
    model_type = transformer_options.get("model_type")
    enable_teacache = transformer_options.get("enable_teacache", True)
    cache_device = transformer_options.get("cache_device")

    x = self.patch_embedding(x.float()).to(x.dtype)
    grid_sizes = x.shape[2:]
    x = x.flatten(2).transpose(1, 2)
    e = self.time_embedding(sinusoidal_embedding_1d(self.freq_dim, t).to(dtype=x[0].dtype))
    e0 = self.time_projection(e).unflatten(1, (6, self.dim))
    context = self.text_embedding(context)
    context_img_len = None
    if clip_fea is not None:
        if self.img_emb is not None:
            context_clip = self.img_emb(clip_fea)
            context = torch.concat([context_clip, context], dim=1)
        context_img_len = clip_fea.shape[-2]
    blocks_replace = patches_replace.get("dit", {})

    modulated_inp = e0.to(cache_device) if "ret_mode" in model_type else e.to(cache_device)
    if not hasattr(self, 'teacache_state'):
        self.teacache_state = {
            0: {'should_calc': True, 'accumulated_rel_l1_distance': 0, 'previous_modulated_input': None,
                'previous_residual': None},
            1: {'should_calc': True, 'accumulated_rel_l1_distance': 0, 'previous_modulated_input': None,
                'previous_residual': None}}

    def update_cache_state(cache, modulated_inp):
        if cache['previous_modulated_input'] is not None:
            try:
                cache['accumulated_rel_l1_distance'] += poly1d(coefficients, (
                    (modulated_inp - cache['previous_modulated_input']).abs().mean()
                    / cache['previous_modulated_input'].abs().mean()))
                if cache['accumulated_rel_l1_distance'] < rel_l1_thresh:
                    cache['should_calc'] = False
                else:
                    cache['should_calc'] = True
                    cache['accumulated_rel_l1_distance'] = 0
            except Exception:
                cache['should_calc'] = True
                cache['accumulated_rel_l1_distance'] = 0
        cache['previous_modulated_input'] = modulated_inp

    b = int(len(x) / len(cond_or_uncond))
    for i, k in enumerate(cond_or_uncond):
        update_cache_state(self.teacache_state[k], modulated_inp[i * b:(i + 1) * b])
    if enable_teacache:
        should_calc = False
        for k in cond_or_uncond:
            should_calc = (should_calc or self.teacache_state[k]['should_calc'])
    else:
        should_calc = True

    if not should_calc:
        for i, k in enumerate(cond_or_uncond):
            x[i * b:(i + 1) * b] += self.teacache_state[k]['previous_residual'].to(x.device)
    else:
        ori_x = x.to(cache_device)
        for i, block in enumerate(self.blocks):
            if ("double_block", i) in blocks_replace:
                def block_wrap(args, block=block):
                    out = {}
                    out["img"] = block(args["img"], context=args["txt"], e=args["vec"], freqs=args["pe"],
                                       context_img_len=context_img_len)
                    return out
                out = blocks_replace[("double_block", i)]({"img": x, "txt": context, "vec": e0, "pe": freqs},
                                                          {"original_block": block_wrap,
                                                           "transformer_options": transformer_options})
                x = out["img"]
            else:
                x = block(x, e=e0, freqs=freqs, context=context, context_img_len=context_img_len)
        for i, k in enumerate(cond_or_uncond):
            self.teacache_state[k]['previous_residual'] = (x.to(cache_device) - ori_x)[i * b:(i + 1) * b]

    x = self.head(x, e)
    return self.unpatchify(x, grid_sizes)


teacache_flux_forward.__module__ = teacache_wanmodel_forward.__module__ = TEACACHE_MODULE


def apply_teacache(patcher, model_type="flux", rel_l1_thresh=0.4, start_percent=0.0, end_percent=1.0):
    """``TeaCache.apply_teacache`` (cache_device "cpu"): a clone with its settings in transformer_options and a
    model_function_wrapper that swaps forward_orig for each call (the model's forward for the model type)."""
    new_model = patcher.clone()
    if 'transformer_options' not in new_model.model_options:
        new_model.model_options['transformer_options'] = {}
    new_model.model_options["transformer_options"]["rel_l1_thresh"] = rel_l1_thresh
    new_model.model_options["transformer_options"]["coefficients"] = SUPPORTED_MODELS_COEFFICIENTS[model_type]
    new_model.model_options["transformer_options"]["model_type"] = model_type
    new_model.model_options["transformer_options"]["cache_device"] = torch.device("cpu")
    diffusion_model = new_model.get_model_object("diffusion_model")
    if "flux" in model_type:
        is_cfg = False
        forward = teacache_flux_forward
    elif "wan2.1" in model_type:
        is_cfg = True
        forward = teacache_wanmodel_forward
    else:
        raise ValueError(f"Unknown type {model_type}")
    context = unittest.mock.patch.multiple(
        diffusion_model, forward_orig=forward.__get__(diffusion_model, diffusion_model.__class__))

    def unet_wrapper_function(model_function, kwargs):
        input = kwargs["input"]
        timestep = kwargs["timestep"]
        c = kwargs["c"]
        sigmas = c["transformer_options"]["sample_sigmas"]
        matched_step_index = (sigmas == timestep[0]).nonzero()
        if len(matched_step_index) > 0:
            current_step_index = matched_step_index.item()
        else:
            current_step_index = 0
            for i in range(len(sigmas) - 1):
                if (sigmas[i] - timestep[0]) * (sigmas[i + 1] - timestep[0]) <= 0:
                    current_step_index = i
                    break
        if current_step_index == 0:
            if is_cfg:
                if hasattr(diffusion_model, 'teacache_state') and \
                        diffusion_model.teacache_state[0]['previous_modulated_input'] is not None and \
                        diffusion_model.teacache_state[1]['previous_modulated_input'] is not None:
                    delattr(diffusion_model, 'teacache_state')
            else:
                if hasattr(diffusion_model, 'teacache_state'):
                    delattr(diffusion_model, 'teacache_state')
                if hasattr(diffusion_model, 'accumulated_rel_l1_distance'):
                    delattr(diffusion_model, 'accumulated_rel_l1_distance')
        current_percent = current_step_index / (len(sigmas) - 1)
        c["transformer_options"]["current_percent"] = current_percent
        c["transformer_options"]["enable_teacache"] = start_percent <= current_percent <= end_percent
        with context:
            return model_function(input, timestep, **c)

    new_model.set_model_unet_function_wrapper(unet_wrapper_function)
    return new_model


# Comfy-WaveSpeed First Block Cache (chengzeyi/Comfy-WaveSpeed 8253745, first_block_cache.py, fbcache_nodes.py) ------

class CacheContext:
    """first_block_cache.CacheContext (buffers per name and sequence number; the incremental names left out)."""

    def __init__(self):
        self.buffers, self.sequence_num, self.use_cache = {}, 0, False

    def get_buffer(self, name):
        item = self.buffers.get(name)
        if item is None or self.sequence_num >= len(item):
            return None
        return item[self.sequence_num]

    def set_buffer(self, name, buffer):
        curr_item = self.buffers.get(name)
        if curr_item is None:
            curr_item = []
            self.buffers[name] = curr_item
        curr_item += [None] * (self.sequence_num - len(curr_item) + 1)
        curr_item[self.sequence_num] = buffer


_current_cache_context = None


def get_buffer(name):
    return _current_cache_context.get_buffer(name)


def set_buffer(name, buffer):
    _current_cache_context.set_buffer(name, buffer)


def set_current_cache_context(cache_context=None):
    global _current_cache_context
    _current_cache_context = cache_context


def are_two_tensors_similar(t1, t2, *, threshold, only_shape=False):
    if t1.shape != t2.shape:
        return False
    elif only_shape:
        return True
    mean_diff = (t1 - t2).abs().mean()
    mean_t1 = t1.abs().mean()
    diff = mean_diff / mean_t1
    return diff.item() < threshold


def apply_prev_hidden_states_residual(hidden_states):
    hidden_states_residual = get_buffer("hidden_states_residual")
    assert hidden_states_residual is not None, "hidden_states_residual must be set before"
    return (hidden_states_residual + hidden_states).contiguous()


def get_can_use_cache(first_hidden_states_residual, threshold, parallelized=False, validation_function=None):
    prev_first_hidden_states_residual = get_buffer("first_hidden_states_residual")
    cache_context = _current_cache_context
    if cache_context is None or prev_first_hidden_states_residual is None:
        return False
    can_use_cache = are_two_tensors_similar(prev_first_hidden_states_residual, first_hidden_states_residual,
                                            threshold=threshold, only_shape=cache_context.sequence_num > 0)
    if cache_context.sequence_num > 0:
        cache_context.use_cache &= can_use_cache
    else:
        if validation_function is not None:
            can_use_cache = validation_function(can_use_cache)
        cache_context.use_cache = can_use_cache
    return cache_context.use_cache


def create_patch_flux_forward_orig(model, *, residual_diff_threshold, validate_can_use_cache_function=None):
    """Comfy-WaveSpeed's ``create_patch_flux_forward_orig``: Flux's forward running double block 0, then either the
    previous step's residual or the remaining blocks. Blocks are called without transformer_options; a "dit" replace
    patch gets it in its extra dict. PuLID's branches (off without PuLID) left out; ``**kwargs``: the 2026 ComfyUI
    also passes ``timestep_zero_index``, which the pack's signature lacks (its issues #146/#147)."""
    from comfy.ldm.flux.layers import timestep_embedding

    def call_remaining_blocks(self, blocks_replace, control, img, txt, vec, pe, attn_mask, ca_idx, timesteps,
                              transformer_options):
        original_hidden_states = img
        extra_block_forward_kwargs = {}
        if attn_mask is not None:
            extra_block_forward_kwargs["attn_mask"] = attn_mask
        for i, block in enumerate(self.double_blocks):
            if i < 1:
                continue
            if ("double_block", i) in blocks_replace:
                def block_wrap(args, block=block):
                    out = {}
                    out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                                   **extra_block_forward_kwargs)
                    return out
                out = blocks_replace[("double_block", i)](
                    {"img": img, "txt": txt, "vec": vec, "pe": pe, **extra_block_forward_kwargs},
                    {"original_block": block_wrap, "transformer_options": transformer_options})
                txt = out["txt"]
                img = out["img"]
            else:
                img, txt = block(img=img, txt=txt, vec=vec, pe=pe, **extra_block_forward_kwargs)
            if control is not None:
                control_i = control.get("input")
                if i < len(control_i):
                    add = control_i[i]
                    if add is not None:
                        img += add
        img = torch.cat((txt, img), 1)
        for i, block in enumerate(self.single_blocks):
            if ("single_block", i) in blocks_replace:
                def block_wrap(args, block=block):
                    out = {}
                    out["img"] = block(args["img"], vec=args["vec"], pe=args["pe"], **extra_block_forward_kwargs)
                    return out
                out = blocks_replace[("single_block", i)](
                    {"img": img, "vec": vec, "pe": pe, **extra_block_forward_kwargs},
                    {"original_block": block_wrap, "transformer_options": transformer_options})
                img = out["img"]
            else:
                img = block(img, vec=vec, pe=pe, **extra_block_forward_kwargs)
            if control is not None:
                control_o = control.get("output")
                if i < len(control_o):
                    add = control_o[i]
                    if add is not None:
                        img[:, txt.shape[1]:, ...] += add
        img = img[:, txt.shape[1]:, ...]
        img = img.contiguous()
        hidden_states_residual = img - original_hidden_states
        return img, hidden_states_residual

    def forward_orig(self, img, img_ids, txt, txt_ids, timesteps, y, guidance=None, control=None,
                     transformer_options={}, attn_mask=None, **kwargs):  # noqa: B006 - mirrors the pack
        patches_replace = transformer_options.get("patches_replace", {})
        if img.ndim != 3 or txt.ndim != 3:
            raise ValueError("Input img and txt tensors must have 3 dimensions.")
        img = self.img_in(img)
        vec = self.time_in(timestep_embedding(timesteps, 256).to(img.dtype))
        if self.params.guidance_embed:
            if guidance is None:
                raise ValueError("Didn't get guidance strength for guidance distilled model.")
            vec = vec + self.guidance_in(timestep_embedding(guidance, 256).to(img.dtype))
        vec = vec + self.vector_in(y[:, :self.params.vec_in_dim])
        txt = self.txt_in(txt)
        ids = torch.cat((txt_ids, img_ids), dim=1)
        pe = self.pe_embedder(ids)
        ca_idx = 0
        extra_block_forward_kwargs = {}
        if attn_mask is not None:
            extra_block_forward_kwargs["attn_mask"] = attn_mask
        blocks_replace = patches_replace.get("dit", {})
        for i, block in enumerate(self.double_blocks):
            if i >= 1:
                break
            if ("double_block", i) in blocks_replace:
                def block_wrap(args, block=block):
                    out = {}
                    out["img"], out["txt"] = block(img=args["img"], txt=args["txt"], vec=args["vec"], pe=args["pe"],
                                                   **extra_block_forward_kwargs)
                    return out
                out = blocks_replace[("double_block", i)](
                    {"img": img, "txt": txt, "vec": vec, "pe": pe, **extra_block_forward_kwargs},
                    {"original_block": block_wrap, "transformer_options": transformer_options})
                txt = out["txt"]
                img = out["img"]
            else:
                img, txt = block(img=img, txt=txt, vec=vec, pe=pe, **extra_block_forward_kwargs)
            if control is not None:
                control_i = control.get("input")
                if i < len(control_i):
                    add = control_i[i]
                    if add is not None:
                        img += add
            if i == 0:
                first_hidden_states_residual = img
                can_use_cache = get_can_use_cache(first_hidden_states_residual, threshold=residual_diff_threshold,
                                                  validation_function=validate_can_use_cache_function)
                if not can_use_cache:
                    set_buffer("first_hidden_states_residual", first_hidden_states_residual)
                del first_hidden_states_residual
        torch._dynamo.graph_break()
        if can_use_cache:
            img = apply_prev_hidden_states_residual(img)
        else:
            img, hidden_states_residual = call_remaining_blocks(self, blocks_replace, control, img, txt, vec, pe,
                                                                attn_mask, ca_idx, timesteps, transformer_options)
            set_buffer("hidden_states_residual", hidden_states_residual)
        torch._dynamo.graph_break()
        img = self.final_layer(img, vec)
        return img

    forward_orig.__module__ = WAVESPEED_MODULE
    new_forward_orig = forward_orig.__get__(model)

    @contextlib.contextmanager
    def patch_forward_orig():
        with unittest.mock.patch.object(model, "forward_orig", new_forward_orig):
            yield

    return patch_forward_orig


def apply_fbcache(patcher, residual_diff_threshold):
    """``ApplyFBCacheOnModel.patch`` on Flux (start 0, end 1, unlimited cache hits: no validation function): a clone
    whose model_function_wrapper keeps the cache state and swaps forward_orig for each call."""
    prev_timestep = None
    prev_input_state = None
    current_timestep = None

    def reset_cache_state():
        nonlocal prev_input_state, prev_timestep
        prev_input_state = prev_timestep = None
        set_current_cache_context(CacheContext())

    def ensure_cache_state(model_input, timestep):
        nonlocal current_timestep
        input_state = (model_input.shape, model_input.dtype, model_input.device)
        cache_context = _current_cache_context
        need_reset = (prev_timestep is None or prev_input_state is None or
                      prev_input_state[1:] != input_state[1:] or prev_input_state[0][1:] != input_state[0][1:] or
                      cache_context is None or timestep > prev_timestep)
        if need_reset:
            reset_cache_state()
        elif timestep == prev_timestep:
            cache_context.sequence_num += 1
        elif timestep < prev_timestep:
            cache_context.sequence_num = 0
        current_timestep = timestep

    def update_cache_state(model_input, timestep):
        nonlocal prev_timestep, prev_input_state
        prev_timestep = timestep
        prev_input_state = (model_input.shape, model_input.dtype, model_input.device)

    model = patcher.clone()
    diffusion_model = model.get_model_object("diffusion_model")
    assert diffusion_model.__class__.__name__ == "Flux"  # the forward_orig branch (UNetModel has its own)
    patch_forward = create_patch_flux_forward_orig(diffusion_model, residual_diff_threshold=residual_diff_threshold,
                                                   validate_can_use_cache_function=None)

    def model_unet_function_wrapper(model_function, kwargs):
        try:
            input = kwargs["input"]
            timestep = kwargs["timestep"]
            c = kwargs["c"]
            t = timestep[0].item()
            ensure_cache_state(input, t)
            with patch_forward():
                result = model_function(input, timestep, **c)
                update_cache_state(input, t)
                return result
        except Exception as exc:
            reset_cache_state()
            raise exc from None

    model_unet_function_wrapper.__module__ = WAVESPEED_NODES
    model.set_model_unet_function_wrapper(model_unet_function_wrapper)
    return model


# ComfyUI-KJNodes (kijai/ComfyUI-KJNodes 3f20054, nodes/model_optimization_nodes.py) ---------------------------------

def get_sage_func(calls):
    """``get_sage_func``'s ``attention_sage`` (wrapped by ComfyUI's ``wrap_attn``), with sage's kernel (not
    installable here) replaced by ComfyUI's own attention_pytorch; records each call's (queries, keys)."""
    from comfy.ldm.modules.attention import attention_pytorch, wrap_attn

    @wrap_attn
    def attention_sage(q, k, v, heads, mask=None, attn_precision=None, skip_reshape=False, skip_output_reshape=False,
                       **kwargs):
        seq = 2 if skip_reshape else 1
        calls.append((q.shape[seq], k.shape[seq]))
        return attention_pytorch.__wrapped__(q, k, v, heads, mask=mask, attn_precision=attn_precision,
                                             skip_reshape=skip_reshape, skip_output_reshape=skip_output_reshape,
                                             **kwargs)
    return attention_sage


def patch_sage_attention(model, calls):
    """``PathchSageAttentionKJ.patch``: the clone's optimized_attention_override runs sage instead of ``func``."""
    model_clone = model.clone()
    new_attention = get_sage_func(calls)

    def attention_override_sage(func, *args, **kwargs):
        return new_attention.__wrapped__(*args, **kwargs)

    model_clone.model_options["transformer_options"]["optimized_attention_override"] = attention_override_sage
    return model_clone


def skip_torch_compile_dict(guard_entries):
    return [("transformer_options" not in entry.name) for entry in guard_entries]


def build_compile_kwargs(backend, mode, fullgraph, dynamic, use_guard_filter=True):
    kw = {"backend": backend, "fullgraph": fullgraph, "dynamic": dynamic}
    if mode and mode != "default":
        kw["mode"] = mode
    elif use_guard_filter:
        kw["options"] = {"guard_filter_fn": skip_torch_compile_dict}
    return kw


_KJ_COMPILE_KEY = "torch.compile"
_KJ_COMPILED_BY_MODEL = {}  # the pack's WeakKeyDictionary: BaseModel -> {key: compiled module}


def _kj_apply_torch_compile_wrapper(executor, *args, **kwargs):
    import comfy.utils

    compiled = _KJ_COMPILED_BY_MODEL.get(executor.class_obj)
    if not compiled:
        return executor(*args, **kwargs)
    orig = {}
    try:
        for key, value in compiled.items():
            orig[key] = comfy.utils.get_attr(executor.class_obj, key)
            comfy.utils.set_attr(executor.class_obj, key, value)
        return executor(*args, **kwargs)
    finally:
        for key, value in orig.items():
            comfy.utils.set_attr(executor.class_obj, key, value)


def kj_set_torch_compile_wrapper(model, backend, options=None, mode=None, fullgraph=False, dynamic=None,
                                 keys=("diffusion_model",)):
    import comfy.patcher_extension

    WrappersMP = comfy.patcher_extension.WrappersMP
    model.remove_wrappers_with_key(WrappersMP.APPLY_MODEL, _KJ_COMPILE_KEY)
    if not keys:
        keys = ["diffusion_model"]
    compile_kwargs = {"backend": backend, "options": options, "mode": mode, "fullgraph": fullgraph, "dynamic": dynamic}
    compiled_modules = {key: torch.compile(model=model.get_model_object(key), **compile_kwargs) for key in keys}
    _KJ_COMPILED_BY_MODEL[model.model] = compiled_modules
    model.add_wrapper_with_key(WrappersMP.APPLY_MODEL, _KJ_COMPILE_KEY, _kj_apply_torch_compile_wrapper)
    model.model_options["torch_compile_kwargs"] = compile_kwargs


def torch_compile_model_advanced(model, backend="inductor"):
    """``TorchCompileModelAdvanced.patch`` with its defaults (fullgraph off, mode "default", dynamic "false",
    transformer blocks only, cache size 64): each of Flux's double_blocks.i / single_blocks.i compiled by
    torch.compile, swapped in on the BaseModel by an APPLY_MODEL wrapper for each call (the guard filter drops the
    guards on transformer_options so that a changed option does not recompile)."""
    m = model.clone()
    diffusion_model = m.get_model_object("diffusion_model")
    torch._dynamo.config.cache_size_limit = 64
    compile_key_list = []
    layer_types = ["double_blocks", "single_blocks", "layers", "transformer_blocks", "blocks",
                   "visual_transformer_blocks", "text_transformer_blocks", "patch_blocks", "pixel_blocks"]
    for layer_name in layer_types:
        if hasattr(diffusion_model, layer_name):
            blocks = getattr(diffusion_model, layer_name)
            for i in range(len(blocks)):
                compile_key_list.append(f"diffusion_model.{layer_name}.{i}")
    if not compile_key_list:
        compile_key_list = ["diffusion_model"]
    kj_set_torch_compile_wrapper(model=m, keys=compile_key_list,
                                 **build_compile_kwargs(backend, "default", False, False))
    return m


# Spies ---------------------------------------------------------------------------------------------------------------

def tome(patcher, mode, **settings):
    return patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode, **settings))


@contextlib.contextmanager
def tokens_into(blocks):
    """The image tokens each call of these blocks receives ("img" or the first argument), in call order."""
    seen = []

    def hook(module, args, kwargs):
        seen.append((kwargs.get("img") if "img" in kwargs else args[0]).shape[1])

    handles = [block.register_forward_pre_hook(hook, with_kwargs=True) for block in blocks]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


# ComfyUI-TeaCache on Flux ---------------------------------------------------------------------------------------------

@pytest.mark.parametrize("mode", ["kv", "merge"])
@pytest.mark.parametrize("order", ["tome_first", "teacache_first"])
def test_a_forward_replacing_cache_stops_the_prompt_naming_the_pack(comfy, mode, order):
    patcher, latent, cond, _ = flux(comfy)
    config = ToMeConfig(ratio=0.5, mode=mode, block_start=0.0)
    alone = sample(comfy, apply_teacache(patcher), latent, cond, steps=1)
    assert torch.isfinite(alone).all()  # the stand-in runs by itself
    both = apply_teacache(patch_dit_model_patcher(patcher, config)) if order == "tome_first" else \
        patch_dit_model_patcher(apply_teacache(patcher), config)
    what = "attention" if mode == "kv" else "block"
    with pytest.raises(RuntimeError, match=f"mode {mode} reached no {what} of Flux's first model call: "
                                           "ComfyUI-TeaCache's teacache_flux_forward \\(in place of Flux.forward_orig\\)"):
        sample(comfy, both, latent, cond, steps=1)
    with pytest.raises(RuntimeError, match="ComfyUI-TeaCache"):  # every run, until one of the two goes
        sample(comfy, both, latent, cond, steps=1)


# Comfy-WaveSpeed First Block Cache on Flux ----------------------------------------------------------------------------

FBCACHE_STEPS = 3  # step 1 computes every block; with threshold 1.0 steps 2 and 3 reuse its residual on this model


def fbcache_runs(comfy, model, patcher, latent, cond):
    """The image, and the image tokens each double and single block call received."""
    diffusion_model = patcher.model.diffusion_model
    with tokens_into(diffusion_model.double_blocks) as double, tokens_into(diffusion_model.single_blocks) as single:
        image = sample(comfy, model, latent, cond, steps=FBCACHE_STEPS)
    return image, list(double), list(single)


@pytest.mark.parametrize("order", ["tome_first", "fbcache_first"])
def test_wavespeed_first_block_cache_stops_mode_kv_naming_the_pack(comfy, order):
    """WaveSpeed's forward_orig copy calls every block without transformer_options: the attention override never
    runs, so the first model call stops the prompt naming the pack's function."""
    patcher, latent, cond, _ = flux(comfy)
    assert torch.isfinite(sample(comfy, apply_fbcache(patcher, 1.0), latent, cond, steps=1)).all()  # runs alone
    config = ToMeConfig(ratio=0.5, mode="kv", block_start=0.0)
    both = apply_fbcache(patch_dit_model_patcher(patcher, config), 1.0) if order == "tome_first" else \
        patch_dit_model_patcher(apply_fbcache(patcher, 1.0), config)
    with pytest.raises(RuntimeError, match="mode kv reached no attention of Flux's first model call: Comfy-WaveSpeed's "
                                           "create_patch_flux_forward_orig.<locals>.forward_orig \\(in place of "
                                           "Flux.forward_orig\\)"):
        sample(comfy, both, latent, cond, steps=1)
    with pytest.raises(RuntimeError, match="Comfy-WaveSpeed"):  # every run, until one of the two goes
        sample(comfy, both, latent, cond, steps=1)


@pytest.mark.parametrize("order", ["tome_first", "fbcache_first"])
def test_wavespeed_first_block_cache_and_mode_merge_both_act(comfy, order):
    """WaveSpeed's copy hands transformer_options to the "dit" replace patches in their extra dict, where mode merge
    reads it: the blocks it runs get the merged tokens (35 -> fewer), and the cache still skips the remaining blocks
    of steps 2 and 3 (ToMe's merge is planned per call, so a skipped call loses nothing); the image then differs
    from ToMe's alone (the test below)."""
    patcher, latent, cond, _ = flux(comfy)
    plain, _, plain_single = fbcache_runs(comfy, patcher, patcher, latent, cond)
    cached, cached_double, cached_single = fbcache_runs(comfy, apply_fbcache(patcher, 1.0), patcher, latent, cond)
    assert len(plain_single) == 2 * FBCACHE_STEPS and len(cached_single) == 2  # the cache acts alone: step 1 only
    assert cached_double == [35] * FBCACHE_STEPS and not torch.equal(cached, plain)
    config = ToMeConfig(ratio=0.5, mode="merge", block_start=0.0)
    both = apply_fbcache(patch_dit_model_patcher(patcher, config), 1.0) if order == "tome_first" else \
        patch_dit_model_patcher(apply_fbcache(patcher, 1.0), config)
    image, double, single = fbcache_runs(comfy, both, patcher, latent, cond)
    assert torch.isfinite(image).all() and not torch.equal(image, cached)
    assert len(double) == FBCACHE_STEPS and max(double) < 35  # ToMe: block 0 merged on every step
    assert len(single) == 2 and max(single) < 5 + 35  # the cache: the single blocks of step 1 only, merged


def test_wavespeed_first_block_cache_with_mode_merge_differs_from_tome_alone(comfy):
    """The cache skips the remaining blocks of steps 2 and 3 (test above), so the image must differ from ToMe's
    alone, which computes them (it did not while merged Flux blocks, which add to their input in place, lost their
    update: test_comfy_dit_merge.test_the_merged_blocks_update_reaches_the_output)."""
    patcher, latent, cond, _ = flux(comfy)
    config = ToMeConfig(ratio=0.5, mode="merge", block_start=0.0)
    alone = sample(comfy, patch_dit_model_patcher(patcher, config), latent, cond, steps=FBCACHE_STEPS)
    both = sample(comfy, apply_fbcache(patch_dit_model_patcher(patcher, config), 1.0), latent, cond,
                  steps=FBCACHE_STEPS)
    assert not torch.equal(both, alone)


# ComfyUI-TeaCache on Wan ----------------------------------------------------------------------------------------------

TEACACHE_STEPS = 3
# On the seeded reduced model the time embedding moves ~0.6-0.9 (rel-L1) a step, far off what the coefficients were
# fitted on: the 14B polynomial then estimates a negative distance, so every step after the first is cached.
WAN_TYPE = "wan2.1_t2v_14B"


def teacache_runs(comfy, model, patcher, latent, cond):
    """The image and the video tokens each block call received. TeaCache keeps its state on the model and resets it
    at step 0 only once both cond and uncond ran (cfg 1 runs cond alone): each run starts without it, as a new
    process would."""
    diffusion_model = patcher.model.diffusion_model
    vars(diffusion_model).pop("teacache_state", None)
    with tokens_into(diffusion_model.blocks) as seen:
        image = sample(comfy, model, latent, cond, steps=TEACACHE_STEPS)
    return image, list(seen)


@pytest.mark.parametrize("order", ["tome_first", "teacache_first"])
def test_teacache_on_wan_stops_mode_kv_naming_the_pack(comfy, order):
    """TeaCache's Wan forward calls the blocks without transformer_options: the attention override never runs."""
    patcher, latent, cond, _ = wan(comfy)
    alone, _ = teacache_runs(comfy, apply_teacache(patcher, WAN_TYPE), patcher, latent, cond)
    assert torch.isfinite(alone).all()
    config = ToMeConfig(ratio=0.5, mode="kv")
    both = apply_teacache(patch_dit_model_patcher(patcher, config), WAN_TYPE) if order == "tome_first" else \
        patch_dit_model_patcher(apply_teacache(patcher, WAN_TYPE), config)
    with pytest.raises(RuntimeError, match="mode kv reached no attention of WanModel's first model call: "
                                           "ComfyUI-TeaCache's teacache_wanmodel_forward \\(in place of "
                                           "WanModel.forward_orig\\)"):
        teacache_runs(comfy, both, patcher, latent, cond)


@pytest.mark.parametrize("order", ["tome_first", "teacache_first"])
def test_teacache_on_wan_and_mode_merge_both_act(comfy, order):
    """TeaCache's Wan forward hands transformer_options to the "dit" replace patches in their extra dict: the first
    step's blocks get the merged video tokens (45 -> fewer) and the later steps reuse that step's residual."""
    patcher, latent, cond, _ = wan(comfy)
    plain, plain_calls = teacache_runs(comfy, patcher, patcher, latent, cond)
    cached, cached_calls = teacache_runs(comfy, apply_teacache(patcher, WAN_TYPE), patcher, latent, cond)
    assert plain_calls == [45] * 2 * TEACACHE_STEPS and cached_calls == [45, 45]  # the cache acts alone
    assert not torch.equal(cached, plain)
    config = ToMeConfig(ratio=0.5, mode="merge")
    alone, _ = teacache_runs(comfy, patch_dit_model_patcher(patcher, config), patcher, latent, cond)
    both = apply_teacache(patch_dit_model_patcher(patcher, config), WAN_TYPE) if order == "tome_first" else \
        patch_dit_model_patcher(apply_teacache(patcher, WAN_TYPE), config)
    image, calls = teacache_runs(comfy, both, patcher, latent, cond)
    assert len(calls) == 2 and max(calls) < 45  # step 1's two blocks, merged; steps 2 and 3 cached
    assert torch.isfinite(image).all() and not torch.equal(image, cached) and not torch.equal(image, alone)


# ComfyUI-KJNodes: Sage attention patch and torch.compile, on Flux ----------------------------------------------------

@pytest.mark.parametrize("mode", ["kv", "merge"])
@pytest.mark.parametrize("order", ["tome_first", "sage_first"])
def test_kjnodes_sage_attention_and_tome_both_act(comfy, mode, order):
    """The Sage patch is an optimized_attention_override on the model options; ToMe sets its own per model call and
    chains the one there before: sage runs every attention, over the shortened keys (kv) or merged tokens (merge),
    and the image is ToMe's (sage's kernel aside)."""
    patcher, latent, cond, _ = flux(comfy)
    sage_calls = []
    sage_alone = sample(comfy, patch_sage_attention(patcher, sage_calls), latent, cond)
    assert sage_calls and all(q == k == 40 for q, k in sage_calls)  # 5 text + 35 image tokens, whole
    tome_alone = sample(comfy, tome(patcher, mode), latent, cond)
    calls = []
    both = patch_sage_attention(tome(patcher, mode), calls) if order == "tome_first" else \
        tome(patch_sage_attention(patcher, calls), mode)
    image = sample(comfy, both, latent, cond)
    assert len(calls) == len(sage_calls)  # sage ran every attention
    if mode == "kv":
        assert any(q == 40 and k < 40 for q, k in calls)  # the single blocks' keys, shortened
    else:
        assert any(q == k < 40 for q, k in calls)  # the single blocks' merged tokens
    assert rel(image, tome_alone) < 1e-4 and rel(image, sage_alone) > 1e-3


def compile_backend() -> str:
    """The pack's default "inductor" where a C++ compiler is found (it builds CPU kernels), else "aot_eager"
    (the same dynamo tracing of the blocks and of ToMe's override; only the code generation differs)."""
    import shutil

    return "inductor" if any(shutil.which(cc) for cc in ("g++", "c++", "clang++")) else "aot_eager"


@pytest.mark.parametrize("mode", ["kv", "merge"])
@pytest.mark.parametrize("order", ["tome_first", "compile_first"])
def test_kjnodes_torch_compile_and_tome_both_act(comfy, mode, order):
    """The compiled blocks still get transformer_options from Flux's forward, so dynamo traces ToMe's attention
    override (kv) or gets the merged tokens from its replace patch (merge). compile_first runs the compiled model
    alone first, then ToMe on it: the pack's guard filter drops the guards on transformer_options, and the blocks
    must not reuse the graphs traced without ToMe."""
    from torch._dynamo.utils import counters

    patcher, latent, cond, _ = flux(comfy)
    plain = sample(comfy, patcher, latent, cond)
    eager = sample(comfy, tome(patcher, mode), latent, cond)
    assert rel(eager, plain) > 5e-3
    torch._dynamo.reset()
    counters.clear()
    with torch._dynamo.config.patch(cache_size_limit=torch._dynamo.config.cache_size_limit):  # the pack sets 64
        try:
            if order == "compile_first":
                compiled = torch_compile_model_advanced(patcher, compile_backend())
                assert rel(sample(comfy, compiled, latent, cond), plain) < 1e-4
                assert counters["stats"]["unique_graphs"] > 0  # dynamo compiled the swapped-in blocks
                counters.clear()
                both = tome(compiled, mode)
            else:
                both = torch_compile_model_advanced(tome(patcher, mode), compile_backend())
            image = sample(comfy, both, latent, cond)
            assert counters["stats"]["unique_graphs"] > 0
            assert rel(image, eager) < 1e-3 and rel(image, plain) > 5e-3
        finally:
            _KJ_COMPILED_BY_MODEL.clear()
            torch._dynamo.reset()


# ComfyUI's own EasyCache (comfy_extras/nodes_easycache.py) ------------------------------------------------------------

@pytest.mark.parametrize("mode", ["kv", "merge"])
@pytest.mark.parametrize("order", ["tome_first", "easycache_first"])
def test_easycache_skipping_steps_is_not_taken_for_a_pack_that_bypasses_tome(comfy, mode, order, caplog):
    """EasyCache skips whole model calls once it has two computed steps. ToMe starting later in sampling
    (start_percent 0.5) must not take a skipped first reduced call for blocks run without it: the reach check runs at
    the first model call (which no step cache skips), with a pass-through probe where ToMe leaves the call whole.
    Both act: EasyCache skips steps, and the image differs from EasyCache's alone."""
    easycache = pytest.importorskip("comfy_extras.nodes_easycache")
    patcher, latent, cond, _ = flux(comfy)

    def with_easycache(model):
        return easycache.EasyCacheNode.execute(model, reuse_threshold=0.5, start_percent=0.0, end_percent=1.0,
                                               verbose=False).result[0]

    def skipped() -> int:  # EasyCache logs "EasyCache - skipped k/n steps" when sampling ends, then resets
        counts = [int(m.group(1)) for r in caplog.records
                  for m in [re.search(r"EasyCache - skipped (\d+)/", r.getMessage())] if m]
        caplog.clear()
        return counts[-1]

    steps = 8
    caplog.set_level(logging.INFO)
    cached = sample(comfy, with_easycache(patcher), latent, cond, steps=steps)
    assert skipped() > 0
    config = ToMeConfig(ratio=0.5, mode=mode, start_percent=0.5, block_start=0.0)
    both = with_easycache(patch_dit_model_patcher(patcher, config)) if order == "tome_first" else \
        patch_dit_model_patcher(with_easycache(patcher), config)
    image = sample(comfy, both, latent, cond, steps=steps)
    assert skipped() > 0 and torch.isfinite(image).all() and not torch.equal(image, cached)
