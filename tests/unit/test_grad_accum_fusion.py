"""--gradient-accumulation-fusion without apex: the stand-in kernels, the per-shape choice,
the placeholder gradient that is a view of main_grad, and Megatron's linear layers with it.

Every path's `main_grad += dY^T X` is checked against an fp64 reference (fp32 and 16-bit
inputs, fp32 and 16-bit main_grad); Megatron's ColumnParallelLinear/RowParallelLinear, which
refuse the flag without apex, build with the feature and put the same weight gradient in
main_grad as the unfused layer computes; the counters prove which path ran.
"""
from __future__ import annotations

import pytest
import torch

from npuspeed import telemetry

FLAG = "--gradient-accumulation-fusion"


def _chooser(fixed=None):
    from npuspeed import get_accelerator
    from npuspeed.features.grad_accum_fusion.candidates import WgradPaths

    return WgradPaths(get_accelerator(), fixed=fixed)


def _inputs(rows, n, k, dtype, grad_dtype):
    g = torch.randn(rows, n).to(dtype)
    x = torch.randn(rows, k).to(dtype)
    main_grad = torch.randn(n, k).to(grad_dtype)
    expected = main_grad.double() + g.double().t() @ x.double()
    return g, x, main_grad, expected


@pytest.mark.parametrize("path", ["fused", "unfused"])
@pytest.mark.parametrize("dtype, grad_dtype, entry", [
    (torch.float32, torch.float32, "wgrad_gemm_accum_fp32"),
    (torch.bfloat16, torch.float32, "wgrad_gemm_accum_fp32"),
    (torch.float16, torch.float32, "wgrad_gemm_accum_fp32"),
    (torch.bfloat16, torch.bfloat16, "wgrad_gemm_accum_fp16"),
])
def test_stand_in_accumulates_like_the_reference(npuspeed_runtime, path, dtype, grad_dtype, entry):
    from npuspeed.features.grad_accum_fusion.wgrad import WgradAccumulator

    torch.manual_seed(0)
    g, x, main_grad, expected = _inputs(48, 24, 40, dtype, grad_dtype)
    before = telemetry.snapshot("grad_accum_fusion.")
    storage = main_grad.data_ptr()
    getattr(WgradAccumulator(_chooser(path)), entry)(x, g, main_grad)
    assert main_grad.data_ptr() == storage and main_grad.dtype == grad_dtype  # in place
    tol = 1e-5 if grad_dtype == torch.float32 and dtype == torch.float32 else 0.1
    torch.testing.assert_close(main_grad.double(), expected, atol=tol * 40, rtol=tol)
    ran = telemetry.since(before, "grad_accum_fusion.")
    name = "mm_then_add" if path == "unfused" else ("addmm_inplace" if dtype == grad_dtype else "addmm_inplace_upcast")
    assert ran == {"grad_accum_fusion.calls": 1, f"grad_accum_fusion.kernel.{name}": 1}


def test_wrong_main_grad_dtype_or_shape_is_refused(npuspeed_runtime):
    from npuspeed.features.grad_accum_fusion.wgrad import WgradAccumulator

    acc = WgradAccumulator(_chooser("fused"))
    g, x, main_grad, _ = _inputs(8, 4, 6, torch.float32, torch.float32)
    with pytest.raises(RuntimeError, match="needs a 16-bit main_grad"):
        acc.wgrad_gemm_accum_fp16(x, g, main_grad)
    with pytest.raises(RuntimeError, match="does not match"):
        acc.wgrad_gemm_accum_fp32(x, g, main_grad.t().contiguous())


def test_choice_is_measured_once_per_shape_and_never_larger(npuspeed_runtime):
    from npuspeed.features.grad_accum_fusion import kernels

    chooser = _chooser()
    notes = []
    chooser.note = notes.append
    before = telemetry.snapshot("grad_accum_fusion.")
    # bf16 inputs upcast to fp32 hold rows x (n + k) x 4 bytes, far above the n x k x 2 of the
    # unfused product when rows >> n, k: the unfused path is taken whatever the timing
    g, x, main_grad, expected = _inputs(512, 8, 8, torch.bfloat16, torch.float32)
    assert chooser.choose(g, x, main_grad) == kernels.MM_ADD
    assert chooser.choose(g, x, main_grad) == kernels.MM_ADD
    assert telemetry.since(before, "grad_accum_fusion.") == {"grad_accum_fusion.measured": 1}
    assert len(notes) == 1 and notes[0].startswith("--gradient-accumulation-fusion: torch.bfloat16 inputs")
    # fp32 in place allocates nothing: chosen unless it measured slower
    g, x, main_grad, _ = _inputs(64, 32, 32, torch.float32, torch.float32)
    record_path = chooser.choose(g, x, main_grad)
    record = next(r for key, r in chooser.choices.items() if key[1] == "float32")
    assert record_path == (kernels.ADDMM if record["addmm_inplace_ms"] <= record["mm_then_add_ms"] else kernels.MM_ADD)
    assert "measured once" in chooser.summary()


