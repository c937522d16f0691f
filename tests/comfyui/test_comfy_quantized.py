"""ToMe on quantized models as users load them in ComfyUI (project issue 28).

ComfyUI-GGUF (city96/ComfyUI-GGUF at 795e45156ece99afbc3efef911e63fcb46e6a20d): ``UnetLoaderGGUF`` makes a normal
ComfyUI model (comfy.sd.load_diffusion_model_state_dict with model_options={"custom_operations": GGMLOps()}) whose
Linear layers hold GGML-quantized weights and dequantize them in forward. ToMe patches it like any Flux or Wan: both
act. The pack is not on PyPI, so its parts that a Q8_0 Linear runs are mirrored here from that commit (each stand-in
names what it mirrors); the weights are quantized by the ``gguf`` package (requirements-comfy-test.txt), as the
pack's GGUF files are. The real pack at that commit, loading a Q8_0 .gguf of these models, gave the same outputs
bit for bit.

Nunchaku (nunchaku-tech/ComfyUI-nunchaku at dbfd194294b727d9bec597a9a5df6d431c5d3a6f; mit-han-lab/ComfyUI-nunchaku at
28c7fa41b460b3f82ef5230b522c70a72fe47a6e for Flux): its SVDQuant models are its own classes, which ToMe's catalogue
(matching module and class name) does not know: refused before sampling, naming the class.
"""
from __future__ import annotations

import os

import pytest
import torch

from test_comfy_dit import _node_classes, comfy, flux, sample, spy_on, tome_package, wan  # noqa: F401

from tome_core.adapters.model_patcher.dit import patch_dit_model_patcher
from tome_core.adapters.model_patcher.plan import plan_patch
from tome_core.engine.config import ToMeConfig

GGUF_MISSING = "the gguf package is missing: requirements-comfy-test.txt installs it (tests/comfyui/setup_env.sh)"


@pytest.fixture(scope="module")
def gguf(comfy):
    """The gguf package; after ``comfy``, so a ComfyUI without the attention override skips first. An optional
    package: skipped, naming it, where missing (a local environment for another ComfyUI); CI (CI=true), whose set-up
    installs it, fails instead."""
    try:
        import gguf
    except ImportError:
        if os.environ.get("CI") == "true":
            pytest.fail(GGUF_MISSING)
        pytest.skip(GGUF_MISSING)
    return gguf


class GGMLTensor(torch.Tensor):
    """ComfyUI-GGUF ops.py ``GGMLTensor``: the raw GGML blocks (uint8) with their type and the weight's shape."""

    def __init__(self, *args, tensor_type, tensor_shape, patches=[], **kwargs):
        super().__init__()
        self.tensor_type = tensor_type
        self.tensor_shape = tensor_shape
        self.patches = patches

    def __new__(cls, *args, tensor_type, tensor_shape, patches=[], **kwargs):
        return super().__new__(cls, *args, **kwargs)

    def to(self, *args, **kwargs):
        new = super().to(*args, **kwargs)
        new.tensor_type = getattr(self, "tensor_type", None)
        new.tensor_shape = getattr(self, "tensor_shape", new.data.shape)
        new.patches = getattr(self, "patches", []).copy()
        return new

    def clone(self, *args, **kwargs):
        return self

    def detach(self, *args, **kwargs):
        return self

    @property
    def shape(self):
        if not hasattr(self, "tensor_shape"):
            self.tensor_shape = self.size()
        return self.tensor_shape


def torch_compatible(gguf, tensor) -> bool:
    """dequant.py ``is_torch_compatible`` (``is_quantized`` is its negation)."""
    return tensor is None or getattr(tensor, "tensor_type", None) in (
        None, gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16)


