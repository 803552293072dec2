"""Output projection + vocab-parallel cross-entropy in tiles: no [tokens, V] tensor lives.

Tiles are [token block, vocab chunk] of the logits: the vocabulary is walked in chunks for a
block of tokens (all tokens unless they are very many), so each weight chunk is read once per
pass and its gradient written once, and only the small [block, h] hidden gradient is
accumulated (walking tokens for the whole vocabulary instead re-reads the [V/TP, h] weight
and re-writes its fp32 gradient per chunk: for a small hidden size that traffic, not the
matmul, sets the time).

What is kept for backward, and why: the hidden states (as Megatron's linear keeps them: the
sequence-parallel shard, gathered again in backward), the labels and one fp32 log-sum-exp per
token. Backward recomputes each tile's logits from them. The alternative (Liger's: gradients
computed in forward, backward only scales them) needs the upstream gradient to be one scalar;
here the model returns a per-token loss and Megatron's loss function applies the loss mask and
the averaging afterwards, so the gradient is per token and the weight gradient
sum_t g_t (p_t - y_t) h_t^T cannot be formed before g is known. Recomputing costs one more
logits matmul; it is what bounds the memory at one tile.

The math is Megatron's `vocab_parallel_cross_entropy` (megatron-core 0.16.1): logits in the
activation dtype then fp32, the max over the vocabulary (over chunks, then all-reduce MAX over
TP), the sum of exp(logit - max) (chunk sums rescaled to the running max, then all-reduce SUM),
the target's logit from the shard owning it (all-reduce SUM, others give 0),
loss = log(sum) - (target - max); gradient (softmax - 1[target]) times the per-token upstream
gradient, cast to the activation dtype before the linear's backward as Megatron's `.float()`
does. The TP collectives run once per call over [tokens] vectors, not per tile.

`scale` is MuP's output multiplier (megatron-core 0.17+ `_scale_logits`: logits * m in the
activation dtype after the output layer): each tile's logits are multiplied by it in place as
Megatron multiplies the whole tensor, and the logits' gradient by it again in backward.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from npuspeed import telemetry
from npuspeed.accelerator.devices import for_device

#: counters: calls of the fused path, and chunks issued (forward and backward)
CALLS, CHUNKS = "fused_linear_ce.calls", "fused_linear_ce.chunks"
#: default logits per tile (tokens x vocab entries) on CPU: 4 MiB in fp32 (a share of the cache;
#: measured best of 256Ki-4Mi on the README's CPU)
DEFAULT_CHUNK = 1 << 20
#: on an accelerator: 128 MiB in fp32, so a tile's matmul fills the device and a 152k vocabulary
#: at 8k tokens takes tens of tiles, not thousands of launches (not measured here: no GPU)
DEVICE_CHUNK = 32 << 20
#: narrowest vocab chunk worth a matmul; token blocks shrink below all tokens only past it
MIN_VOCAB_CHUNK = 256


def default_chunk(device_type: str) -> int:
    return DEFAULT_CHUNK if for_device(device_type).host_is_device() else DEVICE_CHUNK


def tile(tokens: int, vocab_local: int, chunk: int | None, device_type: str = "cpu") -> tuple[int, int]:
    """(token block, vocab chunk) with block x chunk <= `chunk` logits (the device's default if
    None): all tokens and as wide a vocab chunk as fits; fewer tokens only when even
    MIN_VOCAB_CHUNK columns of all of them would not fit."""
    budget = default_chunk(device_type) if chunk is None else int(chunk)
    width = min(vocab_local, max(1, budget // max(1, tokens)))
    if width < min(MIN_VOCAB_CHUNK, vocab_local):
        width = min(MIN_VOCAB_CHUNK, vocab_local)
    block = max(1, min(tokens, budget // width))
    return block, width


def _world(group) -> tuple[int, int]:
    if group is None or not dist.is_initialized():
        return 1, 0
    return dist.get_world_size(group), dist.get_rank(group)


def _gather_tokens(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """All-gather along dim 0 (the sequence), as Megatron's sequence-parallel linear does."""
    if world == 1:
        return x
    out = x.new_empty((x.shape[0] * world,) + tuple(x.shape[1:]))
    dist.all_gather_into_tensor(out, x.contiguous(), group=group)
    return out


