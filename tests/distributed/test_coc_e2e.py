"""The example at TP2 + sequence parallel: --use-coc --coc-parallel-num 2 matches the run
without it (fp32, 8 iterations, |loss difference| <= 1e-4 at every iteration), GPT-style and
Llama-style with --use-flash-attn and the fused RMSNorm/SwiGLU/RoPE on; every rank ran the
chunked layers (their collective counts are dumped per rank), the baseline ran none.

Run as a script (under torchrun) this file is the runner: it trains the example unchanged,
then writes the feature's counters to `--coc-stats PATH.rank<N>`.
"""
from __future__ import annotations

import json
import os
import sys

import pytest

COC = ["--use-coc", "--coc-parallel-num", "2"]
FUSED = ["--use-flash-attn", "--use-fused-rmsnorm", "--use-fused-swiglu", "--use-fused-rotary-pos-emb"]


def _train(monkeypatch, tmp_path, name: str, extra: list[str]):
    import launch

    stats = tmp_path / f"{name}.stats"
    monkeypatch.setattr(launch, "EXAMPLE", os.path.abspath(__file__))  # this file, as the runner
    monkeypatch.delenv("NPUSPEED_ARGS", raising=False)
    args = ["--tensor-model-parallel-size", "2", "--sequence-parallel", "--train-iters", "8",
            *launch.TINY, *extra, "--coc-stats", str(stats)]
    result = launch.run_example(args, tmp_path, nproc=2, name=name)
    per_rank = [json.loads((tmp_path / f"{name}.stats.rank{r}").read_text()) for r in (0, 1)]
    return result["losses"], per_rank, result["log"]


def _check(base, base_stats, coc, coc_stats, log):
    assert "coc_overlap" in log.split("features=")[1].split()[0], "--use-coc was not applied"
    assert all(s == {"collectives": {}, "calls": {}} for s in base_stats), base_stats
    for s in coc_stats:  # both linears of every layer, forward and backward, in 2 chunks
        for path in ("column_sp.forward", "column_sp.backward", "row_sp.forward", "row_sp.backward"):
            assert s["calls"].get(path, 0) > 0, s
        assert s["collectives"]["all_gather"] >= 2 * s["calls"]["column_sp.forward"], s
        assert s["collectives"]["reduce_scatter"] >= 2 * s["calls"]["row_sp.forward"], s
    assert len(base) == len(coc) == 8
    diffs = [abs(a - b) for a, b in zip(base, coc)]
    print(f"max |loss difference| over {len(diffs)} iterations: {max(diffs):.3g}")
    assert max(diffs) <= 1e-4, f"loss differences {diffs}"
    assert coc[-1] < coc[0], "loss did not fall"


@pytest.mark.slow  # CI time: the Llama + flash + fused-ops CoC case covers the same layers
def test_tp2_sp_coc_matches_gpt(monkeypatch, tmp_path):
    base, base_stats, _ = _train(monkeypatch, tmp_path, "base", [])
    coc, coc_stats, log = _train(monkeypatch, tmp_path, "coc", COC)
    _check(base, base_stats, coc, coc_stats, log)


def test_tp2_sp_coc_matches_llama_flash_attn_fused_ops(monkeypatch, tmp_path):
    import launch

    extra = [*launch.LLAMA, *FUSED, "--attention-dropout", "0"]
    base, base_stats, _ = _train(monkeypatch, tmp_path, "base", extra)
    coc, coc_stats, log = _train(monkeypatch, tmp_path, "coc", extra + COC)
    _check(base, base_stats, coc, coc_stats, log)


def _coc_stats() -> dict:
    from npuspeed.features.coc_overlap.comm import CALL, COLLECTIVE, counted

    return {"collectives": counted(COLLECTIVE), "calls": counted(CALL)}


if __name__ == "__main__":
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "tools"))
    from launch import run_then_dump

    run_then_dump("--coc-stats", _coc_stats)
