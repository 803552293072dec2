"""The NPU path of --use-flash-attn, against an EMULATOR of npu_fusion_attention.

No NPU exists here. `npu_contract.emulate_attention` is a plain-PyTorch function with the
op's documented signature, layouts, mask polarity and sparse modes; it is first checked
against a naive attention for every layout and mode, then stands in for `torch_npu` on an
accelerator whose name is 'npu', so the patched Megatron layer must marshal its arguments
(SBH layout, head_num, scale, keep_prob, mask polarity, compressed causal mask) correctly
to match Megatron's own unfused DotProductAttention.
"""
from __future__ import annotations

import contextlib
import math
import types

import pytest
import torch

from npu_contract.emulate_attention import npu_fusion_attention as emulator
from npu_contract.layouts import to_layout
from npu_contract.emulate_attention import npu_fusion_attention_grad as emulator_grad
from test_fused_attention import band_mask, make_attention, make_inputs, make_windowed, run


def naive(q, k, v, scale, allowed):
    """q [b, n, sq, d], k/v [b, n2, sk, d], allowed [.., sq, sk] (True = attend)."""
    k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~allowed, float("-inf"))
    return torch.softmax(scores, dim=-1) @ v


COMPRESSED = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


@pytest.mark.parametrize("layout", ["SBH", "BSH", "BSND", "BNSD"])
def test_emulator_layouts_gqa_and_polarity(layout):
    gen = torch.Generator().manual_seed(0)
    b, n, n2, sq, d = 2, 4, 2, 9, 8
    q, k, v = (torch.randn(b, h, sq, d, generator=gen) for h in (n, n2, n2))
    mask = torch.rand(b, 1, sq, sq, generator=gen) < 0.3
    mask[..., 0] = False  # no fully masked row
    out = emulator(to_layout(q, layout), to_layout(k, layout), to_layout(v, layout), n, layout,
                   atten_mask=mask, scale=0.3)
    assert len(out) == 7 and out[0].shape == to_layout(q, layout).shape
    assert out[1].shape == (b, n, sq, 8) and out[1].dtype == torch.float32
    ref = naive(q, k, v, 0.3, ~mask)  # True in atten_mask = masked out
    torch.testing.assert_close(out[0], to_layout(ref, layout))


@pytest.mark.parametrize("sq, sk", [(7, 7), (5, 9)])
def test_emulator_sparse_modes(sq, sk):
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(1, 2, sq, 8, generator=gen)
    k, v = (torch.randn(1, 2, sk, 8, generator=gen) for _ in range(2))
    i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
    call = lambda **kw: emulator(q, k, v, 2, "BNSD", scale=0.5, **kw)[0]  # noqa: E731
    cases = {
        2: (dict(atten_mask=COMPRESSED, sparse_mode=2), j <= i),
        3: (dict(atten_mask=COMPRESSED, sparse_mode=3), j <= i + (sk - sq)),
        4: (dict(atten_mask=COMPRESSED, sparse_mode=4, pre_tockens=2, next_tockens=1),
            ((j - i - (sk - sq)) >= -2) & ((j - i - (sk - sq)) <= 1)),
        0: (dict(atten_mask=torch.zeros(sq, sk, dtype=torch.bool), sparse_mode=0, pre_tockens=1, next_tockens=2),
            ((j - i) >= -1) & ((j - i) <= 2)),
    }
    for mode, (kwargs, allowed) in cases.items():
        torch.testing.assert_close(call(**kwargs), naive(q, k, v, 0.5, allowed), msg=f"sparse_mode {mode}")
    torch.testing.assert_close(call(), naive(q, k, v, 0.5, torch.ones(sq, sk, dtype=torch.bool)))
    with pytest.raises(ValueError, match="compressed"):
        call(atten_mask=torch.ones(sq, sk, dtype=torch.bool).triu(1), sparse_mode=2)


TND_Q, TND_K = [3, 0, 5, 4], [3, 2, 7, 4]  # per-sequence lengths; one empty query sequence


