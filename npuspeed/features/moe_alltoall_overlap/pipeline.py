"""Dispatch, expert compute and combine of the all-to-all dispatcher, in chunks that overlap.

Every (destination rank j, local expert l) segment of this rank's permuted tokens is cut
into C row ranges; chunk c takes range c of every segment. Chunk c+1's all-to-all is in
flight while the experts compute chunk c, and chunk c's results travel back while chunk c+1
computes; the shared experts compute while chunk 0 is in flight. Split sizes of every chunk
follow from the counts the dispatcher already exchanged, so chunking adds no collective.

Expert maths is per token row, so any cut gives the same result as the unchunked path.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from npuspeed import telemetry
from npuspeed.features.moe_alltoall_overlap import a2a
from npuspeed.features.moe_common.grad_sink import share_weight_grads


def _cut(n: int, c: int, chunks: int) -> tuple[int, int]:
    return n * c // chunks, n * (c + 1) // chunks


@dataclass
class Plan:
    chunks: int
    #: rows this rank sends per chunk to each rank, and receives per chunk from each rank
    send_splits: list[list[int]]
    recv_splits: list[list[int]]
    #: rows per local expert in each received chunk
    tokens_per_expert: list[list[int]]
    #: permuted rows -> chunk-major order (None: already in it), and back
    to_chunks: torch.Tensor | None
    from_chunks: torch.Tensor | None
    #: per chunk: received (source-major) rows -> expert-major, and back (None: one local expert)
    by_expert: list[torch.Tensor | None]
    by_source: list[torch.Tensor | None]


def _starts(sizes: list[list[int]]) -> list[list[int]]:
    """Where block [i][l] of `sizes` starts when the blocks lie back to back, i-major."""
    out, at = [], 0
    for row in sizes:
        out.append([])
        for n in row:
            out[-1].append(at)
            at += n
    return out


def make_plan(send: list[list[int]], recv: list[list[int]], chunks: int, device) -> Plan:
    """`send[j][l]`: rows of this rank for local expert l of rank j (in permuted order, j-major);
    `recv[s][l]`: rows rank s sends to this rank's local expert l."""
    ranks, local = len(send), len(send[0])
    starts = _starts(send)
    order, send_splits, recv_splits, tpe, by_expert, by_source = [], [], [], [], [], []
    for c in range(chunks):
        send_splits.append([])
        for j in range(ranks):
            total = 0
            for l in range(local):
                lo, hi = _cut(send[j][l], c, chunks)
                order.append(torch.arange(starts[j][l] + lo, starts[j][l] + hi))
                total += hi - lo
            send_splits[c].append(total)
        pieces = [[_cut(recv[s][l], c, chunks) for l in range(local)] for s in range(ranks)]
        sizes = [[hi - lo for lo, hi in row] for row in pieces]
        recv_splits.append([sum(row) for row in sizes])
        tpe.append([sum(sizes[s][l] for s in range(ranks)) for l in range(local)])
        if local == 1:
            by_expert.append(None)
            by_source.append(None)
            continue
        offsets = _starts(sizes)
        idx = [torch.arange(offsets[s][l], offsets[s][l] + sizes[s][l]) for l in range(local) for s in range(ranks)]
        perm = torch.cat(idx) if idx else torch.zeros(0, dtype=torch.long)
        by_expert.append(perm.to(device))
        by_source.append(torch.empty_like(perm).scatter_(0, perm, torch.arange(perm.numel())).to(device))
    to_chunks = torch.cat(order) if order else torch.zeros(0, dtype=torch.long)
    if chunks == 1 or torch.equal(to_chunks, torch.arange(to_chunks.numel())):
        to_chunks_d = from_chunks_d = None
    else:
        from_chunks = torch.empty_like(to_chunks).scatter_(0, to_chunks, torch.arange(to_chunks.numel()))
        to_chunks_d, from_chunks_d = to_chunks.to(device), from_chunks.to(device)
    return Plan(chunks, send_splits, recv_splits, tpe, to_chunks_d, from_chunks_d, by_expert, by_source)


class _Reorder(torch.autograd.Function):
    """Rows in a new order; the gradient goes back by the inverse order (a gather, where
    index_select's own backward zero-fills and scatter-adds)."""

    @staticmethod
    def forward(ctx, x, index, inverse):
        ctx.save_for_backward(inverse)
        return x.index_select(0, index)

    @staticmethod
    def backward(ctx, grad):
        (inverse,) = ctx.saved_tensors
        return grad.index_select(0, inverse), None, None


def _take(x: torch.Tensor, index: torch.Tensor | None, inverse: torch.Tensor | None = None) -> torch.Tensor:
    if index is None:
        return x
    return _Reorder.apply(x, index, inverse)


def run(experts, tokens: torch.Tensor, probs: torch.Tensor, plan: Plan, group, shared=None,
        restore_order: bool = True):
    """Permuted tokens/probs (this rank's, expert-major) -> expert outputs, plus the shared
    experts' output (`shared()` runs while chunk 0 is in flight). The outputs come back in
    the permuted row order, or, with `restore_order=False`, in the chunk-major order
    `plan.to_chunks` gives (for an unpermute that takes the composed index instead)."""
    send_rows = [sum(s) for s in plan.send_splits]
    tok_chunks = _take(tokens, plan.to_chunks, plan.from_chunks).split(send_rows)
    prob_chunks = _take(probs, plan.to_chunks, plan.from_chunks).split(send_rows)

    def dispatch(c):
        telemetry.count("moe.a2a_overlap.dispatch_chunks")
        t = a2a.start(tok_chunks[c], group, plan.recv_splits[c], plan.send_splits[c], "dispatch")
        p = a2a.start(prob_chunks[c], group, plan.recv_splits[c], plan.send_splits[c], "dispatch_probs")
        return t, p

    in_flight = dispatch(0)
    shared_out = None
    if shared is not None:
        shared_out = shared()
        telemetry.count("moe.a2a_overlap.shared_experts_overlapped")
    combines = []
    undo = share_weight_grads(experts, plan.chunks)  # a GroupedMLP sums its chunks' weight grads in place
    try:
        for c in range(plan.chunks):
            following = dispatch(c + 1) if c + 1 < plan.chunks else None
            (t, tf), (p, pf) = in_flight
            t, p = a2a.finish(t, tf), a2a.finish(p, pf)
            counts = torch.tensor(plan.tokens_per_expert[c], dtype=torch.long)
            by_expert, by_source = plan.by_expert[c], plan.by_source[c]
            out, bias = experts(_take(t, by_expert, by_source), counts, _take(p, by_expert, by_source))
            assert bias is None, "expert bias is not supported with the all-to-all dispatcher"
            combines.append(a2a.start(_take(out, by_source, by_expert), group, plan.send_splits[c],
                                      plan.recv_splits[c], "combine"))
            telemetry.count("moe.a2a_overlap.combine_chunks")
            in_flight = following
    finally:
        undo()
    rows = torch.cat([a2a.finish(y, flight) for y, flight in combines])
    if restore_order:
        rows = _take(rows, plan.from_chunks, plan.to_chunks)
    return rows, shared_out
