"""Stand-in of Neo's ``backend/modules/k_prediction.py`` (de2193d9; ported from ComfyUI v0.27.1 model_sampling.py):
``flux_time_shift`` (29-30), ``time_snr_shift`` (33-36), ``AbstractPrediction`` (61-99), ``PredictionFlux``
(151-182) and ``PredictionDiscreteFlow`` (185-216).

Which class an engine gets (``diffusion_engine/base.py:49-53 _get_predictor``): ``PredictionDiscreteFlow`` for a
FLOW model type (Flux schnell, Chroma, Qwen-Image, Wan, Lumina 2 / Z-Image), ``PredictionFlux`` otherwise (Flux dev).
``sampling_settings`` come from huggingface_guess model_list.py (Flux dev: {} -> shift 1.15; Chroma: shift 1.0,
multiplier 1.0; Qwen-Image: shift 1.15, multiplier 1.0; Wan 2.1: shift 8.0, multiplier 1000; Z-Image: shift 3.0,
multiplier 1.0). The eps/v ``Prediction`` (UNet models) is not modelled.
"""
import math

import torch


def flux_time_shift(mu, sigma, t):
    """Mirrors k_prediction.py:29-30."""
    return math.exp(mu) / (math.exp(mu) + (1 / t - 1) ** sigma)


def time_snr_shift(alpha, t):
    """Mirrors k_prediction.py:33-36."""
    if alpha == 1.0:
        return t
    return alpha * t / (1 + (alpha - 1) * t)


class AbstractPrediction(torch.nn.Module):
    """Mirrors k_prediction.py:61-99 AbstractPrediction (the "const" flow path and the eps path)."""

    def __init__(self, sigma_data=1.0, prediction_type="epsilon"):
        super().__init__()
        self.sigma_data = sigma_data
        self.prediction_type = prediction_type
        assert self.prediction_type in ("epsilon", "v_prediction", "const")

    def calculate_input(self, sigma, noise):
        if self.prediction_type == "const":
            return noise
        sigma = sigma.view(sigma.shape[:1] + (1,) * (noise.ndim - 1))
        return noise / (sigma**2 + self.sigma_data**2) ** 0.5

    def calculate_denoised(self, sigma, model_output, model_input):
        sigma = sigma.view(sigma.shape[:1] + (1,) * (model_output.ndim - 1))
        if self.prediction_type == "v_prediction":
            total = sigma**2 + self.sigma_data**2
            return model_input * self.sigma_data**2 / total - model_output * sigma * self.sigma_data / total**0.5
        return model_input - model_output * sigma

    def noise_scaling(self, sigma, noise, latent_image, max_denoise=False):
        sigma = sigma.view(sigma.shape[:1] + (1,) * (noise.ndim - 1))
        if self.prediction_type == "const":
            return sigma * noise + (1.0 - sigma) * latent_image
        noise = noise * torch.sqrt(1.0 + sigma**2.0) if max_denoise else noise * sigma
        return noise + latent_image

    def inverse_noise_scaling(self, sigma, latent):
        if self.prediction_type == "const":
            sigma = sigma.view(sigma.shape[:1] + (1,) * (latent.ndim - 1))
            return latent / (1.0 - sigma)
        return latent


class PredictionFlux(AbstractPrediction):
    """Mirrors k_prediction.py:151-182 PredictionFlux: timestep(sigma) = sigma, exp-shifted schedule."""

    def __init__(self, model_config):
        super().__init__(sigma_data=None, prediction_type="const")
        self.set_parameters(shift=model_config.sampling_settings.get("shift", 1.15))

    def set_parameters(self, *, shift=None, timesteps=10000):
        self.shift = shift or self.shift
        self.register_buffer("sigmas", self.sigma(torch.arange(1, timesteps + 1, 1) / timesteps))

    @property
    def sigma_min(self):
        return self.sigmas[0]

    @property
    def sigma_max(self):
        return self.sigmas[-1]

    def timestep(self, sigma):
        return sigma

    def sigma(self, timestep):
        return flux_time_shift(self.shift, 1.0, timestep)

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return flux_time_shift(self.shift, 1.0, 1.0 - percent)


class PredictionDiscreteFlow(AbstractPrediction):
    """Mirrors k_prediction.py:185-216 PredictionDiscreteFlow: timestep(sigma) = sigma * multiplier, SNR shift."""

    def __init__(self, model_config):
        super().__init__(sigma_data=None, prediction_type="const")
        settings = model_config.sampling_settings
        self.set_parameters(shift=settings.get("shift", 1.0), multiplier=settings.get("multiplier", 1000))

    def set_parameters(self, *, shift=None, multiplier=None, timesteps=1000):
        self.shift = shift or self.shift
        self.multiplier = multiplier or self.multiplier
        self.register_buffer("sigmas", self.sigma((torch.arange(1, timesteps + 1, 1) / timesteps) * self.multiplier))

    @property
    def sigma_min(self):
        return self.sigmas[0]

    @property
    def sigma_max(self):
        return self.sigmas[-1]

    def timestep(self, sigma):
        return sigma * self.multiplier

    def sigma(self, timestep):
        return time_snr_shift(self.shift, timestep / self.multiplier)

    def percent_to_sigma(self, percent):
        if percent <= 0.0:
            return 1.0
        if percent >= 1.0:
            return 0.0
        return time_snr_shift(self.shift, 1.0 - percent)
