"""The npu_fusion_attention EMULATOR against torch_npu's stated contract (issue 33): the
newest schema's arguments and defaults, the release each argument first appears in (read from
the cached wheels when present), dropout whose gradient rebuilds the forward's mask from
(seed, offset), TND trailing batches, the 2.6.0 gradient arity and the documented mask shapes.
"""
from __future__ import annotations

import inspect
import re

import pytest
import torch

from npu_contract import emulate_attention as emu
from npu_contract import emulate_attention_core as core
from npu_contract import standin, wheel

# torch_npu 2.14.0's codegen yaml (the newest schema), argument lists only
FWD_2_14 = ("Tensor query, Tensor key, Tensor value, int head_num, str input_layout, Tensor? pse=None, "
            "Tensor? padding_mask=None, Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
            "int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, int[]? prefix=None, "
            "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
            "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None, "
            "Tensor? dropout_mask=None, int seed=0, int offset=0")
GRAD_2_14 = ("Tensor query, Tensor key, Tensor value, Tensor dy, int head_num, str input_layout, *, "
             "Tensor? pse=None, Tensor? padding_mask=None, Tensor? atten_mask=None, Tensor? softmax_max=None, "
             "Tensor? softmax_sum=None, Tensor? softmax_in=None, Tensor? attention_in=None, float scale_value=1., "
             "float keep_prob=1., int pre_tockens=2147483647, int next_tockens=2147483647, int inner_precise=0, "
             "int seed=0, int offset=0, int numels=0, int[]? prefix=None, int[]? actual_seq_qlen=None, "
             "int[]? actual_seq_kvlen=None, int sparse_mode=0, bool gen_mask_parallel=True, bool sync=False, "
             "str softmax_layout=\"\", Tensor? sink=None")
_DEFAULTS = {"None": None, "True": True, "False": False, '""': ""}


def _cached_schemas():
    """{release: {op: (argument list, returns)}}, from each wheel's schemas (fetched once)."""
    return {release: {op: re.match(rf"{op}\((.*?)\) -> \((.*?)\)", standin.contract(release)[0][op]).groups()
                      for op in ("npu_fusion_attention", "npu_fusion_attention_grad")}
            for release in wheel.RELEASES}


def _parse(arglist: str):
    """[(name, default or inspect.Parameter.empty, keyword_only)] of a schema's arguments."""
    out, kw_only = [], False
    for arg in arglist.split(", "):
        if arg == "*":
            kw_only = True
            continue
        name, eq, default = arg.split(" ", 1)[1].partition("=")
        if not eq:
            value = inspect.Parameter.empty
        elif default in _DEFAULTS:
            value = _DEFAULTS[default]
        else:
            value = float(default) if "." in default else int(default)
        out.append((name, value, kw_only))
    return out


def _declared(fn):
    return [(p.name, p.default, p.kind == p.KEYWORD_ONLY) for p in inspect.signature(fn).parameters.values()]


@pytest.mark.parametrize("fn, schema", [(emu.npu_fusion_attention, FWD_2_14),
                                        (emu.npu_fusion_attention_grad, GRAD_2_14)], ids=["forward", "grad"])
def test_signature_is_the_newest_schema(fn, schema):
    assert _cached_schemas()["2.14.0"][fn.__name__][0] == schema  # the embedded copy is the wheel's
    assert _declared(fn) == _parse(schema)


def test_first_release_of_each_new_argument():
    """softmax_layout and sink first in 2.9.0's schema, dropout_mask / seed / offset (forward) in
    2.14.0's; the gradient's arity 4 in 2.6.0, 5 (dsink) from 2.9.0."""
    schemas = _cached_schemas()
    for name, release in core.ARGUMENT_SINCE.items():
        first = next(r for r in wheel.RELEASES if f" {name}=" in schemas[r]["npu_fusion_attention"][0])
        assert first == release, name
    assert [schemas[r]["npu_fusion_attention_grad"][1].count("Tensor") for r in wheel.RELEASES] == [4, 5, 5]
    assert "2.9.0" in emu.__doc__ and "7.2" not in emu.__doc__
    from npuspeed.ops.npu import varlen as npu_varlen
    assert "2.9.0" in npu_varlen.__doc__ and "7.2" not in npu_varlen.__doc__


