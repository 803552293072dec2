"""The training runs behind the device report, as argument lists.

One Llama-style model, the README's one-GPU configuration (8 layers, hidden 2048, GQA 16/4,
SwiGLU ffn 5632, S 4096, bf16, Megatron's default dropout 0.1, micro-batch 1), about 709M
parameters with the example's vocabulary. Every per-flag comparison is against the same
flash-attention run, so a handful of shared runs serve the whole report (its budget is 8
minutes on one H100). `smoke` is the same plan at a size a CPU trains in seconds: it checks
the report's code, its figures mean nothing.
"""
from __future__ import annotations

from dataclasses import dataclass, field

LLAMA = ["--num-layers", "8", "--hidden-size", "2048", "--num-attention-heads", "16",
         "--group-query-attention", "--num-query-groups", "4", "--ffn-hidden-size", "5632",
         "--seq-length", "4096", "--max-position-embeddings", "4096",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16",
         "--micro-batch-size", "1", "--lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1"]
SMOKE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--group-query-attention", "--num-query-groups", "2", "--ffn-hidden-size", "176",
         "--seq-length", "128", "--max-position-embeddings", "128", "--make-vocab-size-divisible-by", "1",
         "--normalization", "RMSNorm", "--swiglu", "--position-embedding-type", "rope",
         "--disable-bias-linear", "--untie-embeddings-and-output-weights", "--bf16", "--use-cpu-initialization",
         "--micro-batch-size", "1", "--lr", "3e-4", "--lr-warmup-iters", "2", "--log-interval", "1"]

FLASH = ["--use-flash-attn"]
#: "all flags": every single-rank flag that trades nothing for its gain (the memory-for-time
#: swaps and --recompute-norm are measured one by one instead)
ALL = FLASH + ["--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb", "--reuse-fp32-param",
               "--recompute-activation-function", "--use-fused-linear-cross-entropy",
               "--gradient-accumulation-fusion"]


@dataclass(frozen=True)
class Run:
    """One training run: its flags over the model, the global batch and iterations."""
    flags: tuple = ()
    global_batch: int = 8
    iters: int = 6
    env: dict = field(default_factory=dict)


#: name -> run, in the order they are taken (most wanted first: the budget may cut the tail)
RUNS = {
    "all off": Run(),
    "flash-attn": Run(tuple(FLASH)),
    "all flags": Run(tuple(ALL)),
    "reuse-fp32-param": Run(tuple(FLASH + ["--reuse-fp32-param"])),
    "swap-optimizer": Run(tuple(FLASH + ["--swap-optimizer"])),
    "gradient-accumulation-fusion": Run(tuple(FLASH + ["--gradient-accumulation-fusion"])),
    "swap-attention": Run(tuple(FLASH + ["--swap-attention"])),
    "flash-attn gbs64": Run(tuple(FLASH), global_batch=64, iters=3),
    "swap-optimizer gbs64": Run(tuple(FLASH + ["--swap-optimizer"]), global_batch=64, iters=3),
}
#: flag run -> the run it is compared with (same global batch, flash attention on both)
BASE_OF = {"reuse-fp32-param": "flash-attn", "swap-optimizer": "flash-attn",
           "gradient-accumulation-fusion": "flash-attn", "swap-attention": "flash-attn",
           "swap-optimizer gbs64": "flash-attn gbs64"}
#: the e2e table's rows, against "all off"
E2E = ("all off", "flash-attn", "all flags")


def args_for(run: Run, smoke: bool) -> list[str]:
    model = SMOKE if smoke else LLAMA
    gbs = max(2, run.global_batch // 8) if smoke else run.global_batch
    iters = min(run.iters, 3) if smoke else run.iters
    return model + ["--global-batch-size", str(gbs), "--train-iters", str(iters)] + list(run.flags)
