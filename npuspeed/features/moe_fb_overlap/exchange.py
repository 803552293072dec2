"""The token dispatcher's all-to-alls, launched asynchronously with the turn passed while they
are in flight.

`all_to_all` replaces the one in Megatron's token_dispatcher module (megatron.core.tensor_parallel
.all_to_all's contract; the reverse exchange in backward): every exchange on 0.12, which has no
separate dispatch and combine steps. From 0.13 `token_combine` runs in two steps with the layer's
held-back shared experts between them (combine.py), and `token_dispatch` sends the tokens and
their routing probabilities together as one autograd step, both launched before the turn passes
once and both waited after, and in backward their gradients the same way. Sent one after the other
with a wait each, the small probabilities' exchange would pay alone for whatever the ranks drifted
apart while the other micro-batch computed; sent with the tokens, the other micro-batch's compute
hides it too.

Each transfer uses `async_op=True`; the turn goes to the other micro-batch (pipeline/turns.py) before the
wait, so its compute runs while the rows are on the wire. With no pair (a lone forward or
backward, a serial step) it waits at once, as Megatron's does. Every transfer is on the clock
(moe_common/a2a_clock.py).
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npuspeed import telemetry
from npuspeed.features.moe_common import a2a_clock
from npuspeed.features.moe_fb_overlap import wgrad
from npuspeed.features.pipeline import turns


def split_sizes(sizes):
    return None if sizes is None else [int(s) for s in sizes]


def launch(x: torch.Tensor, group, out_splits, in_splits):
    x = x.contiguous()
    out = torch.empty_like(x) if out_splits is None else x.new_empty((sum(out_splits), *x.shape[1:]))
    work = dist.all_to_all_single(out, x, output_split_sizes=out_splits, input_split_sizes=in_splits,
                                  group=group, async_op=True)
    return out, work, a2a_clock.launch(work)


def hand_over(label: str, transfers: int = 1) -> None:
    """Pass the turn (if a pair is taking turns) while `transfers` launched all-to-alls travel."""
    pair = turns.current()
    passed = pair is not None and pair.pass_turn()
    telemetry.count(f"moe.fb_overlap.a2a.{label}.{'overlapped' if passed else 'alone'}", transfers)


def settle(launched, label: str) -> None:
    """Pass the turn once for every transfer in `launched`, then wait for each."""
    hand_over(label, len(launched))
    for _out, work, flight in launched:
        flight.wait(work)


def exchange(tensors, group, out_splits, in_splits, label: str, between=None) -> list:
    """all_to_all_single of each tensor (None passes through), launched together, settled
    together; `between()` runs after the launch, before the turn passes."""
    launched = [None if t is None else launch(t, group, out_splits, in_splits) for t in tensors]
    if between is not None:
        between()
    settle([item for item in launched if item is not None], label)
    return [None if item is None else item[0] for item in launched]


class _Exchange(torch.autograd.Function):
    @staticmethod
    def forward(ctx, group, out_splits, in_splits, *tensors):
        ctx.group, ctx.out_splits, ctx.in_splits = group, out_splits, in_splits
        return tuple(exchange(tensors, group, out_splits, in_splits, "forward"))

    @staticmethod
    def backward(ctx, *grads):
        # the experts' owed weight gradients (wgrad.py) compute while the token gradients travel
        return (None, None, None, *exchange(grads, ctx.group, ctx.in_splits, ctx.out_splits, "backward",
                                            between=wgrad.run_owed))


def all_to_all(group, input_, output_split_sizes_=None, input_split_sizes=None, **_kwargs):
    """megatron.core.tensor_parallel.all_to_all's contract (0.19's use_nccl_stream is moot:
    every transfer is asynchronous here)."""
    if group.size() == 1:
        return input_
    (out,) = _Exchange.apply(group, split_sizes(output_split_sizes_), split_sizes(input_split_sizes), input_)
    return out


def token_dispatch_wrapper(original):
    """MoEAlltoAllTokenDispatcher.token_dispatch: the tokens and probabilities in one step
    (upstream's path where a shared-expert overlap hooks into it: refused with the flag)."""

    def token_dispatch(self, permutated_local_input_tokens, permuted_probs):
        if getattr(self, "shared_experts", None) is not None or self.ep_size == 1:
            return original(self, permutated_local_input_tokens, permuted_probs)
        self.tokens_per_expert = self._maybe_dtoh_and_synchronize("before_ep_alltoall", self.tokens_per_expert)
        out = _Exchange.apply(self.ep_group, split_sizes(self.output_splits), split_sizes(self.input_splits),
                              permutated_local_input_tokens, permuted_probs)
        wgrad.arm()  # the experts between here and the combine owe their dW to this exchange's backward
        return out

    return token_dispatch

