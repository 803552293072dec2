"""Which Python runs which multi-process test file in `make test` (CI), decided in one place.

The unit and contract tiers run whole on both Pythons: they call Megatron in process, with the
patches on, on each supported megatron-core of each Python (0.16.1 on 3.11, 0.19.2 on 3.12). The
multi-process tier (tests/distributed/, tests/e2e/: torchrun runs of the example, a few seconds
of start-up per rank before any step) is most of CI's time, and running it twice took CI past
its limit (the last full run: 45 min for 3.11 alone). So in `make test` each file named in SPLIT
runs on the one Python it names, a file not named runs on both, and `make test-full` (or plain
`pytest` without NPUSPEED_TEST_SHARD) runs every file on both, as `make bench` runs the slow cases.

The split keeps on both Pythons the files whose subject changes between megatron-core releases
(the release matrix itself, checkpoint resume, the pipeline schedules) and balances the rest by
their measured times, 3.12 (the slower suite: a CUDA build of torch run on the CPU) taking less.
"""
from __future__ import annotations

import os
from pathlib import Path

VAR = "NPUSPEED_TEST_SHARD"
PYTHONS = ("3.11", "3.12")

#: test file (relative to tests/) -> the Python that runs it in `make test`
#: Measured 29 Nov 2026 on 3.11 at 1-minute load 8-20 (inflated, for their order only), seconds per
#: file: fb-overlap 875 (before 3 of its cases went to `make bench`), checkpoint layouts 374 (one
#: case since), faults 314, convert 202, CP e2e 193, DualPipeV 165, elastic 146, all features 144,
#: damaged checkpoints 113, CoC e2e 96, checkpoint resume 87, fused ops 79, fused attention 68,
#: CP attention 63, dropout 47, fused Adam 46, CoC layers 38, gradient-accumulation fusion 29.
#: (on both: distributed/test_megatron_versions.py, test_checkpoint_resume.py,
#: test_feature_combinations.py, test_parallel_parity.py, and any file not named)
SPLIT = {
    "distributed/test_dualpipev.py": "3.11",
    "distributed/test_failures.py": "3.11",
    "distributed/test_checkpoint_layouts.py": "3.11",
    "distributed/test_context_parallel_e2e.py": "3.11",
    "distributed/test_coc_e2e.py": "3.11",
    "distributed/test_fused_ops_e2e.py": "3.11",
    "distributed/test_fused_adam_e2e.py": "3.11",
    "distributed/test_coc_layers.py": "3.11",
    "distributed/test_grad_accum_fusion_e2e.py": "3.11",
    "distributed/test_moe_fb_overlap_vpp.py": "3.11",
    "distributed/test_moe_pipeline.py": "3.11",
    "distributed/test_recompute_activation_e2e.py": "3.11",
    "e2e/test_example.py": "3.11",
    "e2e/test_plan_memory.py": "3.11",
    "e2e/test_adaptive_memory_e2e.py": "3.11",
    "distributed/test_moe_fb_overlap.py": "3.12",
    "distributed/test_convert_layouts.py": "3.12",
    "distributed/test_elastic_restart.py": "3.12",
    "distributed/test_damaged_checkpoints.py": "3.12",
    "distributed/test_fused_attention_e2e.py": "3.12",
    "distributed/test_context_parallel_attention.py": "3.12",
    "distributed/test_flash_attention_dropout_e2e.py": "3.12",
    "distributed/test_fused_attention_tp.py": "3.12",
    "distributed/test_fused_linear_ce_tp.py": "3.12",
    "distributed/test_nonfinite.py": "3.12",
    "distributed/test_recompute_norm_e2e.py": "3.12",
    "distributed/test_reuse_fp32_param.py": "3.12",
    "distributed/test_swap_attention_e2e.py": "3.12",
    "e2e/test_megatron_lm.py": "3.12",
    "e2e/test_make_example.py": "3.12",
    "e2e/test_plan_calibrate.py": "3.12",
    "e2e/test_example_tflops.py": "3.12",
}


def shard() -> str | None:
    """The Python whose share runs here (None: every file), checked against PYTHONS."""
    value = os.environ.get(VAR, "").strip()
    if not value:
        return None
    if value not in PYTHONS:
        raise RuntimeError(f"{VAR}={value!r}: set it to one of {', '.join(PYTHONS)} or unset it (every file)")
    return value


def runs_here(path: str | Path, tests_dir: str | Path, here: str | None) -> bool:
    """Whether the test file at `path` runs in the shard `here` (None: all of them)."""
    if here is None:
        return True
    rel = Path(path).resolve().relative_to(Path(tests_dir).resolve()).as_posix()
    return SPLIT.get(rel, here) == here