def test_deterministic_mode_decides_without_timing(npuspeed_runtime, monkeypatch):
    """--deterministic-mode promises the same bits on every run and rank: the fused and the
    unfused weight gradient round differently, so no timing may pick between them. The path
    follows from the shape alone (the fused one unless it holds more temporary bytes)."""
    from npuspeed.features.grad_accum_fusion import candidates as chooser_mod, kernels
    from npuspeed.ops.choose.trial import Clock

    def no_timing(*_a, **_k):
        raise AssertionError("timed a weight-gradient path under --deterministic-mode")

    monkeypatch.setattr(Clock, "time", no_timing)
    chooser = _chooser()
    before = telemetry.snapshot("grad_accum_fusion.")
    torch.use_deterministic_algorithms(True)
    try:
        fp32 = chooser.choose(*_inputs(64, 32, 32, torch.float32, torch.float32)[:3])
        upcast_larger = chooser.choose(*_inputs(512, 8, 8, torch.bfloat16, torch.float32)[:3])
        upcast_smaller = chooser.choose(*_inputs(4, 64, 64, torch.bfloat16, torch.float32)[:3])
    finally:
        torch.use_deterministic_algorithms(False)
    assert (fp32, upcast_larger, upcast_smaller) == (kernels.ADDMM, kernels.MM_ADD, kernels.ADDMM_UPCAST)
    assert "grad_accum_fusion.measured" not in telemetry.since(before, "grad_accum_fusion.")
    assert "--deterministic-mode" in chooser.summary()


def test_unmeasured_device_never_takes_a_larger_fused_path(npuspeed_runtime, monkeypatch):
    """Where nothing is timed on a GPU/NPU (--deterministic-mode), the rule "never larger than
    the flag off" is known from the shape: an NPU without torch_npu's matmul-add kernel has only
    the upcast fp32 GEMM, whose fp32 copies of dY and X (rows x (n + k) x 4 bytes) exceed the
    unfused n x k product when the rows outnumber n and k; there the unfused path runs. A kernel
    with no temporaries is taken."""
    from npuspeed.features.grad_accum_fusion import candidates as chooser_mod, kernels
    from npuspeed.ops.choose.trial import Clock

    class NoKernelNpu(_FakeDevice):
        def has_matmul_add_fp32(self):
            return False

    class KernelNpu(NoKernelNpu):
        def has_matmul_add_fp32(self):
            return True

    monkeypatch.setattr(Clock, "time", lambda *a, **k: pytest.fail("timed under --deterministic-mode"))
    # an fp32 main_grad on an NPU (only its device type and dtype are read)
    fake_grad = type("MainGrad", (), {"device": type("Npu", (), {"type": "npu"})(), "dtype": torch.float32})()
    torch.use_deterministic_algorithms(True)
    try:
        without = chooser_mod.WgradPaths(NoKernelNpu()).choose_shape(4096, 64, 64, torch.bfloat16, fake_grad)
        few_rows = chooser_mod.WgradPaths(NoKernelNpu()).choose_shape(4, 64, 64, torch.bfloat16, fake_grad)
        native = chooser_mod.WgradPaths(KernelNpu()).choose_shape(4096, 64, 64, torch.bfloat16, fake_grad)
    finally:
        torch.use_deterministic_algorithms(False)
    assert (without, few_rows, native) == (kernels.MM_ADD, kernels.ADDMM_UPCAST, kernels.NATIVE)


class _FakeDevice:
    """An accelerator that is not the host, for the chooser's guard and device clock: its
    events read a clock the candidates below advance (milliseconds)."""

    now = [0.0]

    class Event:
        def __init__(self, enable_timing=True):
            self.at = None

        def record(self):
            self.at = _FakeDevice.now[0]

        def synchronize(self):
            pass

        def elapsed_time(self, other):
            return other.at - self.at

    def host_is_device(self):
        return False

    def synchronize(self):
        pass

    def get_rng_state(self):
        return torch.get_rng_state()

    def set_rng_state(self, state):
        pass

    def max_memory_allocated(self):
        return 0

    max_memory_reserved = max_memory_allocated


