"""Reading a DiT call never looks at a tensor's values through Python formatting.

Z-Image passes its latents and captions as lists of tensors. The call memo once keyed such arguments by their
``repr``: on a GPU that formats every tensor (copies to the host, syncs), and it cost Z-Image 3x per model call
on an H200 (vanilla 9.3 ms, either mode 27 ms). A dispatch-mode op count cannot see it (tensor formatting
disables the current dispatch modes), so these tests watch torch's tensor formatter itself."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("diffusers")

import torch._tensor_str  # noqa: E402

from tome_core import apply_patch, remove_patch  # noqa: E402
from tome_core.adapters.hooks.call_memo import CallMemo  # noqa: E402
from tome_core.catalogue.diffusers_lookup import family_of  # noqa: E402
from test_dit_families import FAMILIES, run  # noqa: E402


@pytest.fixture
def formatted(monkeypatch):
    """The number of tensors torch formats as text while the test runs."""
    calls = []
    real = torch._tensor_str._str

    def counting(self, *args, **kwargs):
        calls.append(tuple(self.shape))
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch._tensor_str, "_str", counting)
    return calls


def _modes(family: str) -> list:
    model = FAMILIES[family]()[0]
    return ["kv"] + (["merge"] if family_of(model).merge is not None else [])


@pytest.mark.parametrize("family,mode", [(f, m) for f in FAMILIES for m in _modes(f)])
def test_a_patched_call_formats_no_tensor(family, mode, formatted):
    model, inputs, _ = FAMILIES[family]()
    apply_patch(model, ratio=0.5, mode=mode)
    try:
        run(model, inputs)
        run(model, inputs)  # the second call reads the memo
    finally:
        remove_patch(model)
    assert formatted == [], f"{family} {mode}: tensors formatted during a patched call: {formatted[:3]}"


def test_the_memo_keys_lists_by_their_tensors_without_formatting_them(formatted):
    reads = []
    memo = CallMemo()
    latents = [torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)]
    captions = [torch.randn(5, 16), torch.randn(7, 16)]

    def read(args):
        return memo.read(args, {}, (0, 1), lambda: reads.append(1) or len(reads))  # latents, step: by shape

    assert read((latents, torch.tensor([0.5]), captions)) == 1
    # new latents of the same shapes (the next step), the same captions: remembered
    assert read(([torch.randn(4, 1, 8, 8), torch.randn(4, 1, 8, 8)], torch.tensor([0.4]), list(captions))) == 1
    # a caption changed in place, another size, another caption: read again
    captions[0].add_(1)
    assert read((latents, torch.tensor([0.4]), captions)) == 2
    assert read(([torch.randn(4, 1, 8, 6)] * 2, torch.tensor([0.4]), captions)) == 3
    assert read((latents, torch.tensor([0.4]), [captions[0], torch.randn(7, 16)])) == 4
    assert formatted == []