def _tnd_inputs(gen, n=4, n2=2, d=8, requires_grad=False):
    q = torch.randn(sum(TND_Q), n, d, generator=gen, requires_grad=requires_grad)
    k, v = (torch.randn(sum(TND_K), n2, d, generator=gen, requires_grad=requires_grad) for _ in range(2))
    cu = lambda lengths: torch.tensor(lengths).cumsum(0).tolist()  # noqa: E731
    return q, k, v, cu(TND_Q), cu(TND_K)


def _tnd_naive(q, k, v, scale, causal):
    """Per sequence, naive BNSD attention (rightDownCausal when causal); out [T, N, D], lse [T, N]."""
    outs, lses, qa, ka = [], [], 0, 0
    for sq, sk in zip(TND_Q, TND_K):
        qi, ki, vi = (x.permute(1, 0, 2)[None] for x in (q[qa:qa + sq], k[ka:ka + sk], v[ka:ka + sk]))
        i, j = torch.arange(sq)[:, None], torch.arange(sk)[None, :]
        allowed = (j <= i + sk - sq) if causal else torch.ones(sq, sk, dtype=torch.bool)
        outs.append(naive(qi, ki, vi, scale, allowed)[0].permute(1, 0, 2))
        kk = ki.repeat_interleave(q.shape[1] // k.shape[1], 1)
        lses.append(((qi @ kk.transpose(-1, -2)) * scale).masked_fill(~allowed, float("-inf"))
                    .logsumexp(-1)[0].t())
        qa, ka = qa + sq, ka + sk
    return torch.cat(outs), torch.cat(lses)


@pytest.mark.parametrize("causal", [False, True], ids=["full", "sparse3"])
@pytest.mark.parametrize("softmax_layout", ["", "TND"], ids=["default-stats", "tnd-stats"])
def test_emulator_tnd_varlen(causal, softmax_layout):
    """TND: each sequence attends to its own keys only; GQA; stats in the documented storage."""
    gen = torch.Generator().manual_seed(2)
    q, k, v, cu_q, cu_k = _tnd_inputs(gen)
    mask = dict(atten_mask=COMPRESSED, sparse_mode=3) if causal else {}
    out = emulator(q, k, v, 4, "TND", scale=0.4, actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k,
                   softmax_layout=softmax_layout, **mask)
    ref, lse = _tnd_naive(q, k, v, 0.4, causal)
    torch.testing.assert_close(out[0], ref)
    assert out[1].shape == (sum(TND_Q), 4, 8) and out[2].shape == out[1].shape
    stats = out[1][..., 0] + out[2][..., 0].log()
    if softmax_layout == "":  # storage: each sequence's [N, Sq_i] in turn
        flat, qa, parts = stats.reshape(-1), 0, []
        for sq in TND_Q:
            parts.append(flat[qa * 4:(qa + sq) * 4].view(4, sq).t())
            qa += sq
        stats = torch.cat(parts)
    torch.testing.assert_close(stats, lse)


@pytest.mark.parametrize("softmax_layout", ["", "TND"])
def test_emulator_tnd_grad(softmax_layout):
    """The TND gradient op, given the forward's max / sum, equals autograd of the naive reference."""
    gen = torch.Generator().manual_seed(4)
    q, k, v, cu_q, cu_k = _tnd_inputs(gen, requires_grad=True)
    kw = dict(atten_mask=COMPRESSED, sparse_mode=3, actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k,
              softmax_layout=softmax_layout)
    out, smax, ssum = emulator(q.detach(), k.detach(), v.detach(), 4, "TND", scale=0.4, **kw)[:3]
    dy = torch.randn(out.shape, generator=gen)
    grads = emulator_grad(q.detach(), k.detach(), v.detach(), dy, 4, "TND", softmax_max=smax, softmax_sum=ssum,
                          attention_in=out, scale_value=0.4, **kw)
    _tnd_naive(q, k, v, 0.4, causal=True)[0].backward(dy)
    for got, want in zip(grads[:3], (q.grad, k.grad, v.grad)):
        torch.testing.assert_close(got, want)


def test_emulator_tnd_contract_errors():
    gen = torch.Generator().manual_seed(0)
    q, k, v, cu_q, cu_k = _tnd_inputs(gen)
    with pytest.raises(ValueError, match="needs actual_seq_qlen"):
        emulator(q, k, v, 4, "TND")
    with pytest.raises(ValueError, match="ends at"):
        emulator(q, k, v, 4, "TND", actual_seq_qlen=cu_q[:-1] + [cu_q[-1] - 1], actual_seq_kvlen=cu_k)
    with pytest.raises(TypeError, match="host list"):
        emulator(q, k, v, 4, "TND", actual_seq_qlen=torch.tensor(cu_q), actual_seq_kvlen=cu_k)
    with pytest.raises(ValueError, match="for input_layout TND"):
        emulator(q[None], k[None], v[None], 4, "BSND", actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k)


class _FakeNpu:
    """A CPU accelerator that says it is an NPU and carries the contract tier's torch_npu 2.14.0
    (the wheel's schemas and meta functions, the emulator as kernel, backward through
    npu_fusion_attention_grad as torch_npu's autograd does)."""

    name = "npu"

    def __init__(self, cpu_accelerator):
        from npu_contract import standin

        self._cpu = cpu_accelerator
        self.calls, self.grad_calls = [], []  # npuspeed's own calls (autograd's grad calls not)
        contract = standin.module("2.14.0")

        def record(*args, **kwargs):
            self.calls.append((args, kwargs))
            return contract.npu_fusion_attention(*args, **kwargs)

        def record_grad(*args, **kwargs):
            self.grad_calls.append((args, kwargs))
            return contract.npu_fusion_attention_grad(*args, **kwargs)

        self.torch_npu = types.SimpleNamespace(npu_fusion_attention=record, npu_fusion_attention_grad=record_grad)

    def has_fused_attention(self):
        return hasattr(self.torch_npu, "npu_fusion_attention")

    def __getattr__(self, item):
        return getattr(self._cpu, item)


@contextlib.contextmanager
def npu_patched(cpu_accelerator, argv=("--use-flash-attn",)):
    from feature_ctx import ctx_for

    from npuspeed.features.fused_attention import FusedAttentionFeature
    from npuspeed.patching import registry

    fake = _FakeNpu(cpu_accelerator)
    feature = FusedAttentionFeature()
    ctx = ctx_for(list(argv), fake)
    feature.validate(ctx)
    feature.register_patches(registry, ctx)
    registry.apply()
    try:
        yield fake
    finally:
        registry.remove(feature.name)


def _parity(module, inputs, mask, fake_ctx, fused_mask="same"):
    from npuspeed.features.fused_attention import kernel_calls

    ref = run(module, *inputs, mask)
    with fake_ctx as fake:
        before = kernel_calls().get("npu_fusion_attention", 0)
        got = run(module, *inputs, mask if fused_mask == "same" else fused_mask)
        assert kernel_calls().get("npu_fusion_attention", 0) == before + 1
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got):
        err = (a - b).abs().max().item()
        assert err <= 1e-5, f"{name}: {err}"
    assert len(fake.calls) == 1
    return fake.calls[0]


