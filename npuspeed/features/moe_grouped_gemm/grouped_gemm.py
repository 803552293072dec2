"""One grouped matmul over tokens sorted by expert: y[rows of g] = x[rows of g] @ w[g].

x [M, K] holds the groups' rows back to back (`counts[g]` rows for group g, zeros allowed),
w [G, K, N] one weight per group. Backends, chosen once per (device type, dtype):

- `npu`: torch_npu's `npu_grouped_matmul` (m-axis groups, one output tensor) forward and for
  the input gradient; the weight gradients per group (its k-axis grouping is not offered).
- `torch`: PyTorch's grouped mm (`torch._grouped_mm`, the op behind
  `torch.nn.functional.grouped_mm`) for the forward and both gradients (its own autograd
  rejects an expanded, zero-stride gradient), where a tiny probe of this device and dtype
  runs: the CPU build of torch 2.13 has it for fp32 and bf16, CUDA for bf16 on recent GPUs.
- `loop`: one `torch.mm` per group written into its rows of a preallocated output, forward
  and backward (benchmarks/bench_moe.py measures it against the others).
- `linear`: Megatron's SequentialMLP matmuls exactly: per group `F.linear` on the weight in
  Megatron's [N, K] layout (one contiguous transposed copy of w per call), the input gradient
  `grad @ W` and the weight gradient `grad.t() @ x` as Megatron's linear layer computes them,
  copied back into w's [K, N] layout. The same products, layouts and roundings as the flag off;
  on a CPU the layout alone changes a bf16 GEMM's speed several-fold, so this (not `loop`) is
  the `megatron` candidate of the per-shape choice below.
- `loop_fp32` (bf16/fp16 on CPU): the same loop on fp32 copies of each group's rows and
  weight, rounded once to the input dtype: what a bf16 GEMM computes (fp32 accumulation,
  one rounding), but on fp32 units. A CPU without bf16 GEMM units (AVX2 only) runs a bf16
  1024x512x2816 matmul in 0.3-4 s by layout and the fp32 one in 0.04 s (measured here), so
  where it is a candidate the per-shape measurement below decides.

`--moe-grouped-gemm` does not take the grouped backend blindly: per (device, dtype, group
count, weight shape, rows to the nearest power of two) Megatron's per-expert matmuls
(`linear`, the `megatron` candidate), the device's grouped backend (or `loop` where it has
none) and, for bf16/fp16 on a CPU, `loop_fp32` are timed once, forward + backward, by
npuspeed.ops.fused_choice, and the fastest runs (`choose_backend`; ties go to `linear`), so
the flag never runs slower GEMMs than SequentialMLP's by more than the measurement's noise.
NPUSPEED_FUSED_OP_PATH=megatron forces `linear`, any other forced value the grouped kernel
(loop_fp32 where the device has none).
Each call is counted (`moe.grouped_gemm.<backend>`) so tests prove which one ran.

A weight used by several calls in one step (the chunks of the overlapped all-to-all) can
share a `GradSink` (features/moe_common/grad_sink.py): the first backward to run writes its
weight gradient, the others add theirs into it inside the matmul (addmm, no extra pass), and
only the last one hands the sum to autograd, instead of autograd adding one full weight-sized
gradient per chunk.
"""
from __future__ import annotations

import torch

from npuspeed import telemetry
from npuspeed.accelerator.devices import for_device
from npuspeed.features.moe_common import deferred_wgrad
from npuspeed.features.moe_common.grad_sink import GradSink
from npuspeed.ops import _dispatch
from npuspeed.ops.npu import moe as npu_moe

BACKENDS = (_dispatch.NPU_IMPL, "torch", "loop", "loop_fp32", "linear")
UPCAST = "loop_fp32"
LINEAR = "linear"  # Megatron's per-expert F.linear: the `megatron` candidate
_CHOSEN: dict[tuple[str, torch.dtype], str] = {}


