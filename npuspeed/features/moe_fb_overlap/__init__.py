"""MoE all-to-all hidden behind another micro-batch's compute (`--moe-fb-overlap`, and
Megatron's `--overlap-moe-expert-parallel-comm`): the feature and its flags
(moe_fb_overlap_feature.py), its patches (patches.py), its plan effect (plan.py), the paired
schedules (schedule.py at PP 1, interleaved.py at PP > 1), the
asynchronous dispatcher all-to-alls (exchange.py), the combine with the shared experts inside
(combine.py, masking.py), the routed experts' weight gradient run inside the dispatch
gradient's all-to-all (wgrad.py) and Megatron's flag taken over (takeover.py).
What DualPipeV shares with it is in the shared room `features/pipeline/`: the two parties
taking turns (turns.py), the paired-or-serial step trial (pair_choice.py), the pairing scope,
the chunk runners and the bubble measure."""
from npuspeed.features.moe_fb_overlap.moe_fb_overlap_feature import MoeFbOverlapFeature

__all__ = ["MoeFbOverlapFeature"]
