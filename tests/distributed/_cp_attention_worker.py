"""Worker of test_context_parallel_attention.py: one gloo rank running CP attention cases.

Each case builds Megatron's DotProductAttention under npuspeed's CP flags, feeds this rank
its part of global q/k/v (Megatron's load-balanced CP split of the sequence, TP's split of
the heads), runs forward and backward, gathers the outputs and input gradients, and rank 0
compares them with a float64 reference over the whole sequence (causal, documents, GQA).
Counters (ring send/recv, all-to-alls, block kernels) come back per case.
"""
from __future__ import annotations

import os

import torch

S, B, D = 32, 2, 16


def _reference(q, k, v, dout, scale, causal, cu):
    """float64 attention over the full [S, b, h, d] tensors; returns out and q/k/v grads."""
    q, k, v = (t.detach().double().requires_grad_(True) for t in (q, k, v))
    groups = q.shape[2] // k.shape[2]
    kk, vv = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("sbhd,tbhd->bhst", q, kk) * scale
    s = q.shape[0]
    allowed = torch.ones(q.shape[1], s, s, dtype=torch.bool)
    if causal:
        allowed &= torch.ones(s, s, dtype=torch.bool).tril()
    if cu is not None:
        flat = cu.tolist()
        doc = torch.zeros(q.shape[1] * s, dtype=torch.int64)
        for i, (lo, hi) in enumerate(zip(flat, flat[1:])):
            doc[lo:hi] = i
        doc = doc.view(q.shape[1], s)
        allowed &= doc[:, :, None] == doc[:, None, :]
    scores = scores.masked_fill(~allowed[:, None], float("-inf"))
    out = torch.einsum("bhst,tbhd->sbhd", scores.softmax(-1), vv)
    out.backward(dout.double())
    return out.detach(), q.grad, k.grad, v.grad


def _cp_rows(x, cp_rank, cp_size):
    """Megatron's split: chunks cp_rank and 2N-1-cp_rank of the sequence (dim 0)."""
    chunks = x.chunk(2 * cp_size, dim=0)
    return torch.cat([chunks[cp_rank], chunks[2 * cp_size - 1 - cp_rank]])


def _gather(x, group):
    parts = [torch.empty_like(x) for _ in range(torch.distributed.get_world_size(group))]
    torch.distributed.all_gather(parts, x.contiguous(), group=group)
    return parts


def _unsplit(parts, cp_size):
    """Inverse of _cp_rows over all CP ranks' parts."""
    chunks = [None] * (2 * cp_size)
    for r, p in enumerate(parts):
        a, b = p.chunk(2, dim=0)
        chunks[r], chunks[2 * cp_size - 1 - r] = a, b
    return torch.cat(chunks)


def run_case(case: dict) -> dict:
    from megatron.core import parallel_state as mpu
    from megatron.core.packed_seq_params import PackedSeqParams
    from megatron.core.transformer.dot_product_attention import DotProductAttention
    from megatron.core.transformer.enums import AttnMaskType
    from megatron.core.transformer.transformer_config import TransformerConfig

    from npuspeed import runtime, telemetry

    cp, tp = case["cp"], case.get("tp", 1)
    heads, groups = case.get("heads", 4), case.get("groups", 4)
    dtype = getattr(torch, case.get("dtype", "float32"))
    flags = ["--use-flash-attn", "--context-parallel-size", str(cp), "--context-parallel-algo", case["algo"]]
    if case.get("ulysses"):
        flags += ["--ulysses-degree-in-cp", str(case["ulysses"])]
    runtime.reset()
    runtime.initialize(flags)
    if mpu.model_parallel_is_initialized():
        mpu.destroy_model_parallel()
    mpu.initialize_model_parallel(tp, 1, context_parallel_size=cp)
    config = TransformerConfig(num_layers=1, hidden_size=heads * D, num_attention_heads=heads, kv_channels=D,
                               num_query_groups=groups, attention_dropout=0.0, use_cpu_initialization=True,
                               tensor_model_parallel_size=tp, context_parallel_size=cp,
                               bf16=dtype == torch.bfloat16, params_dtype=dtype)
    mask_type = AttnMaskType.causal if case.get("causal", True) else AttnMaskType.no_mask
    module = DotProductAttention(config, 1, mask_type, "self")
    gen = torch.Generator().manual_seed(7)
    q = torch.randn(S, B, heads, D, generator=gen)
    k, v = (torch.randn(S, B, groups, D, generator=gen) for _ in range(2))
    dout = torch.randn(S, B, heads, D, generator=gen)
    cu = None
    if case.get("docs"):
        cu = torch.tensor([0, 5, 13, 32, 32 + 20, 64], dtype=torch.int32)  # crosses CP chunks
    packed = None if cu is None else PackedSeqParams(qkv_format="sbhd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                                                     max_seqlen_q=S, max_seqlen_kv=S)
    cp_rank, tp_rank = mpu.get_context_parallel_rank(), mpu.get_tensor_model_parallel_rank()
    hq, hk = heads // tp, groups // tp
    local = [_cp_rows(t, cp_rank, cp)[:, :, r * h:(r + 1) * h].to(dtype).requires_grad_(True)
             for t, r, h in ((q, tp_rank, hq), (k, tp_rank, hk), (v, tp_rank, hk))]
    telemetry.reset("cp.")
    out = module(*local, None, packed_seq_params=packed)
    out.backward(_cp_rows(dout, cp_rank, cp)[:, :, tp_rank * hq:(tp_rank + 1) * hq].reshape(out.shape).to(dtype))
    counters = telemetry.snapshot("cp.")
    cp_group, tp_group = mpu.get_context_parallel_group(), mpu.get_tensor_model_parallel_group()
    results = {}
    for name, t, h in (("out", out.detach().view(-1, B, hq, D), hq), ("dq", local[0].grad, hq),
                       ("dk", local[1].grad, hk), ("dv", local[2].grad, hk)):
        full_seq = _unsplit(_gather(t.float(), cp_group), cp)
        results[name] = torch.cat(_gather(full_seq, tp_group), dim=2)
    ref = dict(zip(("out", "dq", "dk", "dv"), _reference(q, k, v, dout, D ** -0.5, case.get("causal", True), cu)))
    errors = {n: float((results[n].double() - ref[n]).abs().max()) for n in ref}
    return {"errors": errors, "counters": counters}


def main(rank: int, world: int, port: int, cases: list, out_path: str) -> None:
    import json

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(port))
    torch.set_num_threads(1)
    from npuspeed import runtime

    runtime.initialize([])
    torch.distributed.init_process_group("gloo", rank=rank, world_size=world)
    results = [run_case(c) for c in cases]
    with open(f"{out_path}.rank{rank}", "w") as fh:
        json.dump(results, fh)
    torch.distributed.destroy_process_group()