def dequantize_tensor(gguf, tensor, dtype=None, dequant_dtype=None):
    """dequant.py ``dequantize_tensor`` -> ``dequantize`` -> ``dequantize_blocks_Q8_0`` (Q8_0 alone here): each
    32-weight block is a float16 scale and 32 int8s."""
    qtype = getattr(tensor, "tensor_type", None)
    oshape = getattr(tensor, "tensor_shape", tensor.shape)
    if torch_compatible(gguf, tensor):
        return tensor.to(dtype)
    assert qtype == gguf.GGMLQuantizationType.Q8_0, qtype  # the stand-in mirrors Q8_0 only
    dequant_dtype = dtype if dequant_dtype == "target" else dequant_dtype
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    rows = tensor.data.reshape((-1, tensor.data.shape[-1])).view(torch.uint8)
    blocks = rows.reshape((rows.numel() // type_size, type_size))
    d, x = torch.split(blocks, [2, type_size - 2], dim=1)  # split_block_dims(blocks, 2)
    d = d.view(torch.float16).to(dequant_dtype)
    return (d * x.view(torch.int8)).reshape(oshape).to(dtype)


@pytest.fixture(scope="module")
def ggml(comfy, gguf):
    """ComfyUI-GGUF's ``GGMLOps`` (ops.py: ``GGMLOps.Linear`` with ``GGMLLayer``'s load, ``get_weight``,
    ``cast_bias_weight``, ``forward_comfy_cast_weights`` and ``Linear.forward_ggml_cast_weights``) and
    ``GGUFModelPatcher`` (nodes.py: ``clone``, ``load``), on this ComfyUI's comfy.ops.manual_cast and ModelPatcher.
    Left out: LoRA patches on quantized weights, mmap release, VRAM estimation, torch.compile guards.
    ``ran`` collects each quantized Linear that dequantized its weight in forward."""
    import comfy.model_management
    import comfy.model_patcher
    import comfy.ops

    ran = set()

    class GGMLOps(comfy.ops.manual_cast):
        class Linear(comfy.ops.manual_cast.Linear):
            comfy_cast_weights = True
            dequant_dtype = None
            patch_dtype = None

            def __init__(self, in_features, out_features, bias=True, device=None, dtype=None):
                torch.nn.Module.__init__(self)  # no weights made: the state dict's are set as they are
                self.in_features = in_features
                self.out_features = out_features
                self.weight = None
                self.bias = None

            def is_ggml_quantized(self, *, weight=None, bias=None):
                weight = self.weight if weight is None else weight
                bias = self.bias if bias is None else bias
                return not torch_compatible(gguf, weight) or not torch_compatible(gguf, bias)

            def _load_from_state_dict(self, state_dict, prefix, local_metadata, strict, missing_keys,
                                      unexpected_keys, error_msgs):  # GGMLLayer: a Linear always loads this way
                for k, v in state_dict.items():
                    if k[len(prefix):] == "weight":
                        self.weight = torch.nn.Parameter(v, requires_grad=False)
                    elif k[len(prefix):] == "bias" and v is not None:
                        self.bias = torch.nn.Parameter(v, requires_grad=False)
                    else:
                        unexpected_keys.append(k)
                if self.weight is None:
                    self.weight = torch.nn.Parameter(torch.zeros(self.in_features, self.out_features),
                                                     requires_grad=False)
                    missing_keys.append(prefix + "weight")

            def get_weight(self, tensor, dtype):
                if tensor is None:
                    return None
                weight = dequantize_tensor(gguf, tensor, dtype, self.dequant_dtype)
                if isinstance(weight, GGMLTensor):
                    weight = torch.Tensor(weight)
                return weight

            def cast_bias_weight(s, input=None, dtype=None, device=None, bias_dtype=None):
                if input is not None:
                    dtype = getattr(input, "dtype", torch.float32) if dtype is None else dtype
                    bias_dtype = dtype if bias_dtype is None else bias_dtype
                    device = input.device if device is None else device
                bias = None
                non_blocking = comfy.model_management.device_supports_non_blocking(device)
                if s.bias is not None:
                    bias = s.get_weight(s.bias.to(device), dtype)
                    bias = comfy.ops.cast_to(bias, bias_dtype, device, non_blocking=non_blocking, copy=False)
                weight = s.get_weight(s.weight.to(device), dtype)
                weight = comfy.ops.cast_to(weight, dtype, device, non_blocking=non_blocking, copy=False)
                return weight, bias

            def forward_comfy_cast_weights(self, input, *args, **kwargs):
                if self.is_ggml_quantized():
                    out = self.forward_ggml_cast_weights(input, *args, **kwargs)
                else:
                    out = super().forward_comfy_cast_weights(input, *args, **kwargs)
                if isinstance(out, GGMLTensor):
                    out = torch.Tensor(out)
                return out

            def forward_ggml_cast_weights(self, input):
                ran.add(self)
                weight, bias = self.cast_bias_weight(input)
                return torch.nn.functional.linear(input, weight, bias)

    class GGUFModelPatcher(comfy.model_patcher.ModelPatcher):
        patch_on_device = False

        def load(self, *args, force_patch_weights=False, **kwargs):
            super().load(*args, force_patch_weights=True, **kwargs)

        def clone(self, *args, **kwargs):
            src_cls = self.__class__
            self.__class__ = GGUFModelPatcher
            n = super().clone(*args, **kwargs)
            n.__class__ = GGUFModelPatcher
            self.__class__ = src_cls
            n.patch_on_device = getattr(self, "patch_on_device", False)
            if src_cls != GGUFModelPatcher:
                n.size = 0
            return n

    return dict(ops=GGMLOps, patcher=GGUFModelPatcher, ran=ran, gguf=gguf)


def q8_0_state_dict(gguf, diffusion_model: torch.nn.Module) -> dict:
    """The state dict loader.py ``gguf_sd_loader`` returns for a Q8_0 file of ``diffusion_model``: every Linear
    weight whose rows hold whole 32-weight blocks quantized by ``gguf.quants.quantize`` (raw blocks, uint8, shape
    [rows, blocks * 34]); the other tensors F32; each a GGMLTensor with its type and shape."""
    q8 = {f"{name}.weight" for name, m in diffusion_model.named_modules()
          if isinstance(m, torch.nn.Linear) and m.weight.shape[-1] % 32 == 0}
    sd = {}
    for key, value in diffusion_model.state_dict().items():
        value = value.detach().float().contiguous()
        if key in q8:
            raw = torch.from_numpy(gguf.quants.quantize(value.numpy(), gguf.GGMLQuantizationType.Q8_0))
            sd[key] = GGMLTensor(raw, tensor_type=gguf.GGMLQuantizationType.Q8_0, tensor_shape=value.shape)
        else:
            sd[key] = GGMLTensor(value.clone(), tensor_type=gguf.GGMLQuantizationType.F32, tensor_shape=value.shape)
    assert len(q8) >= 8, sorted(q8)
    return sd


def load_unet_gguf(comfy, ggml, monkeypatch, float_patcher):
    """nodes.py ``UnetLoaderGGUF.load_unet``: comfy.sd.load_diffusion_model_state_dict(sd,
    model_options={"custom_operations": ops}), then ``GGUFModelPatcher.clone``. ComfyUI's model detection sets the
    released models' head counts (Flux: 24), so it is handed the reduced model's config; the rest of the path
    (dtype, custom_operations, get_model, load_model_weights, the ModelPatcher) is ComfyUI's."""
    import comfy.sd

    config = float_patcher.model.model_config
    detected = type(config)(dict(config.unet_config))
    monkeypatch.setattr(comfy.sd.model_detection, "model_config_from_unet", lambda *args, **kwargs: detected)
    ops = ggml["ops"]()
    ops.Linear.dequant_dtype = None
    ops.Linear.patch_dtype = None
    sd = q8_0_state_dict(ggml["gguf"], float_patcher.model.diffusion_model)
    model = comfy.sd.load_diffusion_model_state_dict(sd, model_options={"custom_operations": ops})
    assert model is not None and detected.custom_operations is ops
    patcher = ggml["patcher"].clone(model)
    patcher.patch_on_device = None
    return patcher


def quantized_linears(ggml, patcher) -> list:
    """The model's GGMLOps Linears holding Q8_0 blocks (asserted there are some)."""
    q8 = ggml["gguf"].GGMLQuantizationType.Q8_0
    found = [m for m in patcher.model.diffusion_model.modules()
             if isinstance(m, ggml["ops"].Linear) and getattr(m.weight, "tensor_type", None) == q8]
    assert len(found) >= 8, len(found)
    return found


FAMILIES = {"flux": flux, "wan": wan}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("family", FAMILIES)
def test_the_gguf_model_runs_its_q8_0_weights(comfy, ggml, monkeypatch, family):
    """The loaded model holds Q8_0 blocks in GGMLOps Linears and runs them: its output is not the float model's,
    and within Q8_0's error of it."""
    float_patcher, latent, cond, _ = FAMILIES[family](comfy)
    patcher = load_unet_gguf(comfy, ggml, monkeypatch, float_patcher)
    assert isinstance(patcher, ggml["patcher"])
    linears = quantized_linears(ggml, patcher)
    assert linears and all(m.weight.dtype == torch.uint8 for m in linears)
    reference = sample(comfy, float_patcher, latent, cond)
    ggml["ran"].clear()
    quantized = sample(comfy, patcher, latent, cond)
    assert set(linears) <= ggml["ran"]
    assert not torch.equal(quantized, reference) and 0 < rel(quantized, reference) < 0.05, rel(quantized, reference)


CASES = [("flux", "kv"), ("wan", "kv"), ("flux", "merge"), ("wan", "merge")]


@pytest.mark.parametrize("family,mode", CASES)
def test_tome_acts_on_the_gguf_model(comfy, ggml, monkeypatch, family, mode):
    """ToMe on the GGUF model: ratio 0 is the quantized model bit for bit; 0.5 changes its output boundedly, the
    attention sees fewer keys (kv) or fewer queries (merge), every quantized Linear still runs its Q8_0 blocks, and
    the clone ToMe returns is still the pack's patcher."""
    float_patcher, latent, cond, _ = FAMILIES[family](comfy)
    patcher = load_unet_gguf(comfy, ggml, monkeypatch, float_patcher)
    linears = quantized_linears(ggml, patcher)
    expected = sample(comfy, patcher, latent, cond)
    off = patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.0, mode=mode))
    assert torch.equal(sample(comfy, off, latent, cond), expected)

    vanilla_base = patcher.clone()
    vanilla = spy_on(vanilla_base)
    sample(comfy, vanilla_base, latent, cond, steps=1)
    base = patcher.clone()
    calls = spy_on(base)
    on = patch_dit_model_patcher(base, ToMeConfig(ratio=0.5, mode=mode))
    assert isinstance(on, ggml["patcher"])
    ggml["ran"].clear()
    sample(comfy, on, latent, cond, steps=1)
    assert set(linears) <= ggml["ran"]
    assert len(calls) == len(vanilla) > 0
    seq = 2 if vanilla[0][3] else 1  # skip_reshape: [B, heads, tokens, dim]
    queries = [(a[0].shape[seq], b[0].shape[seq]) for a, b in zip(vanilla, calls)]
    keys = [(a[1].shape[seq], b[1].shape[seq]) for a, b in zip(vanilla, calls)]
    if mode == "kv":
        assert all(before == after for before, after in queries)
        assert any(after < before for before, after in keys), keys
    else:
        assert any(after < before for before, after in queries), queries

    changed = sample(comfy, patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode=mode)), latent, cond)
    assert torch.isfinite(changed).all() and 0 < rel(changed, expected) < 1.0, rel(changed, expected)
    assert torch.equal(sample(comfy, patcher, latent, cond), expected)  # the loaded MODEL is unchanged
    assert all(getattr(m.weight, "tensor_type", None) is not None for m in linears)  # still quantized


