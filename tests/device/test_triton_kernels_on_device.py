"""Each of npuspeed's Triton kernels against its pure-PyTorch reference on the accelerator itself:
RMSNorm (weight of x's dtype, fp32, none; fused with the residual add), SwiGLU, RoPE of q and k
in one launch, MoE permute/unpermute, forward and backward, fp32 and bf16, odd widths and the
tier's model's own sizes (device_runs.MODEL); and the reuse-fp32-param Triton codec bit for bit
against the chunked codec. The kernels are called directly (tests/kernel_vs_reference.py,
tests/codec_vs_chunked.py): one that disagrees fails here, where the fused-op rule would drop
it and run Megatron's path. A last test checks the rule and the codec offer them on this device.

On a host without an accelerator this file is the harness's own check: with TRITON_INTERPRET=1
set before triton is imported it runs on CPU tensors through Triton's interpreter, odd shapes
only (tests/unit/test_triton_device_harness.py); without it, it skips with the tier's reason.
"""
from __future__ import annotations

import pytest
import torch
from codec_vs_chunked import SPECIAL, check_codec, random_bits
from kernel_vs_reference import DTYPES, check_moe, check_rms_norm, check_rope_on_a_view, check_rope_qk, check_swiglu

from npuspeed.features.reuse_fp32_param import codec, triton_codec
from npuspeed.ops import fused_choice
from npuspeed.ops.triton import _runtime

from device_runs import FFN, GROUPS, HEADS, HIDDEN, MICRO, REASON, SEQ, accelerator

pytestmark = pytest.mark.device

COVERS = ()  # kernels, not flags: every flag's device test lives in the other files
DEVICE = "cpu" if _runtime.interpreting() else accelerator()
ON_DEVICE = DEVICE not in (None, "cpu")
MOE_EXPERTS, MOE_TOPK = 8, 2  # tests/device/test_moe_on_device.py's model


@pytest.fixture(autouse=True)
def _needs_accelerator():
    """This file's own gate (overrides the tier's fixture of this name in conftest.py): the
    accelerator, or CPU tensors under the interpreter; and triton running there."""
    if DEVICE is None:
        pytest.skip(REASON)
    if not _runtime.available() or (DEVICE != "cpu" and _runtime.device_type() != DEVICE):
        pytest.skip(f"triton does not run kernels on {DEVICE} here (importable: {_runtime.triton_importable()}, "
                    f"targets: {_runtime.device_type()}): npuspeed's {DEVICE} kernels for these ops are not Triton's")


def _sizes(odd, model):
    """Odd sizes everywhere, more and the model's on the device (the interpreter would take minutes)."""
    return odd + (model if ON_DEVICE else [])


ROWS = _sizes([(3, 1000), (17, 4099)], [(SEQ, MICRO, HIDDEN)])


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ROWS, ids=str)
def test_rms_norm(dtype, shape):
    check_rms_norm(DEVICE, dtype, shape)
    check_rms_norm(DEVICE, dtype, shape, residual=True)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("weight", [None, "fp32"])
def test_rms_norm_without_weight_or_with_an_fp32_one(dtype, weight):
    check_rms_norm(DEVICE, dtype, (17, 4099), weight=weight)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", [s[:-1] + (2 * s[-1],) for s in _sizes([(3, 1000), (17, 4099)],
                                                                       [(SEQ, MICRO, FFN)])], ids=str)
def test_swiglu(dtype, shape):
    check_swiglu(DEVICE, dtype, shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("sizes", _sizes([(7, 3, 6, 2, 80, 48), (5, 1, 5, 5, 66, 66)],
                                         [(SEQ, MICRO, HEADS, GROUPS, HIDDEN // HEADS, HIDDEN // HEADS)]), ids=str)
def test_rope_q_and_k(dtype, interleaved, sizes):
    s, b, hq, hk, d, rot = sizes  # GQA and partial rotary (d - rot channels pass), odd head counts
    check_rope_qk(DEVICE, dtype, s, b, hq, hk, d, rot, interleaved=interleaved, per_batch=interleaved)


def test_rope_on_a_strided_view():
    check_rope_on_a_view(DEVICE)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("with_probs", [True, False])
@pytest.mark.parametrize("sizes", _sizes([(9, 3, 1000, 2)], [(17, 7, 4099, 3), (SEQ * MICRO, MOE_EXPERTS, HIDDEN,
                                                                                   MOE_TOPK)]), ids=str)
def test_moe_permute_unpermute(dtype, with_probs, sizes):
    tokens, experts, hidden, topk = sizes
    check_moe(DEVICE, dtype, tokens, experts, hidden, topk, with_probs=with_probs)


@pytest.mark.parametrize("n", _sizes([1, 1000, 3 * 4099], [17 * 4099, (1 << 22) + 13]))
def test_reuse_fp32_codec(n):
    check_codec(SPECIAL, DEVICE)
    check_codec(random_bits(n, seed=n), DEVICE)


def test_the_rule_and_the_codec_offer_the_triton_kernels_here(monkeypatch):
    """What the runs of the other files take: the fused-op rule has each Triton kernel as a
    candidate at the model's sizes, and --reuse-fp32-param takes the Triton codec on CUDA
    (the chunked fallback cost +83% of a step on an H100)."""
    if DEVICE == "cpu":  # the harness: the interpreter stands in for the device
        monkeypatch.setattr(fused_choice, "TRITON_ON_HOST", True)
    x = torch.zeros(4, MICRO, HIDDEN, dtype=torch.bfloat16, device=DEVICE)
    q = torch.zeros(4, MICRO, HEADS, HIDDEN // HEADS, dtype=torch.bfloat16, device=DEVICE)
    k = torch.zeros(4, MICRO, GROUPS, HIDDEN // HEADS, dtype=torch.bfloat16, device=DEVICE)
    freqs = torch.zeros(4, 1, 1, HIDDEN // HEADS, device=DEVICE)
    offered = {
        "rms_norm": fused_choice.triton_kernel("rms_norm", "rms_norm", x, x.new_ones(HIDDEN)),
        "swiglu": fused_choice.triton_kernel("swiglu", "swiglu", x.new_zeros(4, MICRO, 2 * FFN)),
        "rope q+k": fused_choice.triton_kernel("rope", "rotary_pos_emb_qk", q, k, freqs, check="supports_qk"),
        "moe_permute": fused_choice.triton_kernel("moe_permute", "moe_permute", x.view(-1, HIDDEN)),
    }
    assert all(offered.values()), {op: fn is not None for op, fn in offered.items()}
    if DEVICE == "cuda":
        monkeypatch.delenv(codec.FORCE_ENV, raising=False)
        assert triton_codec.available("cuda") and codec.implementation_for("cuda") == "triton"
