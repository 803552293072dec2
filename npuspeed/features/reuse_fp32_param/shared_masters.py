"""The fp32 main parameters of one optimizer, kept as bf16 parameter + 16-bit residual.

At rest each main parameter's storage is resized to zero: its value lives in the bf16
model parameter (or, with the distributed optimizer, the bf16 shard in DDP's parameter
buffer) plus a residual of 2 bytes per element and a sparse exception list (codec.py).
`materialize()` rebuilds the exact fp32 values into the same tensor objects, so the
optimizer's state keys and Megatron's bookkeeping never change; `release()` splits them
again after the step has written the new bf16 values. While materialized the masters are
authoritative, exactly as in ordinary mixed precision (a checkpoint load writes them).

One tensor at a time, and each residual is freed as soon as its master is rebuilt (and
allocated only when its master is split again): during the step the residuals are gone, so
the step holds bf16 parameters + fp32 masters, 6 bytes a parameter as in ordinary mixed
precision, plus at most one tensor's 2-byte residual while it is converted.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from npuspeed.features.reuse_fp32_param import codec


@dataclass
class _Pair:
    model: torch.Tensor  # bf16 parameter or parameter shard (a view into the model's memory)
    main: torch.Tensor  # fp32 main parameter; storage empty at rest
    residual: torch.Tensor | None  # int16, one per element; None while the master is materialized
    exceptions: codec.Exceptions


_NONE = codec.Exceptions()  # what a materialized master keeps: nothing


class SharedMasters:
    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.pairs = [_Pair(model, main, None, _NONE) for model, main in pairs]
        self.materialized = True  # Megatron just built the masters as copies of the params
        self.counts = {"materialize": 0, "release": 0}

    @torch.no_grad()
    def materialize(self) -> None:
        """Rebuild the fp32 masters (exactly) unless they already hold the current values."""
        if self.materialized:
            return
        for pair in self.pairs:
            storage = pair.main.untyped_storage()
            storage.resize_(pair.main.numel() * pair.main.element_size())
            codec.merge(pair.model, pair.residual, pair.exceptions, pair.main)
            pair.residual, pair.exceptions = None, _NONE  # the master holds its value now
        self.materialized = True
        self.counts["materialize"] += 1

    @torch.no_grad()
    def release(self) -> None:
        """Keep only residuals and exceptions; free the masters' storage."""
        if not self.materialized:
            return
        for pair in self.pairs:
            pair.residual = torch.empty(pair.main.numel(), dtype=torch.int16, device=pair.main.device)
            pair.exceptions = codec.split(pair.main, pair.residual)
            pair.main.untyped_storage().resize_(0)
        self.materialized = False
        self.counts["release"] += 1

    def storages(self) -> list:
        """Storages this representation keeps alive (for weight-byte accounting)."""
        found = [p.residual.untyped_storage() for p in self.pairs if p.residual is not None]
        for p in self.pairs:
            found += [t.untyped_storage() for t in p.exceptions.tensors()]
        return found
