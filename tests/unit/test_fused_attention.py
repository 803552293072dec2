"""--use-flash-attn against Megatron's own unfused DotProductAttention, on one gloo rank.

The same module instance runs unpatched (Megatron's baddbmm + masked softmax + bmm) and
patched (the fused path); outputs and input gradients must match at fp32 <= 1e-5 and
bf16 <= 2e-2, and the call counter must show the fused kernel ran (so a silent fallback to
Megatron's code could not pass). Also: the memory claim, the report text, and the errors.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from npuspeed.features.fused_attention.candidates import SDPA, UNFUSED
from npuspeed.features.fused_attention.forward import CPU_FLASH, CPU_FLASH_FP32

TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def make_attention(heads=4, groups=None, d=16, dtype=torch.float32, mask_type="causal", layer_number=1,
                   dropout=0.0, softmax_scale=None, **config):
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    cfg = TransformerConfig(
        num_layers=4, hidden_size=heads * d, num_attention_heads=heads, num_query_groups=groups or heads,
        kv_channels=d, attention_dropout=dropout, use_cpu_initialization=True,
        bf16=dtype == torch.bfloat16, params_dtype=dtype, **config,
    )
    return DotProductAttention(cfg, layer_number, AttnMaskType[mask_type], "self", softmax_scale=softmax_scale)


def make_inputs(s, b, heads, groups, d, dtype, seed=0, sk=None):
    gen = torch.Generator().manual_seed(seed)
    sk = sk or s
    q = torch.randn(s, b, heads, d, generator=gen).to(dtype)
    k = torch.randn(sk, b, groups, d, generator=gen).to(dtype)
    v = torch.randn(sk, b, groups, d, generator=gen).to(dtype)
    # Output gradient of std 1/4: dV sums it over heads x queries, and at std 1 bf16 grads reach
    # 4-8, where one bf16 ulp is 0.03; scaled, every compared tensor is O(1) and 2e-2 is ~2 ulps.
    grad = (0.25 * torch.randn(s, b, heads * d, generator=gen)).to(dtype)
    return q, k, v, grad


def run(module, q, k, v, grad, mask):
    q, k, v = (t.detach().clone().requires_grad_(True) for t in (q, k, v))
    out = module(q, k, v, mask)
    out.backward(grad)
    return out.detach(), q.grad, k.grad, v.grad


def compare(module, inputs, mask, with_features, flags=("--use-flash-attn",), dtype=torch.float32,
            arbitrary=False):
    """Unfused vs fused on the same module; returns the fused call record. `arbitrary`: the
    mask is not per-row key ranges, so the call goes to the measured fallback."""
    from npuspeed import telemetry
    from npuspeed.features.fused_attention import kernel_calls

    ref = run(module, *inputs, mask)
    with with_features(list(flags)):
        before = sum(kernel_calls().get(k, 0) for k in FUSED_KERNELS)
        got = run(module, *inputs, mask)
        assert sum(kernel_calls().get(k, 0) for k in FUSED_KERNELS) == before + 1, "the fused path did not run"
        record = telemetry.last("attention")
        assert record["kernel"] in expected_kernels(dtype, arbitrary, inputs[0].shape[-1]), record
    for name, a, b in zip(("out", "dq", "dk", "dv"), ref, got):
        assert a.shape == b.shape and a.dtype == b.dtype, name
        err = (a.float() - b.float()).abs().max().item()
        assert err <= TOL[dtype], f"{name}: max abs diff {err:.3g} > {TOL[dtype]}"
    return record


DTYPES = [torch.float32, torch.bfloat16]
FUSED_KERNELS = (SDPA, UNFUSED, CPU_FLASH, CPU_FLASH_FP32)


def expected_kernels(dtype, arbitrary: bool, head_dim: int = 16) -> set:
    """npuspeed's CPU kernel for its dtype where the mask is per-row key ranges (bf16 on the
    fp32 kernel where the bf16 one is absent), else the measured fallback (SDPA or Megatron's
    unfused forward)."""
    from npuspeed.ops.flash_attention import fp32_reason, machine_reason

    if arbitrary or fp32_reason() is not None:
        return {SDPA, UNFUSED}
    if dtype == torch.bfloat16 and machine_reason() is None and head_dim % 16 == 0:
        return {CPU_FLASH}
    return {CPU_FLASH_FP32}


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("groups", [1, 2, 4])
@pytest.mark.parametrize("s", [16, 37])
def test_causal_gqa_parity(megatron_mp, with_features, dtype, groups, s):
    module = make_attention(heads=4, groups=groups, dtype=dtype)
    record = compare(module, make_inputs(s, 2, 4, groups, 16, dtype), None, with_features, dtype=dtype)
    assert record["causal"] and record["gqa"] == (groups != 4) and record["mask"] == "causal"


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
@pytest.mark.parametrize("s", [24, 31])
def test_padding_mask_parity(megatron_mp, with_features, dtype, s):
    module = make_attention(heads=4, groups=2, dtype=dtype, mask_type="padding")
    lengths = torch.tensor([s, s - 5, 3])
    pad = torch.arange(s)[None, :] >= lengths[:, None]  # True = padding = masked out
    mask = pad[:, None, None, :]  # [b, 1, 1, s]: keys only
    record = compare(module, make_inputs(s, 3, 4, 2, 16, dtype, seed=1), mask, with_features, dtype=dtype)
    assert record["mask"] == "attention_mask" and not record["causal"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_packed_documents_and_causal_padding_masks_run_the_kernel(megatron_mp, with_features, dtype):
    """Megatron's reset-attention-mask masks (block-diagonal causal documents) and causal |
    key padding are one key interval per row: npuspeed's kernel runs them, with dropout off,
    matching Megatron; the mask is read into ranges once and reused by the next layer."""
    s = 40
    causal = torch.ones(s, s, dtype=torch.bool).triu(1)
    doc = torch.tensor([0] * 13 + [1] * 20 + [2] * 7)
    packed = (~(doc[:, None] == doc[None, :]) | causal)[None, None].expand(2, 1, s, s)
    record = compare(make_attention(groups=2, dtype=dtype), make_inputs(s, 2, 4, 2, 16, dtype, seed=6), packed,
                     with_features, dtype=dtype)
    assert record["mask"] == "attention_mask" and record["masked"]
    pad = torch.arange(s)[None, :] >= torch.tensor([s, 29])[:, None]
    mixed = (causal[None] | pad[:, None, :])[:, None]
    compare(make_attention(dtype=dtype), make_inputs(s, 2, 4, 4, 16, dtype, seed=7), mixed, with_features, dtype=dtype)


def test_bf16_head_dim_the_bf16_kernel_does_not_tile_runs_on_the_fp32_kernel(megatron_mp, with_features):
    record = compare(make_attention(heads=2, d=24, dtype=torch.bfloat16), make_inputs(30, 2, 2, 2, 24, torch.bfloat16),
                     None, with_features, dtype=torch.bfloat16)
    from npuspeed.ops.flash_attention import fp32_reason, machine_reason

    if fp32_reason() is None and machine_reason() is None:
        assert record["kernel"] == CPU_FLASH_FP32 and "multiple of 16" in record["why"]


def test_query_and_key_padding_has_fully_masked_rows(megatron_mp, with_features):
    """Padded query rows are masked entirely: Megatron gives them mean(V); so must we."""
    s = 19
    module = make_attention(heads=2, mask_type="padding")
    pad = torch.arange(s)[None, :] >= torch.tensor([s, 11])[:, None]
    mask = (pad[:, None, :, None] | pad[:, None, None, :])  # [b, 1, s, s]
    compare(module, make_inputs(s, 2, 2, 2, 16, torch.float32, seed=2), mask, with_features)


def test_arbitrary_mask_and_no_mask(megatron_mp, with_features):
    s = 21
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 1, s, s, generator=gen) < 0.3
    compare(make_attention(mask_type="arbitrary"), make_inputs(s, 2, 4, 4, 16, torch.float32), mask, with_features,
            arbitrary=True)
    record = compare(make_attention(mask_type="no_mask"), make_inputs(s, 2, 4, 4, 16, torch.float32), None,
                     with_features)
    assert record["mask"] == "none" and not record["causal"]


def test_explicit_causal_mask_runs_as_is_causal(megatron_mp, with_features):
    s = 33
    mask = torch.ones(s, s, dtype=torch.bool).triu(1)[None, None].expand(2, 1, s, s)
    record = compare(make_attention(), make_inputs(s, 2, 4, 4, 16, torch.float32), mask, with_features)
    assert record["causal"] and "recognised" in record["mask"]


@pytest.mark.parametrize("dtype", DTYPES, ids=["fp32", "bf16"])
def test_scale_and_query_key_layer_scaling(megatron_mp, with_features, dtype):
    inputs = make_inputs(17, 2, 4, 4, 16, dtype, seed=4)
    module = make_attention(dtype=dtype, layer_number=3, apply_query_key_layer_scaling=True)
    record = compare(module, inputs, None, with_features, dtype=dtype)
    assert record["scale"] == pytest.approx(1 / 4.0)  # 1/sqrt(16), the layer number cancels
    module = make_attention(dtype=dtype, softmax_scale=0.37, layer_number=2, apply_query_key_layer_scaling=True)
    record = compare(module, inputs, None, with_features, dtype=dtype)
    assert record["scale"] == pytest.approx(0.37)


def make_windowed(window):
    """DotProductAttention with window_size, or skip where Megatron (< 0.15) refuses it."""
    try:
        module = make_attention(window_size=window)
    except AssertionError as exc:  # "Sliding Window Attention is only supported by TE..."
        pytest.skip(f"this megatron-core has no window_size in DotProductAttention: {exc}")
    if getattr(module.scale_mask_softmax, "window_size", None) is None:
        pytest.skip("this megatron-core has no window_size in DotProductAttention")
    return module


def band_mask(s, left, right):
    """Megatron's polarity (True = masked out) for the band -left <= j - i <= right."""
    rel = torch.arange(s)[None, :] - torch.arange(s)[:, None]
    return ~((rel >= -left) & (rel <= right))[None, None]