# ComfyUI's load_custom_node imports a custom node folder as a module named after its path (dots as "_x_"), so
# the pack's classes carry that path in their __module__.
NUNCHAKU = "/opt/ComfyUI/custom_nodes/ComfyUI-nunchaku"


def nunchaku_flux(comfy):
    """nodes/models/flux.py ``NunchakuFluxDiTLoader.load_model``: ComfyUI's Flux model with ``diffusion_model`` set to
    wrappers/flux.py's ``ComfyFluxWrapper`` (an nn.Module around nunchaku's NunchakuFluxTransformer2dModel), in a
    plain ModelPatcher."""
    transformer = type("NunchakuFluxTransformer2dModel", (torch.nn.Module,),
                       {"__module__": "nunchaku.models.transformers.transformer_flux"})
    wrapper = type("ComfyFluxWrapper", (torch.nn.Module,), {"__module__": f"{NUNCHAKU}.wrappers.flux"})
    patcher, *_ = flux(comfy)
    patcher.model.diffusion_model = wrapper()
    patcher.model.diffusion_model.model = transformer()
    return patcher


def nunchaku_qwen_image(comfy):
    """models/qwenimage.py ``NunchakuQwenImageTransformer2DModel``: a subclass of ComfyUI's QwenImageTransformer2DModel
    (model_base/qwenimage.py ``NunchakuQwenImage`` builds it), so it would run ComfyUI's attention; its quantized
    layers and fused kernels are nunchaku's."""
    from test_comfy_families import qwen_image

    import comfy.ldm.qwen_image.model

    subclass = type("NunchakuQwenImageTransformer2DModel", (comfy.ldm.qwen_image.model.QwenImageTransformer2DModel,),
                    {"__module__": f"{NUNCHAKU}.models.qwenimage"})
    patcher, *_ = qwen_image(comfy)
    patcher.model.diffusion_model.__class__ = subclass
    return patcher