@pytest.mark.parametrize("groups", [1, 2, 4])
def test_npu_path_causal_marshalling(megatron_mp, groups):
    s, b, h, d = 19, 2, 4, 16
    module = make_attention(heads=h, groups=groups, layer_number=2, apply_query_key_layer_scaling=True)
    args, kwargs = _parity(module, make_inputs(s, b, h, groups, d, torch.float32), None,
                           npu_patched(megatron_mp.accelerator))
    q, k, v, head_num, layout = args
    assert layout == "SBH" and head_num == h
    assert q.shape == (s, b, h * d) and k.shape == (s, b, groups * d) and v.shape == k.shape
    assert kwargs["sparse_mode"] == 2 and torch.equal(kwargs["atten_mask"], COMPRESSED)
    assert kwargs["scale"] == pytest.approx(1 / math.sqrt(d)) and kwargs["keep_prob"] == 1.0


def test_npu_path_padding_mask_marshalling(megatron_mp):
    s, b = 13, 3
    module = make_attention(heads=4, groups=2, mask_type="padding")
    pad = torch.arange(s)[None, :] >= torch.tensor([13, 9, 4])[:, None]
    mask = pad[:, None, None, :]
    _, kwargs = _parity(module, make_inputs(s, b, 4, 2, 16, torch.float32), mask,
                        npu_patched(megatron_mp.accelerator))
    assert kwargs["sparse_mode"] == 0 and kwargs["atten_mask"].shape == (b, 1, s, s)
    assert torch.equal(kwargs["atten_mask"], mask.expand(b, 1, s, s))  # same polarity: True = masked


