"""--moe-tp-extend-ep: the tensor-parallel ranks serve as extra expert-parallel ranks.

With TP t and EP e, experts are spread over t x e ranks and their weights are not split by
TP (expert-TP 1), as MindSpeed's flag does. megatron.core 0.16 can already lay experts out
independently of the dense layers ("parallel folding"); this flag asks for that layout:
`initialize_model_parallel` gets expert-parallel size e*t and expert-tensor-parallel size 1,
and every TransformerConfig built afterwards takes the expert sizes of the groups, so the
MoE layers, the dispatcher, the distributed optimizer and the checkpoints all see one layout.
"""
from __future__ import annotations

import functools
import inspect

from npuspeed import telemetry
from npuspeed.patching.wrappers import bound_call

PARALLEL_STATE = "megatron.core.parallel_state"
CONFIG = "megatron.core.transformer.transformer_config.TransformerConfig"


class LayoutError(ValueError):
    """The expert layout asked for cannot be built (raised from Megatron's initialisation)."""


def init_wrapper(original):
    signature = inspect.signature(original)

    @functools.wraps(original)
    def initialize_model_parallel(*args, **kwargs):
        bound = bound_call(signature, args, kwargs)
        a = bound.arguments
        tp, ep = a.get("tensor_model_parallel_size") or 1, a.get("expert_model_parallel_size") or 1
        etp = a.get("expert_tensor_parallel_size")
        if etp not in (None, 1):
            raise LayoutError(f"--moe-tp-extend-ep puts whole experts on each rank, but "
                              f"expert_tensor_parallel_size is {etp}: drop one of the two")
        a["expert_model_parallel_size"], a["expert_tensor_parallel_size"] = ep * tp, 1
        telemetry.count("moe.tp_extend_ep.layouts")
        telemetry.record("moe.tp_extend_ep.layouts", tensor=tp, expert=ep, extended_expert=ep * tp)
        return original(*bound.args, **bound.kwargs)

    return initialize_model_parallel


def config_wrapper(post_init):
    @functools.wraps(post_init)
    def __post_init__(self):
        from megatron.core import parallel_state

        if getattr(self, "num_moe_experts", None) and parallel_state.model_parallel_is_initialized():
            self.expert_model_parallel_size = parallel_state.get_expert_model_parallel_world_size()
            self.expert_tensor_parallel_size = parallel_state.get_expert_tensor_parallel_world_size()
        post_init(self)

    return __post_init__


def early_config_wrapper(post_init):
    """0.17+: Megatron-LM core_v0.19's pretrain_gpt builds the TransformerConfig before
    initialize_model_parallel, so the groups cannot be read yet: the config then takes the
    layout the flag asks for from its own sizes (experts over EP x TP, expert-TP 1), once (a
    config already extended has expert-TP 1 and is left alone). After the groups exist, as
    before: the groups' sizes."""
    after_init = config_wrapper(post_init)

    @functools.wraps(post_init)
    def __post_init__(self):
        from megatron.core import parallel_state

        tp = self.tensor_model_parallel_size or 1
        if (getattr(self, "num_moe_experts", None) and not parallel_state.model_parallel_is_initialized()
                and tp > 1 and self.expert_tensor_parallel_size in (None, tp)):
            self.expert_model_parallel_size = (self.expert_model_parallel_size or 1) * tp
            self.expert_tensor_parallel_size = 1
            telemetry.count("moe.tp_extend_ep.early_configs")
        after_init(self)

    return __post_init__
