"""--use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb on the accelerator against
Megatron's own RMSNorm, SwiGLU and RoPE on the same device: every op ran npuspeed's device path
(torch_npu's kernel on an NPU; never the CPU kernel) in every layer, the run without the flags ran
none of them, losses agree in bf16, and the flags do not slow a step down (README: never slower
than the flag off)."""
from __future__ import annotations

import pytest

from device_runs import (
    MODEL, NO_DROPOUT, assert_device_impl, assert_not_slower, assert_on_device, assert_parity, op_impls, train,
)

pytestmark = pytest.mark.device

FLAGS = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
OPS = ("rms_norm", "swiglu", "rotary_pos_emb")


def test_fused_ops(tmp_path_factory):
    base = train(tmp_path_factory, MODEL + NO_DROPOUT)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + FLAGS)
    assert_on_device(base, run)
    for op in OPS:
        assert not op_impls(base, op), (op, base["npuspeed_counters"])
        assert_device_impl(run, op)
    assert_parity(base, run)
    assert_not_slower(base, run)
