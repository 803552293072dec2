"""The torch_npu emulators (tests/npu_contract/emulate_*.py) against plain references, their
documented limits, the wheels' schemas (parameter names and defaults) and meta functions
(output shapes and dtypes)."""
from __future__ import annotations

import ast
import inspect
import re
import sys

import pytest
import torch
import torch.nn.functional as F

from npuspeed.ops.moe_permute import permute_reference, unpermute_reference
from npuspeed.ops.rms_norm import rms_norm_reference
from npuspeed.ops.rope import _cos_sin, rotary_pos_emb_reference
from npuspeed.ops.swiglu import swiglu_reference
from npu_contract import emulate_comm, emulate_moe, emulate_norm, gloo_threads, standin, wheel

E = {**emulate_norm.EMULATORS, **emulate_moe.EMULATORS, **emulate_comm.EMULATORS}
RELEASES = wheel.RELEASES


def metas(release):
    return standin.contract(release)[1]


def schemas(release):
    return standin.contract(release)[0]


def _params(schema: str) -> dict:
    """name -> default text (None when required) of a schema's arguments."""
    args = schema.split("(", 1)[1].rsplit(") ->", 1)[0]
    found = {}
    for arg in re.split(r",\s*(?![^()]*\))", args):
        arg = arg.strip()
        if arg == "*" or not arg:
            continue
        decl, _, default = arg.partition("=")
        found[decl.split()[-1]] = default or None
    return found


@pytest.mark.parametrize("release", RELEASES)
def test_signatures_follow_the_schema(release):
    """Every declared parameter is the schema's (same name, same default); one the release lacks
    has a default (the stand-in then never passes it); the schema's required ones are declared."""
    have = schemas(release)
    assert set(E) <= set(schemas("2.14.0")), sorted(set(E) - set(schemas("2.14.0")))
    for op, fn in by_release(release).items():
        if op not in have:
            continue
        params, declared = _params(have[op]), inspect.signature(fn).parameters
        for name, p in declared.items():
            if name in params:
                if params[name] is not None:
                    assert p.default == ast.literal_eval(params[name]), (release, op, name)
            else:
                assert p.default is None, (release, op, name)
        assert {n for n, d in params.items() if d is None} <= set(declared), (release, op)


def test_every_emulator_says_it_is_one():
    from npu_contract import emulate_limits, emulate_permute, emulate_permute_grad, emulate_rope
    for module in (emulate_norm, emulate_rope, emulate_moe, emulate_permute, emulate_permute_grad, emulate_comm,
                   emulate_limits):
        assert module.__doc__.startswith("EMULATOR (not the real op)"), module.__name__
    for op, fn in E.items():
        assert sys.modules[fn.__module__].__doc__.startswith("EMULATOR (not the real op)"), op


def _to_meta(v):
    if isinstance(v, torch.Tensor):
        return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
    if isinstance(v, list):
        return [_to_meta(x) for x in v]
    return v


def _same(out, want):
    if isinstance(want, (tuple, list)):
        assert isinstance(out, (tuple, list)) and len(out) == len(want)
        for o, w in zip(out, want):
            _same(o, w)
    elif want is None:
        assert out is None
    else:
        assert (tuple(out.shape), out.dtype) == (tuple(want.shape), want.dtype)


def by_release(release):
    return {**emulate_norm.emulators(release), **emulate_moe.emulators(release), **emulate_comm.emulators(release)}


def run(op, *args, **kwargs):
    """The emulator's result, checked against the meta function of each release that has it
    (that release's emulator, where the releases' meta functions differ)."""
    out = E[op](*args, **kwargs)
    for release in RELEASES:
        fn = metas(release).get(op)
        if fn is not None:
            emulator = by_release(release)[op]
            got = out if emulator is E[op] else emulator(*args, **kwargs)
            _same(got, fn(*_to_meta(list(args)), **{k: _to_meta(v) for k, v in kwargs.items()}))
    return out


def close(a, b, tol=1e-5):
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


def raises(text, op, *args, **kwargs):
    with pytest.raises(ValueError, match=re.escape(op) + ".*" + text):
        E[op](*args, **kwargs)


# ---- rms_norm, swiglu ---------------------------------------------------------------------------

@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm(dtype):
    x = torch.randn(3, 2, 32, dtype=dtype)
    g = torch.randn(32, dtype=dtype)
    y, rstd = run("npu_rms_norm", x, g, epsilon=1e-5)
    close(y, rms_norm_reference(x, g, 1e-5), 1e-5 if dtype == torch.float32 else 1e-2)
    xf, gf = x.double().requires_grad_(), g.double().requires_grad_()
    ref = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-5) * gf
    dy = torch.randn_like(x)
    ref.backward(dy.double())
    dx, dg = run("npu_rms_norm_backward", dy, x, g, rstd)
    close(dx, xf.grad, 1e-4 if dtype == torch.float32 else 2e-2)
    close(dg, gf.grad, 1e-4 if dtype == torch.float32 else 2e-2)


