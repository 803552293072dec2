"""The fused ops (rms_norm, swiglu, rotary_pos_emb) against their pure-PyTorch references.

Forward and backward, fp32 (<= 1e-5) and bf16 (<= 1e-2), odd sizes, non-contiguous and
zero-size inputs, fp64 gradcheck, the torch.library registrations (opcheck), proof that the
C++ kernel ran (the call tally, with the reference made to fail), and a subprocess with
NPUSPEED_DISABLE_CPP=1 that must run and report the references.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from npuspeed.ops import _dispatch
from npuspeed.ops import rms_norm as rms_mod
from npuspeed.ops import rope as rope_mod
from npuspeed.ops import swiglu as swiglu_mod
from npuspeed.ops._extension import has_op

TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2}
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

pytestmark = pytest.mark.skipif(
    not has_op("rms_norm"), reason="C++ op library not built (NPUSPEED_DISABLE_CPP or no compiler)"
)


def _close(actual, expected, dtype):
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), rtol=tol, atol=tol)


def _fwd_bwd(fn, inputs, grad_seed=0, cot_dtype=None):
    """Output and input gradients of fn(*inputs) for a fixed random cotangent (rounded to
    `cot_dtype` first, so that an upcast reference sees the same cotangent)."""
    leaves = [t.detach().clone().requires_grad_(t.is_floating_point()) for t in inputs]
    out = fn(*leaves)
    gen = torch.Generator().manual_seed(grad_seed)
    cot = torch.randn(out.shape, generator=gen).to(cot_dtype or out.dtype).to(out.dtype)
    out.backward(cot)
    return out.detach(), [t.grad for t in leaves if t.requires_grad]


def _ref_fwd_bwd(fn, inputs, dtype):
    """The reference's output and gradients; for bf16 it runs on fp32 copies of the bf16
    inputs (rounded back at the end), so the comparison is not dominated by the rounding of
    each intermediate that eager bf16 does and the fused kernels avoid."""
    if dtype == torch.float32:
        return _fwd_bwd(fn, inputs)
    out, grads = _fwd_bwd(fn, [t.float() if t.dtype == dtype else t for t in inputs], cot_dtype=dtype)
    return out.to(dtype), [g.to(dtype) for g in grads]


def _randn(*shape, dtype, seed):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _assert_ran(op, impl="cpp"):
    ran = {k[1]: v for k, v in _dispatch.calls().items() if k[0] == op}
    assert ran.get(impl, 0) > 0 and set(ran) == {impl}, f"{op} ran {ran}, expected only {impl}"


@pytest.fixture(autouse=True)
def _fresh_tally():
    _dispatch.reset_calls()


# -- RMSNorm -----------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hidden", [1, 3, 127, 4097])
def test_rms_norm_parity(dtype, hidden):
    x = _randn(2, 5, hidden, dtype=dtype, seed=1)
    w = _randn(hidden, dtype=dtype, seed=2)
    got, got_g = _fwd_bwd(lambda x, w: rms_mod.rms_norm(x, w, 1e-5), [x, w])
    _assert_ran("rms_norm")
    ref, ref_g = _ref_fwd_bwd(lambda x, w: rms_mod.rms_norm_reference(x, w, 1e-5), [x, w], dtype)
    assert got.dtype == dtype and got_g[1].dtype == dtype
    _close(got, ref, dtype)
    for a, b in zip(got_g, ref_g):
        _close(a, b, dtype)


def test_rms_norm_matches_torch_nn_rmsnorm():
    norm = torch.nn.RMSNorm(64, eps=1e-6)
    with torch.no_grad():
        norm.weight.normal_()
    x = _randn(7, 64, dtype=torch.float32, seed=3)
    got, got_g = _fwd_bwd(lambda x, w: rms_mod.rms_norm(x, w, 1e-6), [x, norm.weight])
    ref, ref_g = _fwd_bwd(lambda x, w: torch.nn.functional.rms_norm(x, (64,), w, 1e-6), [x, norm.weight])
    _close(got, ref, torch.float32)
    for a, b in zip(got_g, ref_g):
        _close(a, b, torch.float32)


def test_rms_norm_non_contiguous_and_no_weight_grad():
    base = _randn(64, 10, dtype=torch.float32, seed=4)
    x = base.t()  # [10, 64], strided
    assert not x.is_contiguous()
    w = _randn(64, dtype=torch.float32, seed=5)
    got, (gx,) = _fwd_bwd(lambda x: rms_mod.rms_norm(x, w, 1e-5), [x])
    ref, (rx,) = _fwd_bwd(lambda x: rms_mod.rms_norm(x, w, 1e-5), [x.contiguous()])
    assert torch.equal(got, ref) and torch.equal(gx, rx)
    _close(got, rms_mod.rms_norm_reference(x, w, 1e-5), torch.float32)


def test_rms_norm_zero_size():
    w = torch.ones(8, requires_grad=True)
    x = torch.empty(0, 3, 8, requires_grad=True)
    y = rms_mod.rms_norm(x, w, 1e-5)
    y.sum().backward()
    assert y.shape == (0, 3, 8) and x.grad.shape == x.shape
    assert torch.equal(w.grad, torch.zeros(8))
    _assert_ran("rms_norm")


def test_rms_norm_gradcheck_fp64():
    x = _randn(3, 4, 7, dtype=torch.float64, seed=6).requires_grad_()
    w = _randn(7, dtype=torch.float64, seed=7).requires_grad_()
    assert torch.autograd.gradcheck(lambda x, w: rms_mod.rms_norm(x, w, 1e-5), (x, w))
    _assert_ran("rms_norm")


# -- SwiGLU ------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ffn", [1, 3, 127, 4097])
def test_swiglu_parity(dtype, ffn):
    x = _randn(3, 2, 2 * ffn, dtype=dtype, seed=8)
    got, got_g = _fwd_bwd(swiglu_mod.swiglu, [x])
    _assert_ran("swiglu")
    ref, ref_g = _ref_fwd_bwd(swiglu_mod.swiglu_reference, [x], dtype)
    assert got.shape == (3, 2, ffn)
    _close(got, ref, dtype)
    _close(got_g[0], ref_g[0], dtype)


def test_swiglu_fp32_equals_aten_vectorized_silu_bitwise():
    """Same operation order as ATen's vectorized silu kernel: bit-identical in fp32. (Eager on
    the strided chunk halves takes ATen's scalar path, which can differ by an ulp.)"""
    x = _randn(16, 2 * 300, dtype=torch.float32, seed=9)
    a, b = (h.contiguous() for h in torch.chunk(x, 2, dim=-1))
    assert torch.equal(swiglu_mod.swiglu(x), torch.nn.functional.silu(a) * b)


