"""One Neo sampling pass, reduced to what a DiT sees (not a Neo module; it sits beside the ``backend`` stand-in).

Mirrors ``modules/sd_samplers_kdiffusion.py:206-257 KDiffusionSampler.sample`` (de2193d9): ``sampling_prepare``
(-> ``load_models_gpu([unet])``, which applies the patcher's object patches), the sigmas (``simple_scheduler``,
``modules/sd_schedulers.py:49-55``), ``predictor.noise_scaling(sigmas[0], x, 0)``, then
``model_options["transformer_options"]["sampling_sigmas"] = sigmas`` (line 248) written into the patcher passed in,
the sampler (``k_diffusion/sampling.py:161-183 sample_euler``, no churn) and ``sampling_cleanup``. Each step is
``modules/sd_samplers_cfg_denoiser.py:102-152 CFGDenoiser.forward`` reduced to its ``sampling_function`` call (no
prompt schedules, masks, NGMS / skip-early-CFG, callbacks). Neo runs the pass under no_grad; so does this.
"""
import torch

from backend.sampling.sampling_function import sampling_cleanup, sampling_function, sampling_prepare


def simple_sigmas(predictor, steps):
    """Mirrors modules/sd_schedulers.py:49-55 simple_scheduler: evenly spaced from predictor.sigmas, then 0."""
    ss = len(predictor.sigmas) / steps
    sigs = [float(predictor.sigmas[-(1 + int(x * ss))]) for x in range(steps)]
    return torch.FloatTensor(sigs + [0.0])


def denoise(unet_patcher, x, sigma, cond, uncond, cfg):
    """CFGDenoiser.forward (sd_samplers_cfg_denoiser.py:102-152) reduced to its sampling_function call: denoised x."""
    denoised, cond_pred, uncond_pred = sampling_function(unet_patcher, x, sigma, cond, uncond, cfg)
    return denoised


@torch.no_grad()
def sample(unet_patcher, noise, sigmas, cond, uncond, cfg, callback=None):
    """Mirrors KDiffusionSampler.sample (sd_samplers_kdiffusion.py:206-257) with sample_euler: one pass -> latent."""
    sampling_prepare(unet_patcher, x=noise)
    x = unet_patcher.model.predictor.noise_scaling(sigmas[0], noise, torch.zeros_like(noise))
    unet_patcher.model_options["transformer_options"]["sampling_sigmas"] = sigmas
    s_in = x.new_ones([x.shape[0]])
    for i in range(len(sigmas) - 1):
        denoised = denoise(unet_patcher, x, sigmas[i] * s_in, cond, uncond, cfg)
        d = (x - denoised) / sigmas[i]
        if callback is not None:
            callback({"x": x, "i": i, "sigma": sigmas[i], "sigma_hat": sigmas[i], "denoised": denoised})
        x = x + d * (sigmas[i + 1] - sigmas[i])
    sampling_cleanup(unet_patcher)
    return x
