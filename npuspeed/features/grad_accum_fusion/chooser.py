"""Which weight-gradient path runs, per (device, dtypes, shape): measured once on the CPU.

On the CPU both candidates (a fused in-place GEMM and the unfused GEMM + add) run twice,
interleaved, on scratch copies of main_grad the first time a shape is seen; the fused one is
kept only where it is neither slower nor holds more temporary bytes (16-bit inputs upcast to
fp32 hold rows x (n + k) x 4 bytes, the unfused product n x k in the input dtype) (a 16-bit GEMM with AVX512-BF16 can beat an fp32 in-place one, so the
"fused" path is not always the fast one). The scratch copies and the trial's peak are
released and restored, so the run's memory figures are not disturbed. On a GPU or NPU the
fused path runs without a trial (no device was at hand to measure the alternatives) unless it
holds more temporary bytes (an NPU without torch_npu's matmul-add kernel has only the upcast
GEMM: there the unfused path runs, with a note); a mixed-dtype GEMM this torch does not have
falls back to the unfused path, once, with a note.
Under --deterministic-mode nothing is timed (the paths round differently, and a timing differs
by run and rank): the fused path unless it holds more temporary bytes.
"""
from __future__ import annotations

import os
import time

import torch

from npuspeed import telemetry
from npuspeed.features.grad_accum_fusion import kernels

PREFIX = "grad_accum_fusion."
#: fixes the choice for every shape: "fused" (the in-place path), "unfused" or a kernels name
#: (tests and benchmarks; unset: measure)
FIXED_ENV = "NPUSPEED_WGRAD_PATH"


def _time(run, g, x, scratch, accelerator) -> float:
    accelerator.synchronize()
    start = time.perf_counter()
    run(g, x, scratch, accelerator)
    accelerator.synchronize()
    return time.perf_counter() - start


