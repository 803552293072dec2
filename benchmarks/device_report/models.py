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
    #: profile the last iteration (the example's --profile; it and its warm-up iteration are
    #: left out of the step times)
    profile: bool = False


#: timed iterations of flash attention and of each flag run: 12, of which the first, the
#: profiler's warm-up and the profiled last are left out of the step range (9 steps a run of
#: flash-attn, 11 of a flag run, against 5 before): a step costs ~0.35 s on an H100 and a run's
#: start-up ~25 s, so steps are cheap and a range of 9-11 steps is what "gain" / "loss" stand on
ITERS = 12
#: one flag at a time over flash attention: every single-rank flag of a dense model (the
#: adaptive-memory flags need a memory budget to act on and are left out)
FLAG_RUNS = {
    "fused-linear-cross-entropy": ["--use-fused-linear-cross-entropy"],
    "recompute-activation": ["--recompute-activation-function"],
    "fused-rmsnorm": ["--use-fused-rmsnorm"],
    "fused-swiglu": ["--use-fused-swiglu"],
    "fused-rope": ["--use-fused-rotary-pos-emb"],
    "recompute-norm": ["--recompute-norm"],
    "reuse-fp32-param": ["--reuse-fp32-param"],
    "gradient-accumulation-fusion": ["--gradient-accumulation-fusion"],
    "swap-optimizer": ["--swap-optimizer"],
    "swap-attention": ["--swap-attention"],
}
#: name -> run, in the order they are taken (most wanted first: the budget may cut the tail).
#: The global-batch-64 pair of 2026-11-27 (--swap-optimizer within the steps' spread there) is
#: left out to fit the lease: two start-ups and 6 steps of 2.7 s, about 70 s.
RUNS = {
    "all off": Run(),
    "flash-attn": Run(tuple(FLASH), iters=ITERS, profile=True),
    "all flags": Run(tuple(ALL), iters=ITERS, profile=True),
    **{name: Run(tuple(FLASH + flags), iters=ITERS) for name, flags in FLAG_RUNS.items()},
}
#: flag run -> the run it is compared with (same global batch, flash attention on both)
BASE_OF = {name: "flash-attn" for name in FLAG_RUNS}
#: the runs whose last iteration is profiled (the report's "where a step goes")
PROFILED = tuple(name for name, run in RUNS.items() if run.profile)
#: the e2e table's rows, against "all off"
E2E = ("all off", "flash-attn", "all flags")


def args_for(run: Run, smoke: bool) -> list[str]:
    model = SMOKE if smoke else LLAMA
    gbs = max(2, run.global_batch // 8) if smoke else run.global_batch
    iters = min(run.iters, 4) if smoke else run.iters
    profile = ["--profile", "--profile-step-start", str(iters - 1), "--profile-step-end", str(iters)] \
        if run.profile else []
    return model + ["--global-batch-size", str(gbs), "--train-iters", str(iters)] + list(run.flags) + profile