def test_window_size_parity(megatron_mp, with_features):
    """Megatron (>= 0.15) honours window_size with a sliding-window mask; so does the band path."""
    module = make_windowed((5, 0))
    record = compare(module, make_inputs(23, 2, 4, 4, 16, torch.float32), None, with_features)
    assert record["band"] == (5, 0) and record["mask"] == "window_size"


@pytest.mark.parametrize("mask_type, pre, nxt", [("causal", 5, 0), ("no_mask", 3, 2), ("causal", 4, 7)])
def test_pre_next_tockens_band(megatron_mp, with_features, mask_type, pre, nxt):
    """--pre-tockens/--next-tockens == Megatron given the same band as an explicit mask
    (a causal layer keeps next = 0 whatever --next-tockens says, as on NPU)."""
    from npuspeed import telemetry

    s = 23
    module = make_attention(mask_type=mask_type)
    inputs = make_inputs(s, 2, 4, 4, 16, torch.float32, seed=5)
    ref = run(module, *inputs, band_mask(s, pre, 0 if mask_type == "causal" else nxt))
    with with_features(["--use-flash-attn", "--pre-tockens", str(pre), "--next-tockens", str(nxt)]):
        got = run(module, *inputs, None)
        assert telemetry.last("attention")["band"] == (pre, 0 if mask_type == "causal" else nxt)
    for a, b in zip(ref, got):
        assert (a - b).abs().max().item() <= 1e-5


