"""Fused RMSNorm / SwiGLU / RoPE: every peer against Megatron's default, forward + backward.

    python benchmarks/bench_fused_ops.py [--repeat N] [--warmup N] [--shapes readme,e2e]
                                         [--peers cpp,native,compile,chosen] [--clock wall|cpu] [--quick]

The baseline of every row is what Megatron-Core runs without the flags: torch.nn.RMSNorm
(WrappedTorchNorm, i.e. torch's `F.rms_norm`), silu(a) * b on torch.chunk halves (MLP's
unfused GLU), and Megatron's own `_apply_rotary_pos_emb_bshd`. Peers, one row each:
`cpp` npuspeed's kernel through the `npuspeed.ops` front end (the C++ op on CPU; the run
stops if it is not loaded, so a fallback cannot be timed as "fused"; on an accelerator the
tensors live there and the front end runs the device's implementation); `native` the device's
own fused op where it differs from the baseline (torch_npu's on an NPU; on CPU and CUDA the
baseline RMSNorm already is torch's native op, and torch has no SwiGLU or RoPE op, so no
row); `compile` torch.compile of Megatron's function (slow to compile: opt in); `chosen`
what the flag runs, i.e. npuspeed.ops.fused_choice's measured pick (its trial happens in the
warm-up; the pick is printed and stored in the row's extra; the chooser is pointed at the
accelerator as the features point it in a run). Every candidate the flags choose among, timed
by their own chooser at a model's shapes, with torch.compile and Liger-Kernel among them:
bench_fused_choice.py (the device report's table).
Shapes: `readme` 4096 tokens x hidden 4096, x ffn 11008 (input 2 x 11008), RoPE
[4096, 1, 32, 128]; `e2e` bench_e2e.py's per-rank shapes at TP2 + SP, seq 2048, micro-batch 1
(hidden 512, ffn 1408 -> 704 per rank, 8 heads / 2 groups -> 4 q heads and 1 k head per
rank, head dim 64): RMSNorm [1024, 1, 512], SwiGLU [2048, 1, 1408], RoPE q [2048, 1, 4, 64]
and k [2048, 1, 1, 64]. fp32 and bf16. Results: benchmarks/results/<device>.csv and
fused_ops_<device>.png.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from harness import Bench  # noqa: E402


def fwd_bwd(fn, *inputs):
    """One step: forward, backward of a fixed random cotangent, inputs' grads dropped."""
    out = fn()
    out.backward(_cotangent(out))
    for t in inputs:
        t.grad = None


_COT: dict = {}


def _cotangent(out):
    key = (tuple(out.shape), out.dtype)
    if key not in _COT:
        _COT[key] = torch.randn(out.shape, dtype=out.dtype, device=out.device)
    return _COT[key]


def rope_freqs(seq: int, dim: int, base: float = 10000.0) -> torch.Tensor:
    """Megatron's RotaryEmbedding angles: [s, 1, 1, dim], rotate-half layout, fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def _cpu_timed(fn) -> float:
    """Milliseconds of this process's CPU time for fn() (one intra-op thread: its work only)."""
    start = time.process_time()
    fn()
    return (time.process_time() - start) * 1e3


SHAPES = {  # name -> (rms_norm x shape, swiglu input shape, [rope t shapes])
    "readme": lambda a: ((a.tokens, a.hidden), (a.tokens, 2 * a.ffn), [(a.tokens, 1, a.heads, a.head_dim)]),
    "e2e": lambda a: ((1024, 1, 512), (2048, 1, 1408), [(2048, 1, 4, 64), (2048, 1, 1, 64)]),
}


