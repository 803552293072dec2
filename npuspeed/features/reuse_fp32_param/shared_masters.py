"""The fp32 main parameters of one optimizer, kept as bf16 parameter + 16-bit residual.

At rest the masters' storage is resized to zero: their values live in the bf16 model
parameters (or, with the distributed optimizer, the bf16 shards in DDP's parameter buffer)
plus a residual of 2 bytes per element and the exceptions (codec.py). `materialize()` rebuilds
the exact fp32 values into the same tensor objects, so the optimizer's state keys and
Megatron's bookkeeping never change; `release()` splits them again after the step has written
the new bf16 values. While materialized the masters are authoritative, exactly as in ordinary
mixed precision (a checkpoint load writes them).

The codec works per segment, not per parameter: parameters whose bf16 values lie back to back
in one storage (Megatron's contiguous param buffer, or a rank's shard of it) form one segment,
and their masters are moved, once, into one flat fp32 tensor with the same layout, so a
segment is one codec call (on a GPU one kernel launch) per direction. Parameters outside a
buffer are segments of one, as before.

One segment at a time, and each residual is freed as soon as its masters are rebuilt (and
allocated only when they are split again): during the step the residuals are gone, so the step
holds bf16 parameters + fp32 masters, 6 bytes a parameter as in ordinary mixed precision, plus
one segment's 2-byte residual while it is converted. A segment never holds more elements than
the largest parameter, so that transient is at most what converting parameter by parameter
needed (and half of the fp32 temporary the optimizer's own update of that parameter makes).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from npuspeed import telemetry
from npuspeed.features.reuse_fp32_param import codec


@dataclass
class _Segment:
    models: list[torch.Tensor]  # bf16 params or shards, back to back in one storage (address order)
    mains: list[torch.Tensor]  # their fp32 masters, views into `flat` at the same relative offsets
    flat: torch.Tensor  # fp32, every master of the segment; storage empty at rest
    residual: torch.Tensor | None  # int16, one per element; None while materialized
    exceptions: codec.Exceptions

    def model_flat(self) -> torch.Tensor:
        """The segment's bf16 values as one flat view of the parameter buffer."""
        first, last = self.models[0].detach(), self.models[-1].detach()
        if len(self.models) == 1:
            return first.reshape(-1)
        n = self.flat.numel()
        if last.data_ptr() + last.numel() * last.element_size() != first.data_ptr() + n * first.element_size():
            raise RuntimeError("npuspeed --reuse-fp32-param: Megatron moved the bf16 parameters out of "
                               "their buffer after the optimizer was built; drop --reuse-fp32-param")
        return first.as_strided((n,), (1,), first.storage_offset())


_NONE = codec.Exceptions()  # what a materialized master keeps: nothing


def _adjacent(a: torch.Tensor, b: torch.Tensor) -> bool:
    """b's values start where a's end, in the same storage."""
    return (a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr() and a.dtype == b.dtype
            and a.data_ptr() + a.numel() * a.element_size() == b.data_ptr())


def _runs(pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> list[list[tuple[torch.Tensor, torch.Tensor]]]:
    """Pairs grouped into runs of back-to-back contiguous bf16 tensors, each run at most as
    many elements as the largest pair."""
    cap = max(main.numel() for _, main in pairs)
    order = sorted(pairs, key=lambda p: (p[0].untyped_storage().data_ptr(), p[0].data_ptr()))
    runs, size = [], 0
    for model, main in order:
        joins = (runs and model.is_contiguous() and main.is_contiguous() and size + main.numel() <= cap
                 and runs[-1][-1][0].is_contiguous() and _adjacent(runs[-1][-1][0], model)
                 and main.device == runs[-1][-1][1].device)
        if joins:
            runs[-1].append((model, main))
            size += main.numel()
        else:
            runs.append([(model, main)])
            size = main.numel()
    return runs


@torch.no_grad()
def _segment(run: list[tuple[torch.Tensor, torch.Tensor]]) -> _Segment:
    models, mains = [m for m, _ in run], [p for _, p in run]
    if len(run) == 1:  # the master's own storage is the segment's
        return _Segment(models, mains, mains[0].detach().view(-1), None, _NONE)
    flat = torch.empty(sum(p.numel() for p in mains), dtype=mains[0].dtype, device=mains[0].device)
    offset = 0
    for main in mains:  # move each master into the flat tensor (same object, new storage)
        n = main.numel()
        flat[offset:offset + n].copy_(main.detach().reshape(-1))
        main.data = flat[offset:offset + n].view(main.shape)
        offset += n
    return _Segment(models, mains, flat, None, _NONE)


class SharedMasters:
    def __init__(self, pairs: list[tuple[torch.Tensor, torch.Tensor]]):
        self.segments = [_segment(run) for run in _runs(pairs)] if pairs else []
        # codec calls per direction and step vs. parameters: buffer-level calls show as fewer
        telemetry.count(codec.COUNTER + "segments", len(self.segments))
        telemetry.count(codec.COUNTER + "params", len(pairs))
        self.materialized = True  # Megatron just built the masters as copies of the params
        self.counts = {"materialize": 0, "release": 0}

    @torch.no_grad()
    def materialize(self) -> None:
        """Rebuild the fp32 masters (exactly) unless they already hold the current values."""
        if self.materialized:
            return
        for seg in self.segments:
            seg.flat.untyped_storage().resize_((seg.flat.storage_offset() + seg.flat.numel())
                                               * seg.flat.element_size())
            codec.merge(seg.model_flat(), seg.residual, seg.exceptions, seg.flat)
            seg.residual, seg.exceptions = None, _NONE  # the masters hold their values now
        self.materialized = True
        self.counts["materialize"] += 1

    @torch.no_grad()
    def release(self) -> None:
        """Keep only residuals and exceptions; free the masters' storage."""
        if not self.materialized:
            return
        for seg in self.segments:
            seg.residual = torch.empty(seg.flat.numel(), dtype=torch.int16, device=seg.flat.device)
            seg.exceptions = codec.split(seg.flat, seg.residual)
            seg.flat.untyped_storage().resize_(0)
        self.materialized = False
        self.counts["release"] += 1

    def storages(self) -> list:
        """Storages this representation keeps alive (for weight-byte accounting)."""
        found = [s.residual.untyped_storage() for s in self.segments if s.residual is not None]
        for s in self.segments:
            found += [t.untyped_storage() for t in s.exceptions.tensors()]
        return found
