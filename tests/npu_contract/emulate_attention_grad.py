"""EMULATOR (not the real op): `torch_npu.npu_fusion_attention_grad` in plain PyTorch (see
emulate_attention.py for the contract). P is recomputed as exp(scale * QK^T - max)
/ sum from the max and sum it is given, D = rowsum(dy * attention_in), and with keep_prob < 1
the keep mask is rebuilt from (seed, offset, numels) exactly as the forward drew it.

Returns the 2.6.0 arity, (dq, dk, dv, dpse) with dpse the meta function's empty [0] (pse is
not emulated). 2.9.0 and 2.14.0 add a 5th output, dsink, which is not computed (sink must be
None): a caller standing in for those releases appends it from their meta function.
"""
from __future__ import annotations

import torch

from npu_contract import emulate_attention_core as core
from npu_contract import emulate_attention_tnd as tnd


def _grad(q, k, v, g, o, smax, ssum, scale, mask, keep, keep_prob):
    """BNSD fp64 gradients of Dropout(P) V with P = exp(s - max) / sum; keep: the mask or None."""
    groups = q.shape[1] // k.shape[1]
    kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    s = q @ kk.transpose(-1, -2) * scale
    p = torch.exp(s - smax) / ssum
    if mask is not None:
        p = p.masked_fill(mask, 0.0)
    scale_drop = 1.0 if keep is None else keep.view(p.shape).to(p.dtype) / keep_prob
    dp = (g @ vv.transpose(-1, -2)) * scale_drop
    ds = p * (dp - (g * o).sum(-1, keepdim=True))
    dq = ds @ kk * scale
    dk = (ds.transpose(-1, -2) @ q * scale).unflatten(1, (-1, groups)).sum(2)
    dv = ((p * scale_drop).transpose(-1, -2) @ g).unflatten(1, (-1, groups)).sum(2)
    return dq, dk, dv


def _keep(keep_prob, numels, expected, seed, offset, device):
    if keep_prob < 1.0 and numels != expected:
        raise ValueError(f"keep_prob {keep_prob}: numels {numels} is not this call's {expected}; "
                         "pass back the forward's seed, offset and numels")
    return core.dropout_keep(keep_prob, expected, seed, offset, None, device)


def npu_fusion_attention_grad(query, key, value, dy, head_num, input_layout, *, pse=None, padding_mask=None,
                              atten_mask=None, softmax_max=None, softmax_sum=None, softmax_in=None,
                              attention_in=None, scale_value=1.0, keep_prob=1.0, pre_tockens=core.UNBOUNDED,
                              next_tockens=core.UNBOUNDED, inner_precise=0, seed=0, offset=0, numels=0,
                              prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                              gen_mask_parallel=True, sync=False, softmax_layout="", sink=None):
    """EMULATOR of the gradient op: (dq, dk, dv, dpse) in the input layout (see the module docstring)."""
    core.check_common(pse, padding_mask, prefix, sink, keep_prob, input_layout, actual_seq_qlen, actual_seq_kvlen,
                      softmax_layout)
    d = core.head_dim(query, key, value, head_num, input_layout)
    dpse = torch.empty(0, dtype=query.dtype, device=query.device)
    if input_layout == "TND":
        seqs = tnd.sequences(actual_seq_qlen, actual_seq_kvlen, query.shape[0], key.shape[0])
        maxes = tnd.read_stat(softmax_max.double(), seqs, head_num, softmax_layout)
        sums = tnd.read_stat(softmax_sum.double(), seqs, head_num, softmax_layout)
        sizes = [head_num * (qb - qa) * (kb - ka) for qa, qb, ka, kb in seqs]
        keep = _keep(keep_prob, numels, sum(sizes), seed, offset, query.device)
        keeps = [None] * len(seqs) if keep is None else keep.split(sizes)
        grads = [torch.zeros(x.shape, dtype=torch.float64, device=x.device) for x in (query, key, value)]
        for (qa, qb, ka, kb), m, s, z in zip(seqs, maxes, sums, keeps):
            bnsd = lambda x, a, b: x[a:b].double().permute(1, 0, 2).unsqueeze(0)  # noqa: E731
            mask = core.tnd_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, qb - qa, kb - ka, query.device)
            dq, dk, dv = _grad(bnsd(query, qa, qb), bnsd(key, ka, kb), bnsd(value, ka, kb), bnsd(dy, qa, qb),
                               bnsd(attention_in, qa, qb), m[None, :, :, None], s[None, :, :, None], scale_value,
                               mask, z, keep_prob)
            grads[0][qa:qb], grads[1][ka:kb], grads[2][ka:kb] = (x[0].permute(1, 0, 2) for x in (dq, dk, dv))
        return tuple(g.to(x.dtype) for g, x in zip(grads, (query, key, value))) + (dpse,)
    q, k, v, g, o = (core.to_bnsd(t, input_layout, d).double() for t in (query, key, value, dy, attention_in))
    b, n, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = core.mask(atten_mask, sparse_mode, pre_tockens, next_tockens, b, n, sq, sk, q.device)
    keep = _keep(keep_prob, numels, b * n * sq * sk, seed, offset, q.device)
    dq, dk, dv = _grad(q, k, v, g, o, softmax_max[..., :1].double(), softmax_sum[..., :1].double(), scale_value,
                       mask, keep, keep_prob)
    back = lambda t, like: core.from_bnsd(t.to(like.dtype), input_layout).view_as(like)  # noqa: E731
    return back(dq, query), back(dk, key), back(dv, value), dpse
