"""MoE benchmark: Megatron-Core's default MoE layer (SequentialMLP experts, unfused permute,
one all-to-all each way) against npuspeed's MoE features, alone and together.

    python benchmarks/bench_moe.py [--tokens 2048 --hidden 512 --ffn 1408 --experts 8 --topk 2]

gpt-oss-like, scaled to a 2-core CPU: 8 experts, top-2, SwiGLU experts of FFN 1408 on hidden
512, sequence 2048 per rank, bf16, EP2 on 2 gloo ranks (the bench launches them). One step =
forward + backward of one MoELayer (alltoall dispatcher). Rows, each against the default
layer in the same run, interleaved by the shared harness:

- grouped GEMM: GroupedMLP with npuspeed's grouped matmul (`--moe-grouped-gemm`)
- fused permute: `npuspeed::moe_permute/unpermute` (`--use-fused-moe-token-permute-and-unpermute`)
- all-to-all overlap: dispatch/experts/combine in N chunks (`--moe-alltoall-overlap-comm`)
- all together, and all together with shared experts (both sides with shared experts)
- the grouped matmul alone: torch grouped mm vs the per-expert loop fallback

On an accelerator each rank takes one device (nccl / hccl); with one device, `--world 1` runs
EP 1 without the all-to-all overlap rows. tokens/s = tokens of all ranks / step time. Same weights on both sides of every row. Each row
also records the median CPU seconds a step costs this process (`cpu_ms_*`, all its threads):
on a machine shared with other jobs, time slices taken by others inflate wall time but not
CPU time, so that ratio is the steadier one there.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import statistics
import sys
import time

import torch

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
TD = "megatron.core.transformer.moe.token_dispatcher"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def fused_permute(on: bool):
    """The dispatcher's permute/unpermute as --use-fused-moe-token-permute-and-unpermute sets them."""
    import importlib

    from npuspeed.features.moe_fused_permute.permute import wrappers

    permute_wrapper, unpermute_wrapper = wrappers()

    td = importlib.import_module(TD)
    saved = td.permute, td.unpermute
    if on:
        td.permute, td.unpermute = permute_wrapper(saved[0]), unpermute_wrapper(saved[1])
    try:
        yield
    finally:
        td.permute, td.unpermute = saved


def build_layer(args, dtype, grouped: bool, shared: bool, dispatcher: str = "alltoall"):
    import torch.nn.functional as F
    from megatron.core.models.gpt.moe_module_specs import get_moe_module_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.spec_utils import build_module

    config = TransformerConfig(
        num_layers=1, hidden_size=args.hidden, num_attention_heads=8, ffn_hidden_size=args.ffn,
        num_moe_experts=args.experts, moe_router_topk=args.topk, moe_ffn_hidden_size=args.ffn,
        expert_model_parallel_size=args.world, moe_token_dispatcher_type=dispatcher, gated_linear_unit=True,
        activation_func=F.silu, add_bias_linear=False, bias_activation_fusion=False, use_cpu_initialization=True,
        params_dtype=dtype, bf16=dtype == torch.bfloat16, moe_aux_loss_coeff=0.0, moe_grouped_gemm=grouped,
        moe_shared_expert_intermediate_size=args.ffn if shared else None, hidden_dropout=0.0)
    from npuspeed.accelerator import get_accelerator

    return build_module(get_moe_module_spec(use_te=False, num_experts=args.experts, moe_grouped_gemm=grouped),
                        config=config).to(get_accelerator().device())


@torch.no_grad()
def copy_weights(src, dst) -> None:
    """dst (GroupedMLP experts) gets src's (SequentialMLP) router, expert and shared weights."""
    dst.router.weight.copy_(src.router.weight)
    local = len(src.experts.local_experts)
    w1 = dst.experts.weight1.view(local, src.config.hidden_size, -1)
    w2 = dst.experts.weight2.view(local, -1, src.config.hidden_size)
    for i, expert in enumerate(src.experts.local_experts):
        w1[i].copy_(expert.linear_fc1.weight.t())
        w2[i].copy_(expert.linear_fc2.weight.t())
    if src.shared_experts is not None:
        dst.shared_experts.load_state_dict(src.shared_experts.state_dict())


