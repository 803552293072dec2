"""What `npuspeed plan` prints: a per-rank table, or JSON whose keys are only ever added."""
from __future__ import annotations

MIB = 2**20


def _mib(n) -> str:
    return f"{n / MIB:,.1f} MiB"


def _tflops(x: float) -> str:
    """One decimal as Megatron-LM's log; four digits below 1 (CPU), so a small figure is not 0.0."""
    return f"{x:,.1f}" if x >= 1 else f"{x:.4g}"


def schedule_name(p) -> str:
    """The pipeline schedule the plan simulates: the features' (DualPipeV) or Megatron's."""
    lay = p.spec.layout
    if p.effects is not None and p.effects.schedule == "dualpipev":
        return "DualPipeV"
    return "1F1B" if lay.pp > 1 and not lay.vpp else "interleaved 1F1B" if lay.vpp else "no pipelining"


def as_json(p) -> dict:
    lay, spec = p.spec.layout, p.spec
    out = {
        "peak_mem_bytes": p.peak if p.ok else None,
        "step_ms": p.speed.step_ms if p.speed else None,
        "tokens_per_s": p.speed.tokens_per_s if p.speed else None,
        # Megatron-LM's model FLOPs of the step over the predicted step time, per rank
        "tflops_per_s_per_rank": p.speed.tflops_per_s_per_rank if p.speed else None,
        "fits": p.fits,
        "problems": list(p.problems),
        "layout": {"tp": lay.tp, "pp": lay.pp, "vpp": lay.vpp, "dp": lay.dp, "cp": lay.cp, "ep": lay.ep,
                   "sp": lay.sp, "world": lay.world, "distributed_optimizer": lay.distributed_optimizer,
                   "num_microbatches": spec.batch.num_microbatches(lay.dp), "schedule": schedule_name(p)},
        "breakdown": {},
        # --moe-fb-overlap: the predicted step with and without it (None when the flag is off)
        "moe_fb_overlap": p.fb_overlap.as_dict() if getattr(p, "fb_overlap", None) else None,
    }
    if not p.ok:
        return out
    out["breakdown"] = {
        "per_pipeline_stage": [r.as_dict() for r in p.ranks],
        "features": {name: {"summary": text, "removes_peak_bytes": p.removes.get(name)}
                     for name, text in p.effects.summaries},
        "comm_bytes_per_step": p.comm,
        "speed": p.speed.as_dict() if p.speed else None,
    }
    return out


def text(p) -> str:
    spec, lay = p.spec, p.spec.layout
    m = spec.model
    head = (f"npuspeed plan: {m.num_layers} layers, hidden {m.hidden}, {m.heads} heads, seq {m.seq_length}, "
            f"{spec.batch.dtype}; world {lay.world} = TP {lay.tp} x PP {lay.pp}"
            f"{f' (VPP {lay.vpp})' if lay.vpp else ''} x CP {lay.cp} x DP {lay.dp}"
            f"{' + SP' if lay.sp else ''}{' + distributed optimizer' if lay.distributed_optimizer else ''}")
    lines = [head]
    if not p.ok:
        lines.append("impossible layout:")
        lines += [f"  - {reason}" for reason in p.problems]
        return "\n".join(lines)
    mbs = spec.batch.num_microbatches(lay.dp)
    lines.append(f"micro-batch {spec.batch.micro_batch}, {mbs} micro-batches a step ({schedule_name(p)})")
    lines.append("")
    lines.append(f"{'stage':>5} {'params':>12} {'grads':>12} {'masters':>12} {'optimizer':>12} {'buffers':>10} "
                 f"{'act/layer':>11} {'act/mb':>11} {'in flight':>9} {'step peak':>12} {'peak':>12}")
    for r in p.ranks:
        lines.append(f"{r.pp_rank:>5} {_mib(r.params):>12} {_mib(r.grads):>12} {_mib(r.masters):>12} "
                     f"{_mib(r.optimizer):>12} {_mib(r.buffers):>10} {_mib(r.activation_per_layer):>11} "
                     f"{_mib(max(r.activation_per_microbatch)):>11} {r.in_flight:>9} {_mib(r.step_peak):>12} "
                     f"{_mib(r.peak):>12}")
    lines.append(f"peak per rank (largest): {_mib(p.peak)}" + (
        "" if p.fits is None else f" of {_mib(spec.device_memory_bytes)}: {'fits' if p.fits else 'DOES NOT FIT'}"))
    terms = max(p.ranks, key=lambda r: r.peak).activation_terms
    lines.append("activations of one micro-batch by kind (largest stage): " +
                 ", ".join(f"{k} {_mib(v)}" for k, v in sorted(terms.items(), key=lambda kv: -kv[1])))
    swapped = max(p.ranks, key=lambda r: r.peak)
    if swapped.swapped_per_microbatch:
        lines.append(f"swapped to host memory (--swap-attention): {_mib(swapped.swapped_per_microbatch)} a micro-batch, "
                     f"{_mib(swapped.swapped_per_layer)} a layer (not in the figures above)")
    if p.effects.summaries:
        lines.append("")
        lines.append("features:")
        for name, summary in p.effects.summaries:
            delta = p.removes.get(name)
            what = "" if delta is None else (f" [peak -{_mib(delta)}]" if delta >= 0 else f" [peak +{_mib(-delta)}]")
            lines.append(f"  {name}{what}: {summary}")
            if name == "swap_optimizer":
                off = max(r.swapped_optimizer for r in p.ranks)
                lines.append(f"    optimizer state in host memory between steps: {_mib(off)} per rank (largest stage)"
                             + ("" if off else " (nothing leaves the device on this backend)"))
    lines.append("")
    lines.append("communication per step and rank: " + ", ".join(
        f"{k.upper()} {_mib(v)}" for k, v in p.comm.items() if v) or "communication: none")
    if p.speed:
        s = p.speed
        lines.append(f"step {s.step_ms:,.1f} ms ({s.tokens_per_s:,.0f} tokens/s, {_tflops(s.tflops_per_s_per_rank)} "
                     f"TFLOP/s per rank): compute {s.compute_ms:,.1f}, "
                     f"bubble {s.bubble_ms:,.1f}, optimizer {s.optimizer_ms:,.1f}"
                     + (f" (of it optimizer swap {s.swap_ms:,.1f})" if s.swap_ms else "") + ", comm " +
                     ", ".join(f"{k.upper()} {v:,.1f}" for k, v in s.comm_ms.items()) + " ms")
    else:
        lines.append("step time: no profile (run `npuspeed plan --calibrate ...` and pass --profile)")
    if getattr(p, "fb_overlap", None):
        lines.append(fb_overlap_line(p.fb_overlap))
    return "\n".join(lines)


