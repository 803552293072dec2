"""The call that no fused kernel takes: SDPA or Megatron's own unfused forward, measured.

What is left for it on CPU: masks that are not one key interval per row (or vary by head),
dtypes the kernels do not take (fp16), bf16 where npuspeed's bf16 kernel is absent. There
SDPA may be worse than Megatron's unfused path (with dropout or a mask it runs its math
backend, which keeps more S x S tensors), so once per shape both run forward + backward on
copies of the inputs; SDPA is kept only when it is neither slower nor larger. The random
states (device generator and the model-parallel tracker) are put back after the trial, and
so are the memory peaks, so the run itself is not disturbed. On other devices SDPA's fused
kernels take masks and dropout, and it runs without a trial.
`--flash-attn-fallback {sdpa,unfused}` fixes the choice (e.g. for bitwise-repeatable runs
on arbitrary masks, where two trials could decide differently); under --deterministic-mode the
trial's memory alone decides (no timing), so every run takes the same kernel.
"""
from __future__ import annotations

import time

import torch

SDPA, UNFUSED = "sdpa", "megatron_unfused"


def _trial(run, inputs, acc) -> tuple[float, int]:
    """(seconds, peak bytes above the start) of forward + backward of `run` on fresh leaves."""
    leaves = [t.detach().clone().requires_grad_(True) for t in inputs]
    base = acc.memory_allocated()
    acc.reset_peak_memory_stats()
    start = time.perf_counter()
    out = run(*leaves)
    out.backward(torch.ones_like(out))
    seconds = time.perf_counter() - start
    return seconds, acc.max_memory_allocated() - base


class FallbackChooser:
    """Per shape key: which of SDPA / Megatron's unfused forward runs, and the measurements."""

    def __init__(self, fixed: str | None = None):
        self.fixed = fixed  # "sdpa" | "unfused" | None (measure)
        self.choices: dict[tuple, dict] = {}

    def choose(self, key: tuple, sdpa, unfused, inputs, acc) -> dict:
        if key in self.choices:
            return self.choices[key]
        if self.fixed:
            record = {"kernel": SDPA if self.fixed == "sdpa" else UNFUSED, "why": "--flash-attn-fallback"}
        elif acc.name != "cpu":
            record = {"kernel": SDPA, "why": f"SDPA's fused kernels take masks and dropout on {acc.name}"}
        else:
            record = self._measure(sdpa, unfused, inputs, acc)
        self.choices[key] = record
        return record

    def _measure(self, sdpa, unfused, inputs, acc) -> dict:
        from megatron.core import parallel_state, tensor_parallel

        from npuspeed.ops import memory_tracker

        # Megatron's unfused forward keeps its S x S score buffer in the global memory buffer;
        # if SDPA wins, the trial must not leave that buffer behind.
        buffers = parallel_state.get_global_memory_buffer().buffer
        kept_buffers = dict(buffers)
        tracker = tensor_parallel.get_cuda_rng_tracker()
        states = {name: state.clone() for name, state in tracker.get_states().items()}
        device_state = acc.get_rng_state().clone()
        host_state = torch.get_rng_state()
        peak, peak_reserved = acc.max_memory_allocated(), acc.max_memory_reserved()
        best = {SDPA: (float("inf"), 0), UNFUSED: (float("inf"), 0)}
        try:
            with torch.enable_grad():
                for _ in range(2):  # interleaved; the faster of two runs each
                    for name, run in ((UNFUSED, unfused), (SDPA, sdpa)):
                        seconds, nbytes = _trial(run, inputs, acc)
                        best[name] = (min(best[name][0], seconds), max(best[name][1], nbytes))
        finally:
            tracker.set_states(states)
            acc.set_rng_state(device_state)
            torch.set_rng_state(host_state)
            memory_tracker.restore_peak(peak, peak_reserved)
        (t_sdpa, m_sdpa), (t_unf, m_unf) = best[SDPA], best[UNFUSED]
        # under --deterministic-mode a timing (different in every run) may not decide between two
        # kernels that round differently: the trial's memory alone does, the same in every run
        deterministic = torch.are_deterministic_algorithms_enabled()
        take_sdpa = (deterministic or t_sdpa <= t_unf) and m_sdpa <= m_unf
        if take_sdpa:
            buffers.clear()
            buffers.update(kept_buffers)
        why = (f"measured once for this shape: SDPA {t_sdpa * 1e3:.1f} ms / {m_sdpa / 2**20:.1f} MiB, "
               f"unfused {t_unf * 1e3:.1f} ms / {m_unf / 2**20:.1f} MiB fwd+bwd"
               + ("; --deterministic-mode: chosen by memory alone" if deterministic else ""))
        return {"kernel": SDPA if take_sdpa else UNFUSED, "why": why,
                "sdpa_ms": t_sdpa * 1e3, "sdpa_bytes": m_sdpa, "unfused_ms": t_unf * 1e3, "unfused_bytes": m_unf}
