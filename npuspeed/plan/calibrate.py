"""`npuspeed plan --calibrate`: time a few ops of the model's shapes here, store a profile.

What speed.py prices a step with: GEMM rates (forward + both backward products) at the
linear shapes of every tensor-parallel size that could run the model on the given devices,
the attention core per kernel at the model's (b, heads, s, d), element-wise work per byte,
the framework's per-op cost, AdamW per parameter and a gloo all-reduce's latency and
bandwidth between two processes. Threads default to one per rank, as torchrun's ranks run.
"""
from __future__ import annotations

import json
import os
import time

import torch

from npuspeed.plan.dims import dims
from npuspeed.plan.spec import RunSpec, replace_layout

PROFILE_VERSION = 1


def _time(fn, repeats: int = 5, warmup: int = 1) -> float:
    """The fastest of `repeats` runs: on a shared host the slower ones measure the neighbours."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _dtype(name: str):
    return torch.float32 if name == "fp32" else torch.bfloat16


def gemm_rate(m: int, k: int, n: int, dtype) -> list:
    x = torch.randn(m, k, dtype=dtype)
    w = torch.randn(n, k, dtype=dtype)
    g = torch.randn(m, n, dtype=dtype)

    def run():
        x @ w.t()
        g @ w
        g.t() @ x

    t = _time(run)
    flops = 6.0 * m * k * n
    return [m, k, n, flops, flops / t]


def _linear_shapes(spec: RunSpec, tps: list[int]) -> set:
    shapes = set()
    for tp in tps:
        for sp in (False, True):
            try:
                d = dims(replace_layout(spec, tp=tp, sp=sp and tp > 1))
            except ZeroDivisionError:
                continue
            qkv = (d.heads + 2 * d.groups) * d.head_dim
            shapes |= {(d.tokens, d.hidden, qkv), (d.tokens, d.heads * d.head_dim, d.hidden),
                       (d.tokens, d.hidden, d.ffn * d.glu), (d.tokens, d.ffn, d.hidden),
                       (d.tokens, d.hidden, d.vocab)}
    return shapes


def _attention_unfused(b, h, s, d, dtype, p):
    q = torch.randn(b * h, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b * h, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b * h, s, d, dtype=dtype, requires_grad=True)
    mask = torch.ones(s, s, dtype=torch.bool).triu_(1)

    def run():
        scores = torch.baddbmm(torch.empty(b * h, s, s, dtype=dtype), q, k.transpose(1, 2), beta=0.0,
                               alpha=d ** -0.5)
        probs = torch.softmax(scores.float().masked_fill(mask, -10000.0), dim=-1).to(dtype)
        probs = torch.nn.functional.dropout(probs, p=p)
        torch.bmm(probs, v).sum().backward()

    return _time(run, repeats=3)


def _attention_sdpa(b, h, s, d, dtype, p, flash: bool):
    q = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    k = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    v = torch.randn(b, h, s, d, dtype=dtype, requires_grad=True)
    use_npuspeed = False
    if flash and dtype == torch.bfloat16:
        from npuspeed.ops import flash_attention as cpu_flash

        use_npuspeed = cpu_flash.machine_reason() is None and d % 16 == 0

    def run():
        if use_npuspeed:
            from npuspeed.ops import flash_attention as cpu_flash

            out = cpu_flash.flash_attention(q.permute(2, 0, 1, 3), k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3),
                                            scale=d ** -0.5, causal=True)
        else:
            out = torch.nn.functional.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        out.float().sum().backward()

    return _time(run, repeats=3)


def _elementwise(tokens: int, hidden: int, dtype) -> float:
    x = torch.randn(tokens, hidden, dtype=dtype, requires_grad=True)
    ln = torch.nn.LayerNorm(hidden).to(dtype)

    def run():
        y = ln(x)
        y = torch.nn.functional.dropout(y, p=0.1) + x
        y.float().sum().backward()

    t = _time(run)
    return t / (6 * tokens * hidden * x.element_size())


def _op_overhead() -> float:
    x = torch.ones(4, requires_grad=True)

    def run():
        y = x
        for _ in range(100):
            y = y * 1.0001
        y.sum().backward()

    return _time(run, repeats=5) / 200


def _adam_per_param() -> float:
    p = torch.nn.Parameter(torch.randn(1 << 21))
    p.grad = torch.randn(1 << 21)
    opt = torch.optim.AdamW([p], lr=1e-3)
    opt.step()
    return _time(opt.step) / p.numel()


def _collective_worker(rank: int, port: int, queue) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    out = []
    for n in (1 << 10, 1 << 16, 1 << 20, 1 << 22):
        t = torch.ones(n // 4)
        dist.all_reduce(t)
        out.append((n, _time(lambda: dist.all_reduce(t), repeats=5)))
    if rank == 0:
        queue.put(out)
    dist.destroy_process_group()


def collective() -> dict:
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_collective_worker, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    points = queue.get(timeout=300)
    for p in procs:
        p.join(timeout=60)
    # all-reduce of n bytes on 2 ranks sends n bytes per rank: fit t = latency + n / bandwidth
    (n0, t0), (n1, t1) = points[0], points[-1]
    bw = (n1 - n0) / max(t1 - t0, 1e-9)
    return {"latency_s": max(t0 - n0 / bw, 1e-6), "bytes_per_s": bw, "points": points}


def calibrate(spec: RunSpec, threads: int = 1, with_collective: bool = True) -> dict:
    torch.set_num_threads(threads)
    tps = [t for t in range(1, spec.devices + 1) if spec.model.heads % t == 0 and spec.devices % t == 0]
    dtypes = sorted({"fp32", "bf16" if spec.batch.dtype != "fp32" else "fp32"})
    gemm = {}
    for name in dtypes:
        gemm[name] = [gemm_rate(m, k, n, _dtype(name)) for m, k, n in sorted(_linear_shapes(spec, tps))]
    d = dims(spec)
    p = spec.model.attention_dropout
    attention = {}
    for name in dtypes:
        dt = _dtype(name)
        unit = d.batch * d.heads * d.seq * d.seq * d.head_dim
        attention[name] = {
            "unfused": _attention_unfused(d.batch, d.heads, d.seq, d.head_dim, dt, p) / unit,
            "flash": _attention_sdpa(d.batch, d.heads, d.seq, d.head_dim, dt, 0.0, True) / unit,
            "sdpa_math": _attention_sdpa(d.batch, d.heads, d.seq, d.head_dim, dt, max(p, 0.1), False) / unit,
        }
    profile = {
        "version": PROFILE_VERSION, "threads": threads,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__, "gemm": gemm, "attention": attention,
        "elementwise_s_per_byte": {name: _elementwise(d.tokens, d.hidden, _dtype(name)) for name in dtypes},
        "op_overhead_s": _op_overhead(), "adam_s_per_param": _adam_per_param(),
        "collective": collective() if with_collective else {"latency_s": 1e-4, "bytes_per_s": 1e9},
        "model": {"hidden": spec.model.hidden, "seq": spec.model.seq_length, "mbs": spec.batch.micro_batch},
    }
    return profile


def write(profile: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(profile, fh, indent=1)
