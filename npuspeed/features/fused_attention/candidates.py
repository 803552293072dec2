"""The call that no fused kernel takes: SDPA or Megatron's own unfused forward, one candidate list.

What is left for it on CPU: masks that are not one key interval per row (or vary by head),
dtypes the kernels do not take (fp16), bf16 where npuspeed's bf16 kernel is absent. There
SDPA may be worse than Megatron's unfused path (with dropout or a mask it runs its math
backend, which keeps more S x S tensors), so once per shape npuspeed's one chooser
(npuspeed.ops.choose) runs both forward + backward on copies of the inputs: the fastest
that holds no more bytes than Megatron's unfused forward runs (ties go to Megatron's). The
chooser's guard puts back the random states (device generator, the model-parallel tracker,
host) and the memory peaks, so the run itself is not disturbed. On a device SDPA's fused
kernels take masks and dropout, and it runs without a trial (the only candidate there).
`--flash-attn-fallback {sdpa,unfused}` (or NPUSPEED_ATTN_FALLBACK_PATH) fixes the choice
(e.g. for bitwise-repeatable runs on arbitrary masks, where two trials could decide
differently); under --deterministic-mode the trial's bytes alone decide (no timing), so every
run takes the same kernel.
"""
from __future__ import annotations

from npuspeed.ops.choose.chooser import Chooser
from npuspeed.ops.choose.criteria import Fastest

SDPA, UNFUSED = "sdpa", "megatron_unfused"
FORCE_ENV = "NPUSPEED_ATTN_FALLBACK_PATH"
FIXED = {"sdpa": SDPA, "unfused": UNFUSED}


class AttentionFallback:
    """Per shape key: which of SDPA / Megatron's unfused forward runs, and the record of why."""

    def __init__(self, fixed: str | None = None):
        self.fixed = fixed  # "sdpa" | "unfused" | None (measure)
        self.chooser = Chooser(repeats=2, adaptive=False, criterion=Fastest(no_larger=True), baseline=UNFUSED,
                               force_env=FORCE_ENV, forceable=(SDPA, UNFUSED), aliases={"unfused": (UNFUSED,)},
                               preference=(SDPA,), check=False, name="attention fallback")

    @property
    def choices(self) -> dict:
        return self.chooser.choices

    def choose(self, key: tuple, sdpa, unfused, inputs, acc) -> dict:
        """The record for `key` (kernel, why, per-candidate ms and bytes where measured)."""
        from npuspeed.features.chooser_setup import on_accelerator

        if key not in self.chooser.choices:  # a trial may run: on this run's accelerator
            on_accelerator(self.chooser, acc)
        candidates = {UNFUSED: unfused, SDPA: sdpa} if acc.host_is_device() else {SDPA: sdpa}
        leaves = tuple(t.detach().requires_grad_(True) for t in inputs)
        kept = _global_buffers()
        choice = self.chooser.pick(
            "attention_fallback", key, f"{tuple(inputs[0].shape)} {inputs[0].dtype}", candidates, leaves,
            fixed=FIXED.get(self.fixed), fixed_by="--flash-attn-fallback", grads=True,
            untimed_why=f"SDPA's fused kernels take masks and dropout on {acc.name}")
        if choice.impl == SDPA and kept is not None:
            # Megatron's unfused forward keeps its S x S score buffer in the global memory
            # buffer; where SDPA runs, the trial must not leave that buffer behind
            buffers, before = kept
            buffers.clear()
            buffers.update(before)
        if choice.ms and not choice.why.startswith("measured once"):
            choice.why = f"measured once for this shape: {choice.why}"
        return record(choice)


def record(choice) -> dict:
    """The report's record (its keys are read by `npuspeed report` and scripts)."""
    out = {"kernel": choice.impl, "why": choice.why}
    for name, short in ((SDPA, "sdpa"), (UNFUSED, "unfused")):
        if name in choice.ms:
            out[f"{short}_ms"] = choice.ms[name]
        if name in choice.bytes:
            out[f"{short}_bytes"] = choice.bytes[name]
    return out


def _global_buffers():
    try:
        from megatron.core import parallel_state

        buffers = parallel_state.get_global_memory_buffer().buffer
    except Exception:  # noqa: BLE001 - no Megatron state (a bare call): nothing to keep
        return None
    return buffers, dict(buffers)
