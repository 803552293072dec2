"""The token dispatcher's all-to-all, launched asynchronously with the turn passed while it is
in flight.

Replaces `all_to_all` in Megatron's token_dispatcher module (same contract as
megatron.core.tensor_parallel.all_to_all: group, input, output splits, input splits; the reverse
exchange in backward). Each transfer is launched with `async_op=True`; for token rows (2-D: the
hidden states and their gradients, not the 1-D routing probabilities that follow them) the turn
goes to the other micro-batch (turns.py) before the wait, so its compute runs while the rows are
on the wire. With no pair (a lone forward or backward, or another schedule) it waits at once, as
Megatron's does. Every transfer is on the clock (moe_common/a2a_clock.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npuspeed import telemetry
from npuspeed.features.moe_common import a2a_clock
from npuspeed.features.moe_fb_overlap import turns


def _splits(sizes):
    return None if sizes is None else [int(s) for s in sizes]


def exchange(x: torch.Tensor, group, out_splits, in_splits, label: str) -> torch.Tensor:
    x = x.contiguous()
    if out_splits is None:
        out = torch.empty_like(x)
    else:
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)
    flight = a2a_clock.launch(work)
    pair = turns.current()
    if pair is not None and x.dim() > 1 and pair.pass_turn():
        telemetry.count(f"moe.fb_overlap.a2a.{label}.overlapped")
    else:
        telemetry.count(f"moe.fb_overlap.a2a.{label}.alone")
    flight.wait(work)
    return out


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, x, out_splits, in_splits):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return exchange(x, group, out_splits, in_splits, "forward")

    @staticmethod
    def backward(ctx, grad):
        return None, exchange(grad, ctx.group, ctx.in_splits, ctx.out_splits, "backward"), None, None


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, **_kwargs):
    """megatron.core.tensor_parallel.all_to_all's contract (0.19's use_nccl_stream is moot:
    every transfer is asynchronous here)."""
    if group.size() == 1:
        return input_
    return _Exchange.apply(group, input_, _splits(output_split_sizes_), _splits(input_split_sizes))
