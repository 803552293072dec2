"""A training step's compute floor: every GEMM and attention call of one step at the model's
shapes, each timed alone on the device and summed.

A step can be no faster than its matrix work run back to back with nothing between (no norms,
elementwise kernels, copies, optimizer, communication or host gaps), at the speed the device's
libraries reach for exactly those shapes. step / floor then says how much of a step is
something other than the model's FLOPs, which MFU alone does not: a floor at 60% MFU and a
step at 40% is a step within 1.5x of what its GEMMs allow, whatever the data-sheet peak.

`calls` lists one micro-batch's calls on one tensor-parallel rank for a dense GPT (Megatron's
layout: fused QKV, output projection, fc1 (twice ffn wide with a gated unit such as SwiGLU),
fc2, the logits), each linear layer as its three GEMMs (forward Y = X W^T, data gradient
dX = dY W, weight gradient dW = dY^T X), and the causal core attention once, forward and
backward together, with the kernel npuspeed's --use-flash-attn runs there (npuspeed's CPU
flash kernel on the host where it takes the call, else torch's SDPA). Its FLOPs are
Megatron-LM's count (npuspeed.throughput: causal attention counts half the score matrix),
so `flops(calls) x TP x micro-batches` equals `throughput.model_flops` for the global batch;
the unit tests hold it to that. MoE layers are not enumerated (their GEMM shapes depend on
the routing): `calls` refuses them.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

from npuspeed.throughput import FlopsModel


@dataclass(frozen=True)
class Call:
    """One kernel call of a micro-batch: a GEMM (m, n, k: [m, k] x [k, n]) or the core attention
    (batch, seq, heads, groups, head dim), `count` times per micro-batch per rank."""
    kind: str  # "gemm" | "attention"
    layer: str  # "qkv", "proj", "fc1", "fc2", "logits", "core"
    phase: str  # "fwd" | "dgrad" | "wgrad" | "fwd+bwd"
    shape: tuple
    count: int
    flops: float  # one call's FLOPs, Megatron-LM's count


def _linear(layer: str, tokens: int, inp: int, out: int, count: int) -> list[Call]:
    """A linear layer X[tokens, inp] -> Y[tokens, out] as its three GEMMs (2 m n k FLOPs each)."""
    f = 2.0 * tokens * inp * out
    return [Call("gemm", layer, "fwd", (tokens, out, inp), count, f),
            Call("gemm", layer, "dgrad", (tokens, inp, out), count, f),
            Call("gemm", layer, "wgrad", (out, inp, tokens), count, f)]


def calls(m: FlopsModel, micro_batch: int, tp: int = 1) -> list[Call]:
    """One micro-batch's GEMMs and attention calls on one of `tp` tensor-parallel ranks."""
    if m.num_experts:
        raise ValueError("compute floor: MoE layers are not enumerated (their GEMM shapes depend on the routing)")
    for name, value in (("--num-attention-heads", m.heads), ("--num-query-groups", m.query_groups),
                        ("--ffn-hidden-size", m.ffn), ("padded vocabulary", m.padded_vocab)):
        if value % tp:
            raise ValueError(f"compute floor: {name} {value} is not divisible by TP {tp}")
    t, n = micro_batch * m.seq_length, m.num_layers
    q, kv = m.kv_channels * m.heads // tp, m.kv_channels * m.query_groups // tp
    gate = q if m.attention_output_gate else 0
    glu = 2 if m.swiglu else 1
    out = _linear("qkv", t, m.hidden, q + 2 * kv + gate, n) + _linear("proj", t, q, m.hidden, n)
    out += _linear("fc1", t, m.hidden, glu * m.ffn // tp, n) + _linear("fc2", t, m.ffn // tp, m.hidden, n)
    out += _linear("logits", t, m.hidden, m.padded_vocab // tp, 1)
    # QK^T and its product with V, 2 s^2 q FLOPs each, halved (causal), forward and backward (x3)
    attention = 3 * 2 * micro_batch * m.seq_length * m.seq_length * q
    out.append(Call("attention", "core", "fwd+bwd",
                    (micro_batch, m.seq_length, m.heads // tp, m.query_groups // tp, m.kv_channels), n, attention))
    return out


def flops(call_list: list[Call]) -> float:
    return sum(c.flops * c.count for c in call_list)


def _attention_runner(b, s, hq, hk, d, dtype, device, dropout_p):
    """fwd+bwd of one causal attention call with the kernel --use-flash-attn runs on `device`;
    returns (run, kernel name)."""
    import torch

    gen = torch.Generator().manual_seed(0)

    def leaf(heads):
        return torch.randn(s, b, heads, d, generator=gen).to(device=device, dtype=dtype).requires_grad_()

    query, key, value = leaf(hq), leaf(hk), leaf(hk)
    grad = torch.randn(s, b, hq * d, generator=gen).to(device=device, dtype=dtype)
    scale = d ** -0.5
    from npuspeed.ops import flash_attention as cpu_flash

    reason = cpu_flash.unsupported(query, key, masked=False, dropout_p=dropout_p)
    from npuspeed.ops import _dispatch  # the ops layer's host table (the floor sits below the accelerator)

    on_host = device.type in _dispatch.HOST_DEVICE_TYPES
    upcast = reason is not None and dtype == torch.bfloat16 and on_host and cpu_flash.fp32_reason() is None
    if reason is None or upcast:
        params = cpu_flash.FlashParams(scale=scale, causal=True, dropout_p=dropout_p)
        if upcast:
            query, key, value = (x.detach().float().requires_grad_() for x in (query, key, value))
            grad = grad.float()

        def run():
            cpu_flash.flash_attention(query, key, value, params).backward(grad)
        return run, "npuspeed_flash_fp32" if upcast or dtype == torch.float32 else "npuspeed_flash_bf16"
    import torch.nn.functional as F

    extra = {"enable_gqa": True} if hq != hk else {}

    def run():
        out = F.scaled_dot_product_attention(query.permute(1, 2, 0, 3), key.permute(1, 2, 0, 3),
                                             value.permute(1, 2, 0, 3), is_causal=True, scale=scale,
                                             dropout_p=dropout_p, **extra)
        out.permute(2, 0, 1, 3).reshape(s, b, hq * d).backward(grad)
    return run, "sdpa"


def _gemm_runner(shape, dtype, device, phase):
    """One GEMM in the layout its phase has in Megatron's linear layers (weights [out, in])."""
    import torch

    m, n, k = shape
    gen = torch.Generator().manual_seed(0)
    if phase == "fwd":  # X [m, k] @ W[n, k]^T
        a, b = torch.randn(m, k, generator=gen), torch.randn(n, k, generator=gen).t()
    elif phase == "dgrad":  # dY [m, k=out] @ W [out, n=in]
        a, b = torch.randn(m, k, generator=gen), torch.randn(k, n, generator=gen)
    else:  # dY^T: [out, tokens] (a transposed view) @ X [tokens, in]
        a, b = torch.randn(k, m, generator=gen).t(), torch.randn(k, n, generator=gen)
    a, b = a.to(device=device, dtype=dtype), b.to(device=device, dtype=dtype)
    out = torch.empty(m, n, device=device, dtype=dtype)
    return lambda: torch.mm(a, b, out=out)


def time_call(run, synchronize, *, warmup: int, repeats: int, inner: int, clock=time.perf_counter) -> list[float]:
    """ms per call of `repeats` timings of `inner` back-to-back calls each, after `warmup` calls.
    `clock`: wall time by default; on a shared host time.process_time (this process's CPU
    time, which other processes' load moves least), to compare with a run's CPU time per step."""
    for _ in range(warmup):
        run()
    synchronize()
    times = []
    for _ in range(repeats):
        t0 = clock()
        for _ in range(inner):
            run()
        synchronize()
        times.append((clock() - t0) * 1000.0 / inner)
    return times


def measure(call_list: list[Call], device, synchronize, *, dtype=None, dropout_p: float = 0.0,
            warmup: int | None = None, repeats: int | None = None, inner: int | None = None,
            clock=time.perf_counter) -> list[dict]:
    """Each distinct call timed alone: its median ms, spread, and the kernel attention ran.
    Defaults: on a host 1 warm-up, 3 repeats of 1 call; on an accelerator 3, 5 and 10 (a call
    of ~0.1 ms there is shorter than a synchronisation)."""
    import torch

    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    from npuspeed.ops import _dispatch  # the ops layer's host table (the floor sits below the accelerator)

    host = device.type in _dispatch.HOST_DEVICE_TYPES
    warmup = (1 if host else 3) if warmup is None else warmup
    repeats = (3 if host else 5) if repeats is None else repeats
    inner = (1 if host else 10) if inner is None else inner
    rows, seen = [], {}
    for c in call_list:
        key = (c.kind, c.phase, c.shape)
        if key not in seen:
            kernel = "mm"
            if c.kind == "attention":
                run, kernel = _attention_runner(*c.shape, dtype, device, dropout_p)
            else:
                run = _gemm_runner(c.shape, dtype, device, c.phase)
            times = time_call(run, synchronize, warmup=warmup, repeats=repeats, inner=inner, clock=clock)
            seen[key] = {"median_ms": statistics.median(times), "min_ms": min(times), "max_ms": max(times),
                         "kernel": kernel}
        t = seen[key]
        rows.append({"kind": c.kind, "layer": c.layer, "phase": c.phase, "shape": list(c.shape), "count": c.count,
                     "flops": c.flops, **t, "tflops": c.flops / t["median_ms"] / 1e9 if t["median_ms"] else None})
    return rows


def floor(m: FlopsModel, *, micro_batch: int, micro_batches: int, tp: int, device, synchronize, dtype=None,
          dropout_p: float = 0.0, peak_tflops: float | None = None, **timing) -> dict:
    """One step's floor on one rank: the sum of every call's median time x its count x the
    micro-batches, its FLOPs and TFLOP/s, and its MFU against `peak_tflops` (None: unknown)."""
    rows = measure(calls(m, micro_batch, tp), device, synchronize, dtype=dtype, dropout_p=dropout_p, **timing)
    per_micro = sum(r["median_ms"] * r["count"] for r in rows)
    floor_ms = per_micro * micro_batches
    step_flops = sum(r["flops"] * r["count"] for r in rows) * micro_batches
    tflops = step_flops / floor_ms / 1e9 if floor_ms else 0.0
    by_kind = {kind: sum(r["median_ms"] * r["count"] for r in rows if r["kind"] == kind) * micro_batches
               for kind in ("gemm", "attention")}
    return {"floor_ms": floor_ms, "flops_per_rank": step_flops, "tflops": tflops,
            "mfu": tflops / peak_tflops if peak_tflops else None, "peak_tflops": peak_tflops,
            "ms_by_kind": by_kind, "micro_batches": micro_batches, "micro_batch": micro_batch, "tp": tp,
            "dropout_p": dropout_p, "dtype": str(dtype or "torch.bfloat16").replace("torch.", ""), "calls": rows}