def test_rms_norm_limits():
    x = torch.randn(4, 8)
    raises("2-8 dims", "npu_rms_norm", torch.randn(8), torch.ones(8))
    raises("gamma's dtype", "npu_rms_norm", x, torch.ones(8, dtype=torch.bfloat16))
    raises("trailing dims", "npu_rms_norm", x, torch.ones(4))
    raises("dtype must be one of", "npu_rms_norm", x.double(), torch.ones(8).double())


@pytest.mark.parametrize("dim", [-1, 0])
def test_swiglu(dim):
    x = torch.randn(6, 10, dtype=torch.float32)
    y = run("npu_swiglu", x, dim=dim)
    if dim == -1:
        close(y, swiglu_reference(x))
    xr = x.clone().requires_grad_()
    a, b = torch.chunk(xr, 2, dim=dim)
    g = torch.randn_like(y)
    (F.silu(a) * b).backward(g)
    close(run("npu_swiglu_backward", g, x, dim=dim), xr.grad)


def test_swiglu_limits():
    raises("halves", "npu_swiglu", torch.randn(4, 5))
    raises("1-8 dims", "npu_swiglu", torch.randn(()).reshape(()))
    raises("dtype", "npu_swiglu", torch.randn(4, 4).double())


# ---- rotary_mul ---------------------------------------------------------------------------------

def _rope_inputs(interleaved=False, s=5, b=2, h=3, d=8):
    t = torch.randn(s, b, h, d)
    freqs = torch.randn(s, 1, 1, d)
    cos, sin = _cos_sin(t, freqs, 1.0)
    return t, freqs, cos, sin


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul(mode):
    t, freqs, cos, sin = _rope_inputs()
    out = run("npu_rotary_mul", t, cos, sin, mode)
    close(out, rotary_pos_emb_reference(t, freqs, interleaved=(mode == "interleave")))
    x, r1, r2 = (v.clone().double().requires_grad_() for v in (t, cos, sin))
    if mode == "half":
        x1, x2 = torch.chunk(x, 2, -1)
        x_new = torch.cat((-x2, x1), dim=-1)
    else:
        x_new = torch.stack((-x[..., 1::2], x[..., ::2]), dim=-1).flatten(-2)
    ref = r1 * x + r2 * x_new  # the documented formula
    g = torch.randn_like(t)
    ref.backward(g.double())
    dx, dr1, dr2 = run("npu_rotary_mul_backward", g, t, cos, sin, mode)
    for got, want in ((dx, x.grad), (dr1, r1.grad), (dr2, r2.grad)):
        close(got, want, 1e-4)


def test_rotary_mul_rotate_matrix():
    t, _, cos, sin = _rope_inputs()
    d, half = t.shape[-1], t.shape[-1] // 2
    rotate = torch.zeros(d, d)
    rotate[:half, half:] = torch.eye(half)
    rotate[half:, :half] = -torch.eye(half)
    close(E["npu_rotary_mul"](t, cos, sin, rotate=rotate), E["npu_rotary_mul"](t, cos, sin))


def test_rotary_mul_limits():
    t, _, cos, sin = _rope_inputs()
    op = "npu_rotary_mul"
    raises("in \\[-1, 1\\]", op, t, cos * 1.5, sin)  # e.g. cos * mscale > 1 (YaRN)
    raises("D=7 must be even", op, torch.randn(5, 2, 3, 7), torch.rand(5, 1, 1, 7), torch.rand(5, 1, 1, 7))
    raises("D=896", op, torch.randn(2, 1, 1, 896), torch.rand(2, 1, 1, 896), torch.rand(2, 1, 1, 896))
    raises("fits no layout", op, t, cos.expand(5, 2, 1, 8).contiguous(), sin.expand(5, 2, 1, 8).contiguous(),
           rotary_mode="interleave")  # SB1D: half mode only
    raises("fits no layout", op, t, torch.rand(1, 2, 3, 8), torch.rand(1, 2, 3, 8))  # 1NSD-like: no layout's
    E[op](t, torch.rand(5, 1, 3, 8), torch.rand(5, 1, 3, 8))  # B1SD of a BNSD self: allowed in half mode
    raises("B, N < 1000", op, torch.randn(1, 2, 1000, 4), torch.rand(1, 1, 1, 4).expand(1, 2, 1, 4),
           torch.rand(1, 1, 1, 4).expand(1, 2, 1, 4))
    raises("4-D", op, t[0], cos[0], sin[0])
    raises("rotary_mode", op, t, cos, sin, rotary_mode="full")
    r1 = torch.rand(1, 1, 1, 8).requires_grad_()
    big = torch.randn(1, 40, 30, 8)  # SBND with S11D tables: B * N = 1200
    raises("B \\* N must be <= 1024", "npu_rotary_mul_backward", big, big, r1, torch.rand(1, 1, 1, 8))
    E["npu_rotary_mul_backward"](big, big, r1.detach(), torch.rand(1, 1, 1, 8))  # no cos/sin gradient: allowed


