"""Tensor-parallel shards back into the model's logical tensors.

Each dumped slot (a module's output, a gradient, a parameter) is one entry per TP rank. Between two
runs of the same TP size the ranks are compared one to one. Between different TP sizes each side is
reassembled: a parameter along the dimension Megatron marks it split on (`partition_dim`, from the
layout), an activation or gradient along the one dimension whose size times the TP size matches the
other run's (the hidden dimension after a column-parallel linear, the sequence dimension under
sequence parallelism), or taken from TP rank 0 where both sides have the same shape (replicated).
Where the ranks hold different values of one shape they are partial sums (the gradient of a bias
broadcast over the sequence-parallel split), added up. With a gated MLP (SwiGLU) each rank's fc1 holds [gate; up] of its part, so the halves are regrouped
as Megatron's sharded state dict does. Statistics reassemble without order (max, min, weighted mean,
root of summed squared norms, summed NaN/Inf counts); tensors are concatenated in rank order.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass

import torch


@dataclass
class Entry:
    key: tuple  # (kind, module, micro-batch index, slot, position)
    order: tuple  # where it happened: (micro-batch, pipeline stage (backward: reversed), sequence)
    cls: str
    parts: list  # one stats dict per TP rank (TP rank order), each with "_dir"
    tp: int
    gated: bool = False  # fc1 of a gated MLP: [gate; up] per rank
    partition_dim: int | None = None  # parameters: Megatron's split dimension (None: replicated)
    split_param: bool = False

    @property
    def module(self) -> str:
        return self.key[1]

    @property
    def dtype(self) -> str:
        return self.parts[0]["dtype"]


def _slots(rec: dict):
    kind = rec["kind"]
    if kind == "forward":
        for i, entry in enumerate(rec["output"]):
            yield ("forward", rec["module"], rec["index"], "output", i), entry
    elif kind == "backward":
        yield ("backward", rec["module"], rec["index"], rec["slot"], rec["i"]), rec[rec["slot"]][0]
    elif kind == "parameter":
        yield ("parameter", rec["module"], 0, "data", 0), rec["data"]
        yield ("parameter", rec["module"], 0, "grad", 0), rec["grad"]


def entries(dump, step: int) -> dict[tuple, dict[tuple, Entry]]:
    """{(dp rank, cp rank): {key: Entry}} of one dumped step (records of every PP stage merged)."""
    by_rank = dump.records(step)
    out: dict[tuple, dict[tuple, Entry]] = {}
    for rank, records in by_rank.items():
        layout = dump.layouts[rank]
        replica = (layout["dp_rank"], layout["cp_rank"])
        tp, tp_rank, pp = layout["tp_size"], layout["tp_rank"], layout["pp_rank"]
        table = out.setdefault(replica, {})
        for rec in records:
            for key, stats in _slots(rec):
                if stats is None:
                    continue
                stats = dict(stats, _dir=rec["_dir"])
                entry = table.get(key)
                if entry is None:
                    stage = -pp if key[0] == "backward" else pp
                    module = key[1]
                    param = layout["parameters"].get(module, {}) if key[0] == "parameter" else {}
                    gated = layout["gated_linear_unit"] and (
                        module.endswith("linear_fc1") and key[3] in ("output", "grad_output")
                        or module.endswith(("linear_fc1.weight", "linear_fc1.bias")))
                    entry = table[key] = Entry(key, (key[2], stage, rec["seq"]), rec.get("class", "Parameter"),
                                               [None] * tp, tp, gated, param.get("partition_dim"),
                                               param.get("partition_dim") is not None)
                entry.parts[tp_rank] = stats
    return out


# --- reassembly ------------------------------------------------------------------------------------
def _combine_stats(parts: list[dict], dim: int) -> dict:
    shape = list(parts[0]["shape"])
    shape[dim] = sum(p["shape"][dim] for p in parts)
    n = [math.prod(p["shape"]) for p in parts]
    finite = [p for p in parts if p["Max"] is not None]
    return {"dtype": parts[0]["dtype"], "shape": shape,
            "Max": max(p["Max"] for p in finite) if finite else None,
            "Min": min(p["Min"] for p in finite) if finite else None,
            "Mean": sum(p["Mean"] * k for p, k in zip(parts, n) if p["Mean"] is not None) / max(sum(n), 1),
            "Norm": math.sqrt(sum((p["Norm"] or 0.0) ** 2 for p in parts)),
            "NaN": sum(p["NaN"] for p in parts), "Inf": sum(p["Inf"] for p in parts)}


def load_tensor(stats: dict) -> torch.Tensor | None:
    name = stats.get("data_name")
    if name is None:
        return None
    path = os.path.join(stats["_dir"], name)
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        from npuspeed.errors import UserError

        raise UserError(f"{path} is missing: the dump is incomplete; rerun it") from None
    except Exception as exc:  # noqa: BLE001 - a damaged file: one line naming it
        from npuspeed.errors import UserError

        raise UserError(f"{path} is damaged ({type(exc).__name__}); rerun the dump of that step") from None


def _concat(tensors: list, dim: int, gated: bool) -> torch.Tensor:
    if gated:
        halves = [t.chunk(2, dim) for t in tensors]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim)
    return torch.cat(tensors, dim)


def _same(parts: list[dict]) -> bool:
    return all(all(p[k] == parts[0][k] for k in ("Max", "Min", "Mean", "Norm")) for p in parts[1:])


def _whole(entry: Entry, dim: int | None, tensors: bool):
    """The logical value of `entry`: split along `dim`; None: replicated (rank 0's), or, where the
    ranks hold different values of one shape, partial sums (a gradient of something broadcast over
    the sequence-parallel split, such as a row-parallel linear's returned bias): their sum. A string
    where statistics cannot say it."""
    if dim is None and entry.tp > 1 and not _same(entry.parts):
        if not tensors:
            return "a partial sum over TP ranks (its statistics cannot be added: use --dump-level tensors)"
        return sum(load_tensor(p).double() for p in entry.parts).to(load_tensor(entry.parts[0]).dtype)
    if dim is None or entry.tp == 1:
        return load_tensor(entry.parts[0]) if tensors else entry.parts[0]
    if tensors:
        return _concat([load_tensor(p) for p in entry.parts], dim, entry.gated)
    return _combine_stats(entry.parts, dim)


def pairs(a: Entry, b: Entry, tensors: bool):
    """[(value of A, value of B)] to compare (several for the same TP size: rank by rank), or a
    string saying why they cannot be compared."""
    if any(p is None for p in a.parts) or any(p is None for p in b.parts):
        return "not dumped by every TP rank"
    if a.tp == b.tp:
        if tensors:
            return [(load_tensor(x), load_tensor(y)) for x, y in zip(a.parts, b.parts)]
        return list(zip(a.parts, b.parts))
    sa, sb = a.parts[0]["shape"], b.parts[0]["shape"]
    if a.key[0] == "parameter":
        da = a.partition_dim if a.split_param else None
        db = b.partition_dim if b.split_param else None
    elif sa == sb:
        da = db = None
    else:
        dims = [d for d in range(len(sa)) if len(sa) == len(sb) and sa[d] != sb[d]]
        if len(dims) != 1:
            return f"shapes {sa} (TP{a.tp}) and {sb} (TP{b.tp}) differ in more than the split"
        d = dims[0]
        if sa[d] * a.tp == sb[d] * b.tp:
            da = db = d
        elif sa[d] * a.tp == sb[d]:
            da, db = d, None
        elif sb[d] * b.tp == sa[d]:
            da, db = None, d
        else:
            return f"shapes {sa} (TP{a.tp}) and {sb} (TP{b.tp}) are not shards of one tensor"
    va, vb = _whole(a, da, tensors), _whole(b, db, tensors)
    for value in (va, vb):
        if isinstance(value, str):
            return value
    shape_a = list(va.shape) if tensors else va["shape"]
    shape_b = list(vb.shape) if tensors else vb["shape"]
    if shape_a != shape_b:
        return f"logical shapes {shape_a} and {shape_b} differ"
    return [(va, vb)]