def test_explicit_mindspeed_defaults_are_plain_causal(megatron_mp, with_features):
    """MindSpeed scripts pass --pre-tockens 65536 --next-tockens 0: for S < 65536 that is causal."""
    record = compare(make_attention(), make_inputs(20, 1, 4, 4, 16, torch.float32), None, with_features,
                     flags=("--use-flash-attn", "--pre-tockens", "65536", "--next-tockens", "0"))
    assert record["causal"] and record["band"] is None


def test_dropout_is_drawn_inside_the_model_parallel_tracker(megatron_mp, with_features):
    """Dropout consumes the tracker's model-parallel state, not the default device state."""
    from megatron.core import tensor_parallel

    acc = megatron_mp.accelerator
    module = make_attention(dropout=0.5)
    module.train()
    q, k, v, _ = make_inputs(16, 1, 4, 4, 16, torch.float32)
    tracker = tensor_parallel.get_cuda_rng_tracker()
    with with_features(["--use-flash-attn"]), acc.device_rng_scope():
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        default_before = acc.get_rng_state().clone()
        tracked_before = {n: s.clone() for n, s in tracker.get_states().items()}
        first = module(q, k, v, None)
        assert torch.equal(acc.get_rng_state(), default_before), "dropout drew from the default state"
        changed = [n for n, s in tracker.get_states().items() if not torch.equal(s, tracked_before[n])]
        assert changed == ["model-parallel-rng"]
        second = module(q, k, v, None)
        tensor_parallel.model_parallel_cuda_manual_seed(7)
        again = module(q, k, v, None)
    assert not torch.equal(first, second), "dropout had no effect"
    assert torch.equal(first, again), "not reproducible under the same seed"
    module.eval()
    with with_features(["--use-flash-attn"]):
        from npuspeed import telemetry

        module(q, k, v, None)
        assert telemetry.last("attention")["dropout_p"] == 0.0  # eval mode: no dropout, as nn.Dropout


