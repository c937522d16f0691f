"""The diffusers half of test_comfy_host_parity (run by the core test environment's Python, which has diffusers):
loads the weights and inputs the ComfyUI half saved into diffusers' QwenImageTransformer2DModel, runs it unpatched
and under ToMe's diffusers hooks with the settings given, and saves the outputs in ComfyUI's latent layout.

    <.venv-test python> tests/comfyui/host_parity_diffusers.py IN.pt OUT.pt
"""
import sys

import torch


def main(source: str, target: str) -> None:
    import diffusers

    import tome_core

    saved = torch.load(source)
    model = diffusers.QwenImageTransformer2DModel(**saved["config"]).eval()
    model.load_state_dict(saved["weights"], strict=True)
    x, context, timestep = saved["x"], saved["context"], saved["timestep"]
    b, c, _, h, w = x.shape
    packed = x[:, :, 0].reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5).reshape(b, (h // 2) * (w // 2), 4 * c)

    def run() -> torch.Tensor:
        with torch.no_grad():
            out = model(hidden_states=packed, encoder_hidden_states=context, timestep=timestep,
                        img_shapes=[[(1, h // 2, w // 2)]] * b, return_dict=False)[0]
        return out.reshape(b, h // 2, w // 2, -1, 2, 2).permute(0, 3, 1, 4, 2, 5).reshape(b, -1, 1, h, w)

    outputs = {"vanilla": run()}
    for name, settings in saved["settings"].items():
        tome_core.apply_patch(model, **settings)
        outputs[name] = run()
        tome_core.remove_patch(model)
    torch.save(outputs, target)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
