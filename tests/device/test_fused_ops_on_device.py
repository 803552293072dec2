"""--use-fused-rmsnorm --use-fused-swiglu --use-fused-rotary-pos-emb on the accelerator against
Megatron's own RMSNorm, SwiGLU and RoPE on the same device. The flags follow the fused-op rule
(fastest of npuspeed's kernel, the native op and Megatron's path, measured per shape): every call
is counted under what it ran, never the CPU kernel, the run without the flags counts none, losses
agree in bf16 and a step is not slower (README: never slower than the flag off). Forced onto
npuspeed's kernels (Triton on CUDA, torch_npu's on an NPU), every call runs them and the losses
still agree: the kernels themselves train on the device."""
from __future__ import annotations

import importlib.util

import pytest

from device_checks import assert_device_impl, assert_not_slower, assert_on_device, assert_parity, op_impls
from device_runs import FORCE_NPUSPEED, FUSED_KERNEL, MODEL, NO_DROPOUT, accelerator, train

pytestmark = pytest.mark.device
COVERS = ("--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb")

FLAGS = ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]
OPS = ("rms_norm", "swiglu", "rotary_pos_emb")


def test_fused_ops_follow_the_rule(tmp_path_factory):
    base = train(tmp_path_factory, MODEL + NO_DROPOUT)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + FLAGS)
    assert_on_device(base, run)
    for op in OPS:
        assert not op_impls(base, op), (op, base["npuspeed_counters"])
        assert_device_impl(run, op)
    assert_parity(base, run)
    assert_not_slower(base, run)


def test_npuspeed_kernels_train_on_the_device(tmp_path_factory):
    if accelerator() == "cuda" and importlib.util.find_spec("triton") is None:
        pytest.skip("triton is not installed: npuspeed's CUDA kernels for these ops are Triton kernels")
    base = train(tmp_path_factory, MODEL + NO_DROPOUT)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + FLAGS, env=FORCE_NPUSPEED)
    assert_on_device(base, run)
    for op in OPS:
        assert_device_impl(run, op, only=FUSED_KERNEL[accelerator()])
    assert_parity(base, run)