def _scatter_tokens(x: torch.Tensor, group, world: int) -> torch.Tensor:
    """Reduce-scatter along dim 0: the gradient of `_gather_tokens`."""
    if world == 1:
        return x
    out = x.new_empty((x.shape[0] // world,) + tuple(x.shape[1:]))
    dist.reduce_scatter_tensor(out, x.contiguous(), group=group)
    return out


_OUT_DTYPE_MM: dict = {}
#: exp(x) = 2 ** (x * log2(e))
LOG2E = 1.4426950408889634


def _exp_(x: torch.Tensor) -> torch.Tensor:
    """exp in place. On CPU as exp2 of x * log2(e): on the README's CPU (torch 2.13, AVX512)
    torch.exp costs about 0.9 ms per million fp32 values and the scale + exp2 about 0.45 ms
    (inputs -100 to 0; exp is 30x slower still where its results are subnormal), and the exp
    of every logit, twice per call, is the largest elementwise cost of the tiles. The extra
    rounding of the scaled exponent keeps it within about 1e-6 of exp, relative to the result,
    for |x| <= 20 (the terms that matter in a sum of exps). Elsewhere torch.exp (not measured)."""
    if for_device(x).host_is_device():
        return x.mul_(LOG2E).exp2_()
    return x.exp_()


def _in_tile(tgt: torch.Tensor, own: torch.Tensor, v0: int, v1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Column of each token's target within vocab columns [v0, v1) (clamped, [n, 1]) and whether
    the target is there: masks instead of index lists, so no device-to-host sync per tile."""
    inside = own & (tgt >= v0) & (tgt < v1)
    return (tgt - v0).clamp_(0, v1 - v0 - 1)[:, None], inside


def _add_mm(acc32: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """acc32 += a @ b with an fp32 result. fp32 inputs: addmm in place. 16-bit inputs: the
    device's mm with an fp32 output where it has one (CUDA), else the tile's product in the
    input dtype (what Megatron's own 16-bit matmul gives) accumulated in fp32 across tiles."""
    if a.dtype == torch.float32:
        acc32.addmm_(a, b)
        return
    key = a.device.type
    if _OUT_DTYPE_MM.get(key, True):
        try:
            acc32.add_(torch.mm(a, b, out_dtype=torch.float32))
            _OUT_DTYPE_MM[key] = True
            return
        except (RuntimeError, TypeError, NotImplementedError):
            _OUT_DTYPE_MM[key] = False
    acc32.add_(torch.mm(a, b))


class LinearCrossEntropy(torch.autograd.Function):
    """loss[s, b] = CE(hidden[s, b, h] @ weight[V_local, h]^T, labels[s, b]) over a TP-split vocab.

    `sequence_parallel`: hidden is this rank's sequence shard, all-gathered first (grad:
    reduce-scatter); otherwise, under TP, the hidden grad is all-reduced (Megatron's
    ColumnParallelLinear with allreduce_dgrad). One tile buffer per call is reused by every
    tile (out= matmuls, in-place elementwise).
    """

    @staticmethod
    def forward(ctx, hidden, weight, labels, group, sequence_parallel, chunk, scale=None):
        world, rank = _world(group)
        full = _gather_tokens(hidden, group, world) if sequence_parallel else hidden
        s, b = labels.shape
        h = full.reshape(s * b, -1)
        target = labels.reshape(-1)
        vocab = weight.shape[0]
        start = rank * vocab
        n = h.shape[0]
        block, width = tile(n, vocab, chunk, h.device.type)
        f32 = dict(dtype=torch.float32, device=h.device)
        run_max = torch.full((n,), float("-inf"), **f32)
        run_sum = torch.zeros(n, **f32)
        target_logit = torch.zeros(n, **f32)
        owned = (target >= start) & (target < start + vocab)
        local_target = torch.where(owned, target - start, torch.zeros_like(target))
        buf = torch.empty(block * width, dtype=h.dtype, device=h.device)
        buf32 = buf if h.dtype == torch.float32 else torch.empty(block * width, **f32)
        issued = 0
        for t0 in range(0, n, block):
            t1 = min(n, t0 + block)
            hb, tgt, own = h[t0:t1], local_target[t0:t1], owned[t0:t1]
            for v0 in range(0, vocab, width):
                v1 = min(vocab, v0 + width)
                shape = (t1 - t0, v1 - v0)
                out, logits = buf[:shape[0] * shape[1]].view(shape), buf32[:shape[0] * shape[1]].view(shape)
                torch.mm(hb, weight[v0:v1].t(), out=out)
                if scale is not None:
                    out.mul_(scale)
                # the target's logit where this tile holds it (0 elsewhere; no host sync); the
                # max and the target read the tile in the activation dtype (upcast exactly)
                idx, inside = _in_tile(tgt, own, v0, v1)
                target_logit[t0:t1] += torch.where(inside, out.gather(1, idx)[:, 0].float(), 0.0)
                # running max and sum of exp(logit - running max), the sum rescaled when the max
                # grows; in the fp32 tile (torch's logsumexp would allocate a second one), where
                # the subtraction also does Megatron's logits.float() (one pass, not two)
                new_max = torch.maximum(run_max[t0:t1], torch.amax(out, dim=-1).float())
                chunk_sum = _exp_(torch.sub(out, new_max[:, None], out=logits)).sum(dim=-1)
                run_sum[t0:t1].mul_(torch.exp(run_max[t0:t1] - new_max)).add_(chunk_sum)
                run_max[t0:t1] = new_max
                issued += 1
        del buf, buf32, out, logits
        # across TP as Megatron: all-reduce MAX of the max, all-reduce SUM of the sums of
        # exp(logit - max) (each shard's rescaled to the global max) and of the target's
        # (logit - max) from its owner (0 elsewhere)
        gmax = run_max.clone()
        if world > 1:
            dist.all_reduce(gmax, op=dist.ReduceOp.MAX, group=group)
        both = torch.stack([run_sum * torch.exp(run_max - gmax) if world > 1 else run_sum,
                            torch.where(owned, target_logit - gmax, torch.zeros_like(gmax))])
        if world > 1:
            dist.all_reduce(both, group=group)
        sum_exp, predicted = both[0], both[1]
        log_sum = torch.log(sum_exp)
        loss = log_sum - predicted
        ctx.save_for_backward(hidden, weight, local_target, owned, log_sum.add_(gmax))
        ctx.group, ctx.sp, ctx.tile, ctx.world, ctx.scale = group, sequence_parallel, (block, width), world, scale
        telemetry.count(CALLS)
        telemetry.count(CHUNKS, issued)
        return loss.view(s, b)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, weight, local_target, owned, lse = ctx.saved_tensors
        group, world, (block, width) = ctx.group, ctx.world, ctx.tile
        full = _gather_tokens(hidden, group, world) if ctx.sp else hidden
        h = full.reshape(-1, full.shape[-1])
        n, vocab = h.shape[0], weight.shape[0]
        g = grad_loss.reshape(-1).float()
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        dh32 = torch.zeros(h.shape, dtype=torch.float32, device=h.device) if need_h else None
        one_block = block >= n
        nonneg = bool((g >= 0).all())
        # one token block: each weight chunk's gradient is one matmul over all tokens, written
        # once in the weight's dtype (as Megatron's one weight-gradient matmul rounds it); several
        # blocks: accumulated in fp32
        dw = (torch.empty_like(weight) if one_block and weight.dtype == h.dtype else
              torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)) if need_w else None
        buf = torch.empty(block * width, dtype=h.dtype, device=h.device)
        buf32 = buf if h.dtype == torch.float32 else torch.empty(block * width, dtype=torch.float32, device=h.device)
        issued = 0
        for t0 in range(0, n, block):
            t1 = min(n, t0 + block)
            hb, tgt, own, gb = h[t0:t1], local_target[t0:t1], owned[t0:t1], g[t0:t1, None]
            lse_b = lse[t0:t1, None]
            shift = (lse_b - torch.log(gb)) if nonneg else None  # log 0 = -inf: masked tokens give 0
            for v0 in range(0, vocab, width):
                v1 = min(vocab, v0 + width)
                shape = (t1 - t0, v1 - v0)
                out, p = buf[:shape[0] * shape[1]].view(shape), buf32[:shape[0] * shape[1]].view(shape)
                w = weight[v0:v1]
                torch.mm(hb, w.t(), out=out)
                if ctx.scale is not None:
                    out.mul_(ctx.scale)
                # the subtraction writes the fp32 tile from the activation-dtype one (no copy pass)
                if shift is not None:  # exp(logit - lse + log g) = softmax * g, in two passes
                    _exp_(torch.sub(out, shift, out=p))
                else:  # softmax over the whole (TP-split) vocabulary, times g
                    _exp_(torch.sub(out, lse_b, out=p)).mul_(gb)
                idx, inside = _in_tile(tgt, own, v0, v1)
                p.scatter_add_(1, idx, torch.where(inside, -gb[:, 0], 0.0)[:, None])  # (softmax - 1[target]) * g
                if p is not out:
                    out.copy_(p)  # the gradient reaches the matmul in the activation dtype, as in Megatron
                if ctx.scale is not None:
                    out.mul_(ctx.scale)  # through logits * m (in the activation dtype)
                if need_h:
                    _add_mm(dh32[t0:t1], out, w)
                if need_w:
                    if dw.dtype == out.dtype:
                        torch.mm(out.t(), hb, out=dw[v0:v1]) if one_block else dw[v0:v1].addmm_(out.t(), hb)
                    else:
                        _add_mm(dw[v0:v1], out.t(), hb)
                issued += 1
        telemetry.count(CHUNKS, issued)
        dhidden = None
        if need_h:
            dh = dh32.to(h.dtype).view_as(full)
            if ctx.sp:
                dhidden = _scatter_tokens(dh, group, world)
            else:
                if world > 1:
                    dist.all_reduce(dh, group=group)
                dhidden = dh
        dweight = dw.to(weight.dtype) if need_w else None
        return dhidden, dweight, None, None, None, None, None


def linear_cross_entropy(hidden, weight, labels, group=None, sequence_parallel=False, chunk=None, scale=None):
    """Per-token loss [s, b] of `hidden` [s(/TP under SP), b, h] projected by `weight`
    [V/TP, h] (the logits times `scale` where given: MuP) against `labels` [s, b] (ids in the
    full vocabulary)."""
    scale = None if scale is None or float(scale) == 1.0 else float(scale)
    return LinearCrossEntropy.apply(hidden, weight, labels, group, bool(sequence_parallel), chunk, scale)
