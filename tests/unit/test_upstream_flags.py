"""Megatron's own features paired with the npuspeed flag that does the same: refused with one
line naming both (npuspeed/features/upstream_flags.py); unrelated settings of the same Megatron
flags pass. Light: a context of parsed flags, no runtime."""
from __future__ import annotations

import types

import pytest

from npuspeed import megatron_flags
from npuspeed.features import FeatureError, all_features, upstream_flags

BY_NAME = {f.name: f for f in all_features()}

PAIRS = [  # (npuspeed feature, argv, both flags named)
    ("recompute_norm", ["--recompute-granularity", "selective", "--recompute-modules", "layernorm"],
     ("--recompute-norm", "--recompute-modules layernorm")),
    ("recompute_activation", ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe_act"],
     ("--recompute-activation-function", "--recompute-modules moe_act")),
    ("moe_alltoall_overlap", ["--overlap-moe-expert-parallel-comm"],
     ("--moe-alltoall-overlap-comm", "--overlap-moe-expert-parallel-comm")),
    ("swap_attention", ["--fine-grained-activation-offloading"], ("--swap-attention", "--fine-grained-activation")),
    ("swap_optimizer", ["--optimizer", "muon"], ("--swap-optimizer", "--optimizer muon")),
    ("reuse_fp32_param", ["--optimizer", "lion"], ("--reuse-fp32-param", "--optimizer lion")),
    ("adaptive_memory", ["--pipeline-model-parallel-layout", "Et|tL"],
     ("--adaptive-recompute-device-size", "--pipeline-model-parallel-layout")),
    ("fused_rmsnorm", ["--cuda-graph-impl", "transformer_engine"], ("--use-fused-rmsnorm", "--cuda-graph-impl")),
    ("fused_linear_ce", ["--external-cuda-graph"], ("--use-fused-linear-cross-entropy", "--external-cuda-graph")),
    ("coc_overlap", ["--tensor-model-parallel-size", "2", "--tensor-parallel-num-weight-shards", "4"],
     ("--use-coc", "--tensor-parallel-num-weight-shards 4")),
]
COMPOSE = [  # same Megatron flags, nothing in common with the npuspeed flag
    ("recompute_norm", ["--recompute-granularity", "selective", "--recompute-modules", "core_attn", "moe_act"]),
    ("recompute_norm", ["--recompute-granularity", "full", "--recompute-modules", "layernorm"]),  # ignored by Megatron
    ("swap_optimizer", ["--optimizer", "adam"]),
    ("fused_rmsnorm", ["--cuda-graph-impl", "none"]),
    ("coc_overlap", ["--tensor-model-parallel-size", "2", "--tensor-parallel-num-weight-shards", "2"]),
    ("recompute_norm", ["--pipeline-model-parallel-layout", "Et|tL"]),
]


def _ctx(argv):
    return types.SimpleNamespace(megatron=megatron_flags.parse(argv), argv=tuple(argv))


@pytest.mark.parametrize("name,argv,named", PAIRS, ids=[p[0] for p in PAIRS])
def test_pair_refused_naming_both(name, argv, named):
    with pytest.raises(FeatureError) as err:
        upstream_flags.refuse([BY_NAME[name]], _ctx(argv))
    line = str(err.value)
    assert "\n" not in line and all(n in line for n in named) and "pick one" in line, line


@pytest.mark.parametrize("name,argv", COMPOSE, ids=[f"{c[0]}-{c[1][-1]}" for c in COMPOSE])
def test_unrelated_settings_pass(name, argv):
    upstream_flags.refuse([BY_NAME[name]], _ctx(argv))
