"""Which positions attend: Megatron's masking rules turned into a kernel-neutral plan.

Megatron's local `DotProductAttention` masks in `FusedScaleMaskSoftmax.forward_torch_softmax`:
a layer window replaces every other mask; else a causal layer with no mask and sq > 1 gets
the default causal mask; else the given `attention_mask` (True = masked out) is used as is,
whatever the mask type says. The plan keeps those rules exactly, so the fused kernels see
the same pattern, but says it in the cheapest form a kernel takes: `causal` (no S x S
tensor at all), a `band` (window or --pre/--next-tockens), or an explicit boolean `mask`.

Rows that are masked entirely get uniform attention in Megatron (it fills -10000, not
-inf); fused kernels return 0 or NaN there. Such rows are unmasked for the kernel and
their output replaced by the mean of V afterwards (`dead_rows`), which gives Megatron's
values and gradients.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from npuspeed.features.base import FeatureError

UNBOUNDED = 2147483647  # npu_fusion_attention's default for pre/next_tockens


@dataclass(frozen=True)
class BandOptions:
    """--pre-tockens / --next-tockens as given (None = not given)."""

    pre_tockens: int | None = None
    next_tockens: int | None = None

    @property
    def given(self) -> bool:
        return self.pre_tockens is not None or self.next_tockens is not None


@dataclass
class MaskPlan:
    #: causal self-attention (sq == sk): kernels use is_causal / the compressed causal mask
    causal: bool = False
    #: (left, right): position (i, j) attends iff -left <= j - i - (sk - sq) <= right
    band: tuple[int, int] | None = None
    #: boolean, True = masked out (Megatron's polarity), broadcastable to [b, h, sq, sk]
    mask: torch.Tensor | None = None
    #: boolean [.., sq, 1]: rows that were masked entirely (Megatron gives them mean(V))
    dead_rows: torch.Tensor | None = None
    #: what the pattern came from, for the call record
    source: str = "none"


@functools.lru_cache(maxsize=8)
def _causal_mask(s: int, device: torch.device) -> torch.Tensor:
    return torch.ones(s, s, dtype=torch.bool, device=device).triu_(1)


def band_keep(sq: int, sk: int, band: tuple[int, int], device) -> torch.Tensor:
    """[sq, sk] boolean, True where the band lets query i see key j (SDPA's polarity)."""
    rel = torch.arange(sk, device=device)[None, :] - torch.arange(sq, device=device)[:, None] - (sk - sq)
    left, right = band
    return (rel >= -left) & (rel <= right)


def is_causal_mask(mask: torch.Tensor, sq: int, sk: int) -> bool:
    """True when `mask` is exactly the causal mask for every batch and head (one O(S^2) compare)."""
    if sq != sk or sq < 2 or mask.dtype != torch.bool or mask.dim() < 2 or tuple(mask.shape[-2:]) != (sq, sk):
        return False
    return bool(torch.equal(mask, _causal_mask(sq, mask.device).expand_as(mask)))


def _normalise_band(band: tuple[int, int], sq: int, sk: int) -> tuple[tuple[int, int] | None, bool]:
    """(band or None when it restricts nothing, True when it is exactly causal)."""
    left, right = band
    if left + right < 0:
        raise FeatureError(
            f"--use-flash-attn: the band (pre_tockens={left}, next_tockens={right}) masks every "
            "position; pass --pre-tockens/--next-tockens whose sum is >= 0"
        )
    full_left, full_right = left >= sk - 1, right >= sq - 1
    if full_left and full_right:
        return None, False
    if sq == sk and full_left and right == 0:
        return None, True
    return band, False


def plan_masks(
    *,
    attn_mask_type_name: str,
    attention_mask: torch.Tensor | None,
    window_size: tuple[int, int] | None,
    sq: int,
    sk: int,
    options: BandOptions,
) -> MaskPlan:
    """Megatron's masking for one call, in the cheapest form (see the module docstring)."""
    causal_type = attn_mask_type_name == "causal"
    plan = MaskPlan()
    if window_size is not None:
        if options.given:
            raise FeatureError(
                "--use-flash-attn: the model sets window_size and --pre-tockens/--next-tockens "
                "are given too; keep one of them"
            )
        plan.band, plan.source = (int(window_size[0]), int(window_size[1])), "window_size"
    elif causal_type and attention_mask is None and sq > 1:
        if sq != sk:
            raise FeatureError(f"--use-flash-attn: causal attention needs sq == sk (got {sq} and {sk})")
        plan.causal, plan.source = True, "causal"
    elif attention_mask is not None:
        if attention_mask.dtype != torch.bool:
            raise FeatureError(
                f"--use-flash-attn: attention_mask must be boolean (True = masked out), got "
                f"{attention_mask.dtype}; Megatron's masked_fill needs the same"
            )
        if is_causal_mask(attention_mask, sq, sk):
            plan.causal, plan.source = True, "causal (given mask recognised)"
        else:
            plan.mask, plan.source = attention_mask, "attention_mask"

    if options.given and window_size is None:
        flag_band = (
            UNBOUNDED if options.pre_tockens is None else options.pre_tockens,
            UNBOUNDED if options.next_tockens is None else options.next_tockens,
        )
        if plan.causal:
            flag_band = (flag_band[0], min(flag_band[1], 0))
            plan.causal = False
        plan.band = flag_band
        plan.source += "+pre/next_tockens"

    if plan.band is not None:
        band, exactly_causal = _normalise_band(plan.band, sq, sk)
        if plan.mask is not None:  # one explicit mask: fold the band into it
            if band is not None or exactly_causal:
                plan.mask = plan.mask | ~band_keep(sq, sk, plan.band, plan.mask.device)
            plan.band = None
        else:
            plan.band, plan.causal = band, plan.causal or exactly_causal

    if plan.mask is not None:
        dead = plan.mask.all(dim=-1, keepdim=True)
        plan.mask = plan.mask & ~dead
        plan.dead_rows = dead
    return plan


def fix_dead_rows(out_bhsd: torch.Tensor, value_bhsd: torch.Tensor, dead: torch.Tensor) -> torch.Tensor:
    """Megatron's output for fully masked rows: uniform attention, i.e. the mean of V.

    out: [b, hq, sq, d]; value: [b, hk, sk, d]; dead: broadcastable to [b, hq, sq, 1].
    """
    mean_v = value_bhsd.mean(dim=2, keepdim=True)
    groups = out_bhsd.shape[1] // value_bhsd.shape[1]
    if groups > 1:
        mean_v = mean_v.repeat_interleave(groups, dim=1)  # [b, hq, 1, d]: small
    return torch.where(dead, mean_v.to(out_bhsd.dtype), out_bhsd)
