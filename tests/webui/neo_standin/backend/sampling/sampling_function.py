"""Stand-in of Neo's ``backend/sampling/sampling_function.py`` (de2193d9): ``compute_cond_mark`` /
``compute_cond_indices`` (131-153), ``calc_cond_uncond_batch`` (156-289), ``sampling_function_inner`` (292-327),
``sampling_function`` (326-362, without the CFGDenoiser), ``sampling_prepare`` (365-388), ``sampling_cleanup``
(391-395); the cond containers of ``backend/sampling/condition.py`` (18-88) reduced to plain tensors.

A cond here is a list of entries; an entry is a dict of the model's keyword inputs (``c_crossattn`` plus e.g.
``guidance``, ``y``, ``attention_mask``), and optionally ``"strength"`` (the prompt weight) and ``"control"``.
Simplified away: areas, masks and ``timestep_start``/``timestep_end`` (get_area_and_mult 24-82: every entry covers
the whole latent, ``mult`` is 1), per-cond ``patches`` (always None in Neo's get_area_and_mult), the free-memory
split of a batch (208-213: everything fits, so one call takes every concat-able entry), ControlNet (261-268:
an entry's ``"control"`` only keeps it out of other entries' batch; ``get_control`` is never called and ``c`` gets
no ``"control"``), the context-window handler (303-304).
Kept exact: the to_run order, the reversed batching (a cfg > 1 call runs ``cond_or_uncond == [1, 0]``), the per-call
shallow copy of ``transformer_options`` and its keys, and the ``model_function_wrapper`` contract.
"""
import math

import torch

from backend import memory_management, utils

_RESERVED = ("strength", "control")


def _model_conds(entry, batch_size):
    """get_area_and_mult (24-82) reduced: the entry's model inputs repeated to the batch (condition.py:6-11, 25-26)."""
    out = {}
    for k, v in entry.items():
        if k in _RESERVED:
            continue
        if isinstance(v, torch.Tensor) and v.shape[0] != batch_size:
            v = v.repeat([math.ceil(batch_size / v.shape[0])] + [1] * (v.ndim - 1))[:batch_size]
        out[k] = v
    return out


def _can_concat(c1, c2):
    """Mirrors can_concat_cond / cond_equal_size (83-112) with condition.py's can_concat (28-32, 47-58, 82-85)."""
    if c1["input_x"].shape != c2["input_x"].shape or c1["control"] is not c2["control"]:
        return False
    a, b = c1["conditioning"], c2["conditioning"]
    if a is b:
        return True
    if a.keys() != b.keys():
        return False
    for k in a:
        x, y = a[k], b[k]
        if not isinstance(x, torch.Tensor):
            if x != y:
                return False
        elif k == "c_crossattn" and x.shape != y.shape:
            if x.shape[0] != y.shape[0] or x.shape[2] != y.shape[2]:
                return False
            if math.lcm(x.shape[1], y.shape[1]) // min(x.shape[1], y.shape[1]) > 4:
                return False
        elif x.shape != y.shape:
            return False
    return True


