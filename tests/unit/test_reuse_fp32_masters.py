"""--reuse-fp32-param inside one optimizer: storage really freed at rest, masters exact."""
from __future__ import annotations

import pytest
import torch

from npuspeed.features.base import FeatureError
from npuspeed.features.reuse_fp32_param.shared_masters import SharedMasters


def test_masters_are_freed_at_rest_and_rebuilt_exactly():
    main = torch.randn(1000) * 3
    main[7] = float("nan")
    model = main.to(torch.bfloat16)
    exact = main.clone()
    shared = SharedMasters([(model, main)])
    shared.release()
    assert main.untyped_storage().nbytes() == 0  # the fp32 copy is gone
    assert shared.segments[0].residual.numel() == 1000
    shared.materialize()
    assert torch.equal(main.view(torch.int32), exact.view(torch.int32))
    assert shared.segments[0].residual is None  # during the step: master, no residual
    # A step: new masters; Megatron copies them into the bf16 params before release.
    main.add_(0.125)
    model.copy_(main)
    after = main.clone()
    shared.release()
    shared.materialize()
    assert torch.equal(main.view(torch.int32), after.view(torch.int32))
    assert shared.counts == {"materialize": 2, "release": 2}


def test_flag_rejects_fp16_and_fp32(with_features, monkeypatch):
    from npuspeed.features.reuse_fp32_param import ReuseFp32ParamFeature

    from feature_ctx import ctx_for

    monkeypatch.setattr("sys.argv", ["train.py"])  # the context's argv counts, not sys.argv
    feature = ReuseFp32ParamFeature()
    with pytest.raises(FeatureError, match="--reuse-fp32-param works with --bf16 only"):
        feature.validate(ctx_for(["--fp16", "--reuse-fp32-param"], None))
    feature.validate(ctx_for(["--bf16", "--reuse-fp32-param"], None))
    with with_features(["--reuse-fp32-param"]):
        from megatron.core.optimizer.optimizer import FP32Optimizer

        with pytest.raises(FeatureError, match="add --bf16 or drop --reuse-fp32-param"):
            FP32Optimizer(None, None, None)


def test_params_back_to_back_in_one_buffer_share_one_codec_call():
    """Masters of bf16 params that lie back to back in one buffer (DDP's param buffer with the
    distributed optimizer) move into one flat fp32 tensor: one split / merge per segment, a
    segment never larger than the largest param; a param with its own storage stays alone."""
    from npuspeed import telemetry
    from npuspeed.features.reuse_fp32_param import codec

    torch.manual_seed(0)
    sizes = [30, 20, 40, 100]
    buffer = torch.empty(sum(sizes), dtype=torch.bfloat16)
    models = list(torch.split(buffer, sizes)) + [torch.empty(7, dtype=torch.bfloat16)]
    mains = [torch.randn(m.numel()) for m in models]
    for model, main in zip(models, mains):
        model.copy_(main)
    exact = [m.clone() for m in mains]
    telemetry.reset(codec.COUNTER)
    shared = SharedMasters(list(zip(models, mains)))
    segments = sorted(len(s.mains) for s in shared.segments)
    assert segments == [1, 1, 3]  # 30+20+40 <= 100; the 100 alone; the separate 7 alone
    flat = {m.untyped_storage().data_ptr() for m in mains[:3]}
    assert len(flat) == 1  # the three masters now share one storage
    for _ in range(2):
        shared.release()
        freed = all(m.untyped_storage().nbytes() == 0 for m in mains)
        assert freed
        shared.materialize()
        for got, want in zip(mains, exact):
            assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    calls = telemetry.get(codec.COUNTER + "split.cpp") + telemetry.get(codec.COUNTER + "split.reference")
    assert calls == 2 * 3
