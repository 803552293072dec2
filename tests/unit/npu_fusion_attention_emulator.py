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
  softmax_sum [B, N1, Sq, 8] fp32, softmax_in (reserved, empty), seed, offset, numels);
- "TND" (varlen): query [T, N1, D], key/value [Tkv, N2, D]; actual_seq_qlen and
  actual_seq_kvlen are host lists of cumulative END offsets, one per sequence, no leading 0
  (lengths 2 2 2 -> [2, 4, 6]; a length may be 0); each sequence attends only to its own keys;
  sparse_mode 2 / 3 / 4 apply per sequence (3: j <= i + Skv_i - Sq_i) with the compressed
  mask; softmax_max / softmax_sum have shape [T, N1, 8] but, by default, the storage of
  each sequence in turn is [N1, Sq_i, 8] (head-major; MindSpeed's `flatten_softmax` undoes
  it), token-major [T, N1, 8] only with softmax_layout="TND" (torch_npu 7.2.0 / CANN 8.3);
- npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, atten_mask,
  softmax_max, softmax_sum, attention_in, scale_value, keep_prob, pre_tockens, next_tockens,
  actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout, ...) -> (dq, dk, dv, dpse):
  P recomputed as exp(scale * QK^T - max) / sum from the max and sum it is given, D from
  attention_in (dropout is not emulated in the gradient).