# ---- grouped_matmul -----------------------------------------------------------------------------

@pytest.mark.parametrize("group_list_type", [0, 1])
@pytest.mark.parametrize("transposed", [False, True])
def test_grouped_matmul(group_list_type, transposed):
    counts = [3, 0, 5]
    x = torch.randn(8, 6)
    w = torch.randn(3, 4, 6).transpose(1, 2) if transposed else torch.randn(3, 6, 4)
    glist = torch.tensor(counts if group_list_type else [3, 3, 8], dtype=torch.int64)
    (y,) = run("npu_grouped_matmul", [x], [w], group_list=glist, split_item=3, group_type=0,
               group_list_type=group_list_type)
    want = torch.cat([xs @ w[i] for i, xs in enumerate(x.split(counts))])
    close(y, want)


def test_grouped_matmul_limits():
    op, x, w = "npu_grouped_matmul", torch.randn(8, 6), torch.randn(2, 6, 4)
    kw = dict(split_item=3, group_type=0)

    def gl(*v):
        return torch.tensor(v, dtype=torch.int64)
    raises("length cannot be 1", op, [x], [w[:1]], group_list=gl(8), group_list_type=1, **kw)
    E[op]([x], [w[:1]], group_list=gl(8), group_list_type=0, **kw)  # one group: cumulative form is allowed
    raises("sum 7 must equal x's rows 8", op, [x], [w], group_list=gl(3, 4), group_list_type=1, **kw)
    raises("non-decreasing", op, [x], [w], group_list=gl(5, 3), group_list_type=0, **kw)
    raises("last value 7", op, [x], [w], group_list=gl(3, 7), group_list_type=0, **kw)
    raises("non-negative", op, [x], [w], group_list=gl(-1, 9), group_list_type=1, **kw)
    raises("1-D int64", op, [x], [w], group_list=gl(3, 5).int(), group_list_type=1, **kw)
    raises("length 3 must equal the weight groups 2", op, [x], [w], group_list=gl(3, 5, 0), group_list_type=1, **kw)
    raises("1024 groups", op, [torch.randn(0, 2)], [torch.randn(1025, 2, 2)],
           group_list=torch.zeros(1025, dtype=torch.int64),
           group_list_type=1, **kw)
    raises("must equal x's", op, [x], [w.bfloat16()], group_list=gl(3, 5), group_list_type=1, **kw)
    raises("not be transposed", op, [torch.randn(6, 8).t()], [w], group_list=gl(3, 5), group_list_type=1, **kw)
    raises("65536", op, [torch.randn(2, 65536)], [torch.randn(2, 65536, 1)], group_list=gl(1, 1), group_list_type=1, **kw)
    with pytest.raises(NotImplementedError):
        E[op]([x], [w], group_list=gl(3, 5), split_item=0, group_type=-1)


# ---- MoE permute / unpermute --------------------------------------------------------------------

