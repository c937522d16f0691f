"""Device checks (one-line errors naming the fix), the default dtype a device computes fast, and which SDPA kernel
attention really used."""
from __future__ import annotations

import torch

# aten op each SDPA backend dispatches to (torch 2.x), as seen by torch.profiler
SDPA_KERNELS = {
    "aten::_scaled_dot_product_flash_attention": "flash",
    "aten::_scaled_dot_product_flash_attention_for_cpu": "flash-cpu",
    "aten::_scaled_dot_product_efficient_attention": "mem-efficient",
    "aten::_scaled_dot_product_cudnn_attention": "cudnn",
    "aten::_scaled_dot_product_attention_math": "math",
    "aten::_scaled_dot_product_attention_math_for_mps": "math-mps",
    "aten::_scaled_dot_product_fused_attention_overrideable": "fused-other",
}
NO_SDPA = "no SDPA (bmm+softmax)"


def check_device(device: str, dtype: str) -> str | None:
    """None when ``device`` exists and supports ``dtype``, else a one-line message with the fix."""
    try:
        dev = torch.device(device)
    except (RuntimeError, ValueError):
        return (f"unknown device {device!r}: use --device cpu, --device cuda or --device cuda:N")
    if dev.type not in ("cpu", "cuda"):
        return f"device {device!r} is not supported by the benchmark: use --device cpu or cuda[:N]"
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            why = ("this torch was built without CUDA (install a CUDA build of torch, "
                   "see pytorch.org)" if torch.version.cuda is None else "no CUDA GPU is visible")
            return f"--device {device}: {why}; or run on --device cpu"
        count = torch.cuda.device_count()
        if dev.index is not None and dev.index >= count:
            return (f"--device {device}: only {count} CUDA device(s) here "
                    f"(cuda:0..cuda:{count - 1})")
        if dtype == "bf16" and not torch.cuda.is_bf16_supported():
            return f"--dtype bf16: this GPU has no bf16 support; use --dtype fp16"
    elif dtype == "fp16":
        return "--dtype fp16 is for CUDA only (slow, partly unsupported on CPU): use --dtype bf16 or fp32"
    return None


def cpu_bf16_native() -> tuple[bool, str]:
    """Whether this CPU computes bf16 natively (AVX512-BF16 or AMX, and torch's oneDNN allowed to use them), and why.

    Without it torch runs a bf16 convolution through its slow reference kernel (``slow_conv2d_forward_cpu``): on an
    AVX2-only AMD EPYC one SD1.5 conv took 32 s in bf16 against 128 ms in fp32. Read from torch: the CPU's own flags
    (``torch.cpu._is_avx512_bf16_supported``, ``_is_amx_tile_supported``) and oneDNN's bf16 support, which honours
    ``ONEDNN_MAX_CPU_ISA`` (``torch.ops.mkldnn._is_mkldnn_bf16_supported``)."""
    cpu = getattr(torch, "cpu", None)
    flags = [name for name, test in (("AVX512-BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported"))
             if callable(getattr(cpu, test, None)) and getattr(cpu, test)()]
    slow = "bf16 convolutions run hundreds of times slower than fp32"
    if not flags:
        return False, f"this CPU has no native bf16 (no AVX512-BF16 or AMX): {slow}"
    try:
        onednn = bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):
        onednn = torch.backends.mkldnn.is_available()
    if not onednn:
        return False, (f"this CPU has {' and '.join(flags)}, but torch's oneDNN may not use them here "
                       f"(ONEDNN_MAX_CPU_ISA, or a torch without oneDNN): {slow}")
    return True, f"this CPU computes bf16 natively ({' and '.join(flags)})"


def default_dtype(device: str, gpu_suite: bool = False) -> tuple[str, str]:
    """The benchmark's dtype when --dtype is not given, and why: CUDA fp16 for the GPU suite (tomesd's and the hosts'
    setting) else bf16 where the GPU has it; the CPU bf16 only where it computes it natively (:func:`cpu_bf16_native`),
    else fp32."""
    if torch.device(device).type == "cuda":
        if gpu_suite:
            return "fp16", "the GPU suite's dtype (what SD users run)"
        if torch.cuda.is_available() and not torch.cuda.is_bf16_supported():
            return "fp16", "this GPU has no bf16"
        return "bf16", "the GPU's bf16"
    native, why = cpu_bf16_native()
    return ("bf16" if native else "fp32"), why


def kernels_used(event_names) -> str:
    """The SDPA kernels among profiler event names, e.g. 'flash' or 'flash+math'; NO_SDPA if none."""
    found = sorted({SDPA_KERNELS[n] for n in event_names if n in SDPA_KERNELS})
    return "+".join(found) if found else NO_SDPA
