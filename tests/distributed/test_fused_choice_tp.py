"""--use-fused-rmsnorm at tensor parallel 2 (2 gloo ranks, spawned): every TP rank runs the same
RMSNorm kernel even where their own timings disagree. Without sequence parallelism the norm's
weight is replicated on the TP ranks and its gradient is not reduced over TP, so two kernels
(rounding differently) would let the copies drift apart; the chooser decides on timings agreed
over the TP group (npuspeed/features/chooser_setup.py)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.multiprocessing as mp
from launch import free_port

from npuspeed.ops._extension import has_op

WORLD = 2
#: each rank's own fwd+bwd seconds: alone, rank 0 would take cpp and rank 1 Megatron's path;
#: the MAX over both (cpp 3.0, megatron 2.0) is Megatron's on both
TIMES = [{"cpp": 1.0, "megatron": 2.0}, {"cpp": 3.0, "megatron": 1.0}]


def _worker(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    os.environ.pop("NPUSPEED_FUSED_OP_PATH", None)
    torch.set_num_threads(1)
    from npuspeed import runtime

    runtime.initialize(["--use-fused-rmsnorm"])
    import torch.distributed as dist
    import torch.nn.functional as F
    from megatron.core import parallel_state

    from npuspeed.ops import fused_choice
    from npuspeed.ops.rms_norm import fused_rms_norm

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    parallel_state.initialize_model_parallel(WORLD, 1)

    def fake(name, run):
        run()
        return TIMES[rank][name]

    fused_choice.CHOOSER.trial = fake
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(0)).requires_grad_(True)
    w = torch.ones(16, requires_grad=True)
    fused_rms_norm(x, w, 1e-5, lambda x, w: F.rms_norm(x, (16,), w, 1e-5)).sum().backward()
    (choice,) = [c for c in fused_choice.choices() if c.op == "rms_norm"]
    picked = torch.tensor([0 if choice.impl == "megatron" else 1])
    every = [torch.empty_like(picked) for _ in range(WORLD)]
    dist.all_gather(every, picked)
    assert [int(t) for t in every] == [0, 0], f"TP ranks ran different RMSNorm kernels: {every}, {choice.why}"
    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


@pytest.mark.skipif(not has_op("rms_norm"), reason="C++ op library not built")
# CI time: the agreement hook itself is unit-tested (test_fused_choice.py); this 2-rank run of it
# goes with `make bench`
@pytest.mark.slow
def test_tp_ranks_take_one_rmsnorm_kernel():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