def test_npu_path_fully_masked_rows(megatron_mp):
    s = 11
    module = make_attention(heads=2, mask_type="padding")
    pad = torch.arange(s)[None, :] >= torch.tensor([11, 6])[:, None]
    mask = pad[:, None, :, None] | pad[:, None, None, :]
    _parity(module, make_inputs(s, 2, 2, 2, 16, torch.float32), mask, npu_patched(megatron_mp.accelerator))


def test_npu_path_band_uses_sparse_mode_4(megatron_mp):
    """--pre-tockens 4 on a causal layer: Megatron given the band mask == sparse_mode 4."""
    s = 17
    argv = ("--use-flash-attn", "--pre-tockens", "4", "--next-tockens", "0")
    _, kwargs = _parity(make_attention(), make_inputs(s, 1, 4, 4, 16, torch.float32), band_mask(s, 4, 0),
                        npu_patched(megatron_mp.accelerator, argv), fused_mask=None)
    assert kwargs["sparse_mode"] == 4 and (kwargs["pre_tockens"], kwargs["next_tockens"]) == (4, 0)
    assert torch.equal(kwargs["atten_mask"], COMPRESSED)


def test_npu_path_window_size(megatron_mp):
    _, kwargs = _parity(make_windowed((3, 0)), make_inputs(15, 1, 4, 4, 16, torch.float32), None,
                        npu_patched(megatron_mp.accelerator))
    assert kwargs["sparse_mode"] == 4 and (kwargs["pre_tockens"], kwargs["next_tockens"]) == (3, 0)


def test_npu_forced_sparse_mode_0_full_causal_mask(megatron_mp):
    s = 15
    _, kwargs = _parity(make_attention(), make_inputs(s, 1, 4, 4, 16, torch.float32), None,
                        npu_patched(megatron_mp.accelerator, ("--use-flash-attn", "--sparse-mode", "0")))
    assert kwargs["sparse_mode"] == 0 and kwargs["next_tockens"] == 0
    assert torch.equal(kwargs["atten_mask"], torch.ones(s, s, dtype=torch.bool).triu(1)[None, None])


def test_npu_forced_sparse_mode_that_cannot_fit_is_an_error(megatron_mp):
    from npuspeed.features import FeatureError

    module = make_attention(mask_type="padding")
    q, k, v, _ = make_inputs(8, 1, 4, 4, 16, torch.float32)
    mask = torch.zeros(1, 1, 1, 8, dtype=torch.bool)
    with npu_patched(megatron_mp.accelerator, ("--use-flash-attn", "--sparse-mode", "2")):
        with pytest.raises(FeatureError, match="--sparse-mode 2"):
            module(q, k, v, mask)


def test_npu_dropout_keep_prob_inside_tracker(megatron_mp):
    from megatron.core import tensor_parallel

    acc = megatron_mp.accelerator
    module = make_attention(dropout=0.25)
    module.train()
    q, k, v, _ = make_inputs(8, 1, 4, 4, 16, torch.float32)
    with npu_patched(acc) as fake, acc.device_rng_scope():
        tensor_parallel.model_parallel_cuda_manual_seed(11)
        default_before = acc.get_rng_state().clone()
        first = module(q, k, v, None)
        assert torch.equal(acc.get_rng_state(), default_before)
        tensor_parallel.model_parallel_cuda_manual_seed(11)
        again = module(q, k, v, None)
    assert fake.calls[0][1]["keep_prob"] == pytest.approx(0.75)
    assert torch.equal(first, again)


def test_npu_report_path():
    from feature_ctx import ctx_for

    from npuspeed.features.fused_attention import FusedAttentionFeature

    fake = _FakeNpu(None)
    text = FusedAttentionFeature().path(ctx_for(["--use-flash-attn"], fake))
    assert text.startswith("torch_npu.npu_fusion_attention") and "SBH" in text
