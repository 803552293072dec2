"""npuspeed.step_profile on made-up traces: kernel names sorted into the categories (CUDA,
cuBLAS, flash, NCCL, and the host's aten names), the optimizer span taking the elementwise
kernels launched in it, idle time as the step's wall time no kernel covers (overlapping
streams counted once), the host mode's self times, and the top kernels."""
from __future__ import annotations

import pytest

from npuspeed import step_profile
from npuspeed.step_profile import OPTIMIZER, STEP, breakdown, classify, self_times


@pytest.mark.parametrize("name,category", [
    ("sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x256x64", "gemm"),
    ("nvjet_tst_192x192_64x3_2x1_v_bz_coopB_NNT", "gemm"),
    ("void cutlass::Kernel2<cutlass_80_wmma_tensorop_bf16_s161616gemm_bf16_16x16_128x2_tn_align8>", "gemm"),
    ("aten::mm", "gemm"), ("aten::addmm", "gemm"), ("aten::bmm", "gemm"), ("gemv2T_kernel_val<int, int>", "gemm"),
    ("void splitKreduce_kernel<32, 16, int, float>", "gemm"),
    ("void pytorch_flash::flash_bwd_dq_dk_dv_loop_seqk_parallel_kernel<Flash_bwd_kernel_traits<128>>", "attention"),
    ("fmha_cutlassF_bf16_aligned_64x128_rf_sm80", "attention"),
    ("aten::_scaled_dot_product_flash_attention_for_cpu", "attention"),
    ("npuspeed::flash_attention_fp32_backward", "attention"),
    ("triton_per_fused__fused_rms_norm_0", "norm"), ("npuspeed::rms_norm_backward", "norm"),
    ("aten::native_layer_norm", "norm"),
    ("ncclDevKernel_AllReduce_Sum_f32_RING_LL(ncclDevKernelArgsStorage<4096ul>)", "communication"),
    ("gloo:all_reduce", "communication"), ("c10d::allreduce_", "communication"),
    ("void at::native::multi_tensor_apply_kernel<FusedAdamMathFunctor>", "optimizer"),
    ("void at::native::vectorized_elementwise_kernel<4, at::native::silu_kernel>", "elementwise"),
    ("aten::mul", "elementwise"), ("void at::native::(anonymous)::cunn_SoftMaxForward", "elementwise"),
    ("Memcpy HtoD (Pinned -> Device)", "memcpy"),
])
def test_names_fall_into_their_categories(name, category):
    assert classify(name) == category


def test_python_autograd_functions_are_the_host_s_framework_time():
    assert classify("MulBackward0", cat="cpu_op") == classify("CheckpointFunctionBackward", cat="cpu_op") == "idle"
    assert classify("_Flash", cat="cpu_op") == "attention"  # a name pattern comes first
    assert classify("autograd::engine::evaluate_function: MmBackward0", cat="cpu_op") == "idle"
    assert classify("aten::mul", cat="cpu_op") == "elementwise"
    assert classify("GeneratedBackwardFor_npuspeed_rms_norm_defaultBackward", cat="cpu_op") == "norm"
    assert classify("MulBackward0", cat="kernel") == "elementwise"  # a device kernel is work whatever its name


def test_the_optimizer_span_and_communication_come_before_names():
    assert classify("void at::native::vectorized_elementwise_kernel<4, mul>", in_optimizer=True) == "optimizer"
    assert classify("ncclDevKernel_AllReduce_Sum_f32_RING_LL", in_optimizer=True) == "communication"
    assert classify("whatever copy", cat="gpu_memcpy") == "memcpy"


def _x(name, ts, dur, cat="kernel", tid=7):
    return {"name": name, "cat": cat, "ts": ts, "dur": dur, "tid": tid, "ph": "X"}


def test_device_breakdown_idle_overlap_and_top():
    events = [
        _x(STEP, 0, 1000, "user_annotation", tid=1), _x(OPTIMIZER, 800, 190, "user_annotation", tid=1),
        _x("sm90_xmma_gemm_bf16", 10, 300), _x("sm90_xmma_gemm_bf16", 320, 200),
        _x("flash_fwd_kernel", 530, 100),
        _x("ncclDevKernel_AllReduce", 400, 200, tid=8),  # another stream, overlapping the GEMM and flash
        _x("triton_red_fused_rms_norm", 650, 50),
        _x("vectorized_elementwise_kernel<mul>", 810, 100),  # in the optimizer span
        _x("Memcpy DtoH", 950, 20, cat="gpu_memcpy"),  # in the optimizer span: the optimizer's
        _x("sm90_xmma_gemm_bf16", 1500, 300),  # outside the step: not counted
    ]
    got = breakdown(events, top=3)
    assert got["mode"] == "device" and got["steps"] == 1 and got["step_ms"] == pytest.approx(1.0)
    ms = got["ms"]
    assert ms["gemm"] == pytest.approx(0.5) and ms["attention"] == pytest.approx(0.1)
    assert ms["communication"] == pytest.approx(0.2) and ms["norm"] == pytest.approx(0.05)
    assert ms["optimizer"] == pytest.approx(0.12) and ms["elementwise"] == 0.0
    # busy: [10, 310] + [320, 630] (GEMM, all-reduce, flash) + [650, 700] + [810, 910] + [950, 970]
    assert got["busy_ms"] == pytest.approx(0.78) and ms["idle"] == pytest.approx(0.22)
    assert got["overlap_ms"] == pytest.approx(0.19)  # kernels 0.97 ms in all, 0.78 ms of it busy
    assert got["share"]["gemm"] == pytest.approx(0.5)
    assert [t["name"] for t in got["top"]] == ["sm90_xmma_gemm_bf16", "ncclDevKernel_AllReduce", "flash_fwd_kernel"]
    assert got["top"][0]["calls"] == 2 and got["top"][0]["ms"] == pytest.approx(0.5)


