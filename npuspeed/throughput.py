"""Model FLOPs per iteration as Megatron-LM counts them, TFLOP/s per rank and MFU.

So that a run's TFLOP/s can be compared with published Megatron-LM figures, the count follows
`num_floating_point_operations(args, batch_size)` of Megatron-LM's megatron/training/training.py
at tag core_v0.16.1 (its standard-Transformer branch; no Mamba/hybrid, MLA, linear attention or
MTP here). Per sequence of `seq_length` tokens, every GEMM counted 2 x m x n x k FLOPs and 3 times
(forward, weight gradient, data gradient):
  attention  hidden x (q + k + v [+ output gate]) projections, q x seq / 2 x 2 for QK^T and its
             product with V (causal: half the score matrix), q x hidden output projection
  MLP        dense layers hidden x ffn x (3 with a gated linear unit such as SwiGLU, else 2); MoE
             layers top-k routed experts of moe_ffn and the shared experts, same factor
  logits     hidden x padded vocabulary
That version counts no recompute (a recomputed forward is not model FLOPs), and its count does
not depend on TP/PP/CP/DP: it is the global batch's. TFLOP/s per rank divides by the world size.
"""
from __future__ import annotations

from dataclasses import dataclass

#: bf16 dense (no sparsity) peak TFLOP/s of one device, from the vendors' data sheets.
#: H100/H200 SXM: 989.4 (NVIDIA H100 / H200 data sheets, "BF16 Tensor Core" 1,979 with sparsity,
#: halved); H100 PCIe: 756; A100 (SXM and PCIe): 312; Ascend 910B: 313 for the 910B3 (Huawei's
#: Atlas 800T A2 figure of 313 TFLOPS FP16/BF16 per card, an assumption for every 910B: other
#: variants (910B1/B2) are quoted higher in public reports, so their MFU here reads high; pass
#: --device-peak-tflops or measure with `npuspeed report --measure-peak`). No CPU entry: a CPU's peak
#: depends on its cores and vector units; measure it (`npuspeed report --measure-peak`) and pass
#: `--device-peak-tflops`.
PEAK_BF16_TFLOPS = {
    "H200": 989.0,
    "H100 PCIe": 756.0,
    "H100": 989.0,
    "A100": 312.0,
    "Ascend910B": 313.0,
}


def peak_tflops(device_name: str | None) -> float | None:
    """The table's peak for a device name as the accelerator reports it (e.g. 'NVIDIA H100 80GB
    HBM3', 'Ascend910B3'); None when no entry matches (CPU, unknown devices)."""
    if not device_name:
        return None
    name = device_name.replace(" ", "").lower()
    for key, peak in PEAK_BF16_TFLOPS.items():  # longest names first in the table where they overlap
        if key.replace(" ", "").lower() in name:
            return peak
    return None


@dataclass(frozen=True)
class FlopsModel:
    """The model sizes the count reads (Megatron-LM's argument names in the comments)."""
    num_layers: int
    hidden: int  # --hidden-size
    ffn: int  # --ffn-hidden-size
    heads: int  # --num-attention-heads
    query_groups: int  # --num-query-groups (= heads without --group-query-attention)
    kv_channels: int  # --kv-channels (default hidden / heads)
    seq_length: int
    padded_vocab: int  # args.padded_vocab_size
    swiglu: bool = False  # --swiglu (any gated linear unit)
    num_experts: int | None = None
    moe_topk: int = 2  # --moe-router-topk
    moe_ffn: int | None = None  # --moe-ffn-hidden-size (default: ffn)
    shared_expert_ffn: int = 0  # --moe-shared-expert-intermediate-size
    moe_layer_freq: int | tuple = 1  # --moe-layer-freq: every N-th layer (from layer 0), or a 0/1 pattern
    attention_output_gate: bool = False  # --attention-output-gate

    def moe_layers(self) -> int:
        if not self.num_experts:
            return 0
        if isinstance(self.moe_layer_freq, int):
            return sum(1 for i in range(self.num_layers) if i % self.moe_layer_freq == 0)
        pattern = list(self.moe_layer_freq)
        if len(pattern) != self.num_layers:
            raise ValueError(f"--moe-layer-freq pattern has {len(pattern)} entries for {self.num_layers} layers")
        return sum(pattern)


