"""The Triton codec of --reuse-fp32-param, run on CPU tensors under Triton's interpreter.

It must give the chunked device codec's residual and tie bits bit for bit, and merge back
exactly what that codec merges (NaN patterns included): the same data layout, so either can
merge what the other split. Small buffers and blocks (the interpreter is slow) and a capped
grid, so blocks, loops over blocks and a partial last byte of tie bits are all exercised.
"""
from __future__ import annotations

import contextlib
import importlib.util
import os
import types

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from triton_masks import boolean_masks_only

from codec_vs_chunked import SPECIAL, check_codec, random_bits

from npuspeed import telemetry
from npuspeed.features.reuse_fp32_param import codec, triton_codec
from npuspeed.features.reuse_fp32_param.shared_masters import SharedMasters

pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (the Triton codec is tested under its interpreter)")


@contextlib.contextmanager
def _env(**values):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _against_chunked(bits, block: int = 64, max_programs: int = 3) -> None:
    """codec_vs_chunked.check_codec on CPU tensors under the interpreter, boolean masks checked."""
    with _env(TRITON_INTERPRET="1"), boolean_masks_only():
        check_codec(bits, "cpu", block, max_programs)


def test_special_patterns_and_ties_match_the_chunked_codec():
    _against_chunked(SPECIAL)
    lows = list(range(0, 1 << 16, 251)) + [0x7FFF, 0x8000, 0x8001]
    for high in (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x7F7F, 0xFF80, 0x7FC0):
        _against_chunked([(high << 16) | low for low in lows], block=32)  # loops over blocks


def test_default_block_and_several_programs():
    _against_chunked(random_bits(2 * triton_codec.BLOCK + 13), block=triton_codec.BLOCK,
                     max_programs=triton_codec.MAX_PROGRAMS)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=(1 << 32) - 1), min_size=1, max_size=200))
def test_random_bit_patterns(bits):
    _against_chunked(bits)


@settings(max_examples=10, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=(1 << 16) - 1), min_size=1, max_size=64))
def test_all_ties(highs):
    _against_chunked([(h << 16) | 0x8000 for h in highs], block=16)


def test_dispatch_picks_triton_where_it_compiles(monkeypatch):
    monkeypatch.delenv(codec.FORCE_ENV, raising=False)
    monkeypatch.setattr(triton_codec, "available", lambda device_type: device_type == "cuda")
    assert codec.implementation_for("cuda") == "triton"
    assert codec.implementation_for("npu") == "device"  # no triton-ascend: the chunked codec
    assert codec.implementation_for("cpu") in ("cpp", "reference")
    monkeypatch.setenv(codec.FORCE_ENV, "bogus")
    with pytest.raises(ValueError, match="NPUSPEED_REUSE_CODEC='bogus'"):
        codec.implementation_for("cpu")


def test_triton_on_cpu_needs_the_interpreter():
    x = torch.ones(8)
    with _env(TRITON_INTERPRET="0"), pytest.raises(RuntimeError, match="TRITON_INTERPRET=1"):
        triton_codec.split(x, torch.empty(8, dtype=torch.int16))


def test_forced_triton_path_runs_per_buffer_segment_and_is_counted():
    """Four params back to back in one bf16 buffer (as DDP lays them out for the distributed
    optimizer): two segments (none larger than the largest param), one Triton split and merge
    per segment and step, masters exact, the report names the codec that ran."""
    torch.manual_seed(1)
    sizes = [24, 30, 40, 100]
    buffer = torch.zeros(sum(sizes), dtype=torch.bfloat16)
    mains, models, offset = [], [], 0
    for n in sizes:
        main = torch.randn(n) * 0.02
        main.view(torch.int32)[:2] = torch.tensor([0x3F818000, 0x3F808000])  # ties: odd, even high half
        models.append(buffer[offset:offset + n])
        models[-1].copy_(main)
        mains.append(main)
        offset += n
    exact = [m.clone() for m in mains]
    telemetry.reset(codec.COUNTER)
    with _env(TRITON_INTERPRET="1", **{codec.FORCE_ENV: "triton"}):
        shared = SharedMasters(list(zip(models, mains)))
        shared.release()
        segments = [len(s.mains) for s in shared.segments]  # plain values: an empty storage must not be printed
        freed = all(m.untyped_storage().nbytes() == 0 for m in mains)
        assert segments == [3, 1] and freed
        shared.materialize()
    for got, want in zip(mains, exact):
        assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert telemetry.get(codec.COUNTER + "split.triton") == 2
    assert telemetry.get(codec.COUNTER + "merge.triton") == 2
    assert telemetry.get(codec.COUNTER + "segments") == 2 and telemetry.get(codec.COUNTER + "params") == 4
    assert codec.ran() == {"triton": 4}

    from npuspeed.features.reuse_fp32_param import ReuseFp32ParamFeature

    ctx = types.SimpleNamespace(accelerator=types.SimpleNamespace(name="cpu"))
    assert "ran: triton x4" in ReuseFp32ParamFeature().running(ctx)


def _ptx_for_sm90() -> dict[str, str]:
    """Both kernels compiled for sm_90 through Triton's own ptxas (no GPU here), with the
    16-byte alignment real buffers have: {kernel: ptx}, or {} when triton has no nvidia backend."""
    from triton.backends import backends

    if "nvidia" not in backends:
        return {}
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernels = triton_codec._kernels()
    out = {}
    for name, types_ in (("split_kernel", ["*i32", "*i16", "*u8"]), ("merge_kernel", ["*i16", "*i16", "*u8", "*i32"])):
        fn = getattr(kernels, name)
        signature = dict(zip(fn.arg_names, types_ + ["i32", "constexpr", "constexpr"]))
        source = ASTSource(fn=fn, signature=signature, constexprs={"BLOCK": triton_codec.BLOCK, "ITERS": 1},
                           attrs={(i,): [["tt.divisibility", 16]] for i in range(len(types_) + 1)})
        out[name] = triton.compile(source, target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    return out


def test_kernels_compile_for_a_cuda_gpu_ahead_of_time(monkeypatch):
    """The loads are vectorized (128-bit). In a fresh interpreter without TRITON_INTERPRET:
    in this session another Triton test may have left triton in interpreter mode."""
    from script_run import run_triton_script

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    ptx = run_triton_script("import json, sys; sys.path[:0] = ['tests', 'tests/unit']\n"
                            "import test_reuse_fp32_triton as t; print(json.dumps(t._ptx_for_sm90()))", timeout=600)
    if not ptx:
        pytest.skip("this triton has no nvidia backend")
    assert sorted(ptx) == ["merge_kernel", "split_kernel"]
    for name, text in ptx.items():
        assert "ld.global.v4.b32" in text, name


@pytest.mark.parametrize("value, on", [("1", True), ("true", True), ("ON", True), ("yes", True), ("y", True),
                                       ("0", False), ("", False)])
def test_interpreter_switch_is_read_as_triton_reads_it(monkeypatch, value, on):
    """One reading of TRITON_INTERPRET for every npuspeed Triton path (the ops' kernels and this
    codec): triton itself takes 1/true/on/yes/y; the codec's own copy missed `y`, so under
    TRITON_INTERPRET=y triton interpreted while the codec refused CPU tensors."""
    from npuspeed.ops.triton import _runtime

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert triton_codec.interpreting() is on and _runtime.interpreting() is on
