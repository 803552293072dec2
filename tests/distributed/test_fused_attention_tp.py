"""--use-flash-attn with attention dropout at tensor parallel 2 (2 gloo ranks, spawned).

Dropout must be drawn from Megatron's model-parallel RNG tracker, as upstream draws it:
then a fixed seed reproduces a run bit for bit, each TP rank drops differently (its tracker
is seeded with its TP rank, so heads on different ranks get independent masks), and the
default device state, which TP ranks share, is not consumed.
"""
from __future__ import annotations

import os

import torch
import torch.multiprocessing as mp
from launch import free_port

WORLD = 2
HEADS, D, S, B = 4, 16, 24, 2


def _worker(rank: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORLD), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORLD),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from npuspeed import runtime

    state = runtime.initialize(["--use-flash-attn"])
    import torch.distributed as dist
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from npuspeed.features.fused_attention import kernel_calls

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD)
    parallel_state.initialize_model_parallel(WORLD, 1)
    acc = state.accelerator
    config = TransformerConfig(num_layers=2, hidden_size=HEADS * D, num_attention_heads=HEADS, kv_channels=D,
                               attention_dropout=0.3, use_cpu_initialization=True,
                               tensor_model_parallel_size=WORLD)
    module = DotProductAttention(config, 1, AttnMaskType.causal, "self")
    module.train()
    assert module.num_attention_heads_per_partition == HEADS // WORLD

    gen = torch.Generator().manual_seed(0)
    full = [torch.randn(S, B, HEADS, D, generator=gen) for _ in range(3)]
    grad = torch.randn(S, B, (HEADS // WORLD) * D, generator=gen)
    heads = slice(rank * HEADS // WORLD, (rank + 1) * HEADS // WORLD)

    def step(seed: int, shard: slice):
        q, k, v = (t[:, :, shard].clone().requires_grad_(True) for t in full)
        tensor_parallel.model_parallel_cuda_manual_seed(seed)
        default_before = acc.get_rng_state().clone()
        out = module(q, k, v, None)
        out.backward(grad)
        assert torch.equal(acc.get_rng_state(), default_before), "dropout consumed the default device state"
        return [out.detach(), q.grad, k.grad, v.grad]

    from npuspeed.features.fused_attention.forward import CPU_FLASH_FP32
    from npuspeed.ops.flash_attention import fp32_reason

    with acc.device_rng_scope():
        before = kernel_calls()
        first = step(1234, heads)
        again = step(1234, heads)
        other_seed = step(99, heads)
        same_heads = step(1234, slice(0, HEADS // WORLD))  # both ranks: identical inputs
        ran = {k: n - before.get(k, 0) for k, n in kernel_calls().items() if n != before.get(k, 0)}
        assert sum(ran.values()) == 4, "the fused path did not run"
        if fp32_reason() is None:  # dropout runs inside npuspeed's fp32 kernel
            assert ran == {CPU_FLASH_FP32: 4}, ran
    for a, b in zip(first, again):
        assert torch.equal(a, b), "not reproducible under a fixed seed"
    assert not torch.equal(first[0], other_seed[0]), "another seed gave the same dropout"

    gathered = [torch.empty_like(same_heads[0]) for _ in range(WORLD)]
    dist.all_gather(gathered, same_heads[0])
    assert not torch.equal(gathered[0], gathered[1]), "TP ranks drew the same dropout mask"
    default = acc.get_rng_state()
    states = [torch.empty_like(default) for _ in range(WORLD)]
    dist.all_gather(states, default)
    assert torch.equal(states[0], states[1]), "TP ranks' default device states diverged"

    parallel_state.destroy_model_parallel()
    dist.destroy_process_group()


def test_dropout_tp2_reproducible_and_rank_independent():
    mp.spawn(_worker, args=(free_port(),), nprocs=WORLD, join=True)