def _cond_cat(c_list):
    """Mirrors cond_cat (115-128) with ConditionCrossAttn.concat (60-72) and ConditionConstant.concat (87-88)."""
    out = {}
    for k in c_list[0]:
        vals = [c[k] for c in c_list]
        if not isinstance(vals[0], torch.Tensor):
            out[k] = vals[0]
            continue
        if k == "c_crossattn":
            n = math.lcm(*[v.shape[1] for v in vals])
            vals = [v.repeat(1, n // v.shape[1], 1) if v.shape[1] < n else v for v in vals]
        out[k] = torch.cat(vals)
    return out


def compute_cond_mark(cond_or_uncond, sigmas):
    """Mirrors sampling_function.py:131-139."""
    cond_mark = []
    for cx in cond_or_uncond:
        cond_mark += [cx] * int(sigmas.shape[0])
    return torch.Tensor(cond_mark).to(sigmas)


def compute_cond_indices(cond_or_uncond, sigmas):
    """Mirrors sampling_function.py:142-153."""
    cl = int(sigmas.shape[0])
    cond_indices, uncond_indices = [], []
    for i, cx in enumerate(cond_or_uncond):
        (cond_indices if cx == 0 else uncond_indices).extend(range(i * cl, (i + 1) * cl))
    return cond_indices, uncond_indices


def calc_cond_uncond_batch(model, cond, uncond, x_in, timestep, model_options):
    """Mirrors sampling_function.py:156-289 (see the module docstring for what is reduced)."""
    out_cond, out_count = torch.zeros_like(x_in), torch.ones_like(x_in) * 1e-37
    out_uncond, out_uncond_count = torch.zeros_like(x_in), torch.ones_like(x_in) * 1e-37
    COND, UNCOND = 0, 1

    def area_and_mult(entry):  # get_area_and_mult (24-82) reduced: the whole latent, mult 1
        conditioning = _model_conds(entry, x_in.shape[0])
        return {"input_x": x_in, "mult": torch.ones_like(x_in), "conditioning": conditioning,
                "control": entry.get("control")}

    to_run = []
    for x in cond:
        to_run += [(area_and_mult(x), COND)]
    if uncond is not None:
        for x in uncond:
            to_run += [(area_and_mult(x), UNCOND)]

    while len(to_run) > 0:
        first = to_run[0]
        to_batch_temp = [x for x in range(len(to_run)) if _can_concat(to_run[x][0], first[0])]
        to_batch_temp.reverse()
        to_batch = to_batch_temp  # 208-213: the memory check would keep the whole list when it fits

        input_x, mult, c, cond_or_uncond = [], [], [], []
        for x in to_batch:
            o = to_run.pop(x)
            input_x.append(o[0]["input_x"])
            mult.append(o[0]["mult"])
            c.append(o[0]["conditioning"])
            cond_or_uncond.append(o[1])

        batch_chunks = len(cond_or_uncond)
        input_x = torch.cat(input_x)
        c = _cond_cat(c)
        timestep_ = torch.cat([timestep] * batch_chunks)

        transformer_options = {}
        if "transformer_options" in model_options:
            transformer_options = model_options["transformer_options"].copy()
        transformer_options["cond_or_uncond"] = cond_or_uncond[:]
        transformer_options["sigmas"] = timestep
        transformer_options["cond_mark"] = compute_cond_mark(cond_or_uncond=cond_or_uncond, sigmas=timestep)
        transformer_options["cond_indices"], transformer_options["uncond_indices"] = compute_cond_indices(
            cond_or_uncond=cond_or_uncond, sigmas=timestep)
        c["transformer_options"] = transformer_options

        if "model_function_wrapper" in model_options:
            output = model_options["model_function_wrapper"](
                model.apply_model, {"input": input_x, "timestep": timestep_, "c": c, "cond_or_uncond": cond_or_uncond}
            ).chunk(batch_chunks)
        else:
            output = model.apply_model(input_x, timestep_, **c).chunk(batch_chunks)
        del input_x

        for o in range(batch_chunks):
            if cond_or_uncond[o] == COND:
                out_cond += output[o] * mult[o]
                out_count += mult[o]
            else:
                out_uncond += output[o] * mult[o]
                out_uncond_count += mult[o]

    out_cond /= out_count
    out_uncond /= out_uncond_count
    return out_cond, out_uncond


def sampling_function_inner(model, x, timestep, uncond, cond, cond_scale, model_options={}, seed=None,
                            return_full=False):
    """Mirrors sampling_function.py:292-327: the cfg=1 optimisation, pre/cfg/post functions, the cfg mix."""
    edit_strength = sum((item["strength"] if "strength" in item else 1) for item in cond)
    if math.isclose(cond_scale, 1.0) and model_options.get("disable_cfg1_optimization", False) == False:  # noqa: E712
        uncond_ = None
    else:
        uncond_ = uncond
    for fn in model_options.get("sampler_pre_cfg_function", []):
        model, cond, uncond_, x, timestep, model_options = fn(model, cond, uncond_, x, timestep, model_options)
    cond_pred, uncond_pred = calc_cond_uncond_batch(model, cond, uncond_, x, timestep, model_options)
    if "sampler_cfg_function" in model_options:
        args = {"cond": x - cond_pred, "uncond": x - uncond_pred, "cond_scale": cond_scale, "timestep": timestep,
                "input": x, "sigma": timestep, "cond_denoised": cond_pred, "uncond_denoised": uncond_pred,
                "model": model, "model_options": model_options}
        cfg_result = x - model_options["sampler_cfg_function"](args)
    elif not math.isclose(edit_strength, 1.0):
        cfg_result = uncond_pred + (cond_pred - uncond_pred) * cond_scale * edit_strength
    else:
        cfg_result = uncond_pred + (cond_pred - uncond_pred) * cond_scale
    for fn in model_options.get("sampler_post_cfg_function", []):
        args = {"denoised": cfg_result, "cond": cond, "uncond": uncond, "cond_scale": cond_scale, "model": model,
                "uncond_denoised": uncond_pred, "cond_denoised": cond_pred, "sigma": timestep,
                "model_options": model_options, "input": x}
        cfg_result = fn(args)
    if return_full:
        return cfg_result, cond_pred, uncond_pred
    return cfg_result


def sampling_function(unet_patcher, x, timestep, cond, uncond, cond_scale, extra_model_options=None, seed=None):
    """Mirrors sampling_function.py:326-362 from the patcher on (Neo's first argument is the CFGDenoiser holding it)."""
    model = unet_patcher.model
    model_options = utils.join_dicts(unet_patcher.model_options, extra_model_options)  # a shallow copy
    for modifier in model_options.get("conditioning_modifiers", []):
        model, x, timestep, uncond, cond, cond_scale, model_options, seed = modifier(model, x, timestep, uncond, cond,
                                                                                     cond_scale, model_options, seed)
    return sampling_function_inner(model, x, timestep, uncond, cond, cond_scale, model_options, seed, return_full=True)


def sampling_prepare(unet, x):
    """Mirrors sampling_function.py:365-388: load_models_gpu([unet] + extra patchers) for every pass."""
    shape = list(x.shape)
    unet_inference_memory = unet.memory_required([2 * shape[0]] + shape[1:])
    additional_inference_memory = unet.extra_preserved_memory_during_sampling
    additional_model_patchers = unet.extra_model_patchers_during_sampling
    memory_management.load_models_gpu(models=[unet] + additional_model_patchers,
                                      memory_required=unet_inference_memory + additional_inference_memory,
                                      minimum_memory_required=unet_inference_memory // 2 + additional_inference_memory)
    real_model = unet.model
    percent_to_timestep_function = lambda p: real_model.predictor.percent_to_sigma(p)  # noqa: E731
    for cnet in unet.list_controlnets():
        cnet.pre_run(real_model, percent_to_timestep_function)


def sampling_cleanup(unet):
    """Mirrors sampling_function.py:391-395 (no cache to empty on the CPU)."""
    for cnet in unet.list_controlnets():
        cnet.cleanup()
