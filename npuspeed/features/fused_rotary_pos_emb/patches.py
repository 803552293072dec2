"""--use-fused-rotary-pos-emb's patches: Megatron's `_apply_rotary_pos_emb_bshd` runs the fused op
(rope.py), and three wrappers pair an attention's q and k calls for one launch (rope_qk.py, on the
releases its calls are checked against); the fused-op chooser is first pointed at the run's
accelerator."""
from __future__ import annotations


def register(registry, ctx, config, feature: str) -> None:
    from npuspeed.features.chooser_setup import configure
    from npuspeed.features.fused_rotary_pos_emb import rope, rope_qk

    configure(ctx)
    registry.register(rope.TARGET, wrapper=rope.fused_bshd, feature=feature)
    kw = dict(feature=feature, megatron=rope_qk.MEGATRON_RANGE)
    registry.register(rope_qk.FORWARD, wrapper=rope_qk.forward_wrapper, **kw)
    registry.register(rope_qk.QKV, wrapper=rope_qk.qkv_wrapper, **kw)
    registry.register(rope_qk.APPLY, wrapper=rope_qk.apply_wrapper, **kw)