@pytest.mark.parametrize("fused_ms, want", [(2.0, "unfused"), (0.5, "fused")])
def test_a_device_times_both_paths_with_its_events(npuspeed_runtime, monkeypatch, fused_ms, want):
    """On a GPU/NPU the fused GEMM is not always the fast one (an H100 with torch 2.11: the
    mixed-dtype addmm cost 1.084x of a step): the chooser times both paths there too, with the
    device's events, and keeps Megatron's where the fused one is slower."""
    from npuspeed.features.grad_accum_fusion import candidates as chooser_mod, kernels
    from npuspeed.ops.choose.trial import Clock

    monkeypatch.setattr(Clock, "cpu", lambda self, inputs: False)  # the inputs "live on the device"
    # few rows: the fused upcast's fp32 copies (4 x 128 x 4 B) are smaller than the unfused product
    g, x, main_grad, _ = _inputs(4, 64, 64, torch.bfloat16, torch.float32)
    fused = kernels.candidates("cpu", torch.bfloat16, torch.float32, None)[0]

    def costing(ms):
        def run(*args):
            _FakeDevice.now[0] += ms
        return run

    monkeypatch.setitem(kernels.RUN, fused, costing(fused_ms))
    monkeypatch.setitem(kernels.RUN, kernels.MM_ADD, costing(1.0))
    before = telemetry.snapshot("grad_accum_fusion.")
    path = chooser_mod.WgradPaths(_FakeDevice()).choose(g, x, main_grad)
    assert path == {"unfused": kernels.MM_ADD, "fused": fused}[want]
    assert telemetry.since(before, "grad_accum_fusion.").get("grad_accum_fusion.measured") == 1


def test_candidates_per_device(npuspeed_runtime):
    from npuspeed.features.grad_accum_fusion import kernels

    class Npu:
        def has_matmul_add_fp32(self):
            return True

    bf16, fp32 = torch.bfloat16, torch.float32
    assert kernels.candidates("npu", bf16, fp32, Npu())[0] == kernels.NATIVE
    assert kernels.candidates("npu", fp32, fp32, Npu())[0] == kernels.ADDMM
    assert kernels.candidates("cuda", bf16, fp32, None)[0] == kernels.OUT_DTYPE
    assert kernels.candidates("cpu", bf16, fp32, None)[0] == kernels.ADDMM_UPCAST
    assert kernels.candidates("cpu", bf16, bf16, None)[0] == kernels.ADDMM


def test_npu_kernel_is_called_with_torch_npu_argument_order(npuspeed_runtime):
    from npuspeed.features.grad_accum_fusion import kernels

    calls = []

    class Npu:
        def matmul_add_fp32(self, grad_output, total_input, main_grad):
            calls.append((grad_output, total_input, main_grad))

    g, x, main_grad, _ = _inputs(4, 3, 5, torch.bfloat16, torch.float32)
    kernels.RUN[kernels.NATIVE](g, x, main_grad, Npu())
    assert calls == [(g, x, main_grad)]


def _npu_accelerator(fake_torch_npu):
    """The NPU backend over a fake torch_npu, its probe running on the CPU."""
    from npuspeed.accelerator.npu import NpuAccelerator

    acc = NpuAccelerator.__new__(NpuAccelerator)  # no torch_npu here: hand it the fake module
    acc.torch_npu = fake_torch_npu
    acc.device = lambda index=None: torch.device("cpu")
    acc.synchronize = lambda device=None: None
    return acc


def test_npu_backend_finds_torch_npus_matmul_add():
    """torch_npu registers the ATB kernel as `torch_npu._npu_matmul_add_fp32(x, weight, C)`
    (C += x^T @ weight), the only name in its wheels 2.6.0-2.14.0; `npu_matmul_add_fp32`
    (MindSpeed's own op) is not torch_npu's and is not looked for."""
    calls = []
    fake = type("TorchNpu", (), {"_npu_matmul_add_fp32": staticmethod(lambda x, w, c: calls.append((x, w, c)))})()
    acc = _npu_accelerator(fake)
    g, x, main_grad, _ = _inputs(4, 3, 5, torch.bfloat16, torch.float32)
    assert acc.has_matmul_add_fp32() and acc.matmul_add_fp32_missing() is None
    acc.matmul_add_fp32(g, x, main_grad)
    assert calls[-1] == (g, x, main_grad) and len(calls) == 2  # the probe, then the call
    plain = _npu_accelerator(type("TorchNpu", (), {"npu_matmul_add_fp32": staticmethod(pytest.fail)})())
    assert not plain.has_matmul_add_fp32()
    assert not _npu_accelerator(object()).has_matmul_add_fp32()


