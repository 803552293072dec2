"""Megatron's --overlap-moe-expert-parallel-comm (0.14+) with npuspeed: the TransformerConfig is
built without Megatron's combined-1F1B checks (fp32 is fine) and keeps the field off, so the
schedules take their plain loop, which --moe-fb-overlap's schedule pairs; said once in the log."""
from __future__ import annotations

import pytest

from npuspeed.features.moe_fb_overlap import takeover
from npuspeed.patching.versions import in_range

pytestmark = pytest.mark.skipif(not in_range(takeover.RANGE), reason="Megatron's flag exists from 0.14")


def _config(**extra):
    from megatron.core.transformer.transformer_config import TransformerConfig

    return TransformerConfig(num_layers=2, hidden_size=64, num_attention_heads=4, num_moe_experts=4,
                             expert_model_parallel_size=2, moe_token_dispatcher_type="alltoall",
                             overlap_moe_expert_parallel_comm=True, **extra)


def test_megatron_refuses_its_flag_in_fp32_without_npuspeed():
    with pytest.raises(AssertionError, match="overlap_moe_expert_parallel_comm"):
        _config()


def test_npuspeed_takes_the_flag_over(monkeypatch):
    from megatron.core.transformer.transformer_config import TransformerConfig

    notes = []
    wrapped = takeover.config_wrapper(notes.append)(TransformerConfig.__post_init__)
    monkeypatch.setattr(TransformerConfig, "__post_init__", wrapped)
    config = _config()
    assert config.overlap_moe_expert_parallel_comm is False
    assert len(notes) == 1 and "npuspeed's forward/backward overlap runs it" in notes[0]
