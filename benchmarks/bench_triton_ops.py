"""npuspeed's Triton kernels vs their peers on the accelerator, forward + backward.

    python benchmarks/bench_triton_ops.py [--repeat N] [--iters N] [--dtypes bf16,fp32] [--no-compile]
    TRITON_INTERPRET=1 python benchmarks/bench_triton_ops.py --smoke   # CPU: the code paths, no timing

Per op and shape, every implementation is checked against the reference first (a wrong
kernel is not timed), then timed as `iters` back-to-back fwd+bwd steps between two
synchronizations, median of `repeat`:
- RMSNorm [n, h]: Megatron's default (torch.nn.RMSNorm, i.e. torch's fused F.rms_norm),
  npuspeed's eager reference, torch.compile of that reference, Triton; and the residual-add
  variant: eager add + torch.nn.RMSNorm vs Triton's fused `rms_norm_residual`.
- SwiGLU [n, 2f]: Megatron's eager silu(a) * b on chunk halves, Megatron's jit-fused
  `bias_swiglu_impl` (when megatron-core is importable), torch.compile, Triton.
- RoPE q [s, 1, hq, d] and k [s, 1, hk, d]: Megatron's `_apply_rotary_pos_emb_bshd` on each,
  torch.compile of that, Triton q and k in one launch.
- MoE permute + unpermute [tokens, hidden], E experts top-k: Megatron's unfused
  `moe_utils.permute/unpermute`, Triton.
A case that fails (a kernel that disagrees, a Megatron release whose call differs) is printed
with its error and the others go on (the 2026-11-27 report lost the whole table to its MoE
case: megatron-core 0.19's argsort permute asserts on a missing routed-token count); the
failures land in <results-dir>/failures.json. What the flags choose for RMSNorm, SwiGLU and
RoPE, with torch.compile and Liger-Kernel among the candidates, is bench_fused_choice.py's
table: the flags' own measurement at a model's shapes (the device report shows that one; this
script's own timing of those three is a kernel microbenchmark, not the flags' rule).
Each peer vs Triton is one harness row (baseline = the peer, feature = Triton; speedup > 1
means Triton is faster) in benchmarks/results/<device>.csv. On a CPU it refuses: the kernels
target GPUs/NPUs and the interpreter's times mean nothing; `--smoke` runs tiny shapes under
TRITON_INTERPRET=1 to check the script itself (no torch.compile, nothing written).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Bench  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def step(fn, inputs, cot):
    """One fwd+bwd step: `fn()` returns a tensor or a tuple; backward of sum(out * cot)."""
    out = fn()
    outs = out if isinstance(out, tuple) else (out,)
    torch.autograd.backward([o for o in outs], [c for c in cot])
    for t in inputs:
        t.grad = None


def timed(bench, fn, iters, repeat, warmup):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeat):
        bench.acc.synchronize()
        start = _clock()
        for _ in range(iters):
            fn()
        bench.acc.synchronize()
        times.append((_clock() - start) * 1e3 / iters)
    return statistics.median(times)


def _clock():
    import time

    return time.perf_counter()


def check(name, got, want, dtype):
    tol = 1e-4 if dtype == torch.float32 else 5e-2
    for g, w in zip(got if isinstance(got, tuple) else (got,), want if isinstance(want, tuple) else (want,)):
        if not torch.allclose(g.float(), w.float(), rtol=tol, atol=tol):
            raise SystemExit(f"bench_triton_ops: {name} differs from the reference "
                             f"(max abs diff {(g.float() - w.float()).abs().max().item():.3g}); not timing it")


def compiled(fn, enabled):
    """torch.compile(fn), or None with the reason printed (CPU smoke run, or compile failed)."""
    if not enabled:
        return None
    try:
        return torch.compile(fn, dynamic=False)
    except Exception as exc:  # pragma: no cover - depends on the machine's compiler
        print(f"  torch.compile unavailable: {exc}")
        return None


def run_case(bench, case, dtype_name, impls, triton_name, inputs, cot, args):
    """Time every implementation; record each peer vs Triton; print the op's table."""
    results = {}
    for name, fn in impls.items():
        if fn is None:
            continue
        try:
            results[name] = timed(bench, lambda fn=fn: step(fn, inputs, cot), args.iters, args.repeat, args.warmup)
        except Exception as exc:  # e.g. torch.compile failing at first call
            print(f"  {case} {dtype_name}: {name} failed ({type(exc).__name__}: {str(exc)[:200]}); skipped")
    tri = results.get(triton_name)
    line = ", ".join(f"{k} {v:.3f} ms" for k, v in results.items())
    print(f"[triton_ops] {case} {dtype_name}: {line}", flush=True)
    if tri is None:
        return
    for name, ms in results.items():
        if name != triton_name:
            bench.add(f"{case} vs {name}", dtype_name, baseline_ms=ms, feature_ms=tri,
                      extra={"peer": name, "iters": args.iters, "repeat": args.repeat, "all_ms": results})


