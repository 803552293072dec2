"""The example with --fp8-format: TP2 + sequence parallelism against TP1, both in FP8 (fp32
outside the FP8 GEMMs). The per-tensor recipes reduce their amaxes over the TP group, so the
ranks quantize their shards as TP1 quantizes the whole tensor: the first two iterations agree to
1e-6 (without the reduction the first already differs by 1.5e-4, measured). After that, fp32
summation-order differences (TP1 against TP2 without FP8: at most 2.4e-7 over 8 iterations) move
some values across an FP8 rounding boundary and the runs drift apart: 3.6e-4 (e4m3) and 3.7e-4
(hybrid) at iteration 8 here, so issue 50's "within 1e-4 over 8 iterations" is NOT met; the bound
below is 1e-3. The summary JSON carries the FP8 counters, and the run without the flag is within 2%."""
from __future__ import annotations

import pytest

from launch import LLAMA, NO_DROPOUT, TINY, run_example

BASE = TINY + NO_DROPOUT + ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
                            "--seq-length", "128", "--max-position-embeddings", "128", "--train-iters", "8"] + LLAMA


@pytest.mark.slow  # three example runs, two of them TP2: about 3 minutes here
@pytest.mark.parametrize("recipe", ["tensorwise", "delayed"])
def test_tp2_sp_matches_tp1_in_fp8(tmp_path, recipe):
    fp8 = ["--fp8-format", "hybrid", "--fp8-recipe", recipe]
    tp1 = run_example(BASE + fp8, tmp_path, nproc=1, name=f"tp1_{recipe}")
    tp2 = run_example(BASE + fp8 + ["--tensor-model-parallel-size", "2", "--sequence-parallel"], tmp_path,
                      nproc=2, name=f"tp2_{recipe}")
    assert len(tp1["losses"]) == len(tp2["losses"]) == 8
    diffs = [abs(a - b) for a, b in zip(tp1["losses"], tp2["losses"])]
    assert max(diffs[:2]) < 1e-6, diffs
    assert max(diffs) < 1e-3, diffs
    for run in (tp1, tp2):
        assert run["npuspeed_counters"][f"fp8.gemm.{recipe}"] > 0
    plain = run_example(BASE, tmp_path, nproc=1, name=f"plain_{recipe}")
    assert "fp8.gemm.tensorwise" not in plain["npuspeed_counters"]
    rel = max(abs(a - b) / b for a, b in zip(tp1["losses"], plain["losses"]))
    assert rel < 0.02, (tp1["losses"], plain["losses"])
