"""The two Triton kernels of the device codec (split, merge), one launch per flat buffer.

Imported only where triton is importable (triton_codec.py checks first). The kernels use
integers only, through int views of the tensors (fp32 master -> int32, bf16 -> int16), plain
loads and stores and no inline assembly, so the same source compiles for CUDA and, through
triton-ascend, for Ascend NPUs, and runs on CPU tensors under TRITON_INTERPRET=1.

Each program walks blocks of BLOCK elements, seen as [BLOCK // 8, 8] so that one row is one
byte of tie bits (bit i of byte r = element 8 r + i, the chunked device codec's layout);
a grid capped at `max_programs` loops ITERS times (Ascend runs a grid of about its core
count; ITERS is a constant: 1 below 2^28 elements a buffer, and the interpreter needs it so).
Whether the module was decorated under the interpreter is fixed at import: INTERPRETED. The
kernels call no @triton.jit library function (tl.sum is one): those are decorated when
triton is first imported, so they would refuse the interpreter in a process (a test session)
that imported triton before TRITON_INTERPRET=1 was set.
"""
import triton
import triton.language as tl

from npuspeed.ops.triton._runtime import interpreting

# read as Triton reads it (triton-ascend's older base has no `triton.knobs`)
INTERPRETED = interpreting()


@triton.jit
def _bit_or(a, b):
    return a | b


@triton.jit
def _block(i, n, BLOCK: tl.constexpr):
    """This program's i-th block (blocks a grid apart): its element indices as [BLOCK // 8, 8] (a
    row is one byte of tie bits), which of them are below n, its tie-bit byte indices and the
    bit (column) of each element in its byte."""
    start = (tl.program_id(0).to(tl.int64) + i * tl.num_programs(0).to(tl.int64)) * BLOCK
    rows = tl.arange(0, BLOCK // 8)
    cols = tl.arange(0, 8)
    idx = start + rows[:, None] * 8 + cols[None, :]
    return idx, idx < n, start // 8 + rows, cols


@triton.jit
def split_kernel(bits_ptr, res_ptr, mask_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """bits: int32 view of the fp32 master; res: int16 low halves; mask: uint8 tie bits."""
    for i in range(ITERS):  # this program's blocks, a grid apart; past n all masked
        idx, inside, bidx, cols = _block(i, n, BLOCK)
        word = tl.load(bits_ptr + idx, mask=inside, other=0)
        low = word & 0xFFFF
        tl.store(res_ptr + idx, low.to(tl.int16), mask=inside)
        # an exact tie whose (odd) high half rounded up to even
        tie = ((low == 0x8000) & (((word >> 16) & 1) == 1)).to(tl.int32)
        byte = tl.reduce(tie << cols[None, :], 1, _bit_or)  # bits are disjoint: OR packs them
        tl.store(mask_ptr + bidx, byte.to(tl.uint8), mask=bidx * 8 < n)


@triton.jit
def merge_kernel(high_ptr, res_ptr, mask_ptr, out_ptr, n, BLOCK: tl.constexpr, ITERS: tl.constexpr):
    """high: int16 view of the bf16 values; out: int32 view of the fp32 masters."""
    for i in range(ITERS):  # this program's blocks, a grid apart; past n all masked
        idx, inside, bidx, cols = _block(i, n, BLOCK)
        high = tl.load(high_ptr + idx, mask=inside, other=0).to(tl.int32) & 0xFFFF
        low = tl.load(res_ptr + idx, mask=inside, other=0).to(tl.int32) & 0xFFFF
        byte = tl.load(mask_ptr + bidx, mask=bidx * 8 < n, other=0).to(tl.int32)
        tie = (byte[:, None] >> cols[None, :]) & 1
        carry = (low > 0x8000).to(tl.int32) | tie
        word = ((high - carry) << 16) | low
        tl.store(out_ptr + idx, word, mask=inside)
