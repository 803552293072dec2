"""--use-fused-moe-token-permute-and-unpermute: Megatron's `moe_utils.permute` / `unpermute`
run npuspeed's fused ops (npuspeed/ops/moe_permute.py).

Upstream's unfused pair transposes the routing map and the probabilities into dense
[experts, tokens] copies, masks and gathers, then scatter-adds back; its `fused=True` branch
needs Transformer Engine. Both functions keep their signature and results (same row order,
same sorted_indices meaning off NPU), so every dispatcher that calls them (all-to-all,
all-gather) gets the fused ops; the token dispatchers bind them by name, which the registry
rebinds. A caller asking for TE's fused kernels (`fused=True`, Megatron's
`--moe-permute-fusion`) keeps upstream's function.

The fused pair runs only where it is faster: per (device, dtype, tokens, hidden, experts,
output rows, options) a permute + unpermute round trip, forward + backward, of the fused ops
and of Megatron's own pair is timed once (npuspeed.ops.fused_choice); where Megatron's wins,
its functions run (counted `ops.moe_permute.megatron`, one note, and `npuspeed report` says
so). An unpermute follows the choice of the permute that made its sorted_indices.
"""
from __future__ import annotations

import functools
import weakref

import torch

from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops.moe_permute import implementation, moe_permute, moe_unpermute

_ORIGINAL: dict = {}  # "permute" / "unpermute" -> Megatron's function (set when wrapped)
_PAIRS: dict = {}  # id(sorted_indices) -> (weakref, impl of the permute that made it)


def _choose(tokens, routing_map, probs, num_out_tokens, drop_and_pad) -> str:
    """`megatron` or the fused ops' implementation (cpp/npu) for this permute call."""
    mine = implementation(tokens)
    if mine == "reference" or "unpermute" not in _ORIGINAL:
        return fused_choice.MEGATRON if mine == "reference" else mine
    force = fused_choice.forced()
    if force is not None:
        return fused_choice.MEGATRON if force == fused_choice.MEGATRON else mine
    key = ("moe_permute", tokens.device.type, tokens.dtype, tuple(tokens.shape), tuple(routing_map.shape),
           num_out_tokens, probs is not None, bool(drop_and_pad), torch.is_grad_enabled() and tokens.requires_grad)
    choice = fused_choice.CHOOSER.choices.get(key)
    if choice is None:
        rm, p = routing_map, None if probs is None else probs.detach()
        n, t = num_out_tokens, tokens.shape[0]

        def fused(tok):
            out, _, order, _ = moe_permute(tok, rm, p, num_out_tokens=n, drop_and_pad=drop_and_pad)
            return moe_unpermute(out, order, t, None, rm, drop_and_pad=drop_and_pad)

        def megatron(tok):
            out, _, order = _ORIGINAL["permute"](tok, rm, probs=p, num_out_tokens=n, fused=False,
                                                 drop_and_pad=drop_and_pad)
            return _ORIGINAL["unpermute"](out, order, tok.shape, probs=None, routing_map=rm, fused=False,
                                          drop_and_pad=drop_and_pad)

        label = fused_choice.label(tokens, extra=f"{routing_map.shape[1]} experts, {n} rows")
        choice = fused_choice.CHOOSER.pick("moe_permute", key, label, {fused_choice.MEGATRON: megatron, mine: fused},
                                           (tokens,))
    return choice.impl


def _remember(sorted_indices, impl: str) -> None:
    if len(_PAIRS) > 64:
        _PAIRS.clear()
    _PAIRS[id(sorted_indices)] = (weakref.ref(sorted_indices), impl)


def _paired(sorted_indices) -> str | None:
    hit = _PAIRS.get(id(sorted_indices))
    return hit[1] if hit is not None and hit[0]() is sorted_indices else None

MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MEGATRON_RANGE = ">=0.13,<0.17"  # permute returns (tokens, probs, sorted_indices) since 0.13


def permute_wrapper(original):
    _ORIGINAL["permute"] = original

    @functools.wraps(original)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        if fused:
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad)
        if _choose(tokens, routing_map, probs, num_out_tokens, drop_and_pad) == fused_choice.MEGATRON:
            _dispatch.record("moe_permute", fused_choice.MEGATRON)
            permuted, permuted_probs, sorted_indices = original(
                tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=False,
                drop_and_pad=drop_and_pad)
            _remember(sorted_indices, fused_choice.MEGATRON)
            return permuted, permuted_probs, sorted_indices
        permuted, permuted_probs, sorted_indices, _ = moe_permute(
            tokens, routing_map, probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad)
        return permuted, permuted_probs, sorted_indices

    return permute


def unpermute_wrapper(original):
    _ORIGINAL["unpermute"] = original

    @functools.wraps(original)
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False):
        megatrons = not fused and _paired(sorted_indices) == fused_choice.MEGATRON
        if fused or megatrons:  # TE's kernel asked for, or the permute took Megatron's path
            if megatrons:
                _dispatch.record("moe_unpermute", fused_choice.MEGATRON)
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad)
        return moe_unpermute(permuted_tokens, sorted_indices, restore_shape[0], probs, routing_map,
                             drop_and_pad=drop_and_pad)

    return unpermute


def register(registry, feature: str) -> None:
    kw = dict(feature=feature, megatron=MEGATRON_RANGE)
    registry.register(f"{MOE_UTILS}.permute", wrapper=permute_wrapper, **kw)
    registry.register(f"{MOE_UTILS}.unpermute", wrapper=unpermute_wrapper, **kw)