def test_swiglu_non_contiguous_zero_size_and_odd_width():
    x = _randn(2 * 33, 12, dtype=torch.float32, seed=10).t()  # [12, 66], strided
    assert torch.equal(swiglu_mod.swiglu(x), swiglu_mod.swiglu(x.contiguous()))
    z = torch.empty(0, 10, requires_grad=True)
    y = swiglu_mod.swiglu(z)
    y.sum().backward()
    assert y.shape == (0, 5) and z.grad.shape == (0, 10)
    with pytest.raises(ValueError, match="even"):
        swiglu_mod.swiglu(torch.randn(4, 7))


def test_swiglu_gradcheck_fp64():
    x = _randn(4, 2 * 9, dtype=torch.float64, seed=11).requires_grad_()
    assert torch.autograd.gradcheck(swiglu_mod.swiglu, (x,))
    _assert_ran("swiglu")


# -- RoPE --------------------------------------------------------------------------------------
def _freqs(s, rot, b=1, seed=12):
    return _randn(s, b, 1, rot, dtype=torch.float32, seed=seed) * 3


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("shape,rot", [((5, 2, 3, 128), 128), ((3, 1, 1, 2), 2), ((7, 3, 2, 126), 126),
                                       ((4, 2, 3, 64), 32), ((9, 1, 5, 4098), 4098)])
def test_rope_parity(dtype, interleaved, shape, rot):
    t = _randn(*shape, dtype=dtype, seed=13)
    freqs = _freqs(shape[0], rot)
    got, got_g = _fwd_bwd(lambda t: rope_mod.rotary_pos_emb(t, freqs, interleaved), [t])
    _assert_ran("rotary_pos_emb")
    ref, ref_g = _ref_fwd_bwd(lambda t: rope_mod.rotary_pos_emb_reference(t, freqs, interleaved), [t], dtype)
    _close(got, ref, dtype)
    _close(got_g[0], ref_g[0], dtype)


