"""Expert linear biases (Megatron's default, without --disable-bias-linear) in SequentialMLP.

megatron-core 0.15-0.19: each local expert is an `MLP` called with the router probabilities as
`per_token_scale`, and after `linear_fc2` it adds the scaled bias in place
(`output += output_bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)`). Where the expert's
RowParallelLinear goes through `reduce_from_tensor_model_parallel_region` (EP 1 with TP 1, or an
expert-TP group without EP), that output is what `_ReduceFromModelParallelRegion` returned as-is,
which autograd marks as a custom Function's view and refuses to modify in place: the first forward
dies with "Output 0 of _ReduceFromModelParallelRegion is a view and is being modified inplace".
The fix adds the same scaled bias out of place in a hook on `linear_fc2`, only for that view, and
hands Megatron no bias to add again: the values are what the in-place add computes (promoted, then
cast back to the output's dtype, as an in-place add does), and elsewhere Megatron's own add runs.

megatron-core 0.13-0.14: the same call asserts "Bias is not supported with per_token_scale" (and
0.12 passes no probabilities, so it works): building a SequentialMLP with biases there is refused
in one line naming --disable-bias-linear.
"""
from __future__ import annotations

import functools

from npuspeed.errors import UserError

_EXPERTS = "megatron.core.transformer.moe.experts"
_MLP = "megatron.core.transformer.mlp"
#: releases whose MLP.forward adds the expert bias in place (checked against each release's source)
INPLACE_ADD = ">=0.15,<0.20"
#: releases whose MLP.forward asserts there is no bias when SequentialMLP passes probabilities
ASSERTS_NO_BIAS = ">=0.13,<0.15"


class ExpertBiasError(UserError):
    """Expert biases on a release whose SequentialMLP cannot add them."""


def scaled_bias_hook(per_token_scale):
    """A forward hook for `linear_fc2` that returns (output + bias * scale, None) where the output
    is a custom Function's view (Megatron's in-place add would fail); None (output unchanged)
    elsewhere."""

    def hook(_module, _args, result):
        output, bias = result
        if bias is None or not output._is_view():
            return None
        added = output + bias.unsqueeze(0) * per_token_scale.unsqueeze(-1)
        return added.to(output.dtype), None

    return hook


def out_of_place_bias(forward):
    """MLP.forward with the expert bias added out of place where Megatron's in-place add fails."""

    @functools.wraps(forward)
    def wrapped(self, hidden_states, per_token_scale=None, **kwargs):
        fc2 = getattr(self, "linear_fc2", None)
        if per_token_scale is None or getattr(fc2, "bias", None) is None:
            return forward(self, hidden_states, per_token_scale, **kwargs)
        handle = fc2.register_forward_hook(scaled_bias_hook(per_token_scale))
        try:
            return forward(self, hidden_states, per_token_scale, **kwargs)
        finally:
            handle.remove()

    return wrapped


def refuse_expert_bias(init):
    """SequentialMLP.__init__ that refuses expert biases where MLP.forward asserts against them."""

    @functools.wraps(init)
    def __init__(self, num_local_experts, config, *args, **kwargs):
        if getattr(config, "add_bias_linear", False):
            from npuspeed.patching.versions import megatron_version

            raise ExpertBiasError(
                f"megatron-core {megatron_version()}'s SequentialMLP cannot add expert biases (its MLP asserts "
                "'Bias is not supported with per_token_scale'): add --disable-bias-linear, or use "
                "megatron-core 0.15 or newer, where npuspeed adds them")
        init(self, num_local_experts, config, *args, **kwargs)

    return __init__


def register(registry, feature: str) -> None:
    registry.register(f"{_MLP}.MLP.forward", wrapper=out_of_place_bias, feature=feature, megatron=INPLACE_ADD)
    registry.register(f"{_EXPERTS}.SequentialMLP.__init__", wrapper=refuse_expert_bias, feature=feature,
                      megatron=ASSERTS_NO_BIAS)