def test_npu_matmul_add_without_nnal_takes_the_portable_path(npuspeed_runtime):
    """torch_npu sets `_npu_matmul_add_fp32` as a lazy wrapper (op_plugin/atb/_atb_ops.py) that
    loads the ATB library on the first call and raises OSError where the NNAL package is
    missing: the name is there, the kernel is not. The accelerator probes it once and reports it
    absent; the chooser takes the portable path (no crash at the first backward) and says why,
    once in the log and in the report line."""
    from npuspeed.features.grad_accum_fusion import candidates as chooser_mod, kernels

    probes = []

    def lazy_atb(*_args):
        probes.append(1)
        raise OSError(2, "Please check that the nnal package is installed.")

    acc = _npu_accelerator(type("TorchNpu", (), {"_npu_matmul_add_fp32": staticmethod(lazy_atb)})())
    assert not acc.has_matmul_add_fp32() and not acc.has_matmul_add_fp32()
    assert probes == [1] and "NNAL/ATB" in acc.matmul_add_fp32_missing()
    notes = []
    chooser = chooser_mod.WgradPaths(acc, notes.append)
    fake_grad = type("MainGrad", (), {"device": type("Npu", (), {"type": "npu"})(), "dtype": torch.float32})()
    torch.use_deterministic_algorithms(True)  # the bytes rule (a fake NPU's main_grad cannot be timed)
    try:
        paths = {chooser.choose_shape(rows, 64, 64, torch.bfloat16, fake_grad) for rows in (4096, 4)}
    finally:
        torch.use_deterministic_algorithms(False)
    assert paths == {kernels.MM_ADD, kernels.ADDMM_UPCAST}
    said = [n for n in notes if "NNAL/ATB" in n]
    assert len(said) == 1 and "_npu_matmul_add_fp32" in said[0]
    assert "NNAL/ATB" in chooser.summary()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_storage_view_shares_main_grad(dtype):
    from npuspeed.features.grad_accum_fusion.placeholder import storage_view

    buffer = torch.zeros(100)
    main_grad = buffer[10:70].view(6, 10)
    view = storage_view(main_grad, dtype)
    assert view.shape == (6, 10) and view.dtype == dtype and view.is_contiguous()
    assert view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
    assert view.data_ptr() == main_grad.data_ptr()
    assert storage_view(torch.zeros(4, 4, dtype=torch.bfloat16), torch.float32) is None  # wider


def test_feature_flag_path_and_refusal(npuspeed_runtime):
    from feature_ctx import ctx_for

    from npuspeed.features.base import FeatureError
    from npuspeed.features.grad_accum_fusion import GradAccumFusionFeature

    feature = GradAccumFusionFeature()
    off = ctx_for([])
    assert not feature.enabled(off.args) and feature.path(off) == "off"
    on = ctx_for([FLAG])
    assert feature.enabled(on.args)
    feature.validate(on)
    feature.prepare(on)
    assert "stand-in for fused_weight_gradient_mlp_cuda" in feature.path(on)
    bad = ctx_for([FLAG, "--defer-embedding-wgrad-compute"])
    with pytest.raises(FeatureError, match=r"^--gradient-accumulation-fusion: .*drop --defer-embedding-wgrad-compute"):
        feature.validate(bad)


def _linear_pair(kind, config_kw, fused: bool):
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(num_layers=1, hidden_size=16, num_attention_heads=2, use_cpu_initialization=True,
                               gradient_accumulation_fusion=fused, **config_kw)
    torch.manual_seed(3)
    init = torch.nn.init.normal_
    if kind == "column":
        return ColumnParallelLinear(16, 24, config=config, init_method=init, bias=False, gather_output=False)
    return RowParallelLinear(24, 16, config=config, init_method=init, bias=False, input_is_parallel=True,
                             skip_bias_add=True)


def test_megatron_refuses_without_the_feature(megatron_mp):
    with pytest.raises(RuntimeError, match="fused_weight_gradient_mlp_cuda"):
        _linear_pair("column", {}, fused=True)


