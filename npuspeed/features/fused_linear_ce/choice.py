"""Chunked or Megatron's path, per shape: measured once, the same answer on every TP rank.

The chunked path computes the logits twice (forward, and again in backward) where Megatron
computes them once and keeps them. Where the logits matmul is cheap next to the memory
traffic of [tokens, V] fp32 tensors (a small hidden size) the tiles win on CPU (about 1.1x to
1.3x at hidden 64, README); where the matmul dominates (a large hidden size on CPU) the extra
matmul can cost up to a third of the head's time. So, as fused attention does for its
fallback, both run forward + backward once per (device, dtype, tokens, hidden, V/TP) on local
random inputs of at most TRIAL_TOKENS tokens (no collectives: the same bounded trial on every
rank), the times are all-reduced (MAX) over the TP group so all ranks take the same path, and
the chunked path is kept while it runs at least 0.95x Megatron's speed (TOLERANCE).
`--fused-linear-cross-entropy-fallback never` skips the trial: always chunked, memory first.
Off CPU the trial's Megatron run (at most TRIAL_TOKENS x V/TP logits) shows in the device's
peak-memory statistics. Random states and (on CPU) the memory peak are put back after the trial.
"""
from __future__ import annotations

import time

import torch
import torch.distributed as dist

from npuspeed import telemetry
from npuspeed.features.fused_linear_ce.function import linear_cross_entropy

CHUNKED, MEGATRON = "chunked", "megatron"
TRIAL_TOKENS = 1024
#: the chunked path is kept while at least 0.95x Megatron's speed (the issue's acceptance bound)
TOLERANCE = 1 / 0.95
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


def _trial(run, hidden, weight, labels, acc) -> float:
    """Seconds of one forward + backward. On CPU the process's CPU time: the host's other load
    (a shared machine) then does not decide the path; elsewhere wall time between syncs."""
    clock = time.process_time if acc.name == "cpu" else time.perf_counter
    acc.synchronize()
    start = clock()
    run(hidden, weight, labels)
    acc.synchronize()
    return clock() - start


class PathChooser:
    """Per shape key: which path runs, with the trial's timings (npuspeed report shows them)."""

    def __init__(self, fallback: str = "auto", chunk: int | None = None):
        self.fallback, self.chunk = fallback, chunk
        self.choices: dict[tuple, dict] = {}

    @staticmethod
    def key(tokens: int, hidden: torch.Tensor, weight: torch.Tensor) -> tuple:
        return (hidden.device.type, str(hidden.dtype).replace("torch.", ""), tokens, hidden.shape[-1], weight.shape[0])

    def choose(self, tokens: int, hidden: torch.Tensor, weight: torch.Tensor, group, acc) -> str:
        """The path for `tokens` (all of the micro-batch's, s x b) of `hidden` through `weight`."""
        key = self.key(tokens, hidden, weight)
        if key not in self.choices:
            if self.fallback == "never":
                record = {"path": CHUNKED, "why": "--fused-linear-cross-entropy-fallback never"}
            elif torch.are_deterministic_algorithms_enabled():
                # the two paths round differently and a timing differs run to run (and rank
                # to rank): the flag's own tiles, every run
                record = {"path": CHUNKED, "why": "--deterministic-mode: not measured, the tiles run"}
            else:
                record = self._measure(key, hidden, weight, group, acc)
            record["key"] = key
            self.choices[key] = record
            telemetry.record(CHOICE, **record)
        return self.choices[key]["path"]

    def _measure(self, key, hidden, weight, group, acc) -> dict:
        from npuspeed.ops import memory_tracker

        tokens = min(key[2], TRIAL_TOKENS)
        tp = 1 if group is None or not dist.is_initialized() else dist.get_world_size(group)
        host_state = torch.get_rng_state()
        device_state = acc.get_rng_state().clone()
        peak, peak_reserved = acc.max_memory_allocated(), acc.max_memory_reserved()
        counted = telemetry.snapshot("fused_linear_ce.")
        try:
            gen = torch.Generator().manual_seed(0)
            h = torch.randn(tokens, 1, key[3], generator=gen).to(hidden.device, hidden.dtype)
            w = (torch.randn(weight.shape, generator=gen) * 0.02).to(weight.device, weight.dtype)
            labels = torch.randint(0, weight.shape[0], (tokens, 1), generator=gen).to(hidden.device)
            chunked = _chunked(self.chunk)
            best = {CHUNKED: float("inf"), MEGATRON: float("inf")}
            with torch.enable_grad():
                for _ in range(3):  # interleaved, the fastest of three runs each
                    for name, run in ((MEGATRON, _megatron), (CHUNKED, chunked)):
                        best[name] = min(best[name], _trial(run, h, w, labels, acc))
        finally:
            torch.set_rng_state(host_state)
            acc.set_rng_state(device_state)
            memory_tracker.restore_peak(peak, peak_reserved)
            for name, n in telemetry.since(counted, "fused_linear_ce.").items():
                telemetry.count(name, -n)  # the trial's chunks are not the run's
        times = torch.tensor([best[CHUNKED], best[MEGATRON]], dtype=torch.float64)
        if tp > 1:
            times = times.to(hidden.device)
            dist.all_reduce(times, op=dist.ReduceOp.MAX, group=group)
        t_chunked, t_megatron = (float(x) for x in times.cpu())
        path = CHUNKED if t_chunked <= TOLERANCE * t_megatron else MEGATRON
        why = (f"measured once for {key[2]} tokens x hidden {key[3]} x V/TP {key[4]} {key[1]} (trial on "
               f"{tokens} tokens): chunked {t_chunked * 1e3:.1f} ms, Megatron {t_megatron * 1e3:.1f} ms fwd+bwd")
        return {"path": path, "why": why, "chunked_ms": t_chunked * 1e3, "megatron_ms": t_megatron * 1e3}
