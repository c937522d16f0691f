"""Stand-in of Neo's ``backend/modules/k_model.py`` (de2193d9): ``KModel`` (9-68).

``KModel`` holds the DiT as ``diffusion_model`` and the flow predictor as ``predictor`` (Neo has no
``model_sampling``); ``apply_model`` takes the sigma as ``t``, hands the DiT ``predictor.timestep(t)`` and returns
``predictor.calculate_denoised``. Not modelled: the diffusers-scheduler predictor (UNet models), the dtype log line.
"""
import math

import torch


class KModel(torch.nn.Module):
    """Mirrors k_model.py:9-68 KModel."""

    def __init__(self, model, diffusers_scheduler, config, k_predictor):
        super().__init__()
        assert diffusers_scheduler is None, "the stand-in models only DiT engines (k_predictor given)"
        self.config = config
        self.storage_dtype = model.storage_dtype
        self.computation_dtype = model.computation_dtype
        self.diffusion_model = model
        self.diffusion_model.eval()
        self.diffusion_model.requires_grad_(False)
        self.predictor = k_predictor

    def apply_model(self, x, t, c_concat=None, c_crossattn=None, control=None, transformer_options={}, **kwargs):
        """Mirrors k_model.py:37-58: sigma in, denoised out; extra kwargs cast (ints kept) and passed to the DiT."""
        sigma = t
        xc = self.predictor.calculate_input(sigma, x)
        if c_concat is not None:
            xc = torch.cat([xc] + [c_concat], dim=1)
        context = c_crossattn
        dtype = self.computation_dtype
        xc = xc.to(dtype)
        t = self.predictor.timestep(t).float()
        context = context.to(dtype)
        extra_conds = {}
        for o in kwargs:
            extra = kwargs[o]
            if hasattr(extra, "dtype"):
                if extra.dtype != torch.int and extra.dtype != torch.long:
                    extra = extra.to(dtype)
            extra_conds[o] = extra
        model_output = self.diffusion_model(xc, t, context=context, control=control,
                                            transformer_options=transformer_options, **extra_conds).float()
        return self.predictor.calculate_denoised(sigma, model_output, x)

    def memory_required(self, input_shape):
        """Mirrors k_model.py:60-68 (the non-flash branch)."""
        area = input_shape[0] * math.prod(input_shape[2:])
        return (area * 0.15 * getattr(self.config, "memory_usage_factor", 2.0)) * (1024 * 1024)
