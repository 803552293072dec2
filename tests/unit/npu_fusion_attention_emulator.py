"""EMULATOR (not the real op): `torch_npu.npu_fusion_attention` written in plain PyTorch.

No NPU exists here, so the NPU path of `--use-flash-attn` is tested against this function,
which follows the op's DOCUMENTED contract (Ascend "torch_npu.npu_fusion_attention" API page
and CANN's "sparse_mode" introduction), not its implementation:

- signature and defaults: (query, key, value, head_num, input_layout, pse=None,
  padding_mask=None, atten_mask=None, scale=1., keep_prob=1., pre_tockens=2147483647,
  next_tockens=2147483647, inner_precise=0, prefix=None, actual_seq_qlen=None,
  actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False);
- input_layout "SBH", "BSH" ([.., N*D]), "BSND", "BNSD"; head_num = query heads N1; key and
  value may have N2 heads with N1 % N2 == 0 (GQA);
- out = Dropout(Softmax(Mask(scale * Q K^T, atten_mask)), keep_prob) V;
- atten_mask is boolean, True = that position does NOT take part; shapes SS, 11SS, B1SS, BNSS;
- sparse_mode 0: atten_mask as given plus the band -pre_tockens <= j - i <= next_tockens
  (aligned at the top-left corner; with no atten_mask nothing is masked and the band is
  ignored); 1: atten_mask as given, band ignored; 2: leftUpCausal (j <= i); 3:
  rightDownCausal (j <= i + Skv - Sq); 4: band aligned at the bottom-right corner
  (-pre_tockens <= j - i - (Skv - Sq) <= next_tockens). Modes 2, 3, 4 take the compressed
  2048 x 2048 upper-triangular mask, which is checked here;
- returns (attention_out in the input layout, softmax_max [B, N1, Sq, 8] fp32,
  softmax_sum [B, N1, Sq, 8] fp32, softmax_in (reserved, empty), seed, offset, numels).

Choices the documentation leaves open are made plainly (fully masked rows give 0; dropout
draws from torch's generator of the tensors' device). pse, padding_mask, prefix, TND and
varlen are not emulated and raise.
"""
from __future__ import annotations

import torch

UNBOUNDED = 2147483647
COMPRESSED = 2048
LAYOUTS = ("SBH", "BSH", "BSND", "BNSD")


