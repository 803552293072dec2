"""What a path chooser's trials must leave as they found it, on the run's accelerator (shared
by every feature that chooses a path per shape: the fused ops, MoE's kernels, fused attention's
fallback, gradient-accumulation fusion, fused linear cross-entropy).

npuspeed.ops.fused_choice times each candidate on copies of a call's inputs inside the real
forward. The ops layer knows nothing of the accelerator or Megatron, so the features hand it
this guard: the device and host random states and Megatron's model-parallel RNG tracker are
put back after the trials (as fused attention's fallback trial does), and the memory peaks on
CPU (npuspeed's tracker); a GPU's or NPU's caching allocator has no way to set its peak back
(a reset would drop the run's earlier, higher peak), so there the trials may raise it,
`synchronize` so device timings are real, and the TP agreement for ops whose kernel every TP
rank must share.
"""
from __future__ import annotations

import contextlib

import torch


class AcceleratorGuard:
    def __init__(self, accelerator):
        self.acc = accelerator

    @contextlib.contextmanager
    def __call__(self):
        acc = self.acc
        tracker_states = None
        try:
            from megatron.core import tensor_parallel

            tracker = tensor_parallel.get_cuda_rng_tracker()
            tracker_states = {name: state.clone() for name, state in tracker.get_states().items()}
        except Exception:  # noqa: BLE001 - no Megatron (bare op use): nothing to put back
            tracker = None
        device_state = acc.get_rng_state().clone()
        host_state = torch.get_rng_state()
        peak, peak_reserved = acc.max_memory_allocated(), acc.max_memory_reserved()
        try:
            yield
        finally:
            if tracker is not None:
                tracker.set_states(tracker_states)
            acc.set_rng_state(device_state)
            torch.set_rng_state(host_state)
            if acc.host_is_device():  # device allocators cannot set a peak back (see the module doc)
                from npuspeed.ops import memory_tracker

                memory_tracker.restore_peak(peak, peak_reserved)

    def meter(self):
        """A trial's peak bytes, where the peak can be put back afterwards (the host's tracker;
        zeros while it is off); None on a device (its allocator's peak cannot be set back)."""
        if not self.acc.host_is_device():
            return None
        acc = self.acc

        def start() -> int:
            acc.reset_peak_memory_stats()
            return acc.memory_allocated()

        return start, lambda base: acc.max_memory_allocated() - base


#: ops every TP rank must run with the same kernel: RMSNorm's weight is replicated on the TP ranks
#: and, without sequence parallelism, its gradient is not reduced over TP (Megatron relies on
#: every rank computing the same bits); two kernels would let the copies drift apart. Their
#: calls have the same shapes, in the same order, on every rank of a TP group.
TP_AGREED = ("rms_norm",)


class TensorParallelAgreement:
    """The chooser's `agree` hook: for TP_AGREED ops the MAX of each candidate's time over the
    tensor-parallel group, so every TP rank takes the same implementation."""

    def __init__(self, accelerator):
        self.acc = accelerator

    def __call__(self, op: str, names: list, seconds: list) -> list:
        group = _tp_group() if op in TP_AGREED else None
        if group is None:
            return seconds
        import torch.distributed as dist

        t = torch.tensor(seconds, dtype=torch.float64, device=self.acc.device())
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        return t.tolist()


def _tp_group():
    """Megatron's tensor-parallel group when it has more than one rank, else None."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        return None
    try:
        from megatron.core import parallel_state

        if not parallel_state.model_parallel_is_initialized():
            return None
        group = parallel_state.get_tensor_model_parallel_group()
    except Exception:  # noqa: BLE001 - no Megatron model-parallel state: nothing to agree with
        return None
    return group if group is not None and dist.get_world_size(group) > 1 else None


def configure(ctx) -> None:
    """Point the process's fused-op chooser at this run's accelerator and note sink (idempotent)."""
    from npuspeed.ops import fused_choice

    fused_choice.CHOOSER.configure(notify=ctx.note, agree=TensorParallelAgreement(ctx.accelerator))
    on_accelerator(fused_choice.CHOOSER, ctx.accelerator)


def on_accelerator(chooser, acc) -> None:
    """Point a chooser at the run's accelerator: its synchronize, its events for device timing
    (not on the host, where the process's CPU time is the clock) and the guard above."""
    chooser.configure(sync=acc.synchronize, guard=AcceleratorGuard(acc),
                      events=None if acc.host_is_device() else acc.Event)


def choice_lines(op: str) -> str:
    """"; op [shape]: impl (why)" for each measured choice of `op` so far ("" if none)."""
    from npuspeed.ops import fused_choice

    made = [c.line() for c in fused_choice.choices() if c.op == op]
    return "; " + "; ".join(made) if made else ""