def test_rope_fp32_forward_equals_megatron_bitwise():
    from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd as megatron_bshd

    t = _randn(6, 2, 4, 64, dtype=torch.float32, seed=14)
    freqs = _freqs(6, 64)
    for interleaved in (False, True):
        original = getattr(megatron_bshd, "__wrapped__", megatron_bshd)
        assert torch.equal(rope_mod.rotary_pos_emb(t, freqs, interleaved, mscale=1.5),
                           original(t, freqs, rotary_interleaved=interleaved, mscale=1.5))


def test_rope_broadcast_freqs_per_batch_non_contiguous_and_zero_size():
    t = _randn(5, 3, 2, 16, dtype=torch.float32, seed=15)
    freqs = _freqs(5, 16, b=3)
    _close(rope_mod.rotary_pos_emb(t, freqs), rope_mod.rotary_pos_emb_reference(t, freqs), torch.float32)
    strided = _randn(16, 2, 3, 5, dtype=torch.float32, seed=16).permute(3, 2, 1, 0)  # [5, 3, 2, 16]
    assert not strided.is_contiguous()
    assert torch.equal(rope_mod.rotary_pos_emb(strided, freqs), rope_mod.rotary_pos_emb(strided.contiguous(), freqs))
    z = torch.empty(0, 2, 3, 8, requires_grad=True)
    out = rope_mod.rotary_pos_emb(z, torch.empty(0, 1, 1, 8))
    out.sum().backward()
    assert out.shape == z.shape and z.grad.shape == z.shape


def test_rope_freqs_needing_grad_take_the_reference():
    t = _randn(4, 1, 2, 8, dtype=torch.float32, seed=17)
    freqs = _freqs(4, 8).requires_grad_()
    rope_mod.rotary_pos_emb(t, freqs).sum().backward()
    assert freqs.grad is not None
    _assert_ran("rotary_pos_emb", "reference")


def test_rope_tables_once_per_freqs_tensor(monkeypatch):
    """cos/sin are taken once per freqs tensor (Megatron hands all layers the same one), and
    again after an in-place change or for another tensor; the results stay Megatron's."""
    calls = []
    real = rope_mod._cos_sin
    monkeypatch.setattr(rope_mod, "_cos_sin", lambda *a: calls.append(1) or real(*a))
    rope_mod._TABLES.clear()
    t = _randn(6, 1, 2, 8, dtype=torch.bfloat16, seed=21)
    freqs = _freqs(6, 8)
    first = rope_mod.rotary_pos_emb(t, freqs)
    for _ in range(3):
        assert torch.equal(rope_mod.rotary_pos_emb(t, freqs), first)
    assert len(calls) == 1
    freqs.mul_(0.5)  # same tensor, new values: a miss
    changed = rope_mod.rotary_pos_emb(t, freqs)
    assert len(calls) == 2
    _close(changed, rope_mod.rotary_pos_emb_reference(t, freqs), torch.bfloat16)
    before = len(calls)
    rope_mod.rotary_pos_emb(t, freqs.clone())  # another tensor: a miss
    assert len(calls) == before + 1


@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_gradcheck_fp64(interleaved):
    t = _randn(3, 2, 2, 10, dtype=torch.float64, seed=18).requires_grad_()
    freqs = _freqs(3, 8).double()
    assert torch.autograd.gradcheck(lambda t: rope_mod.rotary_pos_emb(t, freqs, interleaved), (t,))
    _assert_ran("rotary_pos_emb")


# -- registration and proof of path ------------------------------------------------------------
def test_opcheck_registrations():
    rms_mod.rms_norm(torch.randn(2, 4), torch.randn(4))  # registers autograd/fake on first use
    swiglu_mod.swiglu(torch.randn(2, 4))
    rope_mod.rotary_pos_emb(torch.randn(2, 1, 1, 4), torch.randn(2, 1, 1, 4))
    utils = ("test_schema", "test_autograd_registration", "test_faketensor")
    cases = [
        (torch.ops.npuspeed.rms_norm.default, (torch.randn(3, 5, requires_grad=True), torch.randn(5, requires_grad=True), 1e-5)),
        (torch.ops.npuspeed.swiglu.default, (torch.randn(3, 8, requires_grad=True),)),
        (torch.ops.npuspeed.rotary_pos_emb.default,
         (torch.randn(4, 2, 3, 8, requires_grad=True), torch.randn(4, 1, 1, 8), torch.randn(4, 1, 1, 8), False)),
    ]
    for op, args in cases:
        torch.library.opcheck(op, args, test_utils=utils)


