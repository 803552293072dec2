"""EMULATOR (not the real op): `torch_npu.npu_fusion_attention` written in plain PyTorch.

No NPU exists here, so the NPU path of `--use-flash-attn` is tested against this function,
which follows the op's contract as torch_npu's wheels state it (2.6.0, 2.9.0, 2.14.0: the
schema in csrc/aten/npu_native_functions_by_codegen.yaml, the meta functions in
op_plugin/meta/_meta_registrations.py, the documentation in _op_plugin_docs.py), not its
implementation:

- signature and defaults: the newest (2.14.0) schema, (query, key, value, head_num,
  input_layout, pse=None, padding_mask=None, atten_mask=None, scale=1., keep_prob=1.,
  pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0, prefix=None,
  actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
  sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0);
  softmax_layout and sink are first in 2.9.0's schema, dropout_mask, seed, offset in 2.14.0's;
- input_layout "SBH", "BSH" ([.., N*D]), "BSND", "BNSD"; head_num = query heads N1; key and
  value have one shape, with N2 heads, N1 % N2 == 0 (GQA); Dq == Dk; one dtype;
- out = Dropout(Softmax(Mask(scale * Q K^T, atten_mask)), keep_prob) V;
- atten_mask is bool/uint8, True = that position does NOT take part; documented shapes
  SS, 11SS, B1SS, BNSS (others, 1NSS included, raise); TND: SS only;
- with atten_mask None nothing is masked and sparse_mode / pre_tockens / next_tockens have no
  effect ("当atten_mask输入为None时, sparse_mode, pre_tockens, next_tockens参数不生效");
  sparse_mode 0: atten_mask plus the band -pre_tockens <= j - i <= next_tockens (top-left);
  1: atten_mask as given; 2: leftUpCausal (j <= i); 3: rightDownCausal (j <= i + Skv - Sq);
  4: band at the bottom-right (-pre_tockens <= j - i - (Skv - Sq) <= next_tockens). Modes
  2, 3, 4 take the compressed 2048 x 2048 upper-triangular mask, which is checked here;
- returns (attention_out in the input layout, softmax_max [B, N1, Sq, 8] fp32,
  softmax_sum [B, N1, Sq, 8] fp32, softmax_in (reserved, empty), seed, offset, numels);
- dropout (keep_prob < 1): the keep mask is a pure function of (seed, offset) over numels
  draws (B, N1, Sq, Skv order; TND: each sequence's N1, Sq_i, Skv_i in turn); seed = offset
  = 0 (the default) draws a fresh seed from torch's generator of the tensors' device; the
  (seed, offset) used is returned, and npu_fusion_attention_grad given them back rebuilds the
  mask. dropout_mask (2.14.0, "外部传入的dropout mask", format undocumented): here a bool/uint8
  tensor of numels entries, nonzero = kept; the grad op has no such argument;
- "TND" (varlen): query [T, N1, D], key/value [Tkv, N2, D]; actual_seq_qlen and
  actual_seq_kvlen are host lists of cumulative END offsets, one per batch, no leading 0,
  1..1024 entries, same length (lengths 2 2 2 -> [2, 4, 6]; a length may be 0:
  [2, 4, 4, 6, 8]; trailing batches that take no part are trailing 0s: [2, 5, 9, 0, 0], the
  tensors may then hold more tokens, left 0); each sequence attends only to its own keys;
  sparse_mode 2 / 3 / 4 apply per sequence with the compressed mask; softmax_max /
  softmax_sum are [T, N1, 8]; by default each sequence's storage in turn is [N1, Sq_i, 8]
  (head-major, "NTD"; MindSpeed's `flatten_softmax` undoes it), token-major only with
  softmax_layout="TND" (first in torch_npu 2.9.0's schema; "TND" only with input_layout TND);
- npu_fusion_attention_grad: emulate_attention_grad.py (re-exported here).

Choices the documentation leaves open are made plainly (fully masked rows give 0; the
cumulative lengths end at T unless trailing 0s say otherwise). pse, padding_mask, prefix, sink,
a full atten_mask under TND and sparse_modes 5-8 are not emulated and raise.
"""
from __future__ import annotations

import torch

from npu_contract import emulate_attention_core as core
from npu_contract import emulate_attention_tnd as tnd
from npu_contract.emulate_attention_grad import npu_fusion_attention_grad  # noqa: F401 (re-exported)

UNBOUNDED = core.UNBOUNDED