def rms_norm_cases(bench, dev, dtype, name, args):
    from npuspeed.ops.rms_norm import rms_norm_reference
    from npuspeed.ops.triton import rms_norm as trms

    for n, h in args.rms_shapes:
        norm = torch.nn.RMSNorm(h, eps=1e-5, device=dev, dtype=dtype)
        x = torch.randn(n, h, device=dev, dtype=dtype, requires_grad=True)
        w = norm.weight
        check("rms_norm", trms.rms_norm(x, w, 1e-5), rms_norm_reference(x, w, 1e-5), dtype)
        ref_c = compiled(rms_norm_reference, args.compile)
        impls = {"megatron(F.rms_norm)": lambda: norm(x), "npuspeed-reference": lambda: rms_norm_reference(x, w, 1e-5),
                 "torch.compile": (lambda: ref_c(x, w, 1e-5)) if ref_c else None,
                 "triton": lambda: trms.rms_norm(x, w, 1e-5)}
        run_case(bench, f"rmsnorm {n}x{h}", name, impls, "triton", (x, w), (torch.randn_like(x),), args)


def add_rms_norm_cases(bench, dev, dtype, name, args):
    from npuspeed.ops.triton import rms_norm as trms

    for n, h in args.rms_shapes:
        norm = torch.nn.RMSNorm(h, eps=1e-5, device=dev, dtype=dtype)
        x = torch.randn(n, h, device=dev, dtype=dtype, requires_grad=True)
        w = norm.weight
        r = torch.randn(n, h, device=dev, dtype=dtype, requires_grad=True)
        check("rms_norm_residual", trms.rms_norm_residual(x, r, w, 1e-5),
              trms.rms_norm_residual_reference(x, r, w, 1e-5), dtype)

        def eager_residual():
            hsum = x + r
            return norm(hsum), hsum

        cot = (torch.randn_like(x), torch.randn_like(x))
        impls = {"megatron(add+F.rms_norm)": eager_residual, "triton": lambda: trms.rms_norm_residual(x, r, w, 1e-5)}
        run_case(bench, f"add+rmsnorm {n}x{h}", name, impls, "triton", (x, r, w), cot, args)


def swiglu_cases(bench, dev, dtype, name, args):
    from npuspeed.ops.swiglu import swiglu_reference
    from npuspeed.ops.triton import swiglu as tswiglu

    try:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    except Exception as exc:
        print(f"  megatron-core not importable ({type(exc).__name__}): its fused bias_swiglu is not timed")
        bias_swiglu_impl = None
    for n, f in args.swiglu_shapes:
        y = torch.randn(n, 2 * f, device=dev, dtype=dtype, requires_grad=True)
        check("swiglu", tswiglu.swiglu(y), swiglu_reference(y), dtype)
        ref_c = compiled(swiglu_reference, args.compile)

        def eager():
            a, b = torch.chunk(y, 2, dim=-1)
            return F.silu(a) * b

        impls = {"megatron-eager": eager,
                 "megatron-bias_swiglu": (lambda: bias_swiglu_impl(y, None)) if bias_swiglu_impl else None,
                 "torch.compile": (lambda: ref_c(y)) if ref_c else None, "triton": lambda: tswiglu.swiglu(y)}
        run_case(bench, f"swiglu {n}x{2 * f}", name, impls, "triton", (y,), (torch.randn(n, f, device=dev, dtype=dtype),),
                 args)