def test_cpp_path_runs_not_the_reference(monkeypatch):
    def boom(*_a, **_k):
        raise AssertionError("the pure-PyTorch reference ran")

    monkeypatch.setattr(rms_mod, "rms_norm_reference", boom)
    monkeypatch.setattr(swiglu_mod, "swiglu_reference", boom)
    monkeypatch.setattr(rope_mod, "rotary_pos_emb_reference", boom)
    x = torch.randn(4, 8, requires_grad=True)
    rms_mod.rms_norm(x, torch.ones(8), 1e-5).sum().backward()
    swiglu_mod.swiglu(x).sum().backward()
    rope_mod.rotary_pos_emb(x.view(4, 1, 1, 8), torch.randn(4, 1, 1, 8)).sum().backward()
    assert _dispatch.calls() == {("rms_norm", "cpp"): 1, ("swiglu", "cpp"): 1, ("rotary_pos_emb", "cpp"): 1}


def test_mixed_dtypes_take_the_reference_and_promote_like_torch():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    w = torch.randn(8, dtype=torch.float32)
    y = rms_mod.rms_norm(x, w, 1e-5)
    assert y.dtype == torch.nn.functional.rms_norm(x.float(), (8,), w).dtype
    _assert_ran("rms_norm", "reference")


_DISABLED_SCRIPT = r"""
import json, torch
from npuspeed import runtime
state = runtime.initialize(["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"])
from npuspeed.ops import _dispatch, catalog
from npuspeed.ops.rms_norm import rms_norm
from npuspeed.ops.swiglu import swiglu
from npuspeed.ops.rope import rotary_pos_emb
x = torch.randn(4, 8, requires_grad=True)
(rms_norm(x, torch.ones(8), 1e-5).sum() + swiglu(x).sum()
 + rotary_pos_emb(x.view(4, 1, 1, 8), torch.randn(4, 1, 1, 8)).sum()).backward()
paths = {f.name: f.path(state.context) for f, on in state.features if on}
print(json.dumps({"calls": {f"{k[0]}:{k[1]}": v for k, v in _dispatch.calls().items()},
                  "ops": {r["name"]: r["compiled"] for r in catalog()}, "paths": paths, "notes": state.notes}))
"""


def test_disable_cpp_runs_and_reports_the_references():
    env = dict(os.environ, NPUSPEED_DISABLE_CPP="1")
    proc = subprocess.run([sys.executable, "-c", _DISABLED_SCRIPT], env=env, cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["calls"] == {"rms_norm:reference": 1, "swiglu:reference": 1, "rotary_pos_emb:reference": 1}
    assert not any(out["ops"][op] for op in ("rms_norm", "swiglu", "rotary_pos_emb"))
    for name in ("fused_rmsnorm", "fused_swiglu", "fused_rotary_pos_emb"):
        assert "Megatron's path" in out["paths"][name] and "NPUSPEED_DISABLE_CPP" in out["paths"][name]
    assert any("--use-fused-rmsnorm" in n and "no npuspeed kernel" in n for n in out["notes"])


# -- build flags -------------------------------------------------------------------------------
def test_build_flags_capability_check(monkeypatch):
    from npuspeed.ops import build_flags

    monkeypatch.setattr(build_flags, "cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.delenv("NPUSPEED_CPU_CAPABILITY", raising=False)
    if build_flags.platform.machine().lower() in ("x86_64", "amd64"):
        assert build_flags.choose_capability() == "avx2"
    assert "avx512f" in build_flags.unsupported_capability("avx512")
    assert build_flags.unsupported_capability("avx2") is None
    assert build_flags.unsupported_capability("default") is None
    monkeypatch.setenv("NPUSPEED_CPU_CAPABILITY", "default")
    assert not any(f.startswith("-m") for f in build_flags.compile_args())
    monkeypatch.setenv("NPUSPEED_CPU_CAPABILITY", "sse9")
    with pytest.raises(ValueError, match="NPUSPEED_CPU_CAPABILITY"):
        build_flags.choose_capability()


def test_loaded_library_reports_its_capability():
    from npuspeed.ops._extension import load_library

    assert load_library()["cpu_capability"] == torch.ops.npuspeed.cpu_capability()