def test_memory_at_4096_is_at_most_an_eighth(megatron_mp, with_features):
    """S=4096, b=1, 8 heads, d=64, causal, fp32: fused fwd+bwd peak <= 1/8 of unfused."""
    import gc

    from megatron.core import parallel_state

    acc = megatron_mp.accelerator
    if not acc.memory_tracking().startswith("tracking"):
        pytest.skip(f"no live-byte memory statistics here: {acc.memory_tracking()}")
    s, b, h, d = 4096, 1, 8, 64
    module = make_attention(heads=h, d=d)
    inputs = make_inputs(s, b, h, h, d, torch.float32)
    # Megatron's persistent score buffer lives across calls: create it outside the measurement
    # (this favours the baseline).
    parallel_state.get_global_memory_buffer().get_tensor((b * h, s, s), torch.float32, "mpu")

    def peak(ctx) -> int:
        gc.collect()
        with ctx:
            before = acc.memory_allocated()
            acc.reset_peak_memory_stats()
            run(module, *inputs, None)
            return acc.max_memory_allocated() - before

    fused = peak(with_features(["--use-flash-attn"]))
    unfused = peak(contextlib.nullcontext())
    assert fused * 8 <= unfused, f"fused {fused / 2**20:.1f} MiB vs unfused {unfused / 2**20:.1f} MiB"


def test_report_says_which_path_and_why(npuspeed_runtime):
    from feature_ctx import ctx_for

    from npuspeed.features.fused_attention import FusedAttentionFeature

    feature = FusedAttentionFeature()
    text = feature.path(ctx_for(["--use-flash-attn"]))
    assert "scaled_dot_product_attention" in text and "--use-flash-attn" in text
    assert feature.path(ctx_for(["--use-flash-attn", "--pre-tockens", "8"])).count("pre_tockens=8") == 1


class _NoKernel:
    name = "cuda"

    def has_fused_attention(self):
        return False


def test_backend_without_fused_kernel_says_which_path(npuspeed_runtime):
    from feature_ctx import ctx_for

    from npuspeed.features.fused_attention import FusedAttentionFeature

    feature = FusedAttentionFeature()
    ctx = ctx_for(["--use-flash-attn"], _NoKernel())
    feature.prepare(ctx)
    assert any("math backend" in n and "--use-flash-attn" in n for n in ctx.notes)
    assert "no fused kernel" in feature.path(ctx)


@pytest.mark.parametrize("argv, needle", [
    (["--pre-tockens", "4"], "add --use-flash-attn"),
    (["--use-flash-attn", "--sparse-mode", "2"], "--sparse-mode"),
    (["--use-flash-attn", "--pre-tockens", "-5", "--next-tockens", "2"], "sum must be >= 0"),
])
def test_bad_flags_are_clear_errors(npuspeed_runtime, argv, needle):
    from feature_ctx import ctx_for

    from npuspeed.features import FeatureError
    from npuspeed.features.fused_attention import FusedAttentionFeature

    feature = FusedAttentionFeature()
    ctx = ctx_for(argv)
    assert feature.enabled(ctx.args)
    with pytest.raises(FeatureError, match=needle.replace("-", r"\-")):
        feature.validate(ctx)


