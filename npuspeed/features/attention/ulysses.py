"""Ulysses: one all-to-all from sequence-sharded to head-sharded before attention, one back after.

Inside a Ulysses group of U ranks, rank j sends head slice i of its tokens to member i and
receives, from every member, that member's tokens for head slice j. The tokens arrive
member-major; `layout.ulysses_order` puts them in ring order (the group's two coarse chunks).
The head dimension is the second to last; leading extra dims (K and V stacked) ride along.
The backward of each direction is the other direction.
"""
from __future__ import annotations

import torch

from npuspeed.features.attention.comm import all_to_all
from npuspeed.features.attention.layout import inverse


def seq_to_head(x: torch.Tensor, group, members: int, order: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
    """x [.., s, .., h, d] (sequence at `seq_dim`) -> [.., U*s reordered, .., h/U, d]."""
    heads = x.shape[-2]
    parts = x.unflatten(-2, (members, heads // members))  # [.., U, h/U, d]
    send = parts.movedim(-3, 0)  # [U, ..., h/U, d]: slice i goes to member i
    recv = all_to_all(send, group)  # [U (from member), ..., h/U, d]
    recv = recv.movedim(0, seq_dim)  # member next to the sequence: [.., U, s, .., h/U, d]
    merged = recv.flatten(seq_dim, seq_dim + 1)  # [.., U*s, .., h/U, d], member-major
    return merged.index_select(seq_dim, order)


def head_to_seq(y: torch.Tensor, group, members: int, order: torch.Tensor, seq_dim: int = 0) -> torch.Tensor:
    """The inverse of `seq_to_head`."""
    member_major = y.index_select(seq_dim, inverse(order))
    split = member_major.unflatten(seq_dim, (members, y.shape[seq_dim] // members))  # [.., U, s, ..]
    send = split.movedim(seq_dim, 0)  # [U (goes to member), .., s, .., h/U, d]
    recv = all_to_all(send, group)  # [U (head slice of member), .., s, .., h/U, d]
    return recv.movedim(0, -3).flatten(-3, -2)  # [.., s, .., h, d]


class Exchange(torch.autograd.Function):
    """One of the two all-to-alls (`seq_to_head` or `head_to_seq`) as an autograd op; its
    backward is the other one on the gradient (each is the other's inverse):
    `Exchange.apply(x, seq_to_head, group, members, order, seq_dim)`."""

    @staticmethod
    def forward(ctx, x, direction, group, members, order, seq_dim):
        ctx.back = head_to_seq if direction is seq_to_head else seq_to_head
        ctx.args = (group, members, order, seq_dim)
        return direction(x, *ctx.args)

    @staticmethod
    def backward(ctx, grad):
        return ctx.back(grad, *ctx.args), None, None, None, None, None