def test_two_profiled_steps_are_reported_per_step():
    events = [_x(STEP, 0, 100, "user_annotation"), _x(STEP, 200, 100, "user_annotation"),
              _x("gemm_a", 0, 50), _x("gemm_a", 200, 70)]
    got = breakdown(events)
    assert got["steps"] == 2 and got["ms"]["gemm"] == pytest.approx(0.06) and got["ms"]["idle"] == pytest.approx(0.04)


def test_host_mode_counts_self_time_on_the_step_thread():
    events = [
        _x(STEP, 0, 1000, "user_annotation", tid=1), _x(OPTIMIZER, 700, 250, "user_annotation", tid=1),
        _x("aten::linear", 10, 400, "cpu_op", tid=1), _x("aten::mm", 20, 380, "cpu_op", tid=1),
        _x("aten::empty", 30, 10, "cpu_op", tid=1),  # inside aten::mm: its self time leaves mm's
        _x("npuspeed::rms_norm", 420, 100, "cpu_op", tid=1),
        _x("aten::add_", 710, 200, "cpu_op", tid=1),  # in the optimizer span
        _x("aten::mul", 530, 20, "cpu_op", tid=1), _x("aten::mul", 920, 10, "cpu_op", tid=1),  # the second: optimizer
        _x("autograd::engine::evaluate_function: MulBackward0", 560, 60, "cpu_op", tid=1),
        _x("MulBackward0", 565, 50, "cpu_op", tid=1),  # the engine's and the node's own time: framework
        _x("aten::mm", 10, 500, "cpu_op", tid=2),  # another thread (a data loader): not the step's
    ]
    got = breakdown(events)
    assert got["mode"] == "host"
    # gemm: linear's self 20 + mm's self 370; elementwise: empty 10 + mul 20; norm 100; optimizer 200 + 10
    assert got["ms"]["gemm"] == pytest.approx(0.39) and got["ms"]["elementwise"] == pytest.approx(0.03)
    assert got["ms"]["norm"] == pytest.approx(0.1) and got["ms"]["optimizer"] == pytest.approx(0.21)
    assert got["ms"]["idle"] == pytest.approx(1.0 - 0.73)  # the 60 ms of autograd bookkeeping included
    top = {(t["name"], t["category"]): t["ms"] for t in got["top"]}
    assert top[("aten::mul", "elementwise")] == pytest.approx(0.02) and top[("aten::mul", "optimizer")] == 0.01
    assert top[("MulBackward0", "idle")] == pytest.approx(0.05)


def test_self_times_of_nested_ops():
    ops = [_x("a", 0, 100, "cpu_op"), _x("b", 10, 30, "cpu_op"), _x("c", 15, 5, "cpu_op"), _x("d", 50, 40, "cpu_op")]
    assert {op["name"]: t for op, t in self_times(ops)} == {"a": 30, "b": 25, "c": 5, "d": 40}


def test_a_trace_without_a_step_span_is_refused():
    with pytest.raises(ValueError, match="npuspeed/step"):
        breakdown([_x("gemm", 0, 10)])


def test_trace_events_keeps_complete_events():
    trace = {"traceEvents": [_x("a", 0, 1), {"name": "thread_name", "ph": "M"}, {"name": "f", "ph": "s", "ts": 1}]}
    assert [e["name"] for e in step_profile.trace_events(trace)] == ["a"]


def _profiling():
    import os
    import sys

    examples = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    from gpt_example import profiling
    return profiling


def test_the_example_s_profiler_on_a_toy_loop():
    """The example's StepProfiler (Megatron-LM's --profile-step-start/-end) with torch.profiler
    on CPU: the warm-up and profiled iterations are marked perturbed, the breakdown has the
    loop's matmul as GEMM and the update inside the optimizer span as the optimizer."""
    import argparse

    import torch

    args = argparse.Namespace(profile=True, profile_step_start=2, profile_step_end=3, profile_ranks=[0],
                              profile_dir=None, train_iters=4)
    prof = _profiling().StepProfiler(args, rank=0)
    w = torch.randn(128, 128, requires_grad=True)
    x = torch.randn(256, 128)
    perturbed = []
    for it in range(4):
        prof.begin(it)
        (x @ w).square().sum().backward()
        with prof.optimizer():
            with torch.no_grad():
                w.add_(w.grad, alpha=-1e-3)
        prof.end_step(it, last=it == 3)
        perturbed.append(prof.perturbed(it))
    assert perturbed == [False, True, True, False]
    got = prof.summary()
    assert got["iterations"] == [3, 3] and got["steps"] == 1 and got["mode"] == "host" and got["trace"] is None
    assert got["ms"]["gemm"] > 0 and got["ms"]["optimizer"] > 0 and got["ms"]["elementwise"] > 0
    assert got["top"][0]["name"] == "aten::mm"


def test_a_profile_window_that_profiles_nothing_is_one_clear_error():
    import argparse

    from npuspeed.errors import UserError

    profiling = _profiling()
    base = dict(profile=True, profile_step_start=10, profile_step_end=12, train_iters=6)
    with pytest.raises(UserError, match="--profile-step-start 10 is not below --train-iters 6"):
        profiling.check(argparse.Namespace(**base))
    with pytest.raises(UserError, match="0 <= start < end"):
        profiling.check(argparse.Namespace(**{**base, "profile_step_start": 3, "profile_step_end": 3}))
    profiling.check(argparse.Namespace(**{**base, "profile": False}))  # no --profile: nothing to check
