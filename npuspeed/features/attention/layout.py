"""Where each CP rank's tokens sit in the global sequence, and the three algorithms as one.

Megatron's causal load balance (`get_batch_on_this_cp_rank`) cuts a sequence of S tokens into
2N chunks of f = S / 2N and gives CP rank c the chunks c and 2N-1-c, so every rank has the
same share of the causal triangle. Ring, Ulysses and hybrid are one algorithm here:

- the CP group of N ranks is U Ulysses ranks (consecutive CP ranks) times R = N / U ring
  positions (strided), Megatron's `hierarchical_context_parallel_sizes = [U, R]` groups;
- an all-to-all inside the Ulysses group trades heads for tokens: a rank then holds 1/U of
  the heads for all tokens of its group, and after reordering (`ulysses_order`) those are
  the coarse chunks g and 2R-1-g of a 2R-chunk split (coarse chunk = U fine chunks), i.e.
  exactly the ring's load-balanced layout at ring size R;
- the ring passes K/V around the R positions.

Ring is U = 1, Ulysses is R = 1 (the two coarse chunks are then adjacent: one segment).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

ALGOS = ("megatron_cp_algo", "ulysses_cp_algo", "hybrid_cp_algo")
SHORT = {"megatron_cp_algo": "ring", "ulysses_cp_algo": "ulysses", "hybrid_cp_algo": "hybrid"}


@dataclass(frozen=True)
class CPLayout:
    """One CP configuration: N = ulysses * ring ranks."""

    algo: str
    size: int  # N, --context-parallel-size
    ulysses: int  # U, Ulysses degree (1 for ring)
    ring: int  # R = N / U (1 for Ulysses)

    @classmethod
    def make(cls, algo: str, size: int, ulysses_degree: int | None = None) -> "CPLayout":
        if algo == "megatron_cp_algo":
            return cls(algo, size, 1, size)
        if algo == "ulysses_cp_algo":
            return cls(algo, size, size, 1)
        u = int(ulysses_degree or 1)
        return cls(algo, size, u, size // u if u and size % u == 0 else 0)

    @property
    def short(self) -> str:
        return SHORT[self.algo]


@dataclass(frozen=True)
class Segment:
    """Contiguous tokens [start, start + length) of the global sequence, at local rows
    [local, local + length) of this rank's tensor."""

    start: int
    length: int
    local: int

    @property
    def end(self) -> int:
        return self.start + self.length


def ring_segments(position: int, ring: int, chunk: int) -> tuple[Segment, ...]:
    """The segments held by ring position `position` of `ring` when the sequence is cut in
    2 * ring chunks of `chunk` tokens: chunks position and 2R-1-position, merged when adjacent."""
    first = Segment(position * chunk, chunk, 0)
    second_start = (2 * ring - 1 - position) * chunk
    if second_start == first.end:
        return (Segment(first.start, 2 * chunk, 0),)
    return first, Segment(second_start, chunk, chunk)


def ulysses_order(members: int, tokens_per_member: int, device=None) -> torch.Tensor:
    """Row permutation after the Ulysses all-to-all: rows arrive member-major (member j's
    [chunk gU+j ; chunk 2N-1-gU-j]); the ring wants [chunks gU..gU+U-1 ; chunks of the
    mirrored coarse chunk in increasing order] = first halves in member order, then second
    halves in reverse member order. Returns `order` with new_rows = rows[order]."""
    half = tokens_per_member // 2
    rows = torch.arange(members * tokens_per_member, device=device).view(members, 2, half)
    return torch.cat([rows[:, 0].reshape(-1), rows.flip(0)[:, 1].reshape(-1)])


def inverse(order: torch.Tensor) -> torch.Tensor:
    inv = torch.empty_like(order)
    inv[order] = torch.arange(order.numel(), device=order.device)
    return inv
