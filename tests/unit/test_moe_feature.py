"""The MoE flags as features: start-up errors for layouts they cannot serve (each naming the
flag and the fix), model-build errors when the model gives them nothing to do, the report
lines, and the example refusing bad input before it trains."""
from __future__ import annotations

import subprocess
import sys

import pytest
from feature_ctx import ctx_for

from launch import EXAMPLE, ROOT
from npuspeed.features import FeatureError, all_features
from npuspeed.features.moe_alltoall_overlap import MoeAllToAllOverlapFeature
from npuspeed.features.moe_fused_permute import MoeFusedPermuteFeature
from npuspeed.features.moe_grouped_gemm import MoeGroupedGemmFeature
from npuspeed.features.moe_tp_extend_ep import MoeTpExtendEpFeature

MOE = ["--num-experts", "8", "--disable-bias-linear"]


def _validate(feature, argv):
    ctx = ctx_for(argv)
    assert feature.enabled(ctx.args)
    feature.validate(ctx)


@pytest.mark.parametrize("feature, argv, needle", [
    (MoeGroupedGemmFeature(), ["--moe-grouped-gemm", "--num-experts", "8"], "add --disable-bias-linear"),
    (MoeGroupedGemmFeature(), ["--moe-grouped-gemm", *MOE, "--expert-model-parallel-size", "3"],
     "8 experts cannot be split over 3 expert-parallel ranks"),
    (MoeGroupedGemmFeature(), ["--moe-grouped-gemm", *MOE, "--expert-model-parallel-size", "2",
                            "--tensor-model-parallel-size", "3", "--moe-tp-extend-ep"],
     "divisible by --expert-model-parallel-size x --tensor-model-parallel-size"),
    (MoeGroupedGemmFeature(), ["--moe-grouped-gemm", *MOE, "--tensor-model-parallel-size", "2",
                            "--moe-ffn-hidden-size", "101"], "expert FFN size 101 cannot be split over 2"),
    (MoeTpExtendEpFeature(), ["--moe-tp-extend-ep", *MOE], "--tensor-model-parallel-size is 1"),
    (MoeTpExtendEpFeature(), ["--moe-tp-extend-ep", "--num-experts", "6", "--expert-model-parallel-size", "2",
                           "--tensor-model-parallel-size", "2"], "EP x TP = 2 x 2 = 4 ranks, which does not divide"),
    (MoeTpExtendEpFeature(), ["--moe-tp-extend-ep", *MOE, "--tensor-model-parallel-size", "2",
                           "--expert-tensor-parallel-size", "2"], "--expert-tensor-parallel-size is 2"),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm", "--moe-alltoall-chunks", "1"], "must be >= 2"),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-chunks", "4"], "--moe-alltoall-chunks 4 is given without --moe-alltoall-overlap-comm"),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm", "--moe-token-dispatcher-type", "allgather"],
     "use alltoall or drop the flag"),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm", "--expert-model-parallel-size", "1"],
     "no all-to-all to overlap"),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm", "--expert-model-parallel-size", "2",
                                "--tensor-model-parallel-size", "2"], "add --moe-tp-extend-ep"),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm", "--expert-model-parallel-size", "2",
                                "--moe-shared-expert-overlap"], "drop Megatron's --moe-shared-expert-overlap"),
    (MoeFusedPermuteFeature(), ["--use-fused-moe-token-permute-and-unpermute", "--moe-token-dispatcher-type", "flex"],
     "flex dispatcher"),
])
def test_bad_layouts_are_start_up_errors(feature, argv, needle):
    with pytest.raises(FeatureError, match=needle.replace("(", r"\(").replace(")", r"\)")) as err:
        _validate(feature, argv)
    assert feature.flags[0] in str(err.value) or "--moe-alltoall-chunks" in str(err.value)


@pytest.mark.parametrize("feature, argv", [
    (MoeGroupedGemmFeature(), ["--moe-grouped-gemm", *MOE, "--expert-model-parallel-size", "2"]),
    (MoeTpExtendEpFeature(), ["--moe-tp-extend-ep", *MOE, "--expert-model-parallel-size", "2",
                           "--tensor-model-parallel-size", "2"]),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm", "--expert-model-parallel-size", "2"]),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm", "--expert-model-parallel-size", "2",
                                "--tensor-model-parallel-size", "2", "--moe-tp-extend-ep"]),
    (MoeFusedPermuteFeature(), ["--use-fused-moe-token-permute-and-unpermute"]),
])
def test_good_layouts_pass(feature, argv):
    _validate(feature, argv)