def _routing(t=6, e=4, k=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    idx = torch.rand(t, e, generator=g).topk(k, dim=1).indices
    rmap = torch.zeros(t, e, dtype=torch.bool).scatter_(1, idx, True)
    probs = torch.rand(t, e, generator=g) * rmap
    return torch.randn(t, 5, generator=g), rmap, probs


def test_permute_matches_megatron_and_unpermute_inverts_it():
    tokens, rmap, probs = _routing()
    t, k = tokens.shape[0], 2
    permuted, pprobs, sidx = run("npu_moe_token_permute_with_routing_map", tokens, rmap, probs=probs,
                                 num_out_tokens=t * k)
    ref, ref_idx, _ = permute_reference(tokens, rmap)
    close(permuted, ref)
    assert sidx.dtype == torch.int32
    close(permuted[sidx.long()], tokens.repeat_interleave(k, 0))  # permuted[sorted_indices[i]] == tokens[i // topK]
    experts = torch.arange(4).repeat_interleave(rmap.sum(0))
    close(pprobs, probs[ref_idx, experts])
    back = run("npu_moe_token_unpermute_with_routing_map", permuted, sidx, [t, 5])
    close(back, tokens * k)
    weighted = run("npu_moe_token_unpermute_with_routing_map", permuted, sidx, [t, 5], probs=probs, routing_map=rmap)
    close(weighted, unpermute_reference(permuted, ref_idx, pprobs, t))


def test_permute_and_unpermute_grads_match_autograd():
    tokens, rmap, probs = _routing()
    t, k = tokens.shape[0], 2
    permuted, pprobs, sidx = E["npu_moe_token_permute_with_routing_map"](tokens, rmap, probs=probs, num_out_tokens=t * k)
    _, ref_idx, _ = permute_reference(tokens, rmap)
    experts = torch.arange(4).repeat_interleave(rmap.sum(0))
    x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    g, gp = torch.randn_like(permuted), torch.randn_like(pprobs)
    ((x[ref_idx] * g).sum() + (p[ref_idx, experts] * gp).sum()).backward()
    dx, dp = run("npu_moe_token_permute_with_routing_map_grad", g, gp, sidx, rmap, 4, t, False)
    close(dx, x.grad)
    close(dp, p.grad)
    y, p2 = permuted.clone().requires_grad_(), probs.clone().requires_grad_()
    out = unpermute_reference(y, ref_idx, p2[ref_idx, experts], t)
    go = torch.randn_like(out)
    out.backward(go)
    _, out_index, token_id, _ = run("_npu_moe_token_unpermute_with_routing_map", permuted, sidx, [t, 5], probs=probs,
                                    routing_map=rmap)
    dy, dp2 = run("npu_moe_token_unpermute_with_routing_map_grad", go, out_index, token_id, rmap, permuted, probs,
                  False, [t, 5])
    close(dy, y.grad)
    close(dp2, p2.grad)


def test_permute_drop_and_pad_round_trip():
    tokens, rmap, probs = _routing(t=6, e=3, k=1)
    permuted, pprobs, sidx = run("npu_moe_token_permute_with_routing_map", tokens, rmap, probs=probs,
                                 num_out_tokens=9, drop_and_pad=True)  # capacity 3
    assert permuted.shape[0] == 9 and bool((rmap[sidx.long(), torch.arange(3).repeat_interleave(3)] | (pprobs == 0)).all())
    back = run("npu_moe_token_unpermute_with_routing_map", permuted, sidx, [6, 5], probs=probs, routing_map=rmap,
               drop_and_pad=True)
    kept = torch.zeros(6, 3).index_put_((sidx.long(), torch.arange(3).repeat_interleave(3)), pprobs)
    close(back, tokens * kept.sum(1, keepdim=True))


def test_drop_and_pad_grads_match_autograd():
    tokens, rmap, probs = _routing(t=6, e=3, k=1)
    permuted, pprobs, sidx = E["npu_moe_token_permute_with_routing_map"](tokens, rmap, probs=probs, num_out_tokens=9,
                                                                         drop_and_pad=True)
    src, experts = sidx.long(), torch.arange(3).repeat_interleave(3)
    x, p = tokens.clone().requires_grad_(), probs.clone().requires_grad_()
    g, gp = torch.randn_like(permuted), torch.randn_like(pprobs)
    ((x[src] * g).sum() + (p[src, experts] * gp).sum()).backward()
    dx, dp = run("npu_moe_token_permute_with_routing_map_grad", g, gp, sidx, rmap, 3, 6, True)
    close(dx, x.grad)
    close(dp, p.grad)
    y, p2 = permuted.clone().requires_grad_(), probs.clone().requires_grad_()
    out = torch.zeros(6, 5).index_add(0, src, y * p2[src, experts].unsqueeze(1))
    go = torch.randn_like(out)
    out.backward(go)
    _, out_index, token_id, _ = run("_npu_moe_token_unpermute_with_routing_map", permuted, sidx, [6, 5], probs=probs,
                                    routing_map=rmap, drop_and_pad=True)
    dy, dp2 = run("npu_moe_token_unpermute_with_routing_map_grad", go, out_index, token_id, rmap, permuted, probs,
                  True, [6, 5])
    close(dy, y.grad)
    close(dp2, p2.grad)


def test_permute_limits():
    tokens, rmap, probs = _routing()
    op = "npu_moe_token_permute_with_routing_map"
    raises("select topK = num_out_tokens // tokens_num = 1", op, tokens, rmap)  # num_out_tokens defaults to tokens_num
    uneven = rmap.clone()
    uneven[0] = True
    raises("rows select \\[2, 4\\]", op, tokens, uneven, num_out_tokens=12)
    raises("int8 or bool", op, tokens, rmap.float(), num_out_tokens=12)
    raises("probs dtype", op, tokens, rmap, probs=probs.half(), num_out_tokens=12)
    raises("must lie in \\[0", op, tokens, rmap, num_out_tokens=25)
    raises("must be 2-D", op, tokens[0], rmap)
    wide = torch.zeros(600, 600, dtype=torch.bool)
    raises("must be < 512", op, torch.randn(600, 2), wide | True, num_out_tokens=600 * 600)
    _, _, sidx = E[op](tokens, rmap, num_out_tokens=12)
    un = "npu_moe_token_unpermute_with_routing_map"
    raises("1-D int32", un, torch.randn(12, 5), sidx.long(), [6, 5])
    raises("probs needs the routing_map", un, torch.randn(12, 5), sidx, [6, 5], probs=probs)
    raises("restore_shape", un, torch.randn(12, 5), sidx, [6, 4])


# ---- MC2 and the fused grad accumulation ----------------------------------------------------------

def test_mc2_ops_match_the_collective_then_matmul():
    xs = [torch.randn(4, 256, dtype=torch.bfloat16) for _ in range(2)]
    w = torch.randn(256, 8, dtype=torch.bfloat16)

    def body(rank, group):
        hcom = emulate_comm.register_group(group)
        ag = run("npu_all_gather_base_mm", xs[rank], w, hcom, 2, bias=None, gather_index=0, gather_output=True, comm_turn=0)
        ag_no = run("npu_all_gather_base_mm", xs[rank], w, hcom, 2, gather_output=False)
        rs = run("npu_mm_reduce_scatter_base", xs[rank], w, hcom, 2, reduce_op="sum")
        ar = run("npu_mm_all_reduce_base", xs[rank].view(2, 2, 256), w, hcom)
        return ag, ag_no, rs, ar
    out = gloo_threads.two_ranks(body)
    full = torch.cat(xs)
    total = sum(x.float() @ w.float() for x in xs)
    for rank in range(2):
        (ag, gathered), (_, empty), rs, ar = out[rank]
        close(gathered, full)
        close(ag, (full.float() @ w.float()).bfloat16(), 1e-2)
        assert empty.numel() == 0
        close(rs, total[rank * 2:(rank + 1) * 2].bfloat16(), 1e-2)
        close(ar, total.bfloat16().view(2, 2, 8), 1e-2)


def test_mc2_limits():
    class Group:  # the limits are checked before any collective runs
        def size(self):
            return 2
    hcom, x, w = emulate_comm.register_group(Group()), torch.randn(4, 256).half(), torch.randn(256, 8).half()
    ag, rs = "npu_all_gather_base_mm", "npu_mm_reduce_scatter_base"
    raises("k=128 must lie in \\[256, 65535\\)", ag, x[:, :128], w[:128], hcom, 2)
    raises("world_size must be one of", ag, x, w, hcom, 3)
    raises("must be hcom's size 2", ag, x, w, hcom, 4)
    raises("bias is not supported", ag, x, w, hcom, 2, bias=torch.zeros(8).half())
    raises("gather_index must be 0", ag, x, w, hcom, 2, gather_index=1)
    raises("comm_turn must be 0", rs, x, w, hcom, 2, comm_turn=1)
    raises("divisible by world_size", rs, x[:3], w, hcom, 2)
    raises("reduce_op must be 'sum'", rs, x, w, hcom, 2, reduce_op="max")
    raises("dtype must be one of", rs, x.float(), w.float(), hcom, 2)
    raises("x2 dtype", ag, x, w.bfloat16(), hcom, 2)
    raises("not be transposed", ag, torch.randn(256, 4).half().t(), w, hcom, 2)
    raises("names no registered", ag, x, w, "nobody", 2)
    raises("2-D or 3-D", "npu_mm_all_reduce_base", x.view(1, 1, 4, 256), w, hcom)


def test_matmul_add_fp32():
    x, w = torch.randn(6, 3).bfloat16(), torch.randn(6, 4).bfloat16()
    c = torch.randn(3, 4)
    want = c + x.float().t() @ w.float()
    assert E["_npu_matmul_add_fp32"](x, w, c) is None
    close(c, want)
    op = "_npu_matmul_add_fp32"
    raises("C must be float32", op, x, w, c.bfloat16())
    raises("C must be \\[n, k\\]", op, x, w, torch.zeros(4, 3))
    raises("weight dtype", op, x, w.half(), c)
    raises("equal rows", op, x, w[:5], c)
    raises("dtype must be one of", op, x.float(), w.float(), c)
