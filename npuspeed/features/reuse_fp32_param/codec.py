"""Exact split of an fp32 tensor into its bf16 rounding plus a 16-bit residual, and back.

For a non-NaN fp32 bit pattern x, round-to-nearest-even gives bf16(x) = (x + 0x7FFF +
((x >> 16) & 1)) >> 16, the pattern `tensor.to(torch.bfloat16)` produces. Keep the low
16 bits L of x as the residual. Then the high half of x is bf16(x) - carry, where carry
is 1 when L > 0x8000 and 0 when L < 0x8000. When L == 0x8000 (an exact tie) both carries
leave an even bf16, so one more bit is needed: the ties that rounded up are recorded as a
sparse list of indices. Ties are 1 in 65536 of random values, so this costs almost nothing
(a dense bit mask would cost 1/8 byte per parameter, 6% of the 2 bytes saved). NaNs lose
their payload in the bf16 rounding; their full patterns are kept the same sparse way.

That is the CPU path (C++, or the reference). On an accelerator a sparse list needs a
`nonzero`, which waits for the device; there the codec keeps the tie bits densely (1/8 byte
a parameter) and never syncs.
What it gives up: a NaN master comes back as a NaN with the canonical bf16 high half
(infinities, zeros, subnormals and every finite value stay exact). The device codec has two
implementations with identical results: one Triton launch per buffer and direction
(triton_codec.py; CUDA, and Ascend through triton-ascend) and, where triton cannot compile for
the device, the PyTorch ops below in bounded chunks (no full-size int32 temporaries; the
portable reference of the kernels, but several launches per 2^20 elements).

Which one runs: `implementation()`; NPUSPEED_REUSE_CODEC=triton|device|cpp|reference forces
one (triton on CPU tensors needs TRITON_INTERPRET=1). Each call counts
`reuse.codec.<split|merge>.<impl>`.
"""
from __future__ import annotations

import os
from dataclasses import dataclass, field

import torch

from npuspeed import telemetry
from npuspeed.accelerator.devices import for_device
from npuspeed.ops._extension import has_op

#: counter prefix: reuse.codec.<split|merge>.<cpp|reference|device|triton>, so tests can see which ran
COUNTER = "reuse.codec."
#: environment variable forcing one implementation (tests, comparisons)
FORCE_ENV = "NPUSPEED_REUSE_CODEC"
IMPLEMENTATIONS = ("triton", "device", "cpp", "reference")
#: the implementations that keep the tie bits densely (Exceptions.tie_mask)
DENSE = ("triton", "device")
#: elements per chunk of the device codec: its temporaries stay a few MiB whatever the tensor
DEVICE_CHUNK = 1 << 20

_LOW = 0xFFFF
_TIE = 0x8000


@dataclass
class Exceptions:
    """What the residual alone cannot restore: tie indices that rounded up, NaN patterns."""

    tie_up: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    nan_index: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int64))
    nan_bits: torch.Tensor = field(default_factory=lambda: torch.empty(0, dtype=torch.int32))
    #: the device codec's ties instead of `tie_up`: bit i of byte i // 8 set = element i rounded up
    tie_mask: torch.Tensor | None = None

    def tensors(self) -> list[torch.Tensor]:
        found = [self.tie_up, self.nan_index, self.nan_bits]
        return found + ([self.tie_mask] if self.tie_mask is not None else [])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors())


def _use_cpp(*tensors: torch.Tensor) -> bool:
    return all(for_device(t).host_is_device() and t.is_contiguous() for t in tensors) and has_op("fp32_split")


#: what each implementation is, for `npuspeed report`
DESCRIPTIONS = {
    "triton": "Triton kernel, one launch per buffer and direction",
    "device": "chunked PyTorch device codec (no Triton for this device)",
    "cpp": "C++ npuspeed::fp32_split/fp32_merge",
    "reference": "pure-PyTorch codec",
}


def implementation(tensor: torch.Tensor) -> str:
    """The codec for `tensor` (see `implementation_for`)."""
    return implementation_for(tensor.device.type)


def implementation_for(device_type: str) -> str:
    """The forced codec (NPUSPEED_REUSE_CODEC), else C++ or the reference on CPU, else the
    Triton kernel where triton compiles for the device, else the chunked PyTorch one."""
    forced = os.environ.get(FORCE_ENV, "")
    if forced:
        if forced not in IMPLEMENTATIONS:
            raise ValueError(f"npuspeed: {FORCE_ENV}={forced!r}: use one of {', '.join(IMPLEMENTATIONS)} "
                             f"or unset it")
        return forced
    if for_device(device_type).host_is_device():
        return "cpp" if has_op("fp32_split") else "reference"
    from npuspeed.features.reuse_fp32_param import triton_codec

    return "triton" if triton_codec.available(device_type) else "device"


def ran() -> dict[str, int]:
    """Codec calls so far in this process, by implementation (splits and merges)."""
    found: dict[str, int] = {}
    for name, n in telemetry.snapshot(COUNTER).items():
        direction, _, impl = name[len(COUNTER):].partition(".")
        if direction in ("split", "merge") and impl:
            found[impl] = found.get(impl, 0) + n
    return found


def split(master: torch.Tensor, residual: torch.Tensor) -> Exceptions:
    """Write the low halves of `master` into `residual`; return the exceptions (C++ or the
    reference on CPU, the sync-free device codec elsewhere: `implementation()`)."""
    impl = implementation(master)
    if impl == "cpp" and not _use_cpp(master, residual):
        impl = "reference"
    telemetry.count(COUNTER + "split." + impl)
    if impl == "triton":
        from npuspeed.features.reuse_fp32_param import triton_codec

        return Exceptions(tie_mask=triton_codec.split(master, residual))
    if impl == "device":
        return split_device(master, residual)
    if impl == "cpp":
        flat = master.detach().reshape(-1)
        tie_up, nan_index = torch.ops.npuspeed.fp32_split(flat, residual.view(-1))
        return Exceptions(tie_up, nan_index, flat.view(torch.int32)[nan_index].clone())
    return split_reference(master, residual)