def test_unsupported_mask_type_is_a_clear_error(megatron_mp, with_features):
    from npuspeed.features import FeatureError

    with with_features(["--use-flash-attn"]):
        with pytest.raises(FeatureError, match=r"--use-flash-attn.*padding_causal"):
            make_attention(mask_type="padding_causal")
        module = make_attention()
        q, k, v, _ = make_inputs(8, 1, 4, 4, 16, torch.float32)
        with pytest.raises(FeatureError, match="attention_bias"):
            module(q, k, v, None, attention_bias=torch.zeros(1))
        with pytest.raises(FeatureError, match="boolean"):
            module(q, k, v, torch.zeros(1, 1, 8, 8))
    make_attention(mask_type="padding_causal")  # unpatched Megatron builds it


def test_softmax_offset_is_a_clear_error(megatron_mp, with_features):
    from npuspeed.features import FeatureError

    with with_features(["--use-flash-attn"]):
        try:
            with pytest.raises(FeatureError, match=r"--use-flash-attn.*softmax_type"):
                make_attention(softmax_type="off-by-one")
        except TypeError as exc:  # megatron-core < 0.15 has no softmax_type
            pytest.skip(str(exc))


def test_patch_is_removed_after_the_context(megatron_mp, with_features):
    from megatron.core.transformer.dot_product_attention import DotProductAttention

    original = DotProductAttention.forward
    with with_features(["--use-flash-attn"]):
        assert DotProductAttention.forward is not original
        assert getattr(DotProductAttention.forward, "__npuspeed_patch__", "").endswith("DotProductAttention.forward")
    assert DotProductAttention.forward is original


def test_dropout_runs_in_the_kernel_and_arbitrary_masks_take_the_measured_fallback(megatron_mp, with_features):
    """Dropout no longer sends a call away from npuspeed's kernel; a mask that is not per-row
    key ranges goes to SDPA or Megatron's unfused forward, measured once per shape, with the
    random states and the memory peak put back after the trial."""
    from npuspeed import telemetry

    acc = megatron_mp.accelerator
    for dtype in DTYPES:
        module = make_attention(dtype=dtype, dropout=0.2)
        module.train()
        q, k, v, _ = make_inputs(24, 1, 4, 4, 16, dtype)
        with with_features(["--use-flash-attn"]):
            module(q, k, v, None)
            last = telemetry.last("attention")
            assert last["kernel"] in expected_kernels(dtype, False) and last["dropout_p"] == 0.2
    masked = make_attention(dtype=torch.bfloat16, mask_type="arbitrary")
    mask = torch.rand(1, 1, 24, 24, generator=torch.Generator().manual_seed(0)) > 0.7
    mask[..., 0] = False
    telemetry.reset("attention.fallback")
    with acc.device_rng_scope():
        state = acc.get_rng_state().clone()
        record = compare(masked, make_inputs(24, 1, 4, 4, 16, torch.bfloat16), mask, with_features,
                         dtype=torch.bfloat16, arbitrary=True)
        assert torch.equal(acc.get_rng_state(), state), "the trial consumed random state"
    assert record["masked"] and "measured once for this shape" in record["why"]
    choice = telemetry.last("attention.fallback")
    assert {"sdpa_ms", "unfused_ms", "sdpa_bytes", "unfused_bytes"} <= set(choice)
    faster_and_smaller = choice["sdpa_ms"] <= choice["unfused_ms"] and choice["sdpa_bytes"] <= choice["unfused_bytes"]
    assert record["kernel"] == (SDPA if faster_and_smaller else UNFUSED)