def test_flags_listed_and_reported(npuspeed_runtime):
    names = {f.name for f in all_features()}
    assert {"moe_grouped_gemm", "moe_fused_permute", "moe_alltoall_overlap", "moe_tp_extend_ep"} <= names
    ctx = ctx_for(["--moe-grouped-gemm", "--use-fused-moe-token-permute-and-unpermute",
                   "--moe-alltoall-overlap-comm", "--moe-alltoall-chunks", "3", "--moe-tp-extend-ep",
                   "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"])
    paths = {f.name: f.path(ctx) for f in all_features() if f.name.startswith("moe_")}
    from npuspeed.features.moe_grouped_gemm import grouped_mlp
    from npuspeed.patching.versions import in_range

    module = "Megatron's GroupedMLP" if in_range(grouped_mlp.MEGATRON_RANGE) else "npuspeed's GroupedSequentialMLP"
    assert paths["moe_grouped_gemm"].startswith(module) and "with torch._grouped_mm" in paths["moe_grouped_gemm"]
    assert "SwiGLU x router prob: cpp" in paths["moe_grouped_gemm"]
    assert paths["moe_fused_permute"].startswith("npuspeed::moe_permute / moe_unpermute (C++")
    assert "3 chunks, async work handles on gloo" in paths["moe_alltoall_overlap"]
    assert "EP x TP = 2 x 2 ranks, expert-TP 1" in paths["moe_tp_extend_ep"]
    off = ctx_for([])
    assert all(f.path(off) == "off" for f in all_features() if f.name.startswith("moe_"))


def _block(**kw):
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.transformer import TransformerConfig
    from megatron.core.transformer.transformer_block import TransformerBlock

    grouped = kw.pop("grouped", False)
    base = dict(num_layers=1, hidden_size=32, num_attention_heads=4, ffn_hidden_size=48,
                use_cpu_initialization=True, add_bias_linear=False)
    base.update(kw)
    spec = get_gpt_layer_local_spec(num_experts=base.get("num_moe_experts"), moe_grouped_gemm=grouped)
    return TransformerBlock(TransformerConfig(**base), spec)


@pytest.mark.parametrize("flags", [["--moe-grouped-gemm"], ["--use-fused-moe-token-permute-and-unpermute"]])
def test_a_model_without_experts_is_an_error_at_build(megatron_mp, with_features, flags):
    with with_features(flags):
        with pytest.raises(FeatureError, match=f"{flags[0]}: the model has no experts"):
            _block()
        _block(num_moe_experts=4, moe_token_dispatcher_type="alltoall", grouped="--moe-grouped-gemm" in flags)


def test_grouped_gemm_flag_with_a_sequential_spec_is_an_error(megatron_mp, with_features):
    with with_features(["--moe-grouped-gemm"]):
        with pytest.raises(FeatureError, match="built with SequentialMLP: build the layer spec with moe_grouped_gemm"):
            _block(num_moe_experts=4)


def test_overlap_flag_with_the_allgather_dispatcher_is_an_error(megatron_mp, with_features):
    with with_features(["--moe-alltoall-overlap-comm"]):
        with pytest.raises(FeatureError, match="needs --moe-token-dispatcher-type alltoall"):
            _block(num_moe_experts=4, moe_token_dispatcher_type="allgather")


def test_example_refuses_bad_moe_layout_before_training():
    cmd = [sys.executable, str(EXAMPLE), "--num-experts", "6", "--disable-bias-linear", "--moe-tp-extend-ep",
           "--tensor-model-parallel-size", "2", "--expert-model-parallel-size", "2"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "npuspeed: error: --moe-tp-extend-ep" in proc.stderr and "does not divide --num-experts 6" in proc.stderr
    assert "iteration" not in proc.stdout


@pytest.mark.parametrize("feature, argv, release", [
    (MoeGroupedGemmFeature(), ["--moe-grouped-gemm"], "0.12.0"),
    (MoeFusedPermuteFeature(), ["--use-fused-moe-token-permute-and-unpermute"], "0.12.0"),
    (MoeAllToAllOverlapFeature(), ["--moe-alltoall-overlap-comm"], "0.15.0"),
])
def test_older_megatron_is_a_start_up_error_not_a_skipped_patch(monkeypatch, feature, argv, release):
    from packaging.version import Version

    import npuspeed.patching.versions as versions

    monkeypatch.setattr(versions, "megatron_version", lambda: Version(release))
    with pytest.raises(FeatureError, match=f"{argv[0]} needs megatron-core >="):
        _validate(feature, argv)