@pytest.mark.parametrize("kind", ["column", "row"])
@pytest.mark.parametrize("path", ["fused", "unfused"])
def test_megatron_linear_accumulates_into_main_grad(megatron_mp, with_features, monkeypatch, kind, path):
    monkeypatch.setenv("NPUSPEED_WGRAD_PATH", path)
    with with_features([FLAG]):
        layer = _linear_pair(kind, {}, fused=True)
        ref = _linear_pair(kind, {}, fused=False)
        ref.load_state_dict(layer.state_dict())
        weight = layer.weight
        weight.main_grad = torch.zeros_like(weight, dtype=torch.float32)
        weight.grad_added_to_main_grad = False  # as Megatron's DDP sets it
        seen = []

        def ddp_hook(p):  # what Megatron's DDP hook does with the grad autograd hands it
            seen.append((p.grad.shape, p.grad.data_ptr()))
            if not p.grad_added_to_main_grad:
                p.main_grad.add_(p.grad)
            p.grad = None

        weight.register_post_accumulate_grad_hook(ddp_hook)
        x = torch.randn(5, 2, layer.weight.shape[1], requires_grad=True)
        before = telemetry.snapshot("grad_accum_fusion.")
        for _ in range(2):  # two micro-batches accumulate
            layer(x)[0].square().sum().backward()
        x_ref = x.detach().clone().requires_grad_(True)
        for _ in range(2):
            ref(x_ref)[0].square().sum().backward()
        torch.testing.assert_close(weight.main_grad, ref.weight.grad, atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(x.grad, x_ref.grad)
        ran = telemetry.since(before, "grad_accum_fusion.")
        if path == "fused":
            # the placeholder handed to autograd is main_grad's own storage: no [n, k] temporary
            assert weight.grad_added_to_main_grad is True
            assert ran == {"grad_accum_fusion.calls": 2, "grad_accum_fusion.kernel.addmm_inplace": 2,
                           "grad_accum_fusion.placeholder_views": 2}
            assert seen == [(weight.shape, weight.main_grad.data_ptr())] * 2
        else:
            # Megatron's unfused backward ran: the grad is a real product, added by the caller
            assert ran == {"grad_accum_fusion.unfused_calls": 2}
            assert weight.grad_added_to_main_grad is False
            assert all(ptr != weight.main_grad.data_ptr() for _, ptr in seen)


def test_registry_never_rebinds_shared_constants_or_absent_names():
    """Patching a flag (False -> True) or providing a missing name must not rewrite every
    module attribute that happens to hold the same False or None."""
    import sys
    import types

    from npuspeed.patching.registry import PatchRegistry

    owner, bystander = types.ModuleType("gf_owner"), types.ModuleType("gf_bystander")
    owner.available, bystander.flag, bystander.nothing = False, False, None
    sys.modules.update(gf_owner=owner, gf_bystander=bystander)
    try:
        registry = PatchRegistry()
        registry.register("gf_owner.available", True, feature="t", megatron=None)
        registry.register("gf_owner.kernel", object(), feature="t", megatron=None, if_missing=True)
        registry.apply()
        assert owner.available is True and owner.kernel is not None
        assert bystander.flag is False and bystander.nothing is None
        registry.revert()
        assert owner.available is False and not hasattr(owner, "kernel")
    finally:
        del sys.modules["gf_owner"], sys.modules["gf_bystander"]


def test_a_model_built_without_the_config_setting_is_refused(npuspeed_runtime):
    import types

    from feature_ctx import ctx_for

    from npuspeed.features.grad_accum_fusion import GradAccumFusionFeature

    ctx = ctx_for([FLAG])
    feature = GradAccumFusionFeature()
    off = types.SimpleNamespace(config=types.SimpleNamespace(gradient_accumulation_fusion=False))
    on = types.SimpleNamespace(config=types.SimpleNamespace(gradient_accumulation_fusion=True))
    assert feature.check_built(on, ctx) is None
    assert feature.check_built(off, ctx).startswith(f"{FLAG}: this model's TransformerConfig has "
                                                    "gradient_accumulation_fusion=False")


def test_gtp_remat_backward_is_left_to_megatron():
    """megatron-core 0.17+: under GTP weight rematerialisation (`gtp_remat_size > 1`) Megatron
    turns the fusion off inside the backward (the weight is a shard whose gradient it
    reduce-scatters): the wrapper neither asks the chooser nor hides grad_added_to_main_grad."""
    import types

    from npuspeed.features.grad_accum_fusion import placeholder

    class NoChoice:
        def choose_shape(self, *args):
            raise AssertionError("the chooser was asked about a GTP backward")

    weight = torch.zeros(4, 3)
    weight.grad_added_to_main_grad = False
    seen = []

    def backward(ctx, grad_output):
        seen.append(hasattr(weight, "grad_added_to_main_grad"))
        return (None, torch.ones(4, 3), None) + (None,) * 7  # the 0.17+ 10-tuple

    ctx = types.SimpleNamespace(saved_tensors=(torch.zeros(2, 3), weight), gradient_accumulation_fusion=True,
                                main_grad=torch.zeros(4, 3), gtp_remat_size=2)
    grads = placeholder.layer_backward(NoChoice())(backward)(ctx, torch.zeros(2, 4))
    assert seen == [True] and len(grads) == 10 and torch.equal(grads[1], torch.ones(4, 3))
