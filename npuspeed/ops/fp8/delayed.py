"""Delayed scaling (Megatron's `--fp8-recipe delayed`, TE's DelayedScaling): the scale comes from
the amaxes of earlier quantizations, not the tensor at hand.

State per quantized tensor (a linear has three: input, weight, output gradient): an amax
history of `--fp8-amax-history-len` slots and the scale. A quantization uses the current scale
(1 at first), records its own amax (reduced over the group when `amax_reduce` is given) in slot
0, then updates as TE's `amax_and_scale_update` does: amax = max over the history (`max`) or
slot 0 (`most_recent`); scale = (max_fp8 / amax) / 2**margin (kept when amax is 0, Inf or
NaN); the history rotates by -1 and slot 0 is zeroed, so the window is the last L amaxes.
TE updates once per fp8_autocast region; a Megatron linear quantizes each of its tensors once
per microbatch, so updating after each quantization is the same sequence.
"""
from __future__ import annotations

import torch

from npuspeed.ops.fp8.formats import Fp8Format
from npuspeed.ops.fp8.quantized import Fp8Tensor
from npuspeed.ops.fp8.scaling import delayed_scale, nan_amax
from npuspeed.ops.fp8.tensorwise import AmaxReduce, quantize_with_scale

AMAX_COMPUTE_ALGOS = ("max", "most_recent")


class DelayedScaling:
    def __init__(self, fmt: Fp8Format, *, margin: int = 0, history_len: int = 1,
                 algo: str = "most_recent", device=None):
        if history_len < 1:
            raise ValueError(f"--fp8-amax-history-len {history_len}: must be at least 1")
        if algo not in AMAX_COMPUTE_ALGOS:
            raise ValueError(f"--fp8-amax-compute-algo {algo!r}: expected one of {AMAX_COMPUTE_ALGOS}")
        self.fmt, self.margin, self.algo = fmt, margin, algo
        self.amax_history = torch.zeros(history_len, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)

    def quantize(self, x: torch.Tensor, amax_reduce: AmaxReduce = None) -> Fp8Tensor:
        if self.amax_history.device != x.device:
            self.amax_history = self.amax_history.to(x.device)
            self.scale = self.scale.to(x.device)
        out = quantize_with_scale(x, self.scale, self.fmt)
        amax = nan_amax(x)
        if amax_reduce is not None:
            amax = amax_reduce(amax)
        self.amax_history[0] = amax
        self.update()
        return out

    def update(self) -> None:
        h = self.amax_history
        amax = h.amax() if self.algo == "max" else h[0]
        self.scale = delayed_scale(amax, self.scale, self.fmt.max, self.margin)
        h = torch.roll(h, -1)
        h[0] = 0.0
        self.amax_history = h

    def state_dict(self) -> dict:
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, state: dict) -> None:
        self.amax_history = state["amax_history"].clone().float()
        self.scale = state["scale"].clone().float()
