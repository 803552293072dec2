"""--use-fused-moe-token-permute-and-unpermute: Megatron's `moe_utils.permute` / `unpermute`
run npuspeed's fused ops (npuspeed/ops/moe_permute.py: C++ on CPU, torch_npu's on an NPU) or
npuspeed's Triton kernels (npuspeed/ops/triton/moe_permute.py: CUDA, and an NPU through
triton-ascend where torch_npu has no fused permute).

Upstream's unfused pair transposes the routing map and the probabilities into dense
[experts, tokens] copies, masks and gathers, then scatter-adds back; its `fused=True` branch
needs Transformer Engine. Both functions keep their signature and results (same row order,
same sorted_indices meaning off NPU), so every dispatcher that calls them (all-to-all,
all-gather) gets the fused ops; the token dispatchers bind them by name, which the registry
rebinds. A caller asking for TE's fused kernels (`fused=True`, Megatron's
`--moe-permute-fusion`) keeps upstream's function.

The fused pair runs only where it is faster: per (device, dtype, tokens, hidden, experts,
output rows, options) a permute + unpermute round trip, forward + backward, of each fused pair
(cpp/npu, triton) and of Megatron's own pair is timed once (npuspeed.ops.fused_choice); where
Megatron's wins, its functions run (counted `ops.moe_permute.megatron`, one note, and `npuspeed
report` says so); Triton's are counted `ops.moe_permute.triton` / `ops.moe_unpermute.triton`.
An unpermute follows the choice of the permute that made its sorted_indices.
"""
from __future__ import annotations

import functools
import weakref

import torch

from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops.moe_permute import implementation, moe_permute, moe_unpermute, npu_accepts

_ORIGINAL: dict = {}  # "permute" / "unpermute" -> Megatron's function (set when wrapped)
_SAID: set = set()  # the notes said once per process
_PAIRS: dict = {}  # id(sorted_indices) -> (weakref, impl of the permute that made it)


def _triton_runs(tokens, mine: str) -> bool:
    """Whether npuspeed's Triton permute pair is a candidate for these tokens: where Triton runs
    (CUDA; an NPU through triton-ascend when its torch_npu has no fused permute), not on CPU
    (the C++ kernel is the candidate there; the interpreter is a test tool)."""
    return mine != _dispatch.NPU_IMPL and fused_choice.triton_kernel("moe_permute", "moe_permute", tokens) is not None


def _pair_of(impl: str):
    """(permute, unpermute) of a fused implementation: npuspeed.ops' front ends (cpp/npu) or Triton's."""
    if impl == "triton":
        from npuspeed.ops.triton import moe_permute as kernels

        return kernels.moe_permute, kernels.moe_unpermute
    return moe_permute, moe_unpermute


def _choose(tokens, routing_map, probs, num_out_tokens, drop_and_pad) -> str:
    """`megatron` or the fused implementation (cpp/npu/triton) for this permute call: the
    candidates are the device's op (C++ on CPU, torch_npu's on an NPU), npuspeed's Triton
    kernels where Triton runs, and Megatron's own pair; the per-shape rule picks."""
    mine = implementation(tokens)
    if mine == _dispatch.NPU_IMPL and not npu_accepts(routing_map, num_out_tokens, drop_and_pad, tokens, probs):
        mine = "reference"
        _say_rows_vary()
    found = [] if mine == "reference" else [mine]
    if _triton_runs(tokens, mine):
        found.append("triton")
    if not found:
        return fused_choice.MEGATRON
    if "unpermute" not in _ORIGINAL:  # only the permute wrapped (tests): nothing to measure a round trip with
        return found[0]
    key = ("moe_permute", mine, tokens.device.type, tokens.dtype, tuple(tokens.shape), tuple(routing_map.shape),
           num_out_tokens, probs is not None, bool(drop_and_pad), tokens.requires_grad,
           fused_choice.forced())
    choice = fused_choice.CHOOSER.choices.get(key)
    if choice is None:
        rm, p = routing_map, None if probs is None else probs.detach()
        n, t = num_out_tokens, tokens.shape[0]

        def fused(impl):
            perm, unperm = _pair_of(impl)

            def round_trip(tok):
                out, _, order, _ = perm(tok, rm, p, num_out_tokens=n, drop_and_pad=drop_and_pad)
                return unperm(out, order, t, None, rm, drop_and_pad=drop_and_pad)

            return round_trip

        def megatron(tok):
            out, _, order = _ORIGINAL["permute"](tok, rm, probs=p, num_out_tokens=n, fused=False,
                                                 drop_and_pad=drop_and_pad)[:3]
            return _ORIGINAL["unpermute"](out, order, tok.shape, probs=None, routing_map=rm, fused=False,
                                          drop_and_pad=drop_and_pad)

        label = fused_choice.label(tokens, extra=f"{routing_map.shape[1]} experts, {n} rows")
        candidates = {fused_choice.MEGATRON: megatron, **{impl: fused(impl) for impl in found}}
        choice = fused_choice.CHOOSER.pick("moe_permute", key, label, candidates, (tokens,))
    return choice.impl