def model_flops(m: FlopsModel, batch_size: int) -> float:
    """FLOPs of one iteration over `batch_size` sequences (the global batch), Megatron-LM's count."""
    gemm = 3 * 2  # forward + two backward GEMMs, 2 FLOPs a multiply-add
    glu = 3 if m.swiglu else 2
    q = m.kv_channels * m.heads
    kv = m.kv_channels * m.query_groups
    gate = q if m.attention_output_gate else 0
    attention = m.hidden * (q + 2 * kv + gate) + q * m.seq_length + q * m.hidden  # causal: s/2 x 2 GEMMs
    moe = m.moe_layers()
    dense = m.num_layers - moe
    routed = (m.moe_ffn or m.ffn) * (m.moe_topk if m.num_experts else 0)
    mlp = m.hidden * glu * (m.ffn * dense + (routed + m.shared_expert_ffn) * moe)
    per_token = gemm * (mlp + attention * m.num_layers + m.hidden * m.padded_vocab)
    return float(batch_size) * m.seq_length * per_token


def from_args(args) -> FlopsModel:
    """The sizes from a Megatron-LM-style argument namespace (the example's, Megatron-LM's)."""
    heads = args.num_attention_heads
    groups = getattr(args, "num_query_groups", None) if getattr(args, "group_query_attention", False) else None
    freq = getattr(args, "moe_layer_freq", 1)
    return FlopsModel(
        num_layers=args.num_layers, hidden=args.hidden_size, ffn=args.ffn_hidden_size or 4 * args.hidden_size,
        heads=heads, query_groups=groups or heads,
        kv_channels=getattr(args, "kv_channels", None) or args.hidden_size // heads,
        seq_length=args.seq_length, padded_vocab=args.padded_vocab_size, swiglu=bool(getattr(args, "swiglu", False)),
        num_experts=getattr(args, "num_experts", None), moe_topk=getattr(args, "moe_router_topk", 2) or 0,
        moe_ffn=getattr(args, "moe_ffn_hidden_size", None),
        shared_expert_ffn=getattr(args, "moe_shared_expert_intermediate_size", None) or 0,
        moe_layer_freq=freq if isinstance(freq, int) else tuple(freq),
        attention_output_gate=bool(getattr(args, "attention_output_gate", False)),
    )


def tflops_per_rank(flops: float, step_ms: float, world_size: int) -> float:
    """TFLOP/s per rank of an iteration of `flops` taking `step_ms` on `world_size` ranks
    (Megatron-LM's `throughput per GPU (TFLOP/s/GPU)`)."""
    if step_ms <= 0 or world_size < 1:
        return 0.0
    return flops / (step_ms / 1000.0 * 1e12 * world_size)


def mfu(tflops: float, peak: float | None) -> float | None:
    """Model FLOPs utilisation: achieved over peak; None when the peak is unknown."""
    return tflops / peak if peak else None


def measure_gemm_tflops(device, synchronize, *, n: int | None = None, dtype=None, seconds: float = 1.0,
                        min_repeats: int = 3) -> dict:
    """Time an n x n x n GEMM on `device` (bf16 by default) and return its TFLOP/s: the best
    repeat (`tflops`, the figure to pass as --device-peak-tflops) and the median. n defaults to
    8192 on an accelerator (a GEMM of ~1 TFLOP, large enough to reach the tensor cores' rate) and
    2048 on CPU (~70 ms a GEMM on 2 cores here, so the measurement ends in about `seconds`)."""
    import statistics
    import time

    import torch

    from npuspeed.ops._dispatch import HOST_DEVICE_TYPES

    device = torch.device(device)
    dtype = dtype or torch.bfloat16
    n = n or (2048 if device.type in HOST_DEVICE_TYPES else 8192)
    gen = torch.Generator().manual_seed(0)
    a = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(n, n, generator=gen).to(device=device, dtype=dtype)
    out = torch.empty(n, n, device=device, dtype=dtype)
    torch.matmul(a, b, out=out)  # warm-up: kernel choice, library start-up
    synchronize()
    times = []
    start = time.perf_counter()
    while len(times) < min_repeats or time.perf_counter() - start < seconds:
        t0 = time.perf_counter()
        torch.matmul(a, b, out=out)
        synchronize()
        times.append(time.perf_counter() - t0)
    flops = 2.0 * n**3
    return {"tflops": flops / min(times) / 1e12, "median_tflops": flops / statistics.median(times) / 1e12,
            "n": n, "dtype": str(dtype).replace("torch.", ""), "repeats": len(times), "device": str(device)}