def _to_bnsd(x: torch.Tensor, layout: str, head_dim: int) -> torch.Tensor:
    if layout == "BNSD":
        return x
    if layout == "BSND":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        b, s, h = x.shape
        return x.view(b, s, h // head_dim, head_dim).permute(0, 2, 1, 3)
    s, b, h = x.shape  # SBH
    return x.view(s, b, h // head_dim, head_dim).permute(1, 2, 0, 3)


def _from_bnsd(x: torch.Tensor, layout: str) -> torch.Tensor:
    b, n, s, d = x.shape
    if layout == "BNSD":
        return x.contiguous()
    if layout == "BSND":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.permute(0, 2, 1, 3).reshape(b, s, n * d)
    return x.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _check_compressed(atten_mask, sparse_mode: int) -> None:
    if atten_mask is None or tuple(atten_mask.shape) != (COMPRESSED, COMPRESSED):
        raise ValueError(f"sparse_mode {sparse_mode} needs the compressed {COMPRESSED}x{COMPRESSED} atten_mask")
    if atten_mask.dtype != torch.bool and atten_mask.dtype != torch.uint8:
        raise ValueError("atten_mask must be bool or uint8")
    expected = torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool, device=atten_mask.device).triu(1)
    if not torch.equal(atten_mask.bool(), expected):
        raise ValueError("the compressed atten_mask must be the upper triangle (True above the diagonal)")


def _full_mask(atten_mask, b: int, n: int, sq: int, sk: int) -> torch.Tensor:
    if atten_mask.dtype not in (torch.bool, torch.uint8):
        raise ValueError("atten_mask must be bool or uint8")
    m = atten_mask.bool()
    shape = tuple(m.shape)
    if m.dim() == 2 and shape == (sq, sk):
        return m[None, None]
    if m.dim() == 4 and shape[2:] == (sq, sk) and shape[0] in (1, b) and shape[1] in (1, n):
        if shape[0] == 1 and shape[1] != 1:
            raise ValueError(f"atten_mask shape {shape}: 1NSS is not a documented shape")
        return m
    raise ValueError(f"atten_mask shape {shape} is not SS, 11SS, B1SS or BNSS for B={b} N={n} Sq={sq} Skv={sk}")


def _mask(atten_mask, sparse_mode, pre, nxt, b, n, sq, sk, device) -> torch.Tensor | None:
    i = torch.arange(sq, device=device)[:, None]
    j = torch.arange(sk, device=device)[None, :]
    if sparse_mode == 0:
        if atten_mask is None:
            return None
        band_out = ((j - i) > nxt) | ((i - j) > pre)
        return _full_mask(atten_mask, b, n, sq, sk) | band_out[None, None]
    if sparse_mode == 1:
        if atten_mask is None:
            raise ValueError("sparse_mode 1 (allMask) needs atten_mask")
        return _full_mask(atten_mask, b, n, sq, sk)
    _check_compressed(atten_mask, sparse_mode)
    if sparse_mode == 2:
        return (j > i)[None, None]
    if sparse_mode == 3:
        return (j > i + (sk - sq))[None, None]
    if sparse_mode == 4:
        rel = j - i - (sk - sq)
        return ((rel > nxt) | (rel < -pre))[None, None]
    raise NotImplementedError(f"sparse_mode {sparse_mode} is not emulated")


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=UNBOUNDED,
                         next_tockens=UNBOUNDED, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False):
    """EMULATOR of the documented torch_npu.npu_fusion_attention (see the module docstring)."""
    if input_layout not in LAYOUTS:
        raise NotImplementedError(f"input_layout {input_layout!r} is not emulated (only {LAYOUTS})")
    if any(x is not None for x in (pse, padding_mask, prefix, actual_seq_qlen, actual_seq_kvlen)):
        raise NotImplementedError("pse, padding_mask, prefix and varlen are not emulated")
    if not isinstance(head_num, int) or head_num <= 0:
        raise TypeError("head_num must be a positive int")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError("keep_prob must be in (0, 1]")
    if input_layout in ("SBH", "BSH"):
        if query.dim() != 3 or query.shape[-1] % head_num:
            raise ValueError(f"{input_layout}: query hidden {query.shape[-1]} is not head_num * D")
        head_dim = query.shape[-1] // head_num
    else:
        n_axis = 1 if input_layout == "BNSD" else 2
        if query.dim() != 4 or query.shape[n_axis] != head_num:
            raise ValueError(f"{input_layout}: query has {query.shape[n_axis]} heads, head_num={head_num}")
        head_dim = query.shape[-1]
    q, k, v = (_to_bnsd(t, input_layout, head_dim) for t in (query, key, value))
    b, n1, sq, _ = q.shape
    n2, sk = k.shape[1], k.shape[2]
    if n1 % n2 or v.shape[1] != n2:
        raise ValueError(f"key/value heads {n2} must divide query heads {n1}")
    if n1 != n2:
        k = k.repeat_interleave(n1 // n2, dim=1)
        v = v.repeat_interleave(n1 // n2, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    mask = _mask(atten_mask, sparse_mode, pre_tockens, next_tockens, b, n1, sq, sk, q.device)
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    finite_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - finite_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    probs = torch.where(row_sum > 0, exp / row_sum.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(exp))
    numels = 0
    if keep_prob < 1.0:
        keep = torch.rand(probs.shape, device=probs.device) < keep_prob
        probs = probs * keep / keep_prob
        numels = probs.numel()
    out = torch.matmul(probs, v.float()).to(query.dtype)
    softmax_max = finite_max.detach().expand(b, n1, sq, 8).contiguous()
    softmax_sum = row_sum.detach().expand(b, n1, sq, 8).contiguous()
    softmax_in = torch.empty(0, dtype=query.dtype, device=query.device)
    return _from_bnsd(out, input_layout), softmax_max, softmax_sum, softmax_in, 0, 0, numels