def rope_freqs(seq, dim, dev):
    inv = 1.0 / (10000.0 ** (torch.arange(0, dim, 2, dtype=torch.float32, device=dev) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=dev), inv)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def rope_cases(bench, dev, dtype, name, args):
    from npuspeed.ops.rope import rotary_pos_emb_reference
    from npuspeed.ops.triton import rope as trope

    try:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd as megatron_rope
    except Exception as exc:
        print(f"  megatron-core not importable ({type(exc).__name__}): npuspeed's reference stands in for its RoPE")
        megatron_rope = rotary_pos_emb_reference
    for s, hq, hk, d in args.rope_shapes:
        freqs = rope_freqs(s, d, dev)
        q = torch.randn(s, 1, hq, d, device=dev, dtype=dtype, requires_grad=True)
        k = torch.randn(s, 1, hk, d, device=dev, dtype=dtype, requires_grad=True)
        check("rope", trope.rotary_pos_emb_qk(q, k, freqs),
              (rotary_pos_emb_reference(q, freqs), rotary_pos_emb_reference(k, freqs)), dtype)
        both_c = compiled(lambda q, k, f: (megatron_rope(q, f), megatron_rope(k, f)), args.compile)
        impls = {"megatron": lambda: (megatron_rope(q, freqs), megatron_rope(k, freqs)),
                 "torch.compile": (lambda: both_c(q, k, freqs)) if both_c else None,
                 "triton": lambda: trope.rotary_pos_emb_qk(q, k, freqs)}
        cot = (torch.randn_like(q), torch.randn_like(k))
        run_case(bench, f"rope q{s}x{hq}x{d} k{hk}", name, impls, "triton", (q, k), cot, args)


def moe_cases(bench, dev, dtype, name, args):
    from npuspeed.ops.moe_permute import permute_reference, unpermute_reference
    from npuspeed.ops.triton import moe_permute as tmoe

    try:
        from megatron.core.transformer.moe import moe_utils
    except Exception as exc:
        print(f"  megatron-core not importable ({type(exc).__name__}): npuspeed's references stand in")
        moe_utils = None
    for t, h, e, topk in args.moe_shapes:
        logits = torch.randn(t, e, device=dev)
        top = logits.topk(topk, dim=1).indices
        rmap = torch.zeros(t, e, dtype=torch.bool, device=dev).scatter(1, top, True)
        probs = torch.zeros(t, e, device=dev).scatter(1, top, torch.softmax(logits.gather(1, top), -1))
        probs.requires_grad_()
        x = torch.randn(t, h, device=dev, dtype=dtype, requires_grad=True)

        def triton_pair():
            permuted, _, idx, _ = tmoe.moe_permute(x, rmap)
            return tmoe.moe_unpermute(permuted * 2, idx, t, probs, rmap)

        def megatron_pair():
            if moe_utils is None:
                permuted, idx, _ = permute_reference(x, rmap)
                row_probs = probs.T.contiguous().masked_select(rmap.T.contiguous())
                return unpermute_reference(permuted * 2, idx, row_probs, t)
            # 0.19's argsort permute needs the routed-token count (earlier releases accept it too)
            # and returns five values where earlier releases return three
            permuted, _, idx = moe_utils.permute(x, rmap, num_out_tokens=t * topk)[:3]
            return moe_utils.unpermute(permuted * 2, idx, x.shape, probs=probs, routing_map=rmap)

        check("moe permute/unpermute", triton_pair(), megatron_pair(), dtype)
        impls = {"megatron-unfused": megatron_pair, "triton": triton_pair}
        run_case(bench, f"moe {t}x{h} E{e} top{topk}", name, impls, "triton", (x, probs),
                 (torch.randn(t, h, device=dev, dtype=dtype),), args)


