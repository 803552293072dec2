"""A converted DeepSeek-V3 (MLA, sigmoid routing with its expert bias, 2 groups, a shared expert,
a dense first layer) trains in the example: 10 iterations at TP1 lower the loss; TP2, EP2 and
TP2 (with sequence parallelism, which Megatron requires for MoE
with TP) reading the Hugging Face directory itself (--hf-checkpoint) start from TP1's loss within
1e-5 (fp32); TP2's save converts back and transformers' logits equal the Megatron model's
within 1e-5.
"""
from __future__ import annotations

import pytest

from launch import run_example

transformers = pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from test_convert_example import TRAIN, _convert, _run, back_to_hf  # noqa: E402


@pytest.mark.slow  # CI time (about 2 min on 2 cores): `make bench` runs it; CI keeps the unit tests
def test_deepseek_v3_trains_at_any_layout_and_converts_back(tmp_path, megatron_mp):
    converted = _convert(tmp_path, "deepseek_v3")
    tp1 = _run(converted, "tp1", 1, [], 10)
    assert "was converted from DeepseekV3ForCausalLM" in tp1["log"]
    assert tp1["losses"][-1] < tp1["losses"][0] - 0.05, tp1["losses"]
    tp2_layout = ["--tensor-model-parallel-size", "2", "--sequence-parallel"]  # Megatron: MoE with TP needs SP
    tp2 = _run(converted, "tp2", 2, tp2_layout, 1, ["--save", str(tmp_path / "tp2_saved")])
    ep2 = _run(converted, "ep2", 2, ["--expert-model-parallel-size", "2"], 1)
    direct = run_example(TRAIN + converted[1] + tp2_layout + ["--train-iters", "1",
                                                 "--hf-checkpoint", str(tmp_path / "hf")], tmp_path, nproc=2,
                         name="tp2_direct")
    for other in (tp2, ep2, direct):
        assert abs(other["losses"][0] - tp1["losses"][0]) <= 1e-5, (tp1["losses"], other["losses"])
    gap, _ = back_to_hf(tmp_path, "tp2_saved", 1)
    assert gap <= 1e-5, gap
