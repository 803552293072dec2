"""npuspeed's Triton kernels (npuspeed/ops/triton/) against the pure-PyTorch references,
forward and backward (every input's gradient, the norm weight's included), fp32 and bf16,
odd widths and a few rows, on CPU through Triton's interpreter. The checks themselves are
tests/kernel_vs_reference.py's, which the device tier runs on the GPU or NPU.

Run by tests/unit/test_triton_kernels.py in a fresh process with TRITON_INTERPRET=1: the
interpreter needs the flag before triton is first imported (triton.language's own jitted
helpers such as tl.sum are wrapped at that import), and in the suite's process another
test may have imported triton already. Runnable alone too: `pytest tests/unit/_triton_kernel_checks.py`.
Small block caps are patched in where a test needs several column / head blocks or several
rows per backward program at a small shape.
"""
from __future__ import annotations

import os
import sys

import pytest

if "triton" not in sys.modules:
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") != "1":
    pytest.skip("needs TRITON_INTERPRET=1 before triton is imported (run via test_triton_kernels.py)",
                allow_module_level=True)
pytest.importorskip("triton", reason="triton is not installed (pip install -e .[test] on Linux x86_64)")

import torch  # noqa: E402
from kernel_vs_reference import (  # noqa: E402
    DTYPES, check_moe, check_rms_norm, check_rope_on_a_view, check_rope_qk, check_swiglu, freqs,
)

from npuspeed.ops.rope import rotary_pos_emb_reference  # noqa: E402
from npuspeed.ops.triton import _runtime  # noqa: E402
from npuspeed.ops.triton import moe_permute as tmoe  # noqa: E402
from npuspeed.ops.triton import rms_norm as trms  # noqa: E402
from npuspeed.ops.triton import rope as trope  # noqa: E402
from npuspeed.ops.triton import swiglu as tswiglu  # noqa: E402
from triton_masks import boolean_masks_only  # noqa: E402


@pytest.fixture(autouse=True)
def _boolean_masks():
    """Each kernel's masks boolean, as triton 3.9's interpreter requires (older ones let it pass)."""
    with boolean_masks_only():
        yield


def test_available_under_the_interpreter_and_a_clear_error_without(monkeypatch):
    assert trms.available() and tswiglu.available() and trope.available() and tmoe.available()
    monkeypatch.delenv("TRITON_INTERPRET")
    if _runtime.device_type() is None:
        assert not trms.available()
    with pytest.raises(RuntimeError, match="Triton cannot run on"):
        tswiglu.swiglu(torch.randn(2, 6))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(3, 5, 37), (2, 100)])
def test_rms_norm_matches_reference(dtype, shape, monkeypatch):
    monkeypatch.setattr(trms, "PARTIAL_PROGRAMS", 4)  # several rows per backward program, the last one partial
    check_rms_norm("cpu", dtype, shape)


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_without_weight_and_with_an_fp32_weight(dtype):
    check_rms_norm("cpu", dtype, (7, 33), weight=None, eps=1e-6)
    check_rms_norm("cpu", dtype, (7, 33), weight="fp32")


@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm_fused_with_the_residual_add(dtype):
    check_rms_norm("cpu", dtype, (2, 3, 45), residual=True)  # (the interpreter's fp32 -> bf16 cast
    # truncates where a GPU's rounds to nearest: within the bf16 tolerance)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(4, 3, 90), (5, 2 * 45)])
def test_swiglu_matches_reference_and_megatrons_gate_half(dtype, shape, monkeypatch):
    monkeypatch.setattr(tswiglu, "BLOCK_CAP", 16)  # three column blocks, the last one partial
    check_swiglu("cpu", dtype, shape)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("interleaved", [False, True])
def test_rope_on_q_and_k_in_one_launch_matches_reference(dtype, interleaved, monkeypatch):
    monkeypatch.setattr(trope, "TILE", 32)  # one head per program: several head blocks
    check_rope_qk("cpu", dtype, s=5, b=2, hq=3, hk=2, d=24, rot=16, interleaved=interleaved,
                  per_batch=interleaved)  # GQA, 8 channels pass through; angles varying along b too


def test_rope_single_tensor_on_a_strided_view_and_the_reference_fallbacks():
    check_rope_on_a_view("cpu")
    x64 = torch.randn(3, 1, 2, 8, dtype=torch.float64)  # fp64: the reference runs
    assert torch.equal(trope.rotary_pos_emb(x64, freqs(3, 8)), rotary_pos_emb_reference(x64, freqs(3, 8)))


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_permute_unpermute_match_reference(dtype, monkeypatch):
    monkeypatch.setattr(tmoe, "BLOCK_CAP", 16)  # three column blocks of hidden 37
    check_moe("cpu", dtype, tokens=13, experts=5, hidden=37, topk=3)


@pytest.mark.parametrize("dtype", DTYPES)
def test_moe_unpermute_without_probs_and_permute_backward(dtype):
    check_moe("cpu", dtype, tokens=11, experts=4, hidden=20, topk=2, with_probs=False)
