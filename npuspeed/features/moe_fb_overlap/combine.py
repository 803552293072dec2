"""The combine's all-to-all in two autograd steps, the layer's held-back shared experts between.

`_CombineStart` launches (its backward waits for the gradient's transfer), `_CombineFinish`
passes the turn and waits (its backward launches the gradient's transfer and passes the turn).
The shared experts' forward (masking.py) runs between the two, so it computes while the
combine's tokens travel; being made there, autograd (latest-made first) runs their backward
between the gradient's launch and its wait. That is the warm-up's and cool-down's own masking.
"""
from __future__ import annotations

import torch

from npuspeed.features.moe_fb_overlap import masking, wgrad
from npuspeed.features.moe_fb_overlap.exchange import hand_over, launch, settle, split_sizes


class _CombineStart(torch.autograd.Function):
    """The combine's launch; its backward waits for the gradient's transfer that
    _CombineFinish.backward launched (autograd runs the shared experts' backward in between)."""

    @staticmethod
    def forward(ctx, x, group, out_splits, in_splits, held):
        ctx.held = held
        held["group"], held["splits"] = group, (out_splits, in_splits)
        out, work, flight = launch(x, group, out_splits, in_splits)
        held["forward"] = (out, work, flight)
        return out

    @staticmethod
    def backward(ctx, _token):
        out, work, flight = ctx.held.pop("backward")
        flight.wait(work)
        return out, None, None, None, None


class _CombineFinish(torch.autograd.Function):
    @staticmethod
    def forward(ctx, y, held):
        ctx.held = held
        settle([held.pop("forward")], "forward")
        return y.view_as(y)

    @staticmethod
    def backward(ctx, grad):
        held = ctx.held
        out_splits, in_splits = held["splits"]
        launched = launch(grad, held["group"], in_splits, out_splits)
        held["backward"] = launched
        hand_over("backward")
        return grad, None


def token_combine_wrapper(original):
    """MoEAlltoAllTokenDispatcher.token_combine in two steps with the layer's held-back shared
    experts (masking.py) computed between them."""

    def token_combine(self, hidden_states, *args, **kwargs):
        if getattr(self, "shared_experts", None) is not None or self.ep_size == 1:
            return original(self, hidden_states, *args, **kwargs)
        wgrad.disarm()
        held: dict = {}
        out = _CombineStart.apply(hidden_states, self.ep_group, split_sizes(self.input_splits),
                                  split_sizes(self.output_splits), held)
        masking.run_pending()
        return _CombineFinish.apply(out, held)

    return token_combine