def _attend(q, k, v, scale, mask, keep, keep_prob):
    """BNSD -> (out fp32, row max, row sum), each [b, n, sq, 1] for the stats; keep: the mask or None."""
    groups = q.shape[1] // k.shape[1]
    if q.shape[1] % k.shape[1]:
        raise ValueError(f"key/value heads {k.shape[1]} must divide query heads {q.shape[1]}")
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if mask is not None:
        scores = scores.masked_fill(mask, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True) if scores.shape[-1] else torch.full(
        (*scores.shape[:-1], 1), float("-inf"), device=q.device)
    finite_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    exp = torch.exp(scores - finite_max)
    row_sum = exp.sum(dim=-1, keepdim=True)
    probs = torch.where(row_sum > 0, exp / row_sum.clamp_min(torch.finfo(torch.float32).tiny), torch.zeros_like(exp))
    if keep is not None:
        probs = probs * keep.view(probs.shape) / keep_prob
    return torch.matmul(probs, v.float()), finite_max, row_sum


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None,
                         atten_mask=None, scale=1.0, keep_prob=1.0, pre_tockens=UNBOUNDED,
                         next_tockens=UNBOUNDED, inner_precise=0, prefix=None, actual_seq_qlen=None,
                         actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True, sync=False,
                         softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
    """EMULATOR of torch_npu.npu_fusion_attention (see the module docstring)."""
    core.check_common(pse, padding_mask, prefix, sink, keep_prob, input_layout, actual_seq_qlen, actual_seq_kvlen,
                      softmax_layout)
    head_dim = core.head_dim(query, key, value, head_num, input_layout)
    seed, offset = core.draw_seed(seed, offset, query.device) if keep_prob < 1.0 else (int(seed), int(offset))
    softmax_in = torch.empty(0, dtype=query.dtype, device=query.device)
    if input_layout == "TND":
        seqs = tnd.sequences(actual_seq_qlen, actual_seq_kvlen, query.shape[0], key.shape[0])
        sizes = [head_num * (qb - qa) * (kb - ka) for qa, qb, ka, kb in seqs]
        numels = 0 if keep_prob == 1.0 else sum(sizes)
        keep = core.dropout_keep(keep_prob, numels, seed, offset, dropout_mask, query.device)
        keeps = [None] * len(seqs) if keep is None else keep.split(sizes)
        out = torch.zeros((query.shape[0], head_num, value.shape[-1]), dtype=torch.float32, device=query.device)
        maxes, sums = [], []
        for (qa, qb, ka, kb), z in zip(seqs, keeps):
            q, k, v = (x.permute(1, 0, 2).unsqueeze(0) for x in (query[qa:qb], key[ka:kb], value[ka:kb]))
            mask = core.tnd_mask(atten_mask, sparse_mode, pre_tockens, next_tockens, qb - qa, kb - ka, query.device)
            o, m, s = _attend(q, k, v, scale, mask, z, keep_prob)
            out[qa:qb] = o[0].permute(1, 0, 2)
            maxes.append(m[0, :, :, 0])
            sums.append(s[0, :, :, 0])
        t = query.shape[0]
        softmax_max = tnd.write_stat(maxes, seqs, t, head_num, softmax_layout, query.device)
        softmax_sum = tnd.write_stat(sums, seqs, t, head_num, softmax_layout, query.device)
        return out.to(query.dtype), softmax_max, softmax_sum, softmax_in, seed, offset, numels
    q, k, v = (core.to_bnsd(t, input_layout, head_dim) for t in (query, key, value))
    b, n1, sq, sk = q.shape[0], q.shape[1], q.shape[2], k.shape[2]
    mask = core.mask(atten_mask, sparse_mode, pre_tockens, next_tockens, b, n1, sq, sk, q.device)
    numels = 0 if keep_prob == 1.0 else b * n1 * sq * sk
    keep = core.dropout_keep(keep_prob, numels, seed, offset, dropout_mask, query.device)
    out, row_max, row_sum = _attend(q, k, v, scale, mask, keep, keep_prob)
    softmax_max = row_max.detach().expand(b, n1, sq, 8).contiguous()
    softmax_sum = row_sum.detach().expand(b, n1, sq, 8).contiguous()
    return core.from_bnsd(out.to(query.dtype), input_layout), softmax_max, softmax_sum, softmax_in, seed, offset, numels


EMULATORS = {"npu_fusion_attention": npu_fusion_attention, "npu_fusion_attention_grad": npu_fusion_attention_grad}