def _shapes(text, width):
    out = []
    for item in text.split(","):
        dims = tuple(int(v) for v in item.lower().split("x"))
        if len(dims) != width:
            raise SystemExit(f"bench_triton_ops: shape {item!r} needs {width} numbers joined by 'x'")
        out.append(dims)
    return out


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--iters", type=int, default=20, help="fwd+bwd steps per timed sample")
    parser.add_argument("--dtypes", default="bf16,fp32")
    parser.add_argument("--ops", default="rmsnorm,add_rmsnorm,swiglu,rope,moe")
    parser.add_argument("--rms-shapes", default="4096x2048,8192x4096", help="tokens x hidden")
    parser.add_argument("--swiglu-shapes", default="4096x5632,8192x11264", help="tokens x F (input is 2F wide)")
    parser.add_argument("--rope-shapes", default="4096x16x16x128,8192x32x8x128", help="s x hq x hk x head_dim")
    parser.add_argument("--moe-shapes", default="8192x4096x8x2,8192x2048x64x8", help="tokens x hidden x experts x topk")
    parser.add_argument("--no-compile", dest="compile", action="store_false", help="skip the torch.compile peers")
    parser.add_argument("--smoke", action="store_true",
                        help="CPU only, TRITON_INTERPRET=1: tiny shapes through every code path, no results written")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)

    from npuspeed.accelerator import get_accelerator
    from npuspeed.ops.triton import _runtime

    acc = get_accelerator()
    if args.smoke:
        if acc.name != "cpu" or not _runtime.interpreting():
            raise SystemExit("bench_triton_ops --smoke: for a CPU host with TRITON_INTERPRET=1 set before starting")
        args.rms_shapes, args.swiglu_shapes, args.rope_shapes, args.moe_shapes = (
            "5x40", "3x24", "4x3x2x16", "9x16x4x2")
        args.repeat, args.warmup, args.iters, args.compile = 1, 0, 1, False
        args.results_dir = tempfile.mkdtemp(prefix="bench_triton_smoke_")
    elif acc.name == "cpu":
        raise SystemExit("bench_triton_ops: no GPU or NPU here; Triton's kernels (and torch.compile's GPU code) "
                         "are what this times, so there is nothing to measure on a CPU. "
                         "Run it on the device machine (or `--smoke` with TRITON_INTERPRET=1 to check the script).")
    elif not _runtime.available() or _runtime.device_type() != acc.name:
        raise SystemExit(f"bench_triton_ops: Triton cannot target this {acc.name} device "
                         f"(triton importable: {_runtime.triton_importable()}, targets: {_runtime.device_type()})")
    args.rms_shapes = _shapes(args.rms_shapes, 2)
    args.swiglu_shapes = _shapes(args.swiglu_shapes, 2)
    args.rope_shapes = _shapes(args.rope_shapes, 4)
    args.moe_shapes = _shapes(args.moe_shapes, 4)

    bench = Bench("triton_ops", warmup=args.warmup, repeat=args.repeat, results_dir=args.results_dir)
    dev = acc.device()
    torch.manual_seed(0)
    cases = {"rmsnorm": rms_norm_cases, "add_rmsnorm": add_rms_norm_cases, "swiglu": swiglu_cases,
             "rope": rope_cases, "moe": moe_cases}
    unknown = set(args.ops.split(",")) - set(cases)
    if unknown:
        raise SystemExit(f"bench_triton_ops: --ops {','.join(sorted(unknown))}: use some of {','.join(cases)}")
    failures = []
    for dtype_name in args.dtypes.split(","):
        for op in args.ops.split(","):
            try:
                cases[op](bench, dev, DTYPES[dtype_name], dtype_name, args)
            except (Exception, SystemExit) as exc:  # noqa: BLE001 - one case's failure is reported, the rest go on
                if args.smoke:
                    raise
                why = f"{type(exc).__name__}: {str(exc).strip()[:300]}"
                failures.append({"op": op, "dtype": dtype_name, "error": why})
                print(f"[triton_ops] {op} {dtype_name}: FAILED, {why}", flush=True)
    if args.smoke:
        print(bench.table())
        print("smoke run: every path ran; times under the interpreter mean nothing, nothing written")
        return
    bench.finish()
    if failures:  # the device report shows them beside the rows that were measured
        import json
        from pathlib import Path

        folder = Path(bench.results_dir)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "failures.json").write_text(json.dumps(failures, indent=1))


if __name__ == "__main__":
    main()