def _rank(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    from npuspeed import runtime

    acc = runtime.initialize(["--moe-grouped-gemm"]).accelerator  # GroupedMLP without TE; the rest per row
    if acc.name != "cpu":
        acc.set_device(rank)
    torch.set_num_threads(args.threads or max(1, (os.cpu_count() or 1) // world))
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import Bench

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.moe.moe_layer import MoELayer

    from npuspeed import telemetry
    from npuspeed.features.moe_grouped_gemm.grouped_gemm import grouped_mm
    from npuspeed.features.moe_alltoall_overlap.overlap import forward_wrapper

    dist.init_process_group(acc.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(1, 1, expert_model_parallel_size=world)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bench = Bench("moe", warmup=args.warmup, repeat=args.repeat, results_dir=args.results_dir)
    chunked = forward_wrapper(args.chunks, lambda msg: print(msg, flush=True))(MoELayer.forward)
    tokens = args.tokens * world
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        x = torch.randn(args.tokens, 1, args.hidden, dtype=dtype,
                        generator=torch.Generator().manual_seed(rank)).to(bench.device)
        for shared in ([False, True] if args.shared else [False]):
            default = build_layer(args, dtype, grouped=False, shared=shared, dispatcher="allgather")
            base = build_layer(args, dtype, grouped=False, shared=shared)
            fast = build_layer(args, dtype, grouped=True, shared=shared)
            base.load_state_dict(default.state_dict())
            copy_weights(base, fast)

            cpu_ms: dict = {}
            wall_ms: dict = {}

            def step(layer, overlap=False, permute=False, side="baseline"):
                start, wall = time.process_time(), time.perf_counter()
                with fused_permute(permute):
                    inp = x.detach().requires_grad_(True)
                    out, _ = chunked(layer, inp) if overlap else layer(inp)
                    out.float().sum().backward()
                for p in layer.parameters():
                    p.grad = None
                cpu_ms.setdefault(side, []).append((time.process_time() - start) * 1e3)
                wall_ms.setdefault(side, []).append((time.perf_counter() - wall) * 1e3)

            extra = {"tokens_per_rank": args.tokens, "hidden": args.hidden, "ffn": args.ffn, "experts": args.experts,
                     "topk": args.topk, "ep": world, "chunks": args.chunks, "shared_experts": shared}
            # (label, baseline layer, feature layer, feature options): the headline is against
            # Megatron-Core's default MoE path (allgather dispatcher, its TransformerConfig
            # default); each feature alone is against Megatron's all-to-all dispatcher path
            all_on = dict(overlap=True, permute=True)
            rows = [("all vs Megatron default (allgather)", default, fast, all_on),
                    ("all vs Megatron alltoall", base, fast, all_on),
                    ("grouped GEMM + fused permute vs alltoall", base, fast, dict(permute=True))]
            if world == 1:  # no all-to-all to overlap at EP 1
                rows = [(label, ref, layer, {**o, "overlap": False}) for label, ref, layer, o in rows]
            if not shared:
                rows += [("grouped GEMM", base, fast, {}), ("fused permute", base, base, dict(permute=True))]
                rows += [(f"a2a overlap N={args.chunks}", base, base, dict(overlap=True))] if world > 1 else []
            for label, ref, layer, opts in rows:
                before = telemetry.snapshot()
                cpu_ms.clear()
                wall_ms.clear()
                case = f"{label}{' +shared' if shared else ''}"
                row = bench.compare(case, dname, baseline=lambda ref=ref: step(ref),
                                    feature=lambda layer=layer, opts=opts: step(layer, side="feature", **opts),
                                    extra=dict(extra))
                for side in ("baseline", "feature"):
                    row.extra[f"cpu_ms_{side}"] = round(statistics.median(cpu_ms[side]), 1)
                row.extra["cpu_speedup"] = round(row.extra["cpu_ms_baseline"] / row.extra["cpu_ms_feature"], 3)
                # the harness runs baseline and feature alternately: the median of each adjacent
                # pair's ratio is the least disturbed by other jobs' load changing between pairs
                timed = slice(bench.warmup, bench.warmup + bench.repeat)
                pairs = zip(wall_ms["baseline"][timed], wall_ms["feature"][timed])
                row.extra["paired_speedup"] = round(statistics.median(b / f for b, f in pairs), 3)
                ran = {k: v for k, v in telemetry.since(before).items() if k.startswith(("moe.", "ops.moe"))}
                row.extra["counters"] = ran
                row.extra["tokens_per_s_baseline"] = round(tokens / (row.baseline_ms / 1e3), 1)
                row.extra["tokens_per_s_feature"] = round(tokens / (row.feature_ms / 1e3), 1)
        # the grouped matmul alone (fc1 of the local experts, fwd + bwd): torch grouped mm vs per-expert loop
        local = args.experts // world
        counts = [args.tokens * args.topk // local] * local  # rows a rank receives, even split
        xs = torch.randn(sum(counts), args.hidden, dtype=dtype, device=bench.device)
        w = torch.randn(local, args.hidden, 2 * args.ffn, dtype=dtype, device=bench.device) * 0.02
        w.requires_grad_(True)

        def gmm(backend):
            inp = xs.detach().requires_grad_(True)
            grouped_mm(inp, w, counts, backend=backend).float().sum().backward()
            w.grad = None

        bench.compare("grouped mm: torch vs loop", dname, baseline=lambda: gmm("loop"),
                      feature=lambda: gmm("torch"), extra={"rows": sum(counts), "groups": local})
    if rank == 0:
        for r in bench.rows:
            if "tokens_per_s_baseline" in r.extra:
                print(f"{r.case:<42} {r.dtype}: tokens/s {r.extra['tokens_per_s_baseline']:>9.1f} -> "
                      f"{r.extra['tokens_per_s_feature']:>9.1f}  x{r.speedup:.2f} (paired x{r.extra['paired_speedup']:.2f})"
                      f"  CPU/step x{r.extra['cpu_speedup']:.2f}"
                      f"  peak x{r.mem_ratio or 0:.2f}")
        bench.finish()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=2048, help="sequence x micro-batch per rank")
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--ffn", type=int, default=1408, help="expert FFN size (SwiGLU: fc1 is 2x)")
    parser.add_argument("--experts", type=int, default=8)
    parser.add_argument("--topk", type=int, default=2)
    parser.add_argument("--chunks", type=int, default=2)
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["bf16"])
    parser.add_argument("--no-shared", dest="shared", action="store_false", help="skip the shared-expert rows")
    parser.add_argument("--world", type=int, default=2, help="expert-parallel ranks to launch")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / world)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    args = parser.parse_args()
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import ranks_fit

    if not ranks_fit(args.world, "moe"):
        raise SystemExit("bench_moe: give --world 1 (EP 1, no all-to-all overlap rows) on a single device")
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(args.world, free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