def _torch_grouped_mm():
    return getattr(torch, "_grouped_mm", None)


def torch_grouped_mm_runs(device: torch.device, dtype: torch.dtype) -> bool:
    """Does torch's grouped mm run forward and backward here (with an empty group)?"""
    fn = _torch_grouped_mm()
    if fn is None:
        return False
    try:
        x = torch.ones(3, 16, device=device, dtype=dtype)
        w = torch.ones(2, 16, 16, device=device, dtype=dtype)
        offs = torch.tensor([0, 3], device=device, dtype=torch.int32)
        y = fn(x, w, offs=offs)
        dx = fn(y, w.transpose(-2, -1), offs=offs)
        dw = fn(x.t(), y, offs=offs)
        return bool(torch.isfinite(dx).all() and dw[0].abs().sum() == 0 and dw[1].abs().sum() > 0)
    except Exception:  # not implemented for this device/dtype/architecture
        return False


def backend_for(x: torch.Tensor) -> str:
    key = (x.device.type, x.dtype)
    if key not in _CHOSEN:
        if _dispatch.on_npu(x) and npu_moe.has_grouped_matmul():
            _CHOSEN[key] = _dispatch.NPU_IMPL
        elif torch_grouped_mm_runs(x.device, x.dtype):
            _CHOSEN[key] = "torch"
        else:
            _CHOSEN[key] = "loop"
    return _CHOSEN[key]


def upcast_is_candidate(x: torch.Tensor) -> bool:
    """fp32 copies only pay where low-precision GEMMs may lack hardware units: the CPU."""
    return for_device(x).host_is_device() and x.dtype in (torch.bfloat16, torch.float16)


def choose_backend(x: torch.Tensor, w: torch.Tensor, counts: list[int]) -> str:
    """The fastest of the per-expert loop (Megatron's matmuls), the device's grouped backend and,
    for bf16/fp16 on CPU, the loop in fp32, measured once per shape."""
    from npuspeed.ops import fused_choice

    capable = backend_for(x)
    upcast = upcast_is_candidate(x)
    force = fused_choice.forced()
    if force is not None:
        if force == fused_choice.MEGATRON:
            return LINEAR
        return capable if capable != "loop" or not upcast else UPCAST
    rows = row_bucket(x.shape[0])
    grads = x.requires_grad or w.requires_grad  # not grad mode: a recompute reruns with the same choice
    key = ("grouped_mm", x.device.type, x.dtype, tuple(w.shape), rows, grads)
    choice = fused_choice.CHOOSER.choices.get(key)
    if choice is None:
        dtype = str(x.dtype).replace("torch.", "").replace("bfloat16", "bf16").replace("float", "fp")
        label = f"{w.shape[0]} experts, ~{rows}x{w.shape[1]}x{w.shape[2]} {dtype} {x.device.type}"
        candidates = {fused_choice.MEGATRON: lambda x, w: grouped_mm(x, w, counts, backend=LINEAR),
                      capable: lambda x, w: grouped_mm(x, w, counts, backend=capable)}
        if upcast:
            candidates[UPCAST] = lambda x, w: grouped_mm(x, w, counts, backend=UPCAST)
        choice = fused_choice.CHOOSER.pick("grouped_mm", key, label, candidates, (x, w))
    return LINEAR if choice.impl == fused_choice.MEGATRON else choice.impl


def row_bucket(rows: int) -> int:
    """The power of two nearest `rows` (log scale): the rows an all-to-all delivers wobble
    around their mean step to step (EP2, 2048 tokens top-2: 4096 +- a few dozen), and rounding
    up split them over two keys (4096, 8192), so a second trial ran in a later, timed step."""
    if rows <= 1:
        return 1
    low = 1 << (rows.bit_length() - 1)
    return low if rows * rows < 2 * low * low else 2 * low


def _counts(counts) -> list[int]:
    return [int(c) for c in (counts.tolist() if torch.is_tensor(counts) else counts)]