def fb_overlap_line(f) -> str:
    """The predicted step with and without --moe-fb-overlap (plan/fb_overlap.py's FbOverlapStep)."""
    return (f"--moe-fb-overlap at {f.device} rates (roofline compute, all-to-all over {f.links}; prediction): "
            f"step {f.step_without_s * 1e3:,.1f} ms without, {f.step_with_s * 1e3:,.1f} ms with: {f.ratio:.3f}x; "
            f"all-to-all {f.a2a_s * 1e3:,.1f} ms, {f.hidden_s * 1e3:,.1f} ms of it hidden ({f.hidden_fraction:.0%}) "
            f"in {f.pairs} forward/backward pairs (a layer: attention {f.attention_f * 1e3:,.2f} ms, "
            f"MLP {f.mlp_f * 1e3:,.2f} ms forward, each all-to-all {f.a2a * 1e3:,.2f} ms)")


def search_json(ranked, rejected, top: int) -> dict:
    return {
        "top": [{"flags": c.flag_line(), "peak_mem_bytes": c.plan.peak,
                 "step_ms": c.plan.speed.step_ms if c.plan.speed else None,
                 "tokens_per_s": c.plan.speed.tokens_per_s if c.plan.speed else None,
                 "tflops_per_s_per_rank": c.plan.speed.tflops_per_s_per_rank if c.plan.speed else None}
                for c in ranked[:top]],
        "candidates": len(ranked),
        "rejected": [{"flags": line, "reason": why} for line, why in rejected],
    }


def search_text(spec, ranked, rejected, top: int, calibrated: bool) -> str:
    lines = [f"npuspeed plan --search: {len(ranked)} configurations fit, {len(rejected)} rejected"]
    if not calibrated:
        lines.append("(no --profile: ranked by predicted peak memory only; calibrate for tokens/s)")
    world = f"torchrun --nproc-per-node {spec.extra.get('nproc_per_node') or spec.devices}"
    for i, c in enumerate(ranked[:top], 1):
        speed = (f"{c.plan.speed.tokens_per_s:,.0f} tokens/s ({_tflops(c.plan.speed.tflops_per_s_per_rank)} "
                 "TFLOP/s per rank), ") if c.plan.speed else ""
        lines.append(f"{i}. {speed}peak {_mib(c.plan.peak)}")
        lines.append(f"   {world} pretrain_gpt.py {c.flag_line()}")
    reasons = {}
    for _line, why in rejected:
        key = why.split(":")[0]
        reasons[key] = reasons.get(key, 0) + 1
    if reasons:
        lines.append("rejected: " + "; ".join(f"{n} x {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])))
    return "\n".join(lines)
