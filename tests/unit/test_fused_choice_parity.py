"""Every implementation a fused-op flag may choose agrees with Megatron's own path, forward
and backward, fp32 and bf16 (the chooser may pick any of them per shape), and the flags'
entry points with a real measurement run one of them and count it."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops import rms_norm as rms_mod
from npuspeed.ops import rope as rope_mod
from npuspeed.ops import swiglu as swiglu_mod
from npuspeed.ops._extension import has_op

pytestmark = pytest.mark.skipif(not has_op("rms_norm"), reason="C++ op library not built")
# bf16: Megatron's eager paths round each intermediate, the kernels once
TOL = {torch.float32: dict(rtol=1e-5, atol=1e-5), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}
DTYPES = [torch.float32, torch.bfloat16]


def _leaves(inputs):
    return [t.detach().clone().requires_grad_(t.requires_grad) for t in inputs]


def _fwd_bwd(fn, inputs):
    leaves = _leaves(inputs)
    out = fn(*leaves)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    out.backward(cot)
    return [out.detach()] + [t.grad for t in leaves if t.requires_grad]


def _check_all(cands, inputs, dtype, expect):
    assert set(cands) == expect, sorted(cands)
    ref = _fwd_bwd(cands["megatron"], inputs)
    for name, fn in cands.items():
        got = _fwd_bwd(fn, inputs)
        for a, b in zip(got, ref):
            assert a.dtype == b.dtype, name
            torch.testing.assert_close(a.float(), b.float(), **TOL[dtype], msg=name)


def _randn(*shape, dtype, seed=0, grad=True):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)).to(dtype).requires_grad_(grad)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_candidates_match_megatron(dtype):
    x, w = _randn(6, 3, 96, dtype=dtype), _randn(96, dtype=dtype, seed=2)
    cands = rms_mod.candidates(x, w, 1e-6, lambda x, w: F.rms_norm(x, (96,), w, 1e-6))
    _check_all(cands, (x, w), dtype, {"megatron", "cpp"})


@pytest.mark.parametrize("dtype", DTYPES)
def test_swiglu_candidates_match_megatron(dtype):
    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

    y = _randn(10, 2, 2 * 40, dtype=dtype)
    cands = swiglu_mod.candidates(y, {"megatron": swiglu_mod.swiglu_reference,
                                      "megatron_fused": lambda v: bias_swiglu_impl(v, None)})
    _check_all(cands, (y,), dtype, {"megatron", "megatron_fused", "cpp"})


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_candidates_match_megatron(dtype, interleaved):
    from megatron.core.models.common.embeddings import rope_utils

    t = _randn(12, 2, 3, 32, dtype=dtype)
    freqs = torch.randn(12, 1, 1, 24, generator=torch.Generator().manual_seed(3))  # partial rotary
    megatron = lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, freqs, rotary_interleaved=interleaved)  # noqa: E731
    cands = rope_mod.candidates(t, freqs, interleaved, 1.0, megatron)
    _check_all(cands, (t,), dtype, {"megatron", "cpp"})


def test_triton_and_native_are_not_candidates_on_cpu():
    """No Triton kernel for CPU tensors (the interpreter is a test tool, not a fast path)."""
    x = torch.randn(4, 8)
    assert fused_choice.triton_kernel("rms_norm", "rms_norm", x) is None
    assert set(swiglu_mod.candidates(torch.randn(4, 8), {"megatron": swiglu_mod.swiglu_reference})) == {
        "megatron", "cpp"}
    assert set(swiglu_mod.candidates(torch.randn(4, 7), {"megatron": swiglu_mod.swiglu_reference})) == {"megatron"}


def test_flag_entry_points_measure_once_and_count_the_winner(monkeypatch):
    """Real timings: whichever wins, each op is measured once, its call counted, output right."""
    from megatron.core.models.common.embeddings import rope_utils

    monkeypatch.setattr(fused_choice, "CHOOSER", fused_choice.Chooser(repeats=2, budget_s=0.0))
    monkeypatch.delenv(fused_choice.FORCE_ENV, raising=False)
    _dispatch.reset_calls()
    x, w = _randn(64, 128, dtype=torch.float32), _randn(128, dtype=torch.float32, seed=1)
    y, t = _randn(64, 256, dtype=torch.float32), _randn(16, 1, 2, 32, dtype=torch.float32)
    freqs = torch.randn(16, 1, 1, 32)
    for _ in range(2):
        out = rms_mod.fused_rms_norm(x, w, 1e-5, lambda x, w: F.rms_norm(x, (128,), w, 1e-5))
        torch.testing.assert_close(out, F.rms_norm(x, (128,), w, 1e-5), **TOL[torch.float32])
        glu = swiglu_mod.fused_swiglu(y, {"megatron": swiglu_mod.swiglu_reference})
        torch.testing.assert_close(glu, swiglu_mod.swiglu_reference(y), **TOL[torch.float32])
        megatron = lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, freqs)  # noqa: E731
        rot = rope_mod.fused_rotary_pos_emb(t, freqs, False, 1.0, megatron)
        torch.testing.assert_close(rot, megatron(t), **TOL[torch.float32])
    made = {c.op: c for c in fused_choice.choices()}
    assert set(made) == {"rms_norm", "swiglu", "rotary_pos_emb"}
    assert _dispatch.calls() == {(op, c.impl): 2 for op, c in made.items()}
    assert all(set(c.ms) == {"megatron", "cpp"} for c in made.values())


_TRITON_SCRIPT = r"""
import os, json
os.environ["TRITON_INTERPRET"] = "1"
import torch, torch.nn.functional as F
from megatron.core.models.common.embeddings import rope_utils
from npuspeed.ops import fused_choice, rms_norm as R, swiglu as S, rope as P
fused_choice.TRITON_ON_HOST = True  # the interpreter runs the kernels on CPU tensors
x, w = torch.randn(6, 64, requires_grad=True), torch.randn(64, requires_grad=True)
y = torch.randn(6, 64, requires_grad=True)
t, fr = torch.randn(8, 1, 2, 32, requires_grad=True), torch.randn(8, 1, 1, 32)
cases = {"rms_norm": (R.candidates(x, w, 1e-5, lambda x, w: F.rms_norm(x, (64,), w, 1e-5)), (x, w)),
         "swiglu": (S.candidates(y, {"megatron": S.swiglu_reference}), (y,)),
         "rope": (P.candidates(t, fr, False, 1.0, lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, fr)), (t,))}
out = {}
for name, (cands, inputs) in cases.items():
    got = {}
    for impl in ("triton", "megatron"):
        leaves = [i.detach().clone().requires_grad_() for i in inputs]
        o = cands[impl](*leaves)
        o.backward(torch.ones_like(o))
        got[impl] = [o.detach()] + [l.grad for l in leaves]
    out[name] = all(torch.allclose(a, b, atol=1e-5, rtol=1e-5) for a, b in zip(got["triton"], got["megatron"]))
print(json.dumps(out))
"""


def test_triton_kernels_join_as_candidates_and_match_megatron():
    """npuspeed.ops.triton's kernels (Triton's interpreter, fp32, fwd+bwd) are offered by the
    candidates where Triton runs and agree with Megatron's path."""
    import importlib.util
    import json
    import os
    import subprocess
    import sys

    if importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed here (the device tier runs the kernels)")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    proc = subprocess.run([sys.executable, "-c", _TRITON_SCRIPT], cwd=root, capture_output=True, text=True,
                          timeout=300, env=dict(os.environ, PYTHONWARNINGS="ignore"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"rms_norm": True, "swiglu": True, "rope": True}
