"""The swap features' stream/event/record_stream protocol on the NPU accelerator over each
release's stand-in `torch.npu`: streams and events have only the wheel's methods and
constructor keywords, so a call torch_npu does not offer fails here."""
from __future__ import annotations

import pytest
import torch

from npu_contract import on_host, standin, wheel


@pytest.mark.parametrize("release", wheel.RELEASES)
def test_swap_optimizer_on_the_npu_face(release, monkeypatch):
    from npuspeed.features.swap_optimizer.swapper import OptimizerSwap

    acc = on_host.npu_accelerator(release, monkeypatch)
    torch.manual_seed(0)
    shapes = [(64, 32), (32,), (128, 16), (48, 48)]
    plain = [torch.nn.Parameter(torch.randn(s)) for s in shapes]
    swapped = [torch.nn.Parameter(p.detach().clone()) for p in plain]
    ref = torch.optim.AdamW(plain, lr=1e-2)
    inner = torch.optim.AdamW(swapped, lr=1e-2)
    swap = OptimizerSwap(acc, inner, masters=[], chunk_bytes=16 * 1024)
    for i in range(2):
        for a, b in zip(plain, swapped):
            a.grad = torch.randn(a.shape, generator=torch.Generator().manual_seed(i))
            b.grad = a.grad.clone()
        ref.step()
        swap.in_step = True
        swap.step()
        swap.in_step = False
        assert all(torch.equal(a, b) for a, b in zip(plain, swapped))
    assert swap.chunk_count >= 2
    assert acc.recorded_streams and all(n > 0 for _, n in acc.recorded_streams)
