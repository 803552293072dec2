"""The device block kernels' wiring (packed documents at CP 1, dropout drawn per call),
against CPU emulations: PyTorch's CUDA flash ops and torch_npu's npu_fusion_attention. No GPU
or NPU exists here, so this checks what npuspeed hands the ops (no cumulative lengths for
dense CUDA calls, dropout p / keep_prob, each call's random state given back to its own
backward), not the kernels (the device tier runs the CUDA ones).

The emulated forward draws a keep mask from a generator seeded by a fresh per-call seed and
returns that seed, as the real op returns its Philox seed/offset; the emulated backward
rebuilds the mask from the seed it is given, so a seed handed to the wrong call's backward
gives wrong gradients.
"""
from __future__ import annotations

import itertools

import pytest
import torch

from npuspeed.features.attention.blocks import Block, CallSpec, tiled_backward, tiled_forward
from npuspeed.features.attention.kernels_device import CudaAten

_SEEDS = itertools.count(100)


def _attend(q, k, v, p, causal, scale, seed):
    """[b, h, s, d] math attention with a keep mask drawn from `seed`; returns out, lse."""
    s = (q.float() @ k.float().transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(torch.ones(s.shape[-2:], dtype=torch.bool).triu(1), float("-inf"))
    lse = torch.logsumexp(s, dim=-1)
    probs = torch.exp(s - lse[..., None])
    if p > 0:
        keep = torch.rand(probs.shape, generator=torch.Generator().manual_seed(int(seed))) >= p
        probs = probs * keep / (1 - p)
    return (probs @ v.float()).to(q.dtype), lse


def _fake_forward(q, k, v, dropout_p, causal, debug, scale=None):
    seed = torch.tensor(next(_SEEDS))
    out, lse = _attend(q, k, v, dropout_p, causal, scale, seed)
    return out, lse, None, None, q.shape[2], k.shape[2], seed, torch.tensor(0), None


def _fake_backward(do, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, dropout_p, causal, seed, offset, scale=None):
    assert cum_q is None and cum_k is None, "a dense call must not pass cumulative lengths (varlen)"
    qq, kk, vv = (t.detach().float().requires_grad_() for t in (q, k, v))
    o, _ = _attend(qq, kk, vv, dropout_p, causal, scale, seed)
    return torch.autograd.grad(o, (qq, kk, vv), do.float())


@pytest.fixture
def fake_flash(monkeypatch):
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention", _fake_forward, raising=False)
    monkeypatch.setattr(torch.ops.aten, "_scaled_dot_product_flash_attention_backward", _fake_backward,
                        raising=False)


def test_documents_with_dropout_give_each_tile_its_own_draw_back(fake_flash):
    """Two rows of packed documents, dropout 0.3: tile-by-tile forward/backward through the
    kernel equals autograd through the same per-tile draws, tile by tile."""
    gen = torch.Generator().manual_seed(0)
    s, b, hq, hk, d = 8, 2, 4, 2, 8
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (hq, hk, hk))
    tiles = [[(0, 3, 0, 3), (3, 8, 3, 8)], [(0, 5, 0, 5), (5, 8, 5, 8)]]
    block = Block(0, 0, True, tiles=tiles)
    spec = CallSpec(scale=d ** -0.5, dropout_p=0.3)
    kernel = CudaAten(torch.bfloat16)
    first = next(_SEEDS) + 1
    out, lse = tiled_forward(kernel, q, k, v, block, spec)
    dout = torch.randn(out.shape, generator=gen)
    dq, dk, dv = tiled_backward(kernel, dout, q, k, v, out, lse, block, spec)
    assert all(not queue for queue in kernel._philox.values()), "every forward draw was given back"

    seeds = itertools.count(first)
    ref = [torch.zeros_like(t) for t in (q, k, v)]
    for row, pieces in enumerate(tiles):
        for qa, qb, ka, kb in pieces:
            leaves = [t[a:z, row:row + 1].permute(1, 2, 0, 3).detach().requires_grad_()
                      for t, a, z in ((q, qa, qb), (k, ka, kb), (v, ka, kb))]
            qq, kk, vv = leaves[0], *(x.repeat_interleave(hq // hk, dim=1) for x in leaves[1:])
            o, _ = _attend(qq, kk, vv, 0.3, True, spec.scale, next(seeds))
            assert torch.allclose(o.permute(2, 0, 1, 3), out[qa:qb, row:row + 1], atol=1e-5)
            grads = torch.autograd.grad(o, leaves, dout[qa:qb, row:row + 1].permute(1, 2, 0, 3))
            for acc, g, (a, z) in zip(ref, grads, ((qa, qb), (ka, kb), (ka, kb))):
                acc[a:z, row:row + 1] += g.permute(2, 0, 1, 3)
    for got, want in zip((dq, dk, dv), ref):
        assert torch.allclose(got, want, atol=1e-5)


def test_fp32_blocks_refused_under_deterministic_mode():
    torch.use_deterministic_algorithms(True)
    try:
        with pytest.raises(Exception, match="--deterministic-mode: fp32 attention blocks on CUDA"):
            CudaAten(torch.float32)
        assert CudaAten(torch.bfloat16).name == "aten_flash_cuda"
    finally:
        torch.use_deterministic_algorithms(False)


class _SeedCheckingNpu:
    """npu_fusion_attention(_grad) through the contract emulator, with each forward call's
    dropout state (seed, offset, numels) made unique and checked in the grad op: the grad of
    a call must get back exactly that call's state (same query rows, same keep_prob)."""

    def __init__(self):
        from npu_contract import emulate_attention as emu

        self.emu, self.issued, self.returned = emu, {}, []

    def npu_fusion_attention(self, query, *args, keep_prob=1.0, **kwargs):
        res = list(self.emu.npu_fusion_attention(query, *args, keep_prob=1.0, **kwargs))  # masks: not emulated
        seed = next(_SEEDS)
        self.issued[seed] = (query.detach().clone(), keep_prob)
        return (*res[:4], seed, 7, query.numel())

    def npu_fusion_attention_grad(self, query, *args, keep_prob=1.0, seed=0, offset=0, numels=0, **kwargs):
        rows, keep = self.issued[seed]
        assert torch.equal(rows, query) and keep == keep_prob and offset == 7 and numels == query.numel()
        self.returned.append(seed)
        return self.emu.npu_fusion_attention_grad(query, *args, keep_prob=1.0, **kwargs)


@pytest.mark.parametrize("documents", [False, True], ids=["dense", "documents-varlen"])
def test_npu_block_gives_each_call_its_dropout_state_back(documents):
    from npuspeed.features.attention.kernels_device import NpuFusion

    gen = torch.Generator().manual_seed(1)
    s, b, hq, hk, d = 8, 2, 4, 2, 8
    q, k, v = (torch.randn(s, b, h, d, generator=gen) for h in (hq, hk, hk))
    tiles = [[(0, 3, 0, 3), (3, 8, 3, 8)], [(0, 5, 0, 5), (5, 8, 5, 8)]] if documents else None
    block, spec = Block(0, 0, True, tiles=tiles), CallSpec(scale=d ** -0.5, dropout_p=0.3)
    fake = _SeedCheckingNpu()
    kernel = NpuFusion(fake)
    for _ in range(2):  # two calls at the same place: first in, first out
        out, lse = tiled_forward(kernel, q, k, v, block, spec)
    for _ in range(2):
        tiled_backward(kernel, torch.randn(out.shape, generator=gen), q, k, v, out, lse, block, spec)
    assert sorted(fake.returned) == sorted(fake.issued) and len(fake.issued) >= 2
    assert all(not queue for queue in kernel._rng.values())