@pytest.mark.parametrize("make,name", [(nunchaku_flux, "ComfyFluxWrapper"),
                                       (nunchaku_qwen_image, "NunchakuQwenImageTransformer2DModel")])
def test_nunchaku_models_are_refused_before_sampling_naming_the_class(comfy, tome_package, make, name):
    """A class the catalogue does not list (module and name) is refused by the plan, the DiT patch and both nodes,
    naming it; nothing is registered on the model. A subclass of a listed class is not taken for it."""
    patcher = make(comfy)
    module = type(patcher.model.diffusion_model).__module__
    with pytest.raises(TypeError, match=f"\\({name}, {module}.{name}\\): .*not a transformer class of ToMe's catalogue"):
        plan_patch(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    with pytest.raises(TypeError, match=f"{name} is not a DiT .*\\({module}.{name}\\)"):
        patch_dit_model_patcher(patcher, ToMeConfig(ratio=0.5, mode="kv"))
    tome_nodes = _node_classes(tome_package)
    with pytest.raises(TypeError, match=name):
        tome_nodes.ToMe().patch(patcher, ratio=0.5, max_downsample=1)
    with pytest.raises(TypeError, match=name):
        tome_nodes.ToMeAdvanced().patch(patcher, ratio=0.5, max_downsample=1, sx=2, sy=2, use_rand=True, tome_seed=0,
                                        mode="kv", merge_crossattn=False, start_percent=0.0, end_percent=1.0,
                                        min_tokens=0)
    assert not patcher.wrappers.get("apply_model")
    assert not patcher.model_options.get("transformer_options", {}).get("patches_replace")
