"""Compute-communication overlap benchmark: Megatron's ColumnParallelLinear / RowParallelLinear
at TP2 + sequence parallel, unchunked (Megatron's forward) vs --use-coc with N chunks.

    python benchmarks/bench_coc.py [--tokens 4096 --hidden 2048 --ffn 8192 --chunks 2 4 8]

The bench launches its own ranks (2 gloo processes on CPU; on a machine with >= 2 devices the
accelerator's backend and one device per rank, no code change). One step = forward + backward
of one layer: column [tokens/2, hidden] -> all-gather -> [tokens, ffn/2], row [tokens, ffn/2]
-> reduce-scatter -> [tokens/2, hidden]. Baseline and feature run on the same module and
inputs, interleaved, through the shared harness; rank 0 writes the CSV row and PNG.

Also measured, to make the overheads visible: the chunked matmul alone, without any
collective (the per-chunk cost of cutting the matmul and writing rank-major rows), and the
time of the unchunked collective alone (how much there is to hide). `--matmul-only` runs just
the chunked-matmul rows in one process (e.g. on a single GPU).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tools"))
from launch import free_port  # noqa: E402

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
LAYERS = "megatron.core.tensor_parallel.layers"


def _median_ms(fn, acc, repeat: int = 5) -> float:
    times = []
    for _ in range(repeat):
        acc.synchronize()
        t0 = time.perf_counter()
        fn()
        acc.synchronize()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def chunked_matmul(x: torch.Tensor, w_t: torch.Tensor, n: int, ranks: int) -> torch.Tensor:
    """The compute of ag_mm without its collectives: n x ranks matmuls of c rows, each written
    into its contiguous rows of the rank-major result."""
    m = x.shape[0] // ranks
    c = m // n
    out = x.new_empty(x.shape[0], w_t.shape[1])
    for i in range(n):
        for r in range(ranks):
            rows = slice(r * m + i * c, r * m + (i + 1) * c)
            torch.matmul(x[rows], w_t, out=out[rows])
    return out


def _matmul_rows(bench, args, acc, dtype, dname, world: int) -> None:
    dev = acc.device()
    x = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
    w_t = torch.randn(args.hidden, args.ffn // world, device=dev, dtype=dtype) * 0.02
    for n in args.chunks:
        bench.compare(f"chunked matmul N={n}", dname, baseline=lambda: torch.matmul(x, w_t),
                      feature=lambda n=n: chunked_matmul(x, w_t, n, world),
                      extra={"chunks": n, "m": args.tokens, "k": args.hidden, "n": args.ffn // world,
                             "no_comm": True})
        row = bench.rows[-1]
        row.extra["overhead_per_chunk_ms"] = round((row.feature_ms - row.baseline_ms) / n, 3)


def _rank(rank: int, world: int, port: int, args) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    if rank != 0:
        sys.stdout = open(os.devnull, "w")
    from npuspeed import runtime

    state = runtime.initialize([])  # the device layer only: --use-coc is applied per callable
    acc = state.accelerator
    threads = args.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import Bench

    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.model_parallel_config import ModelParallelConfig
    from megatron.core.tensor_parallel.layers import ColumnParallelLinear, RowParallelLinear

    from npuspeed.features.coc_overlap.layers import Settings, column_forward_wrapper, row_forward_wrapper

    if acc.name != "cpu":
        acc.set_device(rank)
    dist.init_process_group(acc.dist_backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    parallel_state.initialize_model_parallel(world, 1)
    tensor_parallel.model_parallel_cuda_manual_seed(1234)
    bench = Bench("coc", warmup=args.warmup, repeat=args.repeat, results_dir=args.results_dir)
    dev = acc.device()
    group = parallel_state.get_tensor_model_parallel_group()
    for dname in args.dtypes:
        dtype = DTYPES[dname]
        cfg = ModelParallelConfig(tensor_model_parallel_size=world, sequence_parallel=True,
                                  use_cpu_initialization=acc.name == "cpu", params_dtype=dtype)
        init = lambda w: torch.nn.init.normal_(w, std=0.02)  # noqa: E731
        local = args.tokens // world
        layers = {
            "column": (ColumnParallelLinear(args.hidden, args.ffn, config=cfg, init_method=init, bias=False),
                       (local, 1, args.hidden), (args.tokens, 1, args.ffn // world), column_forward_wrapper),
            "row": (RowParallelLinear(args.ffn, args.hidden, config=cfg, init_method=init, bias=False,
                                      input_is_parallel=True, skip_bias_add=False),
                    (args.tokens, 1, args.ffn // world), (local, 1, args.hidden), row_forward_wrapper),
        }
        for name, (module, in_shape, out_shape, wrapper) in layers.items():
            module.to(dev)
            x = torch.randn(in_shape, device=dev, dtype=dtype)
            g = torch.randn(out_shape, device=dev, dtype=dtype)
            original = getattr(ColumnParallelLinear if name == "column" else RowParallelLinear, "forward")

            def step(forward, module=module, x=x, g=g):
                module.weight.grad = None
                out, _ = forward(module, x.detach().requires_grad_(True))
                out.backward(g)

            # the unchunked collective alone: how much communication there is to hide
            if name == "column":
                buf = torch.empty(args.tokens, args.hidden, device=dev, dtype=dtype)
                comm = lambda: dist.all_gather_into_tensor(buf, x.view(local, -1), group=group)  # noqa: E731
            else:
                y = torch.randn(args.tokens, args.hidden, device=dev, dtype=dtype)
                out = torch.empty(local, args.hidden, device=dev, dtype=dtype)
                comm = lambda: dist.reduce_scatter_tensor(out, y, group=group)  # noqa: E731
            comm_ms = _median_ms(comm, acc)
            for n in args.chunks:
                chunked = wrapper(Settings(n, False, acc))(original)
                bench.compare(f"{name} TP{world}+SP N={n}", dname, baseline=lambda: step(original),
                              feature=lambda chunked=chunked: step(chunked),
                              extra={"chunks": n, "tokens": args.tokens, "hidden": args.hidden,
                                     "ffn": args.ffn, "tp": world, "threads": threads,
                                     "collective_ms": round(comm_ms, 3)})
        _matmul_rows(bench, args, acc, dtype, dname, world)
    if rank == 0:
        bench.finish()
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=4096, help="sequence x batch, all ranks together")
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--ffn", type=int, default=8192)
    parser.add_argument("--chunks", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--dtypes", nargs="+", choices=sorted(DTYPES), default=["fp32"])
    parser.add_argument("--world", type=int, default=2, help="tensor-parallel ranks to launch")
    parser.add_argument("--threads", type=int, default=0, help="intra-op threads per rank (0: cores / world)")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--results-dir", default=None, help="default: benchmarks/results")
    parser.add_argument("--matmul-only", action="store_true",
                        help="only the chunked matmul without communication, in this process")
    args = parser.parse_args()
    if args.matmul_only:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from harness import Bench

        from npuspeed.accelerator import get_accelerator

        bench = Bench("coc_matmul", warmup=args.warmup, repeat=args.repeat, results_dir=args.results_dir)
        for dname in args.dtypes:
            _matmul_rows(bench, args, get_accelerator(), DTYPES[dname], dname, args.world)
        bench.finish()
        return
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    from harness import ranks_fit

    if not ranks_fit(args.world, "coc"):
        raise SystemExit("bench_coc: tensor parallelism needs one device per rank here; --matmul-only runs on one")
    import torch.multiprocessing as mp

    mp.spawn(_rank, args=(args.world, free_port(), args), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
