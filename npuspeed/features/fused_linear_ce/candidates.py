"""Chunked or Megatron's path, per shape: a candidate list for the one chooser, memory first.

The flag exists to remove the [tokens, V/TP] logits (and their fp32 softmax and gradient)
from the peak: the chunked path holds one tile at a time and an fp32 log-sum-exp per token,
where Megatron keeps all of them. So its chooser (npuspeed.ops.choose) ranks by bytes first
(`Smallest`): the chunked path runs while its head takes at most ALLOWANCE x Megatron's time,
whatever the load (the bytes are known from the shape, and only a slowdown well past the
noise of a trial flips it). The chunked path computes the logits twice (forward, and again in
backward); where that matmul dominates (a large hidden size on CPU it can cost a third of the
head's time) Megatron's path runs, said once. Both run forward + backward once per (device,
dtype, tokens, hidden, V/TP) on local random inputs of at most TRIAL_TOKENS tokens (no
collectives: the same bounded trial on every rank), timed by the chooser's clock (the
process's CPU time on the host), and the times are all-reduced (MAX) over the TP group so all
ranks take the same path. `--fused-linear-cross-entropy-fallback never` (or
NPUSPEED_FLCE_PATH=chunked) skips the trial: always chunked. Under --deterministic-mode
nothing is timed: the bytes decide (chunked). Random states and (on CPU) the memory peak are
put back after the trial (the chooser's guard); the trial's chunks are not counted.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npuspeed import telemetry
from npuspeed.features.fused_linear_ce.function import linear_cross_entropy
from npuspeed.ops.choose.chooser import Chooser
from npuspeed.ops.choose.criteria import Smallest

CHUNKED, MEGATRON = "chunked", "megatron"
TRIAL_TOKENS = 1024
#: memory first: the chunked path runs while its head takes at most this much of Megatron's time
#: (a trial's noise on a loaded host is a few percent; the extra logits matmul of a large hidden
#: size costs up to a third, and there Megatron's path runs)
ALLOWANCE = 1.25
FORCE_ENV = "NPUSPEED_FLCE_PATH"
#: telemetry record of the latest choice (fields: key, path, why, chunked_ms, megatron_ms)
CHOICE = "fused_linear_ce.choice"


def _megatron(hidden, weight, labels):
    """Megatron's output layer + vocab_parallel_cross_entropy on this rank's shard, forward and
    backward, from the library's own building blocks minus the TP all-reduces (which the trial
    must not issue: ranks measure independently)."""
    from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy as ce

    h = hidden.detach().reshape(-1, hidden.shape[-1])
    w = weight.detach()
    target = labels.reshape(-1)
    logits, logits_max = ce.calculate_logits_max(torch.mm(h, w.t()))
    target_mask, masked_target_1d, predicted, sum_exp, exp_logits = ce.calculate_predicted_logits(
        logits, target, logits_max, 0, w.shape[0])
    softmax, loss = ce.calculate_cross_entropy_loss(exp_logits, predicted, sum_exp)
    grad_2d, arange_1d, update, grad_input = ce.prepare_gradient_calculation_operands(softmax, target_mask)
    grad = ce.calculate_gradients(grad_2d, arange_1d, masked_target_1d, update, grad_input,
                                  torch.ones_like(loss)).to(h.dtype)
    torch.mm(grad, w)
    torch.mm(grad.t(), h)
    return loss


def _chunked(chunk):
    def run(hidden, weight, labels):
        h = hidden.detach().clone().requires_grad_(True)
        w = weight.detach().clone().requires_grad_(True)
        loss = linear_cross_entropy(h, w, labels, None, False, chunk)
        loss.backward(torch.ones_like(loss))
        return loss
    return run


def _max_over(group, device):
    """The chooser's `agree` hook: each candidate's time, the MAX over the TP group."""
    def agree(_op, _names, seconds):
        if group is None or not dist.is_initialized() or dist.get_world_size(group) == 1:
            return seconds
        times = torch.tensor(seconds, dtype=torch.float64, device=device)
        dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        return times.cpu().tolist()
    return agree


def held_bytes(tokens: int, vocab_local: int) -> dict[str, int]:
    """What each path holds from the head's forward to its backward: Megatron's fp32 softmax
    (its logits' storage, tokens x V/TP) for the gradient; the chunked path's fp32 log-sum-exp
    and max per token (its tiles are freed one by one inside the forward and the backward)."""
    return {MEGATRON: tokens * vocab_local * 4, CHUNKED: 2 * tokens * 4}


class LossPaths:
    """Per shape key: which path runs, with the trial's timings (npuspeed report shows them)."""

    def __init__(self, fallback: str = "auto", chunk: int | None = None):
        self.fallback, self.chunk = fallback, chunk
        self.chooser = Chooser(repeats=3, adaptive=False, criterion=Smallest(ALLOWANCE), baseline=MEGATRON,
                               force_env=FORCE_ENV, forceable=(CHUNKED, MEGATRON), preference=(CHUNKED,),
                               check=False, name="fused linear cross-entropy")
        self.choices: dict[tuple, dict] = {}

    @staticmethod
    def key(tokens: int, hidden: torch.Tensor, weight: torch.Tensor) -> tuple:
        return (hidden.device.type, str(hidden.dtype).replace("torch.", ""), tokens, hidden.shape[-1], weight.shape[0])

    def choose(self, tokens: int, hidden: torch.Tensor, weight: torch.Tensor, group, acc) -> str:
        """The path for `tokens` (all of the micro-batch's, s x b) of `hidden` through `weight`."""
        key = self.key(tokens, hidden, weight)
        if key not in self.choices:
            record = self._choose(key, hidden, weight, group, acc)
            record["key"] = key
            self.choices[key] = record
            telemetry.record(CHOICE, **record)
        return self.choices[key]["path"]

    def _choose(self, key, hidden, weight, group, acc) -> dict:
        from npuspeed.features.chooser_setup import on_accelerator

        on_accelerator(self.chooser, acc)
        self.chooser.configure(agree=_max_over(group, hidden.device))
        tokens = min(key[2], TRIAL_TOKENS)
        gen = torch.Generator().manual_seed(0)  # its own generator: no random stream of the run moves
        h = torch.randn(tokens, 1, key[3], generator=gen).to(hidden.device, hidden.dtype)
        w = (torch.randn(weight.shape, generator=gen) * 0.02).to(weight.device, weight.dtype)
        labels = torch.randint(0, weight.shape[0], (tokens, 1), generator=gen).to(hidden.device)
        counted = telemetry.snapshot("fused_linear_ce.")
        try:
            choice = self.chooser.pick(
                "fused_linear_ce", key, "x".join(map(str, key[2:])) + f" {key[1]}",
                {MEGATRON: _megatron, CHUNKED: _chunked(self.chunk)}, (h, w, labels), grads=False,
                fixed=CHUNKED if self.fallback == "never" else None,
                fixed_by="--fused-linear-cross-entropy-fallback never",
                nbytes=held_bytes(key[2], key[4]))
        finally:
            for name, n in telemetry.since(counted, "fused_linear_ce.").items():
                telemetry.count(name, -n)  # the trial's chunks are not the run's
        record = {"path": choice.impl, "why": choice.why}
        if choice.ms:
            t_chunked, t_megatron = choice.ms[CHUNKED], choice.ms[MEGATRON]
            record.update(chunked_ms=t_chunked, megatron_ms=t_megatron, why=(
                f"measured once for {key[2]} tokens x hidden {key[3]} x V/TP {key[4]} {key[1]} (trial on {tokens} "
                f"tokens): chunked {t_chunked:.1f} ms, Megatron {t_megatron:.1f} ms fwd+bwd; memory first: "
                f"chunked while within {ALLOWANCE:.2f}x Megatron's time (holds "
                f"{choice.bytes[CHUNKED] / 2**20:.1f} MiB, Megatron's {choice.bytes[MEGATRON] / 2**20:.1f} MiB)"))
        return record
