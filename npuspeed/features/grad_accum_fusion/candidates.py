"""Which weight-gradient path runs, per (device, dtypes, shape): a candidate list for the one chooser.

The candidates are the fused in-place GEMM the device has (kernels.candidates) and Megatron's
unfused GEMM + add (the baseline). npuspeed's chooser (npuspeed.ops.choose) times
both, interleaved, on scratch copies of main_grad the first time a shape is seen; the fused one
is kept only where it is neither slower nor holds more temporary bytes (16-bit inputs upcast to
fp32 hold rows x (n + k) x 4 bytes, the unfused product n x k in the input dtype; a 16-bit GEMM
with AVX512-BF16 can beat an fp32 in-place one, so the "fused" path is not always the fast one);
ties go to Megatron's. The chooser's guard puts the trial's peak back on the host; on a GPU or
NPU the same trial is timed with device events (the device's allocator may keep the trial's
scratch main_grad on its peak: n x k x 4 bytes, once per shape), and an NPU without torch_npu's
matmul-add kernel has only the upcast GEMM, which the bytes rule keeps out where it is
larger; a mixed-dtype GEMM this torch does not have falls back to the unfused path, once, with a
note. Under --deterministic-mode nothing is timed: the fused path unless it holds more bytes.
NPUSPEED_WGRAD_PATH=fused|unfused|<kernel name> forces a path (tests and benchmarks).
"""
from __future__ import annotations

import torch

from npuspeed import telemetry
from npuspeed.features.grad_accum_fusion import kernels
from npuspeed.ops.choose.chooser import Chooser
from npuspeed.ops.choose.criteria import Fastest

PREFIX = "grad_accum_fusion."
#: forces the choice for every shape: "fused" (the in-place path), "unfused" or a kernels name
FIXED_ENV = "NPUSPEED_WGRAD_PATH"
_FUSED = tuple(name for name in kernels.RUN if name != kernels.MM_ADD)


class WgradPaths:
    """Per shape key: the path name, and why (for `npuspeed report`)."""

    def __init__(self, accelerator, note=None, fixed: str | None = None):
        self.accelerator = accelerator
        self.note = note or (lambda message: None)
        self.fixed = fixed
        self.chooser = Chooser(repeats=2, adaptive=False, criterion=Fastest(no_larger=True), baseline=kernels.MM_ADD,
                               force_env=FIXED_ENV, forceable=tuple(kernels.RUN),
                               aliases={"fused": _FUSED, "unfused": (kernels.MM_ADD,)}, check=False,
                               name="weight gradient")
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
        measured on constant inputs of that shape when `inputs` is not given."""
        key = self.key(rows, n, k, in_dtype, main_grad)
        record = self.choices.get(key)
        if record is None:
            record = self._choose(key, rows, n, k, in_dtype, main_grad, inputs)
            self.choices[key] = record
        return record["path"]

    def _choose(self, key, rows, n, k, in_dtype, main_grad, inputs) -> dict:
        names = kernels.candidates(main_grad.device.type, in_dtype, main_grad.dtype, self.accelerator)
        self._say_native_missing()
        acc = self.accelerator
        # a trial on this run's accelerator (device events there, CPU time on the host), on the
        # call's inputs or constant ones: the fused GEMM is not always the fast one on a device
        # either (an H100, torch 2.11: the mixed-dtype addmm cost 1.084x of a step)
        from npuspeed.features.chooser_setup import on_accelerator

        on_accelerator(self.chooser, acc)
        if torch.are_deterministic_algorithms_enabled():  # nothing is timed: no trial inputs
            inputs = ()
        else:
            if inputs is None:  # constant inputs: no random stream of the run is touched
                inputs = (torch.full((rows, n), 0.5, dtype=in_dtype, device=main_grad.device),
                          torch.full((rows, k), 0.25, dtype=in_dtype, device=main_grad.device))
            inputs = (*inputs, main_grad)
        candidates = {name: (lambda g, x, grad, _run=kernels.RUN[name]: _run(g, x, grad, acc)) for name in names}
        nbytes = {name: kernels.temporary_bytes(name, rows, n, k, in_dtype, main_grad.dtype) for name in names}
        fixed = {"fused": names[0], "unfused": kernels.MM_ADD}.get(self.fixed, self.fixed)
        choice = self.chooser.pick("wgrad", key, " ".join(map(str, key)), candidates, inputs,
                                   fixed=fixed, fixed_by=f"fixed ({self.fixed})", nbytes=nbytes, grads=False)
        if choice.ms:
            telemetry.count(PREFIX + "measured")
            choice.why = f"measured once: {choice.why}"
        if choice.impl == kernels.MM_ADD and not (fixed or self.chooser.forced()):
            how = ("where it measured faster or smaller than the fused one" if choice.ms else
                   "where the fused kernel would need larger fp32 copies of the inputs")
            self.note(f"--gradient-accumulation-fusion: {in_dtype} inputs with a {main_grad.dtype} main_grad on "
                      f"{main_grad.device.type}: Megatron's unfused weight gradient runs {how} "
                      "(npuspeed report lists the shapes)")
        return dict(path=choice.impl, **choice.flat())

    def _say_native_missing(self) -> None:
        """torch_npu names its matmul-add kernel even without the NNAL/ATB package that runs it
        (the accelerator probes it once): say once that the portable path runs instead."""
        missing = getattr(self.accelerator, "matmul_add_fp32_missing", None)
        if self.native_missing is not None or missing is None:
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

    def summary(self) -> str:
        """One line per shape key, for the report."""
        if not self.choices:
            return "no weight gradient computed yet in this process"
        parts = [f"NPU kernel unavailable: {self.native_missing}"] if self.native_missing else []
        for (device, in_dtype, grad_dtype, rows, n, k), record in sorted(self.choices.items(), key=str):
            parts.append(f"{device} {in_dtype}->{grad_dtype} [{rows}x{n}]^T[{rows}x{k}]: {record['path']} "
                         f"({record['why']})")
        return "; ".join(parts)