def _shape(shape) -> str:
    return "x".join(str(s) for s in shape)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--ffn", type=int, default=11008)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--dtypes", default="fp32,bf16")
    parser.add_argument("--shapes", default="readme", help="comma list of: readme, e2e")
    parser.add_argument("--peers", default="cpp,native,chosen",
                        help="comma list of: cpp, native, compile, chosen (compile takes ~1 min per case on CPU)")
    parser.add_argument("--clock", choices=["wall", "cpu"], default="wall",
                        help="cpu: one intra-op thread and the process's CPU time (what e2e ranks run "
                             "with, OMP_NUM_THREADS=1; stable on a busy host, where wall time is not)")
    parser.add_argument("--quick", action="store_true", help="tiny shapes, two repeats (smoke test)")
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    args = parser.parse_args(argv)
    if args.quick:
        args.tokens, args.hidden, args.ffn, args.heads, args.repeat, args.warmup = 64, 256, 512, 4, 2, 2
        args.shapes = "readme"

    bench = Bench("fused_ops", warmup=args.warmup, repeat=args.repeat, results_dir=args.results_dir)  # enables memory tracking first
    if args.clock == "cpu":
        torch.set_num_threads(1)
        bench._timed = _cpu_timed

    from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl
    from megatron.core.models.common.embeddings import rope_utils

    from npuspeed.features.chooser_setup import on_accelerator
    from npuspeed.ops import _dispatch, fused_choice
    from npuspeed.ops.rms_norm import fused_rms_norm, rms_norm
    from npuspeed.ops.rope import fused_rotary_pos_emb, rotary_pos_emb
    from npuspeed.ops.swiglu import fused_swiglu, swiglu, swiglu_reference

    peers = args.peers.split(",")
    # the features do this in a run (chooser_setup.configure); without it the 2026-11-27 H100
    # bench's chooser had no synchronize and no device events, and timed kernel launches
    on_accelerator(fused_choice.CHOOSER, bench.acc)
    device = bench.acc.name
    dev = bench.device  # tensors on the accelerator npuspeed picked
    if "cpp" in peers and dev.type == "cpu":
        for op in ("rms_norm", "swiglu", "rotary_pos_emb"):
            if _dispatch.implementation(op, torch.empty(1)) != "cpp":
                raise SystemExit(f"bench_fused_ops: the C++ op {op} is not loaded on this machine; nothing to compare")

    def rows(case, name, extra, megatron, inputs, impls):
        """One row per peer: Megatron's `megatron()` against each of `impls[peer]()`."""
        for peer in peers:
            fn = impls.get(peer)
            if fn is None:
                continue
            if peer == "compile":
                compiled = torch.compile(megatron)
                fn = compiled  # noqa: PLW2901
            row = bench.compare(f"{case} [{peer}]", name, extra={**extra, "peer": peer},
                                baseline=lambda: fwd_bwd(megatron, *inputs), feature=lambda: fwd_bwd(fn, *inputs))
            if peer == "chosen":
                made = [c for c in fused_choice.choices() if c.op == case.split()[0]]
                row.extra["chosen"] = made[-1].as_dict() if made else None
                print(f"    chosen: {made[-1].line() if made else '?'}", flush=True)

    torch.manual_seed(0)
    for shapes in args.shapes.split(","):
        rms_shape, glu_shape, rope_shapes = SHAPES[shapes](args)
        for name in args.dtypes.split(","):
            dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[name]
            extra = {"threads": torch.get_num_threads(), "shapes": shapes, "clock": args.clock}

            h = rms_shape[-1]
            norm = torch.nn.RMSNorm(h, eps=1e-5, dtype=dtype, device=dev)
            x = torch.randn(*rms_shape, dtype=dtype, device=dev, requires_grad=True)
            megatron_norm = lambda x, w: F.rms_norm(x, (h,), w, 1e-5)  # noqa: E731 - torch.nn.RMSNorm.forward
            rows(f"rms_norm {_shape(rms_shape)}", name, {**extra, "shape": list(rms_shape)},
                 lambda: norm(x), (x, norm.weight),
                 {"cpp": lambda: rms_norm(x, norm.weight, 1e-5),
                  "native": None,  # on CPU/CUDA the baseline is torch's native F.rms_norm
                  "compile": True,
                  "chosen": lambda: fused_rms_norm(x, norm.weight, 1e-5, megatron_norm)})
            del x, norm

            y = torch.randn(*glu_shape, dtype=dtype, device=dev, requires_grad=True)
            megatron_glu = {"megatron": swiglu_reference}
            if y.dim() in (2, 3):
                megatron_glu["megatron_fused"] = lambda v: bias_swiglu_impl(v, None)
            rows(f"swiglu {_shape(glu_shape)}", name, {**extra, "shape": list(glu_shape)},
                 lambda: swiglu_reference(y), (y,),
                 {"cpp": lambda: swiglu(y), "compile": True,
                  "chosen": lambda: fused_swiglu(y, megatron_glu)})
            del y

            for rope_shape in rope_shapes:
                t = torch.randn(*rope_shape, dtype=dtype, device=dev, requires_grad=True)
                freqs = rope_freqs(rope_shape[0], rope_shape[-1]).to(dev)
                megatron_rope = lambda t: rope_utils._apply_rotary_pos_emb_bshd(t, freqs)  # noqa: E731
                rows(f"rotary_pos_emb {_shape(rope_shape)}", name, {**extra, "shape": list(rope_shape)},
                     lambda: megatron_rope(t), (t,),
                     {"cpp": lambda: rotary_pos_emb(t, freqs), "compile": True,
                      "chosen": lambda: fused_rotary_pos_emb(t, freqs, False, 1.0, megatron_rope)})
                del t

    calls = {f"{op}:{impl}": c for (op, impl), c in _dispatch.calls().items()}
    print(f"implementations that ran: {calls}")
    print("chosen per shape:\n  " + "\n  ".join(c.line() for c in fused_choice.choices()))
    bench.finish()


if __name__ == "__main__":
    main()
