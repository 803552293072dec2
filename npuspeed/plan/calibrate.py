"""`npuspeed plan --calibrate`: time this model's real modules on this machine, store a profile.

Bare ops miss what dominates a small model's step (Megatron's Python per module) and what a
tensor-parallel step waits for (the other rank, inside each collective). So the calibration
spawns the world this host runs (its ranks, one thread each as torchrun's) and times
Megatron-Core's own TransformerLayer, embedding and loss in every parallel group shape the
plan or the search can use (calib_worker.py), the optimizer step and the world's
collectives; plus the attention kernels alone (so a plan with another attention kernel
than the calibrated one is priced by the difference). speed.py scales these by layers,
micro-batches, the pipeline schedule and DP. About ten seconds a group shape here; the
profile is reused by every plan and search of this model shape on this machine.
"""
from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import replace

import torch

from npuspeed.plan.dims import dims
from npuspeed.plan.spec import RunSpec, layout_problems, replace_layout
from npuspeed.plan.speed import group_key

PROFILE_VERSION = 2


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
    kernel = None
    if flash:
        from npuspeed.ops import flash_attention as cpu_flash

        bf16_ok = dtype == torch.bfloat16 and cpu_flash.machine_reason() is None and d % 16 == 0
        fp32_ok = dtype == torch.float32 and cpu_flash.fp32_reason() is None
        if bf16_ok or fp32_ok:
            kernel = cpu_flash

    def run():
        if kernel is not None:
            out = kernel.flash_attention(q.permute(2, 0, 1, 3), k.permute(2, 0, 1, 3), v.permute(2, 0, 1, 3),
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

    return _time(run) / (6 * tokens * hidden * x.element_size())


def kernels(spec: RunSpec, threads: int) -> dict:
    """Attention kernels alone at this model's (b, heads, s, d), per element of b x heads x s x s x d."""
    torch.set_num_threads(threads)
    d = dims(spec)
    p = spec.model.attention_dropout
    name = "fp32" if spec.batch.dtype == "fp32" else "bf16"
    dt = _dtype(name)
    unit = d.batch * d.heads * d.seq * d.seq * d.head_dim
    attention = {name: {
        "unfused": _attention_unfused(d.batch, d.heads, d.seq, d.head_dim, dt, p) / unit,
        "flash": _attention_sdpa(d.batch, d.heads, d.seq, d.head_dim, dt, 0.0, True) / unit,
        "sdpa_math": _attention_sdpa(d.batch, d.heads, d.seq, d.head_dim, dt, max(p, 0.1), False) / unit,
    }}
    return {"attention": attention, "elementwise_s_per_byte": {name: _elementwise(d.tokens, d.hidden, dt)}}


def calibration_world(spec: RunSpec) -> int:
    """Ranks the calibration runs at once: this host's ranks of the run (at most 8)."""
    per_node = spec.extra.get("nproc_per_node") or spec.devices
    return max(1, min(per_node, spec.devices, 8))


def groups(spec: RunSpec, world: int) -> dict:
    """Group shapes to time: the run's own, and every TP size (with and without SP) that
    --search could choose within the calibration world."""
    lay = spec.layout
    out = {}

    def add(tp, sp, cp, ep):
        cand = replace_layout(spec, tp=tp, sp=sp, cp=cp, ep=ep, pp=1, vpp=None, world=world)
        cand = replace(cand, devices=world, batch=replace(spec.batch, global_batch=None))
        if not layout_problems(cand):
            out[group_key(tp, sp, cp, ep)] = {"tp": tp, "sp": sp, "cp": cp, "ep": ep}

    add(lay.tp, lay.sp, lay.cp, lay.ep)
    for tp in range(1, world + 1):
        if world % tp == 0:
            for sp in ((False, True) if tp > 1 else (False,)):
                add(tp, sp, 1, lay.ep)
    return out


def points(spec: RunSpec, g: dict) -> list[tuple[int, int]]:
    """(micro-batch, sequence) to time: the run's, and half its tokens where that still splits."""
    b, s = spec.batch.micro_batch, spec.model.seq_length
    split = (g["tp"] if g["sp"] else 1) * (2 * g["cp"] if g["cp"] > 1 else 1)
    if b >= 2:
        return [(b, s), (b // 2, s)]
    if (s // 2) % split == 0 and s >= 32:
        return [(b, s), (b, s // 2)]
    return [(b, s)]


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: the CP feature's flags (each takes a value): a world timing CP-1 group shapes runs without them
CP_FLAGS = ("--context-parallel-size", "--context-parallel-algo", "--ulysses-degree-in-cp")


#: flags that count layers of a chunk: the calibration builds chunks of one layer (up to four for
#: the optimizer), so their variant is timed on every layer built and speed.py scales it by the
#: layers the run applies it to (effects.layers_for)
LAYER_COUNT_FLAGS = ("--recompute-activation-function-num-layers", "--recompute-norm-num-layers")


def without(argv: list[str], flags: tuple) -> list[str]:
    """`argv` less `flags` (each with its value, as `--flag v` or `--flag=v`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif not a.startswith(tuple(f + "=" for f in flags)):
            out.append(a)
    return out


def without_cp(argv: list[str]) -> list[str]:
    return without(argv, CP_FLAGS)


def run_world(spec: RunSpec, argv: list[str], threads: int, timeout: float = 900.0) -> dict:
    """Time every group shape of `groups`, the optimizer step and the collectives. A process
    runs under one set of feature patches, as a training run does: with CP > 1 the run's CP
    group shapes are timed in a world with its CP flags, the CP-1 shapes (--search's other
    layouts), the optimizer and the collectives in a second world without them (the CP
    feature refuses a model built without the CP size it was given)."""
    world = calibration_world(spec)
    gs = groups(spec, world)
    grouped = "--moe-grouped-gemm" in argv  # the experts the run builds (Megatron's flag)
    for g in gs.values():
        g["grouped_gemm"] = grouped
    argv = without([a for a in argv if not a.startswith("--npuspeed-device")], LAYER_COUNT_FLAGS)
    cp = spec.layout.cp
    if cp <= 1:
        return _world(spec, argv, threads, world, gs, True, timeout)
    with_cp = {k: g for k, g in gs.items() if g["cp"] == cp}
    plain = {k: g for k, g in gs.items() if g["cp"] != cp}
    result = _world(spec, argv, threads, world, with_cp, False, timeout)
    rest = _world(spec, without_cp(argv), threads, world, plain, True, timeout)
    rest["groups"] = {**result["groups"], **rest["groups"]}
    return rest


def _world(spec: RunSpec, argv: list[str], threads: int, world: int, gs: dict, optimizer: bool,
           timeout: float) -> dict:
    import queue as queue_mod

    import torch.multiprocessing as mp

    from npuspeed.plan import calib_worker

    job = {"spec": spec, "argv": argv, "threads": threads, "groups": gs, "grouped_gemm": "--moe-grouped-gemm" in argv,
           "points": {k: points(spec, g) for k, g in gs.items()}, "optimizer": optimizer}
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    port = _port()
    procs = [ctx.Process(target=calib_worker.main, args=(r, world, port, job, q)) for r in range(world)]
    for p in procs:
        p.start()
    result = None
    deadline = time.monotonic() + timeout
    try:
        while result is None:
            try:
                result = q.get(timeout=2.0)
            except queue_mod.Empty:
                dead = [p.exitcode for p in procs if p.exitcode not in (None, 0)]
                if dead:  # a rank died without a word (e.g. killed): do not wait out the timeout
                    result = q.get(timeout=5.0) if not q.empty() else {
                        "error": f"a calibration rank exited with status {dead[0]} and no message"}
                elif time.monotonic() > deadline:
                    result = {"error": f"calibration did not finish in {timeout:.0f} s"}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    if "error" in result:
        raise RuntimeError(f"npuspeed plan --calibrate failed: {result['error']}")
    return result


def calibrate(spec: RunSpec, argv: list[str] | None = None, threads: int = 1) -> dict:
    from npuspeed.plan import effects as effects_mod
    from npuspeed.plan.context import context_for

    argv = list(argv or [])
    t0 = time.perf_counter()
    measured = run_world(spec, argv, threads)
    ctx, features = context_for(argv)
    eff = effects_mod.collect(spec, ctx, features)
    profile = {
        "version": PROFILE_VERSION, "threads": threads,
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "torch": torch.__version__, "world": measured["world"], "groups": measured["groups"],
        "optimizer": measured["optimizer"], "collective": measured["collective"],
        # what the timed layers ran: a plan with other variants is priced by the kernel difference
        "variants": dict(eff.variants), "recompute_granularity": spec.model.recompute_granularity,
        "model": {"hidden": spec.model.hidden, "seq": spec.model.seq_length, "mbs": spec.batch.micro_batch,
                  "dtype": spec.batch.dtype, "layers": spec.model.num_layers},
        **kernels(spec, threads),
    }
    profile["seconds"] = time.perf_counter() - t0
    return profile


def write(profile: dict, path: str) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as fh:
        json.dump(profile, fh, indent=1)
