"""How far an H100's FP8 tensor-core accumulation drifts from the exact sum as K grows, and the
K beyond which it needs fp32 promotion (issue 50): measured on the CPU with mmaemu 0.1.0, a
bit-exact software emulation of the H100 PCIe's torch._scaled_mm (cuBLASLt 12.8), which is not a
dependency of npuspeed: install it apart (`pip install --no-deps --target DIR mmaemu==0.1.0`) and
put DIR on PYTHONPATH.

For each K, E4M3 operands quantized tensorwise (npuspeed.ops.fp8) from N(0, 1) data, [M, K] x
[N, K]^T, against the exact sum of the FP8 products (float64: E4M3 x E4M3 products are multiples
of 2**-18 below 2**18, so the sum is exact in float64 for every K here):
  fast       use_fast_accum=True over all of K (the accumulator cuBLAS keeps in the tensor cores)
  cublas     use_fast_accum=False (cuBLAS's own periodic promotion)
  fast+128   use_fast_accum=True per 128-element chunk, chunks added in fp32 (DeepSeek-V3's promotion)
  fp32       what npuspeed's emulation computes (fp32 GEMM of the FP8 values)
Error: ||acc - exact|| / ||exact|| over all outputs (Frobenius), the relative error a result shows
(random signs cancel, so |exact| grows as sqrt(K) while the accumulator's truncation follows the
products' magnitudes). K*: the first K where `fast` passes 2**-9, the half-ulp of a bf16 output,
i.e. where the short accumulation shows in a bf16 result.
"""
from __future__ import annotations

import argparse

import torch

from npuspeed.ops.fp8 import E4M3
from npuspeed.ops.fp8.tensorwise import quantize_tensorwise


def _error(acc: torch.Tensor, exact: torch.Tensor) -> float:
    return ((acc.double() - exact).norm() / exact.norm()).item()


def measure(ks, m=64, n=64, seed=0):
    import mmaemu

    rows = []
    for k in ks:
        g = torch.Generator().manual_seed(seed + k)
        a = quantize_tensorwise(torch.randn(m, k, generator=g), E4M3).data
        b = quantize_tensorwise(torch.randn(n, k, generator=g), E4M3).data
        exact = a.double() @ b.double().t()
        fast = mmaemu.accumulate(a, b, use_fast_accum=True, profile="hopper", splitk=1)
        cublas = mmaemu.accumulate(a, b, use_fast_accum=False, profile="hopper", splitk=1)
        chunked = torch.zeros(m, n, dtype=torch.float32)
        for c in range(0, k, 128):
            chunked += mmaemu.accumulate(a[:, c:c + 128].contiguous(), b[:, c:c + 128].contiguous(),
                                         use_fast_accum=True, profile="hopper", splitk=1)
        fp32 = a.float() @ b.float().t()
        rows.append((k, *(_error(x, exact) for x in (fast, cublas, chunked, fp32))))
    return rows


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--max-k", type=int, default=16384)
    args = p.parse_args()
    ks = [2 ** i for i in range(7, 15) if 2 ** i <= args.max_k]
    rows = measure(ks)
    print(f"{'K':>6} {'fast':>10} {'cublas':>10} {'fast+128':>10} {'fp32':>10}")
    for k, *errs in rows:
        print(f"{k:>6} " + " ".join(f"{e:10.2e}" for e in errs))
    over = [k for k, fast, *_ in rows if fast > 2.0 ** -9]
    print(f"K* (fast accumulation past 2**-9 = {2.0 ** -9:.2e}): {over[0] if over else f'none up to {ks[-1]}'}")


if __name__ == "__main__":
    main()
