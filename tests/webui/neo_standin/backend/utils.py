"""Stand-in of Neo's ``backend/utils.py`` (de2193d9): attribute paths (117-167), ``fp16_fix`` (207-213),
``pad_to_patch_size`` (300-309), ``process_img`` (312-329), ``join_dicts`` (332-346) and ``deepcopy_`` (349-365).
"""
import torch

ATTR_UNSET = {}  # utils.py:117: the marker set_attr_raw returns for an attribute that was not set


def resolve_attr(obj, attr):
    """Mirrors utils.py:120-124 resolve_attr: the owner of a dotted path and the last name."""
    attrs = attr.split(".")
    for name in attrs[:-1]:
        obj = getattr(obj, name)
    return obj, attrs[-1]


def set_attr_raw(obj, attr, value):
    """Mirrors utils.py:127-134 set_attr_raw: set (or delete, for ATTR_UNSET) and return the previous value."""
    obj, name = resolve_attr(obj, attr)
    prev = getattr(obj, name, ATTR_UNSET)
    if value is ATTR_UNSET:
        delattr(obj, name)
    else:
        setattr(obj, name, value)
    return prev


def set_attr(obj, attr, value):
    """Mirrors utils.py:137-142 set_attr: set_attr_raw of a frozen Parameter."""
    return set_attr_raw(obj, attr, torch.nn.Parameter(value, requires_grad=False))


def get_attr(obj, attr):
    """Mirrors utils.py:153-157 get_attr: follow a dotted path."""
    for name in attr.split("."):
        obj = getattr(obj, name)
    return obj


def get_attr_with_parent(obj, attr):
    """Mirrors utils.py:160-167 get_attr_with_parent."""
    parent, name = obj, None
    for name in attr.split("."):
        parent = obj
        obj = getattr(obj, name)
    return parent, name, obj


def fp16_fix(x):
    """Mirrors utils.py:207-213 fp16_fix: clamp fp16 overflow (a no-op for float32)."""
    if x.dtype == torch.float16:
        return torch.nan_to_num(x, nan=0.0, posinf=65504, neginf=-65504)
    return x


def pad_to_patch_size(img, patch_size=(2, 2), padding_mode="circular"):
    """Mirrors utils.py:300-309 pad_to_patch_size (circular padding of the trailing axes)."""
    pad = ()
    for i in range(img.ndim - 2):
        pad = (0, (patch_size[i] - img.shape[i + 2] % patch_size[i]) % patch_size[i]) + pad
    return torch.nn.functional.pad(img, pad, mode=padding_mode)


def process_img(x, index=0, h_offset=0, w_offset=0):
    """Mirrors utils.py:312-329 process_img: [B, C, H, W] to 2x2 patch tokens and their (index, h, w) ids."""
    bs, c, h, w = x.shape
    x = pad_to_patch_size(x, (2, 2))
    h_len, w_len = (h + 1) // 2, (w + 1) // 2
    img = x.reshape(bs, c, h_len, 2, w_len, 2).permute(0, 2, 4, 1, 3, 5).reshape(bs, h_len * w_len, c * 4)
    h_offset, w_offset = (h_offset + 1) // 2, (w_offset + 1) // 2
    ids = torch.zeros((h_len, w_len, 3), device=x.device, dtype=x.dtype)
    ids[:, :, 0] = index
    rows = torch.linspace(h_offset, h_len - 1 + h_offset, steps=h_len, device=x.device, dtype=x.dtype)
    cols = torch.linspace(w_offset, w_len - 1 + w_offset, steps=w_len, device=x.device, dtype=x.dtype)
    ids[:, :, 1] += rows.unsqueeze(1)
    ids[:, :, 2] += cols.unsqueeze(0)
    return img, ids.reshape(1, h_len * w_len, 3).repeat(bs, 1, 1)


def join_dicts(base_dict, update_dict):
    """Mirrors utils.py:332-346 join_dicts: a SHALLOW copy of base_dict when there is nothing to join."""
    if not update_dict:
        return (base_dict or {}).copy()
    result = (base_dict or {}).copy()
    for key, value in update_dict.items():
        if key in result and isinstance(result[key], dict) and isinstance(value, dict):
            result[key] = join_dicts(result[key], value)
        elif key in result and isinstance(result[key], list) and isinstance(value, list):
            result[key] = result[key] + value
        else:
            result[key] = value
    return result


def deepcopy_(obj, memo=None):
    """Mirrors utils.py:349-365 deepcopy_: dicts and lists copied recursively, every other object shared."""
    if memo is None:
        memo = {}
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, dict):
        res = {deepcopy_(k, memo): deepcopy_(v, memo) for k, v in obj.items()}
    elif isinstance(obj, list):
        res = [deepcopy_(i, memo) for i in obj]
    else:
        res = obj
    memo[id(obj)] = res
    return res