def _say_rows_vary() -> None:
    """Once per process: torch_npu's permute is skipped where the routing map's rows differ (or
    probs have a dtype it does not take)."""
    if not _SAID and fused_choice.CHOOSER.notify is not None:
        _SAID.add("rows")
        fused_choice.CHOOSER.notify(
            "--use-fused-moe-token-permute-and-unpermute: torch_npu's npu_moe_token_permute_with_routing_map "
            "needs every routing-map row to select the same number of experts (top-k), and probs of the "
            "tokens' dtype (or fp32 with bf16 tokens); this call has neither (the all-gather dispatcher's map "
            "of this rank's experts at EP > 1, dropped tokens, or fp16 tokens with fp32 probs), so "
            "Megatron's permute (or npuspeed's Triton one) runs for such calls")


def _remember(sorted_indices, impl: str) -> None:
    """Which permute made `sorted_indices` (torch_npu's have their own meaning): its unpermute
    must be the same implementation's. Dead entries are dropped, live ones kept."""
    if len(_PAIRS) > 256:
        for key in [k for k, (ref, _) in _PAIRS.items() if ref() is None]:
            del _PAIRS[key]
    _PAIRS[id(sorted_indices)] = (weakref.ref(sorted_indices), impl)


def _paired(sorted_indices) -> str | None:
    hit = _PAIRS.get(id(sorted_indices))
    return hit[1] if hit is not None and hit[0]() is sorted_indices else None


MOE_UTILS = "megatron.core.transformer.moe.moe_utils"
MEGATRON_RANGE = ">=0.13,<0.20"  # permute returns (tokens, probs, sorted_indices) since 0.13
#: 0.17 added padding for fp8/fp4 (tokens_per_expert, align_size in; pad_offsets and padded
#: tokens_per_expert out: a 5-tuple); only TE's fused kernels pad, the unfused pair passes through
PADDED_RANGE = ">=0.17,<0.20"
TRIPLE_RANGE = ">=0.13,<0.17"


def permute_wrapper(original):
    _ORIGINAL["permute"] = original

    @functools.wraps(original)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False):
        if fused:
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad)
        impl = _choose(tokens, routing_map, probs, num_out_tokens, drop_and_pad)
        if impl == fused_choice.MEGATRON:
            _dispatch.record("moe_permute", fused_choice.MEGATRON)
            permuted, permuted_probs, sorted_indices = original(
                tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=False,
                drop_and_pad=drop_and_pad)
        else:
            if impl == "triton":  # npuspeed.ops' front ends count themselves
                _dispatch.record("moe_permute", "triton")
            checked = {"checked": True} if impl == _dispatch.NPU_IMPL else {}  # _choose checked torch_npu's row rule
            permuted, permuted_probs, sorted_indices, _ = _pair_of(impl)[0](
                tokens, routing_map, probs, num_out_tokens=num_out_tokens, drop_and_pad=drop_and_pad, **checked)
        _remember(sorted_indices, impl)
        return permuted, permuted_probs, sorted_indices

    return permute


def permute_padded_wrapper(original):
    """0.17+: the same choice inside upstream's 5-tuple contract. The unfused path never pads
    (upstream returns pad_offsets None and the given tokens_per_expert), so neither does this."""
    triple = permute_wrapper(lambda *a, **kw: original(*a, **kw)[:3])
    _ORIGINAL["permute"] = original

    @functools.wraps(original)
    def permute(tokens, routing_map, probs=None, num_out_tokens=None, fused=False, drop_and_pad=False,
                tokens_per_expert=None, align_size=None):
        if fused:  # TE's kernels (--moe-permute-fusion), padding included; upstream's own default
            pad = {} if align_size is None else {"align_size": align_size}
            return original(tokens, routing_map, probs=probs, num_out_tokens=num_out_tokens, fused=fused,
                            drop_and_pad=drop_and_pad, tokens_per_expert=tokens_per_expert, **pad)
        return (*triple(tokens, routing_map, probs, num_out_tokens, False, drop_and_pad), None, tokens_per_expert)

    return permute


def unpermute_padded_wrapper(original):
    """0.17+: pad_offsets only come from TE's fused permute (upstream's unfused unpermute
    ignores them); a call that passes them keeps upstream's function."""
    plain = unpermute_wrapper(original)

    @functools.wraps(original)
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False, pad_offsets=None):
        if pad_offsets is not None:
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad, pad_offsets=pad_offsets)
        return plain(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                     fused=fused, drop_and_pad=drop_and_pad)

    return unpermute


def unpermute_wrapper(original):
    _ORIGINAL["unpermute"] = original

    @functools.wraps(original)
    def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                  drop_and_pad=False):
        paired = None if fused else _paired(sorted_indices)
        if fused or paired == fused_choice.MEGATRON:  # TE's kernel asked for, or the permute took Megatron's path
            if paired == fused_choice.MEGATRON:
                _dispatch.record("moe_unpermute", fused_choice.MEGATRON)
            return original(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad)
        unpermute_ = moe_unpermute
        if paired == "triton":
            _dispatch.record("moe_unpermute", "triton")
            unpermute_ = _pair_of("triton")[1]
        return unpermute_(permuted_tokens, sorted_indices, restore_shape[0], probs, routing_map,
                          drop_and_pad=drop_and_pad)

    return unpermute


def wrappers():
    """(permute wrapper, unpermute wrapper) for the running megatron-core (benchmarks, tests)."""
    from npuspeed.patching.versions import in_range

    if in_range(PADDED_RANGE):
        return permute_padded_wrapper, unpermute_padded_wrapper
    return permute_wrapper, unpermute_wrapper
