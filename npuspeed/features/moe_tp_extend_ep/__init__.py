"""Experts over the tensor-parallel ranks too (`--moe-tp-extend-ep`): the feature and its flag
(moe_tp_extend_ep_feature.py), its patches (patches.py), its plan effect (plan.py), the expert
layout the patches set (tp_extend_ep.py). The layout checks shared by the MoE features:
npuspeed/features/moe_common/."""
from npuspeed.features.moe_tp_extend_ep.moe_tp_extend_ep_feature import MoeTpExtendEpFeature

__all__ = ["MoeTpExtendEpFeature"]
