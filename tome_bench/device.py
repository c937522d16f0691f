"""Device checks (one-line errors naming the fix) and which SDPA kernel attention really used."""
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


def kernels_used(event_names) -> str:
    """The SDPA kernels among profiler event names, e.g. 'flash' or 'flash+math'; NO_SDPA if none."""
    found = sorted({SDPA_KERNELS[n] for n in event_names if n in SDPA_KERNELS})
    return "+".join(found) if found else NO_SDPA
