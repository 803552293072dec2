"""The split/merge behind --reuse-fp32-param over random and adversarial fp32 bit patterns.

bf16 must equal `x.to(torch.bfloat16)` bit for bit and merge must restore x bit for bit.
"""
from __future__ import annotations

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npuspeed import telemetry
from npuspeed.features.reuse_fp32_param import codec

from codec_vs_chunked import SPECIAL, floats

IMPLS = {"reference": (codec.split_reference, codec.merge_reference), "dispatch": (codec.split, codec.merge)}


def _roundtrip(bits: list[int]) -> None:
    for split, merge in IMPLS.values():
        _roundtrip_with(bits, split, merge)


def _roundtrip_with(bits, split, merge) -> None:
    x = floats(bits)
    bf16 = x.to(torch.bfloat16)
    residual = torch.empty(x.numel(), dtype=torch.int16)
    exceptions = split(x, residual)
    out = torch.empty_like(x)
    merge(bf16, residual, exceptions, out)
    same = out.view(torch.int32) == x.view(torch.int32)
    assert bool(same.all()), [hex(b) for b, ok in zip(bits, same.tolist()) if not ok][:10]


def test_special_patterns_roundtrip():
    telemetry.reset(codec.COUNTER)
    _roundtrip(SPECIAL)
    # The dispatching front end ran the C++ kernels (the op library is built in CI).
    assert telemetry.get(codec.COUNTER + "split.cpp") == 1 and telemetry.get(codec.COUNTER + "merge.cpp") == 1
    assert telemetry.get(codec.COUNTER + "split.reference") == 0


def test_every_low_half_around_ties_roundtrips():
    # All 65536 low halves under an odd and an even high half, positive and negative.
    lows = list(range(0, 1 << 16))
    for high in (0x3F80, 0x3F81, 0xBF80, 0xBF81, 0x0000, 0x7F7F):
        _roundtrip([(high << 16) | low for low in lows])


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=(1 << 32) - 1), min_size=1, max_size=257))
def test_random_bit_patterns_roundtrip(bits):
    _roundtrip(bits)


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=(1 << 16) - 1), min_size=1, max_size=64))
def test_all_ties_roundtrip(highs):
    _roundtrip([(h << 16) | 0x8000 for h in highs])


def test_exceptions_are_sparse_for_ordinary_weights():
    x = torch.randn(1 << 16) * 0.02
    exceptions = codec.split(x, torch.empty(x.numel(), dtype=torch.int16))
    assert exceptions.nan_index.numel() == 0
    assert exceptions.tie_up.numel() <= 8  # ~1 exact tie in 65536, half of them round up


def test_cpp_exceptions_match_reference_across_blocks():
    # The C++ split collects ties and NaNs per block in parallel: the lists must still be the
    # reference's, in ascending order, with specials in many blocks and at block edges.
    torch.manual_seed(0)
    n = 5 * (1 << 16) + 123
    bits = (torch.randn(n) * 0.02).view(torch.int32)
    where = torch.cat([torch.randint(0, n, (300,)), torch.tensor([0, 1023, 1024, 65535, 65536, n - 1])])
    bits[where] = (bits[where] & ~0xFFFF) | 0x8000  # ties, both parities of the high half
    bits[where[::7]] = 0x7FC00001  # NaN with a payload
    x = bits.view(torch.float32)
    got = codec.split(x, torch.empty(n, dtype=torch.int16))
    want = codec.split_reference(x, torch.empty(n, dtype=torch.int16))
    assert telemetry.get(codec.COUNTER + "split.cpp") > 0
    for name in ("tie_up", "nan_index", "nan_bits"):
        assert torch.equal(getattr(got, name), getattr(want, name)), name
    assert got.tie_up.numel() > 100 and got.nan_index.numel() > 40


def _device_roundtrip(bits: list[int]) -> None:
    x = floats(bits)
    bf16 = x.to(torch.bfloat16)
    residual = torch.empty(x.numel(), dtype=torch.int16)
    exceptions = codec.split_device(x, residual)
    assert exceptions.tie_up.numel() == 0 and exceptions.tie_mask.numel() == (x.numel() + 7) // 8
    out = torch.empty_like(x)
    codec.merge(bf16, residual, exceptions, out)  # the front end picks the device merge
    nan = torch.isnan(x)
    assert torch.equal(torch.isnan(out), nan)
    same = out.view(torch.int32)[~nan] == x.view(torch.int32)[~nan]
    assert bool(same.all()), [hex(b) for b, n in zip(bits, nan.tolist()) if not n][:10]


def test_device_codec_is_exact_but_for_nan_payloads(monkeypatch):
    """The accelerator codec (dense tie bits, chunked, no nonzero), run here on CPU tensors:
    every non-NaN pattern exact, NaN stays NaN; chunks and a partial last byte of tie bits."""
    monkeypatch.setattr(codec, "DEVICE_CHUNK", 16)
    _device_roundtrip(SPECIAL)
    lows = list(range(0, 1 << 16, 7)) + [0x8000, 0x8001, 0x7FFF]
    for high in (0x3F80, 0x3F81, 0xBF80, 0xBF81):
        _device_roundtrip([(high << 16) | low for low in lows])
    _device_roundtrip([(h << 16) | 0x8000 for h in range(0, 1 << 16, 97)])  # all ties


@settings(max_examples=100, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=(1 << 32) - 1), min_size=1, max_size=257))
def test_device_codec_random_patterns(bits):
    _device_roundtrip(bits)