def _bnsd(gen, b=2, n=4, n2=2, sq=5, sk=7, d=8):
    return (torch.randn(b, h, s, d, generator=gen) for h, s in ((n, sq), (n2, sk), (n2, sk)))


def test_sink_is_not_emulated():
    q, k, v = _bnsd(torch.Generator().manual_seed(0))
    emu.npu_fusion_attention(q, k, v, 4, "BNSD", sink=None)
    with pytest.raises(NotImplementedError, match="sink"):
        emu.npu_fusion_attention(q, k, v, 4, "BNSD", sink=torch.zeros(4))


def _autograd_vs_grad_op(q, k, v, head_num, layout, **kw):
    """Autograd through the emulated forward (fixed seed / offset) vs the emulated grad op."""
    leaves = [x.clone().requires_grad_() for x in (q, k, v)]
    out, smax, ssum, _, seed, offset, numels = emu.npu_fusion_attention(*leaves, head_num, layout, **kw)
    dy = torch.randn(out.shape, generator=torch.Generator().manual_seed(9), dtype=out.dtype)
    out.backward(dy)
    kw = {key: value for key, value in kw.items() if key not in ("scale", "seed", "offset")}
    grads = emu.npu_fusion_attention_grad(q, k, v, dy, head_num, layout, softmax_max=smax, softmax_sum=ssum,
                                          attention_in=out.detach(), scale_value=0.3, seed=seed, offset=offset,
                                          numels=numels, **kw)
    for got, leaf in zip(grads[:3], leaves):
        torch.testing.assert_close(got, leaf.grad)
    return out.detach(), (seed, offset, numels), dy, smax, ssum


def test_dropout_gradient_rebuilds_the_forward_mask():
    gen = torch.Generator().manual_seed(1)
    q, k, v = _bnsd(gen)
    sbh = [x.permute(2, 0, 1, 3).reshape(x.shape[2], x.shape[0], -1) for x in (q, k, v)]
    out, state, dy, smax, ssum = _autograd_vs_grad_op(*sbh, 4, "SBH", scale=0.3, keep_prob=0.6, seed=123, offset=4)
    assert state == (123, 4, 2 * 4 * 5 * 7)
    no_drop = emu.npu_fusion_attention(*sbh, 4, "SBH", scale=0.3)[0]
    assert not torch.allclose(out, no_drop)  # the mask was applied
    again = emu.npu_fusion_attention(*sbh, 4, "SBH", scale=0.3, keep_prob=0.6, seed=123, offset=4)[0]
    assert torch.equal(out, again)  # a pure function of (seed, offset)
    other = emu.npu_fusion_attention_grad(*sbh, dy, 4, "SBH", softmax_max=smax, softmax_sum=ssum, attention_in=out,
                                          scale_value=0.3, keep_prob=0.6, seed=123, offset=5, numels=state[2])
    assert not torch.allclose(other[0], emu.npu_fusion_attention_grad(
        *sbh, dy, 4, "SBH", softmax_max=smax, softmax_sum=ssum, attention_in=out, scale_value=0.3,
        keep_prob=0.6, seed=123, offset=4, numels=state[2])[0])
    with pytest.raises(ValueError, match="numels"):  # the forward's state not handed back
        emu.npu_fusion_attention_grad(*sbh, dy, 4, "SBH", softmax_max=smax, softmax_sum=ssum, attention_in=out,
                                      scale_value=0.3, keep_prob=0.6)


def test_dropout_seed_drawn_from_the_generator_and_external_mask():
    q, k, v = _bnsd(torch.Generator().manual_seed(2))
    torch.manual_seed(5)
    first = emu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.5)
    torch.manual_seed(5)
    again = emu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.5)
    assert first[4] != 0 and first[4:] == again[4:] and torch.equal(first[0], again[0])
    kept = torch.ones(first[6], dtype=torch.bool)  # keep everything: out / keep_prob
    full = emu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.5, dropout_mask=kept)[0]
    torch.testing.assert_close(full, emu.npu_fusion_attention(q, k, v, 4, "BNSD")[0] / 0.5)
    with pytest.raises(ValueError, match="dropout_mask"):
        emu.npu_fusion_attention(q, k, v, 4, "BNSD", keep_prob=0.5, dropout_mask=kept[1:])