def _check(x, w, counts):
    if x.dim() != 2 or w.dim() != 3 or x.shape[1] != w.shape[1] or len(counts) != w.shape[0]:
        raise ValueError(f"grouped_mm: x [M, K], w [G, K, N] and G counts expected, got x {tuple(x.shape)}, "
                         f"w {tuple(w.shape)}, {len(counts)} counts")
    if sum(counts) != x.shape[0] or min(counts, default=0) < 0:
        raise ValueError(f"grouped_mm: counts {counts} must be >= 0 and sum to the {x.shape[0]} rows of x")


def _dw(ctx, x, grad, w, fresh):
    """The weight gradient now (None where `w` came detached with a Later: owed to it instead)."""
    if ctx.later is not None:
        ctx.later.owe(fresh)
        return None
    if not ctx.needs_input_grad[1]:
        return None
    sink = ctx.sink
    return fresh() if sink is None else sink.take(x, grad, ctx.counts, w, fresh)


def _mm_into(out, a, b, upcast: bool):
    """out = a @ b: in place, or (upcast) on fp32 copies rounded once into `out`."""
    if upcast:
        out.copy_(torch.mm(a.float(), b.float()))
    else:
        torch.mm(a, b, out=out)


class _LoopGMM(torch.autograd.Function):
    """One mm per group; `upcast`: the loop_fp32 backend (see the module docstring)."""

    @staticmethod
    def forward(ctx, x, w, counts, sink, upcast=False, later=None):
        ctx.counts, ctx.sink, ctx.upcast, ctx.later = counts, sink, upcast, later
        ctx.save_for_backward(x, w)
        out = x.new_empty(x.shape[0], w.shape[2])
        for xs, wg, os_ in zip(x.split(counts), w, out.split(counts)):
            if xs.shape[0]:
                _mm_into(os_, xs, wg, upcast)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = grad.new_empty(x.shape)
            for gs, wg, ds in zip(grad.split(ctx.counts), w, dx.split(ctx.counts)):
                if gs.shape[0]:
                    _mm_into(ds, gs, wg.t(), ctx.upcast)
        dw = _dw(ctx, x, grad, w, lambda: _weight_grads(x, grad, ctx.counts, w, upcast=ctx.upcast))
        return dx, dw, None, None, None, None


class _LinearGMM(torch.autograd.Function):
    """Megatron's SequentialMLP GEMMs per group (the `linear` backend, see the module docstring):
    forward `x @ W.t()`, input gradient `grad @ W`, weight gradient `grad.t() @ x`, with W the
    group's weight in Megatron's [N, K] layout (a contiguous copy of w[g].t())."""

    @staticmethod
    def forward(ctx, x, w, counts, sink, later=None):
        ctx.counts, ctx.sink, ctx.later = counts, sink, later
        wt = w.detach().transpose(1, 2).contiguous()  # [G, N, K]: each expert's linear weight
        ctx.save_for_backward(x, w, wt)
        out = x.new_empty(x.shape[0], w.shape[2])
        for xs, wg, os_ in zip(x.split(counts), wt, out.split(counts)):
            if xs.shape[0]:
                torch.mm(xs, wg.t(), out=os_)
        return out

    @staticmethod
    def backward(ctx, grad):
        x, w, wt = ctx.saved_tensors
        grad = grad.contiguous()
        dx = None
        if ctx.needs_input_grad[0]:
            dx = grad.new_empty(x.shape)
            for gs, wg, ds in zip(grad.split(ctx.counts), wt, dx.split(ctx.counts)):
                if gs.shape[0]:
                    torch.mm(gs, wg, out=ds)
        dw = _dw(ctx, x, grad, w, lambda: _linear_weight_grads(x, grad, ctx.counts, w))
        return dx, dw, None, None, None


