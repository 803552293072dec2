"""All features together, and every pair of them, against the run without them (issue 9).

CI runs "all on vs all off" per layout; the full pair matrix is marked slow (`make bench`).
Tolerances are the feature issues': fp32 1e-4 absolute loss; bf16 2e-2 per iteration.
"""
from __future__ import annotations

import itertools

import pytest

from launch import LLAMA, NO_DROPOUT, TINY, max_abs_diff, run_example

ITERS = ["--train-iters", "8"]
FEATURES = {
    "flash": ["--use-flash-attn"],
    "rmsnorm": ["--use-fused-rmsnorm"],
    "swiglu": ["--use-fused-swiglu"],
    "rope": ["--use-fused-rotary-pos-emb"],
    "reuse": ["--reuse-fp32-param"],  # bf16 only
    "recompute": ["--recompute-activation-function"],
    "coc": ["--use-coc", "--coc-parallel-num", "2"],  # TP > 1 only
}
REPORTED = {"flash": "fused_attention", "rmsnorm": "fused_rmsnorm", "swiglu": "fused_swiglu",
            "rope": "fused_rotary_pos_emb", "reuse": "reuse_fp32_param",
            "recompute": "recompute_activation", "coc": "coc_overlap"}
LAYOUTS = {
    "tp2-sp": ["--tensor-model-parallel-size", "2", "--sequence-parallel"],
    "pp2": ["--pipeline-model-parallel-size", "2"],
    "dp2-distopt": ["--use-distributed-optimizer"],
}


def _allowed(names, layout: str) -> bool:
    return not ("coc" in names and layout != "tp2-sp")


def _flags(names) -> list[str]:
    return [flag for name in names for flag in FEATURES[name]]


def _compare(names, layout: str, tmp_path, bf16: bool):
    base_args = TINY + NO_DROPOUT + ITERS + LLAMA + LAYOUTS[layout] + (["--bf16"] if bf16 else [])
    base = run_example(base_args, tmp_path, nproc=2, name="off")
    run = run_example(base_args + _flags(names), tmp_path, nproc=2, name="on")
    applied = next(line for line in run["log"].splitlines() if line.startswith("npuspeed: device="))
    for name in names:
        assert REPORTED[name] in applied, (name, applied)
    tol = 2e-2 if bf16 else 1e-4
    assert max_abs_diff(run["losses"], base["losses"]) <= tol
    return base, run


ALL_FP32 = [n for n in FEATURES if n != "reuse"]


# TP2+SP (every feature applies) runs in CI; PP2 and DP2 run with `make bench` (-m slow).
@pytest.mark.parametrize("layout", [pytest.param(name, marks=() if name == "tp2-sp" else pytest.mark.slow)
                                    for name in LAYOUTS])
def test_all_features_on_match_all_off(layout, tmp_path):
    names = [n for n in FEATURES if _allowed([n], layout) and (n != "reuse")]
    _compare(names, layout, tmp_path, bf16=False)


# `make bench` (-m slow): CI runs all features on against all off (above)
@pytest.mark.slow
def test_all_features_on_bf16_with_shared_weights(tmp_path):
    names = [n for n in FEATURES if _allowed([n], "tp2-sp")]
    base, run = _compare(names, "tp2-sp", tmp_path, bf16=True)
    assert run["weight_bytes"] < 0.7 * base["weight_bytes"]


def test_impossible_combinations_are_rejected_at_start(tmp_path):
    with pytest.raises(AssertionError, match="--use-coc"):
        run_example(TINY + ITERS + FEATURES["coc"], tmp_path, nproc=1, name="coc-tp1")
    with pytest.raises(AssertionError, match="add --bf16 or drop --reuse-fp32-param"):
        run_example(TINY + ITERS + FEATURES["reuse"], tmp_path, nproc=1, name="reuse-fp32")


PAIRS = [(a, b, layout) for a, b in itertools.combinations(FEATURES, 2) for layout in LAYOUTS
         if _allowed([a, b], layout)]


@pytest.mark.slow
@pytest.mark.parametrize("a,b,layout", PAIRS, ids=[f"{a}+{b}-{layout}" for a, b, layout in PAIRS])
def test_feature_pairs(a, b, layout, tmp_path):
    _compare([a, b], layout, tmp_path, bf16="reuse" in (a, b))