TND_Q, TND_K = [3, 0, 5, 4], [3, 2, 7, 4]


def _tnd(gen, extra_q=0, extra_k=0):
    q = torch.randn(sum(TND_Q) + extra_q, 4, 8, generator=gen)
    k, v = (torch.randn(sum(TND_K) + extra_k, 2, 8, generator=gen) for _ in range(2))
    return q, k, v, torch.tensor(TND_Q).cumsum(0).tolist(), torch.tensor(TND_K).cumsum(0).tolist()


def test_tnd_dropout_gradient():
    q, k, v, cu_q, cu_k = _tnd(torch.Generator().manual_seed(3))
    _autograd_vs_grad_op(q, k, v, 4, "TND", scale=0.3, keep_prob=0.7, seed=77, offset=1, atten_mask=core.compressed(),
                         sparse_mode=3, actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k)


def test_tnd_trailing_batches_take_no_part():
    """[2, 5, 9, 0, 0]: the last two batches are not computed; their tokens may be in the tensors."""
    q, k, v, cu_q, cu_k = _tnd(torch.Generator().manual_seed(4), extra_q=3, extra_k=2)
    kw = dict(scale=0.3, atten_mask=core.compressed(), sparse_mode=3)
    out = emu.npu_fusion_attention(q, k, v, 4, "TND", actual_seq_qlen=cu_q + [0, 0], actual_seq_kvlen=cu_k + [0, 0],
                                   **kw)
    t = sum(TND_Q)
    ref = emu.npu_fusion_attention(q[:t], k[:sum(TND_K)], v[:sum(TND_K)], 4, "TND", actual_seq_qlen=cu_q,
                                   actual_seq_kvlen=cu_k, **kw)
    torch.testing.assert_close(out[0][:t], ref[0])
    assert not out[0][t:].any()
    _autograd_vs_grad_op(q, k, v, 4, "TND", keep_prob=0.8, seed=3, actual_seq_qlen=cu_q + [0, 0],
                         actual_seq_kvlen=cu_k + [0, 0], **kw)
    with pytest.raises(ValueError, match="same trailing 0s"):
        emu.npu_fusion_attention(q, k, v, 4, "TND", actual_seq_qlen=cu_q + [0, 0],
                                 actual_seq_kvlen=cu_k + [cu_k[-1], 0])
    with pytest.raises(ValueError, match="ends at"):  # fewer tokens than T needs the trailing 0s
        emu.npu_fusion_attention(q, k, v, 4, "TND", actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k)
    with pytest.raises(ValueError, match="1..1024"):
        emu.npu_fusion_attention(q, k, v, 4, "TND", actual_seq_qlen=[1] * 1025, actual_seq_kvlen=[1] * 1025)


def test_grad_returns_the_2_6_0_arity():
    q, k, v = _bnsd(torch.Generator().manual_seed(5))
    out, smax, ssum = emu.npu_fusion_attention(q, k, v, 4, "BNSD")[:3]
    grads = emu.npu_fusion_attention_grad(q, k, v, torch.ones_like(out), 4, "BNSD", softmax_max=smax,
                                          softmax_sum=ssum, attention_in=out)
    assert len(grads) == 4 and grads[3].shape == (0,) and grads[3].dtype == q.dtype  # 2.6.0's meta dpse


def test_documented_mask_shapes_only():
    """SS, 11SS, B1SS, BNSS (TND: SS); with atten_mask None sparse_mode has no effect."""
    q, k, v = _bnsd(torch.Generator().manual_seed(6))
    full = emu.npu_fusion_attention(q, k, v, 4, "BNSD")[0]
    for shape in ((5, 7), (1, 1, 5, 7), (2, 1, 5, 7), (2, 4, 5, 7)):
        emu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(shape, dtype=torch.bool), sparse_mode=1)
    for shape in ((1, 4, 5, 7), (1, 5, 7), (2, 2, 5, 7), (5, 8)):
        with pytest.raises(ValueError, match="documented shapes"):
            emu.npu_fusion_attention(q, k, v, 4, "BNSD", atten_mask=torch.zeros(shape, dtype=torch.bool))
    for mode in (1, 2, 3, 4):
        torch.testing.assert_close(emu.npu_fusion_attention(q, k, v, 4, "BNSD", sparse_mode=mode)[0], full)
    tq, tk, tv, cu_q, cu_k = _tnd(torch.Generator().manual_seed(7))
    with pytest.raises(ValueError, match="only SS"):
        emu.npu_fusion_attention(tq, tk, tv, 4, "TND", atten_mask=torch.zeros(1, 1, 5, 7, dtype=torch.bool),
                                 actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k)
    with pytest.raises(ValueError, match="softmax_layout"):
        emu.npu_fusion_attention(q, k, v, 4, "BNSD", softmax_layout="TND")


