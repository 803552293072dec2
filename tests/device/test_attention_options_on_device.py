"""--use-flash-attn's options on the accelerator. --pre-tockens/--next-tockens: a band on the
fused kernel against Megatron's own sliding window (TransformerConfig.window_size, unfused) on
the same device: the band reached the kernel, losses agree (bf16), no S x S tensor (README: bands
on every backend). --sparse-mode: npu_fusion_attention's mask mode (NPU only). --flash-attn-fallback
sdpa|unfused: calls no fused kernel takes run the named path (every call on the device's SDPA
route; on the CPU host fp16 calls, which npuspeed's kernels do not take), counted by name."""
from __future__ import annotations

import pytest

from device_checks import assert_on_device, assert_parity, assert_sxs_saved, attention_calls, layer_calls
from device_runs import ATTENTION_KERNEL, MODEL, NO_DROPOUT, ON_HOST, SEQ, accelerator, device_only, train

pytestmark = pytest.mark.device
COVERS = ("--pre-tockens", "--next-tockens", "--sparse-mode", "--flash-attn-fallback")

BAND = SEQ // 4
WINDOW = "NPUSPEED_TEST_WINDOW_SIZE"  # _example_with_attention.py: Megatron's window_size for the reference
FLASH = ["--use-flash-attn"]
#: Megatron's unfused forward under its npuspeed name (npuspeed/features/fused_attention/candidates.py)
FALLBACK_KERNEL = {"sdpa": "sdpa", "unfused": "megatron_unfused"}


def test_band(tmp_path_factory):
    base = train(tmp_path_factory, MODEL + NO_DROPOUT, env={WINDOW: f"{BAND},0"})
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + FLASH + ["--pre-tockens", str(BAND), "--next-tockens", "0"])
    causal = train(tmp_path_factory, MODEL + NO_DROPOUT + FLASH)
    assert_on_device(base, run)
    assert attention_calls(base) == {}, base["attention_calls"]
    assert attention_calls(run) == {ATTENTION_KERNEL[accelerator()]: layer_calls()}, run["attention_calls"]
    last = run["attention_last"]
    assert last["band"] == [BAND, 0] and last["mask"] == "causal+pre/next_tockens", last
    assert_parity(base, run)
    assert run["losses"] != causal["losses"], "the band changed nothing: it did not reach the kernel"
    assert_sxs_saved(base, run)


def test_sparse_mode(tmp_path_factory):
    if accelerator() != "npu":
        pytest.skip(f"--sparse-mode is npu_fusion_attention's mask mode: {accelerator()} has no such kernel "
                    "(npuspeed refuses the flag there)")
    base = train(tmp_path_factory, MODEL + NO_DROPOUT)
    run = train(tmp_path_factory, MODEL + NO_DROPOUT + FLASH + ["--sparse-mode", "2"])
    assert_on_device(base, run)
    assert attention_calls(run) == {"npu_fusion_attention": layer_calls()}, run["attention_calls"]
    assert_parity(base, run)
    assert_sxs_saved(base, run)


@pytest.mark.parametrize("fixed", ["sdpa", "unfused"])
def test_fallback(tmp_path_factory, fixed):
    if accelerator() == "npu":
        pytest.skip("npu_fusion_attention takes every call: no call reaches the fallback on an NPU")
    model = [("--fp16" if a == "--bf16" else a) for a in MODEL] if ON_HOST else MODEL
    base = train(tmp_path_factory, model + NO_DROPOUT)
    run = train(tmp_path_factory, model + NO_DROPOUT + FLASH + ["--flash-attn-fallback", fixed])
    assert_on_device(base, run)
    kernel = FALLBACK_KERNEL[fixed]
    assert attention_calls(run) == {kernel: layer_calls()}, run["attention_calls"]
    assert "--flash-attn-fallback" in run["attention_calls"]["reasons"][kernel], run["attention_calls"]
    assert_parity(base, run)
    if fixed == "sdpa" and device_only("SDPA's fused kernels keep no S x S (the CPU's fp16 SDPA is its math backend)"):
        assert_sxs_saved(base, run)