def _linear_weight_grads(x, grad, counts, w):
    """Megatron's weight gradient per group (grad.t() @ x, [N, K]) laid into w's [G, K, N]."""
    dw = torch.zeros_like(w)
    for g, (xs, gs) in enumerate(zip(x.split(counts), grad.split(counts))):
        if xs.shape[0]:
            dw[g].copy_(torch.mm(gs.t(), xs).t())
    return dw


def _weight_grads(x, grad, counts, w, upcast: bool = False):
    dw = torch.zeros_like(w)
    for g, (xs, gs) in enumerate(zip(x.split(counts), grad.split(counts))):
        if xs.shape[0]:
            _mm_into(dw[g], xs.t(), gs, upcast)
    return dw


class _TorchGMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, offs, counts, sink, later=None):
        ctx.counts, ctx.sink, ctx.later = counts, sink, later
        ctx.save_for_backward(x, w, offs)
        return _torch_grouped_mm()(x, w, offs=offs)

    @staticmethod
    def backward(ctx, grad):
        x, w, offs = ctx.saved_tensors
        if x.shape[0] == 0:  # no rows: zero, defined weight gradients
            dw = _dw(ctx, x, grad, w, lambda: torch.zeros_like(w))
            return x.new_zeros(x.shape), dw, None, None, None, None
        grad = grad.contiguous()
        fn = _torch_grouped_mm()
        dx = fn(grad, w.transpose(-2, -1), offs=offs) if ctx.needs_input_grad[0] else None
        dw = _dw(ctx, x, grad, w, lambda: fn(x.t(), grad, offs=offs))
        return dx, dw, None, None, None, None


class _NpuGMM(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, w, counts, sink, later=None):
        ctx.counts, ctx.sink, ctx.later = counts, sink, later
        ctx.save_for_backward(x, w)
        return _npu_gmm(x, w, counts)

    @staticmethod
    def backward(ctx, grad):
        x, w = ctx.saved_tensors
        grad = grad.contiguous()
        dx = _npu_gmm(grad, w.transpose(1, 2), ctx.counts) if ctx.needs_input_grad[0] else None
        dw = _dw(ctx, x, grad, w, lambda: _weight_grads(x, grad, ctx.counts, w))
        return dx, dw, None, None, None


def _npu_gmm(x, w, counts):
    if len(counts) == 1:  # one local expert: torch_npu refuses a group_list of length 1 under
        return torch.mm(x, w[0])  # group_list_type=1 ("且长度不能为1"); one group is one matmul
    return npu_moe.grouped_matmul(x, w, torch.tensor(counts, dtype=torch.int64, device=x.device))


def grouped_mm(x: torch.Tensor, w: torch.Tensor, counts, backend: str | None = None,
               sink: GradSink | None = None) -> torch.Tensor:
    """[M, N]: each group's rows of x times its weight; `counts` per group (list or tensor);
    `sink`: shared with the other calls of this weight in the step (see GradSink). Where a
    thread has armed moe_common/deferred_wgrad, the weight's gradient is owed, not returned."""
    counts = _counts(counts)
    _check(x, w, counts)
    backend = backend or choose_backend(x, w, counts)
    if backend not in BACKENDS:
        raise ValueError(f"grouped_mm: unknown backend {backend!r}; one of {BACKENDS}")
    if _dispatch.counting():  # not inside a fused_choice trial
        telemetry.count(f"moe.grouped_gemm.{backend}")
    x = x.contiguous()
    w, later = deferred_wgrad.split(w) if _dispatch.counting() else (w, None)  # a trial's backward: its own
    if backend == "torch":
        offs = torch.tensor(counts, dtype=torch.int64).cumsum(0).to(device=x.device, dtype=torch.int32)
        return _TorchGMM.apply(x, w, offs, counts, sink, later)
    if backend == _dispatch.NPU_IMPL:
        return _NpuGMM.apply(x, w, counts, sink, later)
    if backend == LINEAR:
        return _LinearGMM.apply(x, w, counts, sink, later)
    return _LoopGMM.apply(x, w, counts, sink, backend == UPCAST, later)