Choices the documentation leaves open are made plainly (fully masked rows give 0; dropout
draws from torch's generator of the tensors' device; the cumulative lengths must end at T).
pse, padding_mask, prefix, a full atten_mask under TND and sparse_modes 5-8 are not emulated
and raise.
"""
from __future__ import annotations

import torch

UNBOUNDED = 2147483647
COMPRESSED = 2048
LAYOUTS = ("SBH", "BSH", "BSND", "BNSD", "TND")


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


def _head_dim(query, head_num: int, layout: str) -> int:
    if not isinstance(head_num, int) or head_num <= 0:
        raise TypeError("head_num must be a positive int")
    if layout in ("SBH", "BSH"):
        if query.dim() != 3 or query.shape[-1] % head_num:
            raise ValueError(f"{layout}: query hidden {query.shape[-1]} is not head_num * D")
        return query.shape[-1] // head_num
    n_axis = {"BNSD": 1, "BSND": 2, "TND": 1}[layout]
    if query.dim() != (3 if layout == "TND" else 4) or query.shape[n_axis] != head_num:
        raise ValueError(f"{layout}: query has {query.shape[n_axis]} heads, head_num={head_num}")
    return query.shape[-1]


def _repeat_kv(q, k, v):
    n1, n2 = q.shape[1], k.shape[1]
    if n1 % n2 or v.shape[1] != n2:
        raise ValueError(f"key/value heads {n2} must divide query heads {n1}")
    if n1 != n2:
        k, v = k.repeat_interleave(n1 // n2, dim=1), v.repeat_interleave(n1 // n2, dim=1)
    return k, v


def _attend(q, k, v, scale, keep_prob, mask):
    """BNSD -> (out fp32, row max, row sum), each [b, n, sq, 1] for the stats."""
    k, v = _repeat_kv(q, k, v)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else torch.full(
        (*scores.shape[:-1], 1), float("-inf"), device=q.device)
    finite_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - finite_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    probs = torch.where(row_sum > 0, exp / row_sum.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(exp))
    if keep_prob < 1.0:
        keep = torch.rand(probs.shape, device=probs.device) < keep_prob
        probs = probs * keep / keep_prob
    return torch.matmul(probs, v.float()), finite_max, row_sum


def _sequences(actual_seq_qlen, actual_seq_kvlen, t_q: int, t_k: int):
    """[(q_begin, q_end, k_begin, k_end)] from the cumulative end offsets (host lists)."""
    if actual_seq_qlen is None or actual_seq_kvlen is None:
        raise ValueError("input_layout TND needs actual_seq_qlen and actual_seq_kvlen")
    ends = []
    for name, cu, total in (("actual_seq_qlen", actual_seq_qlen, t_q), ("actual_seq_kvlen", actual_seq_kvlen, t_k)):
        if isinstance(cu, torch.Tensor) or not all(isinstance(x, int) for x in cu):
            raise TypeError(f"{name} must be a host list of ints")
        cu = list(cu)
        if any(y < x for x, y in zip(cu, cu[1:])) or not cu or cu[0] < 0:
            raise ValueError(f"{name} must be non-decreasing cumulative lengths, got {cu}")
        if cu[-1] != total:
            raise ValueError(f"{name} ends at {cu[-1]}, the tensor has T = {total}")
        ends.append(cu)
    if len(ends[0]) != len(ends[1]):
        raise ValueError("actual_seq_qlen and actual_seq_kvlen need one entry per sequence each")
    qs, ks = [0] + ends[0], [0] + ends[1]
    return [(qs[i], qs[i + 1], ks[i], ks[i + 1]) for i in range(len(ends[0]))]


def _tnd_stat(per_seq, seqs, t: int, n: int, softmax_layout: str, device) -> torch.Tensor:
    """Per-sequence [n, sq_i] stats -> the [T, N, 8] output in the documented storage."""
    if softmax_layout == "TND":
        out = torch.zeros(t, n, device=device)
        for (qa, qb, _, _), x in zip(seqs, per_seq):
            out[qa:qb] = x.t()
        return out.unsqueeze(-1).expand(t, n, 8).contiguous()
    flat = torch.cat([x.reshape(-1) for x in per_seq]) if per_seq else torch.zeros(0, device=device)
    return flat.unsqueeze(-1).expand(t * n, 8).contiguous().view(t, n, 8)


def _tnd_stat_read(stat, seqs, n: int, softmax_layout: str):
    """The inverse of `_tnd_stat`: per sequence [n, sq_i]."""
    col = stat[..., 0]
    if softmax_layout == "TND":
        return [col[qa:qb].t() for qa, qb, _, _ in seqs]
    flat = col.reshape(-1)
    return [flat[qa * n:qb * n].view(n, qb - qa) for qa, qb, _, _ in seqs]


def _tnd_mask(atten_mask, sparse_mode, pre, nxt, sq, sk, device):
    if atten_mask is None:  # nothing masked (sparse_mode and the band are ignored)
        return None
    if sparse_mode in (0, 1):
        raise NotImplementedError("TND with a full (maxSq x maxSkv) atten_mask is not emulated")
    if sparse_mode not in (2, 3, 4):
        raise NotImplementedError(f"sparse_mode {sparse_mode} is not emulated")
    return _mask(atten_mask, sparse_mode, pre, nxt, 1, 1, sq, sk, device)


def _check_common(pse, padding_mask, prefix, keep_prob, input_layout, actual_seq_qlen, actual_seq_kvlen):
    if input_layout not in LAYOUTS:
        raise NotImplementedError(f"input_layout {input_layout!r} is not emulated (only {LAYOUTS})")
    if any(x is not None for x in (pse, padding_mask, prefix)):
        raise NotImplementedError("pse, padding_mask and prefix are not emulated")
    if input_layout != "TND" and (actual_seq_qlen is not None or actual_seq_kvlen is not None):
        raise ValueError("actual_seq_qlen / actual_seq_kvlen are for input_layout TND (varlen)")
    if not 0.0 < keep_prob <= 1.0:
        raise ValueError("keep_prob must be in (0, 1]")


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=UNBOUNDED,
                         next_tockens=UNBOUNDED, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                         softmax_layout=""):
    """EMULATOR of the documented torch_npu.npu_fusion_attention (see the module docstring)."""
    _check_common(pse, padding_mask, prefix, keep_prob, input_layout, actual_seq_qlen, actual_seq_kvlen)
    head_dim = _head_dim(query, head_num, input_layout)
    numels = 0
    if input_layout == "TND":
        if softmax_layout not in ("", "TND"):
            raise ValueError("softmax_layout is '' or 'TND'")
        seqs = _sequences(actual_seq_qlen, actual_seq_kvlen, query.shape[0], key.shape[0])
        out = torch.zeros(query.shape, dtype=torch.float32, device=query.device)
        maxes, sums = [], []
        for qa, qb, ka, kb in seqs:
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query[qa:qb], key[ka:kb], value[ka:kb]))
            mask = _tnd_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, qb - qa, kb - ka, query.device)
            o, m, s = _attend(q, k, v, scale, keep_prob, mask)
            out[qa:qb] = o[0].permute(1, 0, 2)
            maxes.append(m[0, :, :, 0])
            sums.append(s[0, :, :, 0])
        t, n = query.shape[0], head_num
        softmax_max = _tnd_stat(maxes, seqs, t, n, softmax_layout, query.device)
        softmax_sum = _tnd_stat(sums, seqs, t, n, softmax_layout, query.device)
        numels = 0 if keep_prob == 1.0 else sum((qb - qa) * (kb - ka) for qa, qb, ka, kb in seqs) * n
        return out.to(query.dtype), softmax_max, softmax_sum, torch.empty(0, dtype=query.dtype), 0, 0, numels
    q, k, v = (_to_bnsd(t, input_layout, head_dim) for t in (query, key, value))
    b, n1, sq, _ = q.shape
    mask = _mask(atten_mask, sparse_mode, pre_tockens, next_tockens, b, n1, sq, k.shape[2], q.device)
    out, row_max, row_sum = _attend(q, k, v, scale, keep_prob, mask)
    if keep_prob < 1.0:
        numels = b * n1 * sq * k.shape[2]
    softmax_max = row_max.detach().expand(b, n1, sq, 8).contiguous()
    softmax_sum = row_sum.detach().expand(b, n1, sq, 8).contiguous()
    softmax_in = torch.empty(0, dtype=query.dtype, device=query.device)
    return _from_bnsd(out.to(query.dtype), input_layout), softmax_max, softmax_sum, softmax_in, 0, 0, numels


def _grad(q, k, v, g, o, smax, ssum, scale, mask):
    """BNSD fp64 gradients with P = exp(s - max) / sum (the op recomputes P from what it is given)."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ kk.transpose(-1, -2) * scale
    p = torch.exp(s - smax) / ssum
    if mask is not None:
        p = p.masked_fill(mask, 0.0)
    dp = g @ vv.transpose(-1, -2)
    ds = p * (dp - (g * o).sum(-1, keepdim=True))
    dq = ds @ kk * scale
    dk = (ds.transpose(-1, -2) @ q * scale).unflatten(1, (-1, groups)).sum(2)
    dv = (p.transpose(-1, -2) @ g).unflatten(1, (-1, groups)).sum(2)
    return dq, dk, dv


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=UNBOUNDED,
                              next_tockens=UNBOUNDED, inner_precise=0, seed=0, offset=0, numels=0,
                              prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                              gen_mask_parallel=True, sync=False, softmax_layout=""):
    """EMULATOR of the documented gradient op: (dq, dk, dv, dpse) in the input layout."""
    _check_common(pse, padding_mask, prefix, keep_prob, input_layout, actual_seq_qlen, actual_seq_kvlen)
    if keep_prob != 1.0:
        raise NotImplementedError("dropout in the gradient is not emulated")
    d = _head_dim(query, head_num, input_layout)
    if input_layout == "TND":
        seqs = _sequences(actual_seq_qlen, actual_seq_kvlen, query.shape[0], key.shape[0])
        maxes = _tnd_stat_read(softmax_max.double(), seqs, head_num, softmax_layout)
        sums = _tnd_stat_read(softmax_sum.double(), seqs, head_num, softmax_layout)
        grads = [torch.zeros(x.shape, dtype=torch.float64, device=x.device) for x in (query, key, value)]
        for (qa, qb, ka, kb), m, s in zip(seqs, maxes, sums):
            bnsd = lambda x, a, b: x[a:b].double().permute(1, 0, 2).unsqueeze(0)  # noqa: E731
            mask = _tnd_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, qb - qa, kb - ka, query.device)
            dq, dk, dv = _grad(bnsd(query, qa, qb), bnsd(key, ka, kb), bnsd(value, ka, kb), bnsd(dy, qa, qb),
                               bnsd(attention_in, qa, qb), m[None, :, :, None], s[None, :, :, None], scale_value, mask)
            grads[0][qa:qb], grads[1][ka:kb], grads[2][ka:kb] = (x[0].permute(1, 0, 2) for x in (dq, dk, dv))
        return tuple(g.to(x.dtype) for g, x in zip(grads, (query, key, value))) + (None,)
    q, k, v, g, o = (_to_bnsd(t, input_layout, d).double() for t in (query, key, value, dy, attention_in))
    mask = _mask(atten_mask, sparse_mode, pre_tockens, next_tockens, q.shape[0], q.shape[1], q.shape[2],
                 k.shape[2], q.device)
    dq, dk, dv = _grad(q, k, v, g, o, softmax_max[..., :1].double(), softmax_sum[..., :1].double(), scale_value, mask)
    back = lambda t, like: _from_bnsd(t.to(like.dtype), input_layout).view_as(like)  # noqa: E731
    return back(dq, query), back(dk, key), back(dv, value), None