class PathChooser:
    """Per shape key: the path name, and why (for `npuspeed report`)."""

    def __init__(self, accelerator, note=None, fixed: str | None = None):
        self.accelerator = accelerator
        self.note = note or (lambda message: None)
        self.fixed = fixed if fixed is not None else (os.environ.get(FIXED_ENV) or None)
        self.choices: dict[tuple, dict] = {}
        #: why the NPU's own kernel does not run here (its NNAL/ATB library failed to load), once known
        self.native_missing: str | None = None

    @staticmethod
    def key(rows: int, n: int, k: int, in_dtype: torch.dtype, main_grad: torch.Tensor) -> tuple:
        return (main_grad.device.type, str(in_dtype).replace("torch.", ""),
                str(main_grad.dtype).replace("torch.", ""), rows, n, k)

    def choose(self, g, x, main_grad) -> str:
        return self.choose_shape(x.shape[0], g.shape[1], x.shape[1], x.dtype, main_grad, (g, x))

    def choose_shape(self, rows, n, k, in_dtype, main_grad, inputs=None) -> str:
        """The path for `main_grad += dY^T X` with dY [rows, n], X [rows, k] of `in_dtype`;
        measured on random inputs of that shape when `inputs` is not given."""
        key = self.key(rows, n, k, in_dtype, main_grad)
        record = self.choices.get(key)
        if record is None:
            names = kernels.candidates(main_grad.device.type, in_dtype, main_grad.dtype, self.accelerator)
            self._say_native_missing(main_grad.device.type)
            if self.fixed is not None:
                path = {"fused": names[0], "unfused": kernels.MM_ADD}.get(self.fixed, self.fixed)
                record = {"path": path, "why": f"fixed ({FIXED_ENV}={self.fixed})"}
            elif torch.are_deterministic_algorithms_enabled():
                record = self._by_shape(names, rows, n, k, in_dtype, main_grad.dtype,
                                        "--deterministic-mode: not measured")
            elif main_grad.device.type == "cpu":
                record = self._measure(names, inputs, (rows, n, k, in_dtype), main_grad)
            else:  # no trial on a device; the temporary bytes are known from the shape alone
                record = self._by_shape(names, rows, n, k, in_dtype, main_grad.dtype,
                                        f"not measured on {main_grad.device.type}")
                if record["path"] == kernels.MM_ADD:
                    self.note(f"--gradient-accumulation-fusion: {in_dtype} inputs with a {main_grad.dtype} "
                              f"main_grad on {main_grad.device.type}: no fused kernel without fp32 copies of the "
                              "inputs here, so Megatron's unfused weight gradient runs where those copies would "
                              "be larger (npuspeed report lists the shapes)")
            self.choices[key] = record
        return record["path"]

    def _say_native_missing(self, device_type: str) -> None:
        """torch_npu names its matmul-add kernel even without the NNAL/ATB package that runs it
        (the accelerator probes it once): say once that the portable path runs instead."""
        missing = getattr(self.accelerator, "matmul_add_fp32_missing", None)
        if self.native_missing is not None or device_type != "npu" or missing is None:
            return
        self.native_missing = missing()
        if self.native_missing:
            self.note(f"--gradient-accumulation-fusion: {self.native_missing}; weight gradients use the "
                      "portable GEMM paths (install Ascend NNAL/ATB and `source set_env.sh` for the fused kernel)")

    def run(self, g, x, main_grad) -> str:
        name = self.choose(g, x, main_grad)
        try:
            kernels.RUN[name](g, x, main_grad, self.accelerator)
        except (RuntimeError, NotImplementedError, TypeError) as exc:
            if name != kernels.OUT_DTYPE:
                raise
            # torch without the mixed-dtype GEMM on this device: the unfused arithmetic, noted once
            key = self.key(x.shape[0], g.shape[1], x.shape[1], x.dtype, main_grad)
            self.choices[key] = {"path": kernels.MM_ADD, "why": f"{name} unavailable: {exc}".splitlines()[0]}
            self.note(f"--gradient-accumulation-fusion: torch's mixed-dtype GEMM (addmm out_dtype) is not "
                      f"available here ({type(exc).__name__}); weight gradients use a GEMM + add")
            name = kernels.MM_ADD
            kernels.RUN[name](g, x, main_grad, self.accelerator)
        telemetry.count(PREFIX + "kernel." + name)
        return name

    def _measure(self, names, inputs, shape, main_grad) -> dict:
        from npuspeed.ops import memory_tracker

        acc = self.accelerator
        rows, n, k, in_dtype = shape
        peak, peak_reserved = acc.max_memory_allocated(), acc.max_memory_reserved()
        best = {name: float("inf") for name in names}
        try:
            acc.reset_peak_memory_stats()  # the trial's own peak is dropped below
            if inputs is None:  # constant inputs: no random stream of the run is touched
                inputs = (torch.full((rows, n), 0.5, dtype=in_dtype, device=main_grad.device),
                          torch.full((rows, k), 0.25, dtype=in_dtype, device=main_grad.device))
            g, x = inputs
            scratch = main_grad.clone()
            for _ in range(2):
                for name in names:
                    best[name] = min(best[name], _time(kernels.RUN[name], g, x, scratch, acc))
            del scratch, inputs, g, x
        finally:
            memory_tracker.restore_peak(peak, peak_reserved)
        telemetry.count(PREFIX + "measured")
        fused = names[0]
        temp = {name: kernels.temporary_bytes(name, rows, n, k, in_dtype, main_grad.dtype) for name in names}
        # the fused path is kept only where it is neither slower nor larger; it wins ties
        take = best[fused] <= best[kernels.MM_ADD] and temp[fused] <= temp[kernels.MM_ADD]
        path = fused if take else kernels.MM_ADD
        if not take:  # the fallback is said once per dtype pair; the report lists the shapes
            self.note(f"--gradient-accumulation-fusion: {in_dtype} inputs with a {main_grad.dtype} main_grad "
                      f"on {main_grad.device.type}: Megatron's unfused weight gradient runs where it measured "
                      "faster or smaller than the fused one (npuspeed report lists the shapes)")
        times = ", ".join(f"{name} {best[name] * 1e3:.3f} ms / {temp[name] / 2**10:.0f} KiB" for name in names)
        return {"path": path, "why": f"measured once: {times}",
                **{f"{name}_ms": best[name] * 1e3 for name in names}}

    @staticmethod
    def _by_shape(names, rows, n, k, in_dtype, grad_dtype, why: str) -> dict:
        """Without a timing (--deterministic-mode: the two paths round differently and a timing
        varies by run and rank; a device: no trial there): the fused path unless it holds more
        temporary bytes than the unfused one."""
        temp = {name: kernels.temporary_bytes(name, rows, n, k, in_dtype, grad_dtype) for name in names}
        fused = names[0]
        path = fused if temp[fused] <= temp[kernels.MM_ADD] else kernels.MM_ADD
        return {"path": path, "why": f"{why}, chosen by temporary bytes "
                                     f"({', '.join(f'{k_} {v / 2**10:.0f} KiB' for k_, v in temp.items())})"}

    def summary(self) -> str:
        """One line per shape key, for the report."""
        if not self.choices:
            return "no weight gradient computed yet in this process"
        parts = [f"NPU kernel unavailable: {self.native_missing}"] if self.native_missing else []
        for (device, in_dtype, grad_dtype, rows, n, k), record in sorted(self.choices.items(), key=str):
            parts.append(f"{device} {in_dtype}->{grad_dtype} [{rows}x{n}]^T[{rows}x{k}]: {record['path']} "
                         f"({record['why']})")
        return "; ".join(parts)
