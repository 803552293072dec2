"""The Triton codec of --reuse-fp32-param against the chunked PyTorch device codec on one device:
the same residual and tie bits bit for bit, and a merge that gives back every non-NaN master
exactly (NaNs as the chunked codec gives them). Shared by the CPU tier (tests/unit/
test_reuse_fp32_triton.py, Triton's interpreter) and the device tier (tests/device/
test_triton_kernels_on_device.py, on the GPU or NPU itself); SPECIAL by the codec's own tests.
"""
from __future__ import annotations

import torch

from npuspeed.features.reuse_fp32_param import codec, triton_codec

#: fp32 bit patterns every codec must keep (or, NaNs, keep as NaNs)
SPECIAL = [
    0x00000000, 0x80000000,  # +-0
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FBFFFFF, 0xFFFFFFFF, 0x7FFFFFFF,  # NaNs with payloads
    0x00000001, 0x80000001, 0x007FFFFF, 0x00008000, 0x00018000,  # subnormals, subnormal ties
    0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7E8000, 0x7F7F7FFF,  # largest finite, ties near max
    0x3F808000, 0x3F818000, 0xBF808000, 0xBF818000,  # ties to even, both parities and signs
    0x3F80FFFF, 0x3F807FFF, 0x3F808001,
]


def floats(bits) -> torch.Tensor:
    """fp32 values with these bit patterns (a list of unsigned 32-bit ints, or an int32 tensor)."""
    if not isinstance(bits, torch.Tensor):
        bits = torch.tensor([b - (1 << 32) if b >= 1 << 31 else b for b in bits], dtype=torch.int32)
    return bits.view(torch.float32)


def random_bits(n: int, seed: int = 0) -> torch.Tensor:
    """n random fp32 bit patterns (int32), every fifth an exact tie of either parity."""
    bits = torch.randint(-(1 << 31), (1 << 31) - 1, (n,), dtype=torch.int32,
                         generator=torch.Generator().manual_seed(seed))
    bits[::5] = (bits[::5] & ~0xFFFF) | 0x8000
    return bits


def check_codec(bits, device="cpu", block=triton_codec.BLOCK, max_programs=triton_codec.MAX_PROGRAMS) -> None:
    x = floats(bits).to(device)
    bf16 = x.to(torch.bfloat16)
    res, want_res = (torch.empty(x.numel(), dtype=torch.int16, device=device) for _ in range(2))
    mask = triton_codec.split(x, res, block=block, max_programs=max_programs)
    want = codec.split_device(x, want_res)
    assert torch.equal(res, want_res), "residuals differ from the chunked codec's"
    assert torch.equal(mask, want.tie_mask), "tie bits differ from the chunked codec's"
    out, want_out = torch.full_like(x, 7.0), torch.empty_like(x)
    triton_codec.merge(bf16, res, mask, out, block=block, max_programs=max_programs)
    codec.merge_device(bf16, want_res, want, want_out)
    assert torch.equal(out.view(torch.int32), want_out.view(torch.int32))  # NaNs too
    ok = torch.isnan(x) | (out.view(torch.int32) == x.view(torch.int32))  # every non-NaN exact
    if not bool(ok.all()):
        wrong = x.view(torch.int32)[~ok][:10].cpu().tolist()
        raise AssertionError(f"merge lost {int((~ok).sum())} masters, e.g. {[hex(b & 0xFFFFFFFF) for b in wrong]}")
