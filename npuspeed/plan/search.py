"""`npuspeed plan --search`: every valid layout and memory-feature set for the devices given,
those predicted to fit, ranked by predicted tokens/s, as ready-to-run flag lines.

Layouts: TP over the divisors of the device count that divide the heads and groups (with and
without sequence parallelism), PP over the divisors of the rest that divide the layers
(with 2-way interleaving where the stage's layers split), DP the rest (with and without the
distributed optimizer). Feature sets: activation recompute, fused attention, reuse-fp32-param
(bf16), Megatron's selective and full recompute. The global batch stays what was given (or
micro-batch x devices), so every candidate trains on the same tokens per step.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

from npuspeed.plan.spec import Layout, RunSpec, layout_problems

LAYOUT_FLAGS = {"--tensor-model-parallel-size": 1, "--pipeline-model-parallel-size": 1,
                "--num-layers-per-virtual-pipeline-stage": 1, "--virtual-pipeline-model-parallel-size": 1,
                "--sequence-parallel": 0, "--use-distributed-optimizer": 0, "--context-parallel-size": 1,
                "--global-batch-size": 1, "--recompute-granularity": 1, "--recompute-method": 1,
                "--recompute-num-layers": 1, "--nproc-per-node": 1, "--nproc_per_node": 1, "--nnodes": 1,
                "--device-memory-gb": 1, "--profile": 1, "--search": 0, "--top": 1, "--json": 0,
                "--recompute-activation-function": 0, "--use-flash-attn": 0, "--reuse-fp32-param": 0,
                "--expert-model-parallel-size": 1, "--script": 1}

FEATURE_SETS = {
    "recompute-activation": ["--recompute-activation-function"],
    "flash-attn": ["--use-flash-attn"],
    "reuse-fp32-param": ["--reuse-fp32-param"],
    "selective-recompute": ["--recompute-granularity", "selective"],
    "full-recompute": ["--recompute-granularity", "full", "--recompute-method", "uniform",
                       "--recompute-num-layers", "1"],
}


@dataclass
class Candidate:
    layout: Layout
    features: tuple
    argv: list
    plan: object

    def flag_line(self) -> str:
        return " ".join(self.argv)


def strip(argv: list[str], flags: dict = LAYOUT_FLAGS) -> list[str]:
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in flags:
            i += 1 + (flags[name] if "=" not in a else 0)
            continue
        out.append(a)
        i += 1
    return out


def layouts(spec: RunSpec) -> list[Layout]:
    m, n = spec.model, spec.devices
    out = []
    for tp in [t for t in range(1, n + 1) if n % t == 0]:
        for pp in [p for p in range(1, n // tp + 1) if (n // tp) % p == 0]:
            dp = n // (tp * pp)
            vpps = [None]
            if pp > 1 and (m.num_layers // pp) % 2 == 0 and m.num_layers % pp == 0:
                vpps.append(2)
            for sp, vpp, distopt in itertools.product((False, True) if tp > 1 else (False,), vpps,
                                                     (False, True) if dp > 1 else (False,)):
                out.append(Layout(tp=tp, pp=pp, vpp=vpp, sp=sp, world=n, distributed_optimizer=distopt))
    return out


def _feature_sets(spec: RunSpec):
    names = ["recompute-activation", "flash-attn"] + (["reuse-fp32-param"] if spec.batch.dtype == "bf16" else [])
    for r in range(len(names) + 1):
        for combo in itertools.combinations(names, r):
            for rec in (None, "selective-recompute", "full-recompute"):
                yield combo + ((rec,) if rec else ())


def layout_argv(lay: Layout, gbs: int, num_layers: int) -> list[str]:
    out = ["--tensor-model-parallel-size", str(lay.tp), "--pipeline-model-parallel-size", str(lay.pp),
           "--global-batch-size", str(gbs)]
    if lay.vpp:
        out += ["--num-layers-per-virtual-pipeline-stage", str(num_layers // lay.pp // lay.vpp)]
    if lay.sp:
        out.append("--sequence-parallel")
    if lay.distributed_optimizer:
        out.append("--use-distributed-optimizer")
    return out


def search(spec: RunSpec, argv: list[str], profile, keep_features: bool = True):
    """(ranked fitting candidates, rejected [(flag line, reason)])."""
    from npuspeed.plan.flags import megatron_args, parse
    from npuspeed.plan.planner import plan_spec

    base = strip(argv)
    gbs = spec.batch.global_batch or spec.batch.micro_batch * spec.devices
    ranked, rejected = [], []
    world = ["--nproc-per-node", str(spec.extra.get("nproc_per_node") or spec.devices)]
    for lay in layouts(spec):
        for combo in _feature_sets(spec):
            extra = [f for name in combo for f in FEATURE_SETS[name]]
            cand_argv = base + layout_argv(lay, gbs, spec.model.num_layers) + extra
            cspec, ns, _ = parse(cand_argv + world)
            cspec = cspec.with_layout(lay)
            problems = layout_problems(cspec, microbatches=False)  # the schedule's own need: plan_spec checks it
            line = " ".join(cand_argv)
            if problems:
                rejected.append((line, problems[0]))
                break  # the layout itself is impossible: no feature set changes that
            p = plan_spec(cspec, cand_argv, profile, with_removes=False, megatron=megatron_args(ns))
            if p.problems:
                rejected.append((line, p.problems[0]))
                continue
            if spec.device_memory_bytes is not None and p.peak > spec.device_memory_bytes:
                rejected.append((line, f"does not fit: predicted peak {p.peak / 2**30:.2f} GiB > "
                                       f"{spec.device_memory_bytes / 2**30:.2f} GiB"))
                continue
            ranked.append(Candidate(lay, combo, cand_argv, p))
    ranked.sort(key=lambda c: (-(c.plan.speed.tokens_per_s if c.plan.speed else 0.0), c.plan.peak))
    return ranked, rejected
