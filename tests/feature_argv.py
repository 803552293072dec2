"""One command line per opt-in feature that turns it on and passes its own validation on the
CPU backend: npuspeed's flags, the Megatron flags of a model it has something to do in (also
given to the run without the flag, for parity), an environment, and how many ranks it needs.
The structural idle test (tests/unit/test_idle_features.py) and the per-release table of
scripts/megatron_versions.sh enable every feature with it; the idle test checks that it names
every feature of `npuspeed.features.all_features()`, so a new feature cannot escape either."""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, field

TINY_SHAPE = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length", "128",
              "--max-position-embeddings", "128"]
MOE = ["--num-experts", "4", "--moe-router-topk", "2", "--disable-bias-linear"]


@dataclass(frozen=True)
class Enable:
    flags: list  # npuspeed's (the run without them is the parity baseline)
    model: list = field(default_factory=list)  # Megatron's, in both runs
    env: dict = field(default_factory=dict)
    ranks: int = 1
    # Megatron's argv of the parity baseline where `model` cannot run without the flags
    # (CP on local attention exists only on npuspeed's fused path: the baseline is CP 1 there)
    baseline: list | None = None

    @property
    def argv(self) -> list:
        return self.flags + self.model


FEATURES: dict[str, Enable] = {
    "fused_attention": Enable(["--use-flash-attn"]),
    "context_parallel": Enable(["--context-parallel-algo", "ulysses_cp_algo", "--use-flash-attn"],
                               ["--context-parallel-size", "2"], ranks=2, baseline=["--use-flash-attn"]),
    "fused_rmsnorm": Enable(["--use-fused-rmsnorm"], ["--normalization", "RMSNorm"]),
    "fused_swiglu": Enable(["--use-fused-swiglu"], ["--swiglu"]),
    "fused_rotary_pos_emb": Enable(["--use-fused-rotary-pos-emb"], ["--position-embedding-type", "rope"]),
    "fused_linear_ce": Enable(["--use-fused-linear-cross-entropy"]),
    "reuse_fp32_param": Enable(["--reuse-fp32-param"], ["--bf16"]),
    "recompute_activation": Enable(["--recompute-activation-function"]),
    "dump": Enable(["--npuspeed-dump", os.path.join(tempfile.gettempdir(), "npuspeed_dump_feature_argv"),
                    "--dump-steps", "1"]),
    "recompute_norm": Enable(["--recompute-norm"]),
    "swap_attention": Enable(["--swap-attention"]),
    "swap_optimizer": Enable(["--swap-optimizer"], env={"NPUSPEED_SWAP_OPTIMIZER": "run"}),
    "grad_accum_fusion": Enable(["--gradient-accumulation-fusion"]),
    "fp8": Enable(["--fp8-format", "hybrid", "--fp8-recipe", "tensorwise"]),
    "coc_overlap": Enable(["--use-coc", "--coc-parallel-num", "2"], ["--tensor-model-parallel-size", "2"], ranks=2),
    "adaptive_memory": Enable(["--adaptive-recompute-device-size", "500"], TINY_SHAPE),
    "moe_tp_extend_ep": Enable(["--moe-tp-extend-ep"], MOE + ["--tensor-model-parallel-size", "2", "--sequence-parallel",
                                                            "--moe-token-dispatcher-type", "alltoall"], ranks=2),
    "moe_grouped_gemm": Enable(["--moe-grouped-gemm"], MOE),
    "moe_fused_permute": Enable(["--use-fused-moe-token-permute-and-unpermute"],
                                MOE + ["--moe-token-dispatcher-type", "alltoall"]),
    "moe_alltoall_overlap": Enable(["--moe-alltoall-overlap-comm"], MOE + ["--expert-model-parallel-size", "2",
                                                                         "--moe-token-dispatcher-type", "alltoall"],
                                   ranks=2),
    "moe_fb_overlap": Enable(["--moe-fb-overlap"], MOE + ["--expert-model-parallel-size", "2",
                                                         "--moe-token-dispatcher-type", "alltoall",
                                                         "--micro-batch-size", "1", "--global-batch-size", "4"],
                             ranks=2),  # 2 micro-batches a step at DP 2: one pair
    "dualpipev": Enable(["--schedules-method", "dualpipev"],
                        ["--pipeline-model-parallel-size", "2", "--num-layers", "4",
                         "--num-layers-per-virtual-pipeline-stage", "1", "--untie-embeddings-and-output-weights",
                         "--micro-batch-size", "1", "--global-batch-size", "4"], ranks=2),  # 4 micro-batches: 2 x PP
}
FEATURE_ARGV = {name: enable.argv for name, enable in FEATURES.items()}