def test_documented_shape_limits():
    """key and value one shape, Dq == Dk, D in 1..768, Nq in 1..256."""
    q, k, v = _bnsd(torch.Generator().manual_seed(8))
    with pytest.raises(ValueError, match="one shape"):
        emu.npu_fusion_attention(q, k, v[..., :4], 4, "BNSD")
    with pytest.raises(ValueError, match="Dq must equal Dk"):
        emu.npu_fusion_attention(q[..., :4], k, v, 4, "BNSD")
    with pytest.raises(ValueError, match="1..768"):
        emu.npu_fusion_attention(*(torch.zeros(1, 5, 2 * 769) for _ in range(3)), 2, "BSH")
    with pytest.raises(ValueError, match="1..256"):
        emu.npu_fusion_attention(*(torch.zeros(1, 257, 2, 8) for _ in range(3)), 257, "BNSD")


def _shapes(outputs):
    return [(tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else x for x in outputs]


@pytest.mark.parametrize("release", wheel.RELEASES)
def test_output_shapes_are_the_meta_functions(release):
    """Each layout's outputs (and the grad's dq, dk, dv, dpse) have the wheel's meta shapes and
    dtypes, except where an older meta function is wrong (then the emulator keeps the newer
    shape): TND's softmax_max / softmax_sum are [T, N, 8] as 2.14.0's meta says (2.6.0's and
    2.9.0's read TND as BNSD: [T, N, D, 8]); BSND's are [B, N, S, 8] (2.6.0's: [B, N, N, 8])."""
    metas = standin.contract(release)[1]
    fwd, grad = metas["npu_fusion_attention"], metas["npu_fusion_attention_grad"]
    q, k, v = _bnsd(torch.Generator().manual_seed(9))
    from npu_contract.layouts import to_layout
    for layout in ("SBH", "BSH", "BSND", "BNSD"):
        args = [to_layout(x, layout) for x in (q, k, v)] + [4, layout]
        got, want = _shapes(emu.npu_fusion_attention(*args)), _shapes(fwd(*args))
        if (release, layout) == ("2.6.0", "BSND"):  # 2.6.0's meta reads S from dim 2 (N): [B, N, N, 8]
            assert want[1][0] == (2, 4, 4, 8) and got[1][0] == (2, 4, 5, 8)
            got, want = got[:1] + got[3:], want[:1] + want[3:]
        assert got == want, layout
        got = emu.npu_fusion_attention_grad(*args[:3], args[0], 4, layout, softmax_max=torch.zeros(2, 4, 5, 8),
                                            softmax_sum=torch.ones(2, 4, 5, 8), attention_in=args[0])
        want = [x for x in grad(*args[:3], args[0], 4, layout)[:4] if x is not None]
        assert _shapes(got[:len(want)]) == _shapes(want), layout
    tq, tk, tv, cu_q, cu_k = _tnd(torch.Generator().manual_seed(9))
    kw = dict(actual_seq_qlen=cu_q, actual_seq_kvlen=cu_k)
    got, want = _shapes(emu.npu_fusion_attention(tq, tk, tv, 4, "TND", **kw)), _shapes(fwd(tq, tk, tv, 4, "TND", **kw))
    assert got[0] == want[0] and got[3:] == want[3:]
    assert [s[0] for s in want[1:3]] == ([(12, 4, 8)] * 2 if release == "2.14.0" else [(12, 4, 8, 8)] * 2)
    assert [s[0] for s in got[1:3]] == [(12, 4, 8)] * 2