@pytest.mark.parametrize("fixed, kernel", [("sdpa", SDPA), ("unfused", UNFUSED)])
def test_fallback_flag_fixes_the_choice(megatron_mp, with_features, fixed, kernel):
    mask = torch.rand(2, 1, 21, 21, generator=torch.Generator().manual_seed(3)) < 0.3
    record = compare(make_attention(mask_type="arbitrary"), make_inputs(21, 2, 4, 4, 16, torch.float32), mask,
                     with_features, flags=("--use-flash-attn", "--flash-attn-fallback", fixed), arbitrary=True)
    assert record["kernel"] == kernel and "--flash-attn-fallback" in record["why"]


def test_cpu_without_bf16_kernel_runs_sdpa_and_says_so(megatron_mp, with_features, monkeypatch):
    from feature_ctx import ctx_for

    from npuspeed.accelerator import get_accelerator
    from npuspeed.features.fused_attention import FusedAttentionFeature
    from npuspeed.ops import flash_attention as cpu_flash

    monkeypatch.setattr(cpu_flash, "machine_reason", lambda: "this CPU lacks AVX512-BF16")
    record = compare(make_attention(groups=2, dtype=torch.bfloat16), make_inputs(40, 1, 4, 2, 16, torch.bfloat16), None,
                     with_features, dtype=torch.bfloat16)
    # the portable fp32 kernel takes the bf16 call on fp32 copies (an Arm host does the same)
    fp32 = cpu_flash.fp32_reason() is None
    assert record["kernel"] in ({CPU_FLASH_FP32} if fp32 else {SDPA, UNFUSED}) and "lacks AVX512-BF16" in record["why"]
    feature, acc = FusedAttentionFeature(), get_accelerator()
    monkeypatch.setenv("NPUSPEED_ARGS", "--bf16")
    ctx = ctx_for(["--use-flash-attn"], acc)
    feature.prepare(ctx)
    assert any("lacks AVX512-BF16" in n and "--use-flash-attn" in n for n in ctx.notes)
    assert "kernel unavailable: this CPU lacks AVX512-BF16" in feature.path(ctx)


def test_report_lists_the_attention_calls_and_why(megatron_mp, with_features):
    from npuspeed import telemetry
    from npuspeed.reporting import collect, render

    telemetry.reset("attention")
    module = make_attention(dropout=0.1)
    module.train()
    with with_features(["--use-flash-attn"]):
        module(*make_inputs(20, 1, 4, 4, 16, torch.float32)[:3], None)
        data = collect()
    calls = data["attention_calls"]
    (kernel,) = calls["calls"]
    assert kernel in expected_kernels(torch.float32, False)
    if kernel == CPU_FLASH_FP32:
        assert calls["reasons"][kernel] == "causal, float32, dropout 0.1 in the kernel"
    assert f"{kernel}: 1 (" in render(data)


def test_fallback_choice_takes_no_timing_under_deterministic_mode(megatron_mp, monkeypatch):
    """--deterministic-mode promises the same bits in every run: SDPA and Megatron's unfused
    forward round differently, so the fallback's choice may not hang on a timing (it follows
    the trial's memory alone, which is the same in every run); without the mode both count."""
    from npuspeed import get_accelerator
    from npuspeed.features import chooser_setup
    from npuspeed.features.fused_attention import candidates

    # SDPA measured slower but smaller: a timing would pick unfused, memory alone SDPA
    fake = {SDPA: (2.0, 100), UNFUSED: (1.0, 200)}
    ran = []  # the trial's bytes are those of the candidate that ran last
    monkeypatch.setattr(chooser_setup.AcceleratorGuard, "meter", lambda self: ((lambda: 0), (lambda base: fake[ran[-1]][1])))

    def candidate(name):
        def run(x):
            ran.append(name)
            return x * 1.0
        return run

    def choose(timing):
        made = candidates.AttentionFallback()
        made.chooser.trial = timing
        return made.choose(("k",), candidate(SDPA), candidate(UNFUSED), (torch.zeros(2, 2),), get_accelerator())

    plain = choose(lambda name, run: fake[name][0])
    torch.use_deterministic_algorithms(True)
    try:
        det = choose(lambda name, run: pytest.fail("timed under --deterministic-mode"))
    finally:
        torch.use_deterministic_algorithms(False)
    assert plain["kernel"] == UNFUSED and det["kernel"] == SDPA and "--deterministic-mode" in det["why"]