def merge(bf16: torch.Tensor, residual: torch.Tensor, exceptions: Exceptions, out: torch.Tensor) -> None:
    """Rebuild the exact fp32 values into `out`. Dense tie bits (either device codec) merge with
    the device codec `implementation()` names, sparse lists with C++ or the reference."""
    impl = implementation(out)
    if exceptions.tie_mask is not None:
        impl = impl if impl in DENSE else "device"
    else:
        impl = "cpp" if _use_cpp(bf16, residual, out) and impl != "reference" else "reference"
    telemetry.count(COUNTER + "merge." + impl)
    if impl == "triton":
        from npuspeed.features.reuse_fp32_param import triton_codec

        triton_codec.merge(bf16, residual, exceptions.tie_mask, out)
    elif impl == "device":
        merge_device(bf16, residual, exceptions, out)
    elif impl == "cpp":
        torch.ops.npuspeed.fp32_merge(bf16.detach().reshape(-1), residual.view(-1), exceptions.tie_up,
                                      exceptions.nan_index, exceptions.nan_bits, out.view(-1))
    else:
        merge_reference(bf16, residual, exceptions, out)


def split_reference(master: torch.Tensor, residual: torch.Tensor) -> Exceptions:
    """Write the low halves of `master` (fp32) into `residual` (int16); return the exceptions.

    The bf16 half is not written here: it is `master.to(torch.bfloat16)`, which Megatron's
    copy of main params into model params already produced.
    """
    bits = master.detach().reshape(-1).view(torch.int32)
    low = bits & _LOW
    residual.view(-1).copy_(low.to(torch.int16))
    tie_up = torch.nonzero(((low == _TIE) & ((bits >> 16) & 1).bool()), as_tuple=False).reshape(-1)
    nan_index = torch.nonzero(torch.isnan(master.detach().reshape(-1)), as_tuple=False).reshape(-1)
    return Exceptions(tie_up, nan_index, bits[nan_index].clone())


def merge_reference(bf16: torch.Tensor, residual: torch.Tensor, exceptions: Exceptions,
                    out: torch.Tensor) -> None:
    """Rebuild the exact fp32 values into `out` from the bf16 tensor, residual and exceptions."""
    high = bf16.detach().reshape(-1).view(torch.int16).to(torch.int32) & _LOW
    low = residual.reshape(-1).to(torch.int32) & _LOW
    carry = (low > _TIE).to(torch.int32)
    if exceptions.tie_up.numel():
        carry[exceptions.tie_up] = 1
    words = ((high - carry) << 16) | low
    if exceptions.nan_index.numel():
        words[exceptions.nan_index] = exceptions.nan_bits
    out.view(-1).view(torch.int32).copy_(words)


_BIT_WEIGHTS: dict = {}


def _bit_weights(device) -> torch.Tensor:
    if device not in _BIT_WEIGHTS:
        _BIT_WEIGHTS[device] = torch.tensor([1 << i for i in range(8)], dtype=torch.int32, device=device)
    return _BIT_WEIGHTS[device]


def split_device(master: torch.Tensor, residual: torch.Tensor) -> Exceptions:
    """`split` without a host sync: low halves to `residual`, tie bits packed densely."""
    bits = master.detach().reshape(-1).view(torch.int32)
    res = residual.view(-1)
    n = bits.numel()
    mask = torch.zeros((n + 7) // 8, dtype=torch.uint8, device=bits.device)
    weights = _bit_weights(bits.device)
    for lo in range(0, n, DEVICE_CHUNK):  # DEVICE_CHUNK is a multiple of 8
        hi = min(n, lo + DEVICE_CHUNK)
        word = bits[lo:hi]
        low = word & _LOW
        res[lo:hi].copy_(low)  # int32 -> int16 keeps the low 16 bits
        tie = (low == _TIE) & (((word >> 16) & 1) == 1)
        pad = (-tie.numel()) % 8
        if pad:
            tie = torch.cat([tie, tie.new_zeros(pad)])
        mask[lo // 8:(hi + 7) // 8] = (tie.view(-1, 8).to(torch.int32) * weights).sum(1).to(torch.uint8)
    return Exceptions(tie_mask=mask)


def merge_device(bf16: torch.Tensor, residual: torch.Tensor, exceptions: Exceptions, out: torch.Tensor) -> None:
    """`merge` for `split_device`'s exceptions, chunk by chunk, without a host sync."""
    high16 = bf16.detach().reshape(-1).view(torch.int16)
    res = residual.view(-1)
    words = out.view(-1).view(torch.int32)
    shifts = torch.arange(8, dtype=torch.int32, device=words.device)
    n = words.numel()
    for lo in range(0, n, DEVICE_CHUNK):
        hi = min(n, lo + DEVICE_CHUNK)
        low = res[lo:hi].to(torch.int32) & _LOW
        tie = (exceptions.tie_mask[lo // 8:(hi + 7) // 8].to(torch.int32)[:, None] >> shifts) & 1
        carry = (low > _TIE).to(torch.int32) | tie.reshape(-1)[:hi - lo]
        word = ((high16[lo:hi].to(torch.int32) & _LOW) - carry) << 16
        words[lo:hi] = word | low
