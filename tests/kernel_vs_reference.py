"""npuspeed's Triton kernels (npuspeed/ops/triton/) against their pure-PyTorch references on one
device, forward and backward (every input's gradient, the norm weight's included), in the dtype
asked. One set of checks for two tiers: the CPU tier runs them through Triton's interpreter
(tests/unit/_triton_kernel_checks.py, small block caps patched in so small shapes span several
blocks), the device tier on the GPU or NPU itself (tests/device/test_triton_kernels_on_device.py:
the real caps, odd widths and the model's sizes).

Each check calls the kernel's module directly, never the fused-op rule (which drops a kernel
that disagrees and runs Megatron's path), and first asserts the kernel takes the call: else its
front end would run the reference and the check would compare the reference with itself.
Inputs are drawn on the host from a fixed seed and moved, so every device sees the same numbers.
"""
from __future__ import annotations

import contextlib
import importlib.util
import math

import torch

from npuspeed.ops.moe_permute import permute_reference, unpermute_reference
from npuspeed.ops.rms_norm import rms_norm_reference
from npuspeed.ops.rope import rotary_pos_emb_reference
from npuspeed.ops.swiglu import swiglu_reference
from npuspeed.ops.triton import moe_permute as tmoe
from npuspeed.ops.triton import rms_norm as trms
from npuspeed.ops.triton import rope as trope
from npuspeed.ops.triton import swiglu as tswiglu

DTYPES = (torch.float32, torch.bfloat16)
#: (rtol, atol) per dtype; a gradient summed over n terms (the norm weight's) takes atol x sqrt(n)
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 3e-2)}


def close(got, want, dtype, what: str, scale: float = 1.0) -> None:
    rtol, atol = TOL[dtype]
    torch.testing.assert_close(got.float(), want.float(), rtol=rtol, atol=atol * scale,
                               msg=lambda m: f"{what} ({dtype}, {tuple(got.shape)}): {m}")


def randn(gen, shape, dtype, device, scale=1.0, shift=0.0) -> torch.Tensor:
    return (torch.randn(shape, generator=gen) * scale + shift).to(device=device, dtype=dtype)


def twins(*tensors):
    """Two sets of fresh leaves (kernel's, reference's) of the same values."""
    return ([t.detach().clone().requires_grad_() for t in tensors],
            [t.detach().clone().requires_grad_() for t in tensors])


def backward_both(outs, refs, gen) -> None:
    """One random upstream gradient per output, the same for the kernel and the reference."""
    grads = [randn(gen, o.shape, o.dtype, o.device) for o in outs]
    sum((o * g).sum() for o, g in zip(outs, grads)).backward()
    sum((r * g).sum() for r, g in zip(refs, grads)).backward()
    return grads


def check_rms_norm(device, dtype, shape, weight="same", residual=False, eps=1e-5) -> None:
    """RMSNorm (weight: "same" dtype as x, "fp32" (the output promotes, as torch.nn.RMSNorm) or
    None), or with `residual` the fused residual add + RMSNorm returning (y, x + residual)."""
    gen = torch.Generator().manual_seed(0)
    rows, width = math.prod(shape[:-1]), shape[-1]
    inputs = [randn(gen, shape, dtype, device) for _ in range(2 if residual else 1)]
    if weight is not None:
        inputs.append(randn(gen, (width,), torch.float32 if weight == "fp32" else dtype, device, 0.1, 1.0))
    (mine, ref), w = twins(*inputs), inputs[-1] if weight is not None else None
    assert trms.supports(inputs[0], w), f"rms_norm kernel refuses {shape} {dtype}"
    split = (lambda ts: (ts[:-1], ts[-1])) if weight is not None else (lambda ts: (ts, None))
    (xs, wm), (xrs, wr) = split(mine), split(ref)
    if residual:
        outs, refs = trms.rms_norm_residual(*xs, wm, eps), trms.rms_norm_residual_reference(*xrs, wr, eps)
        if dtype == torch.float32:  # the add is rounded to the activation dtype once, as unfused
            assert torch.equal(outs[1], refs[1])
    else:
        outs, refs = (trms.rms_norm(*xs, wm, eps),), (rms_norm_reference(*xrs, wr, eps),)
    for name, o, r in zip(("y", "x + residual"), outs, refs):
        assert o.dtype == r.dtype and o.shape == r.shape, (name, o.dtype, r.dtype)
        close(o, r, dtype, f"rms_norm {name}")
    backward_both(outs, refs, gen)
    for i, (a, b) in enumerate(zip(mine, ref)):
        is_w = weight is not None and i == len(mine) - 1
        close(a.grad, b.grad, dtype, f"rms_norm d{'weight' if is_w else 'input'}", math.sqrt(rows) if is_w else 1)


def check_swiglu(device, dtype, shape) -> None:
    """SwiGLU of the last dimension's two halves (Megatron's gate half first; against Megatron's
    own function too where megatron-core is importable)."""
    gen = torch.Generator().manual_seed(1)
    x = randn(gen, shape, dtype, device)
    assert tswiglu.supports(x), f"swiglu kernel refuses {shape} {dtype}"
    (xm,), (xr,) = twins(x)
    y, yr = tswiglu.swiglu(xm), swiglu_reference(xr)
    close(y, yr, dtype, "swiglu")
    if importlib.util.find_spec("megatron") is not None:
        from megatron.core.fusions.fused_bias_swiglu import swiglu as megatron_swiglu

        close(y, megatron_swiglu(x), dtype, "swiglu against Megatron's")
    backward_both((y,), (yr,), gen)
    close(xm.grad, xr.grad, dtype, "swiglu dinput")


def freqs(s, rot, per_batch=0, device="cpu", gen=None) -> torch.Tensor:
    """Megatron's angles [s, 1, 1, rot] (or varying along b too: [s, per_batch, 1, rot])."""
    inv = 1.0 / (10000 ** (torch.arange(0, rot, 2, dtype=torch.float32) / rot))
    f = torch.outer(torch.arange(s, dtype=torch.float32), inv)
    f = torch.cat((f, f), dim=-1)[:, None, None, :]
    return (f + torch.randn(s, per_batch, 1, rot, generator=gen) if per_batch else f).to(device)


@contextlib.contextmanager
def counting(module, name: str):
    """The calls of `module.name` made inside, as a list that grows."""
    calls, real = [], getattr(module, name)
    setattr(module, name, lambda *a, **kw: calls.append(1) or real(*a, **kw))
    try:
        yield calls
    finally:
        setattr(module, name, real)


def check_rope_qk(device, dtype, s, b, hq, hk, d, rot, interleaved=False, per_batch=False, mscale=1.25) -> None:
    """RoPE of q [s, b, hq, d] and k [s, b, hk, d] (GQA) in one launch each way; d - rot channels pass."""
    gen = torch.Generator().manual_seed(2)
    f = freqs(s, rot, b if per_batch else 0, device, gen)
    q, k = randn(gen, (s, b, hq, d), dtype, device), randn(gen, (s, b, hk, d), dtype, device)
    assert trope.supports_qk(q, k, f), f"rope kernel refuses q {tuple(q.shape)} k {tuple(k.shape)} {dtype}"
    (qm, km), (qr, kr) = twins(q, k)
    with counting(trope, "_launch") as launches:
        outs = trope.rotary_pos_emb_qk(qm, km, f, interleaved, mscale)
        refs = tuple(rotary_pos_emb_reference(t, f, interleaved, mscale) for t in (qr, kr))
        for name, o, r in zip("qk", outs, refs):
            close(o, r, dtype, f"rope {name}")
        backward_both(outs, refs, gen)
    assert len(launches) == 2, launches  # one forward, one backward for q and k together
    close(qm.grad, qr.grad, dtype, "rope dq")
    close(km.grad, kr.grad, dtype, "rope dk")


def check_rope_on_a_view(device) -> None:
    """One tensor rotated in place of Megatron's q, a strided view of the fused projection: the
    kernel reads and writes through the strides, and the other channels get no gradient."""
    gen = torch.Generator().manual_seed(4)
    qkv = randn(gen, (6, 1, 4, 3 * 16), torch.float32, device).requires_grad_()
    q, f = qkv[..., :16], freqs(6, 16, device=device)
    assert trope.supports(q, f)
    y = trope.rotary_pos_emb(q, f)
    close(y, rotary_pos_emb_reference(q.detach(), f), torch.float32, "rope on a view")
    y.sum().backward()
    assert qkv.grad is not None and torch.count_nonzero(qkv.grad[..., 16:]) == 0


def routing(tokens, experts, topk, device="cpu"):
    """(routing map [T, E] bool, probs [T, E]): top-k of random logits, expert 1 empty, token 2
    dropped, token 5 with one expert more or fewer than top-k."""
    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, experts, generator=gen)
    logits[:, 1] = -1e9
    top = logits.topk(topk, dim=1).indices
    rmap = torch.zeros(tokens, experts, dtype=torch.bool).scatter(1, top, True)
    probs = torch.zeros(tokens, experts).scatter(1, top, torch.softmax(logits.gather(1, top), -1))
    rmap[2] = False
    rmap[5, 0] = rmap[5, 0] ^ True
    return rmap.to(device), probs.to(device)


def row_probs(probs, rmap):
    """Megatron's permuted probabilities: masked_select over the transposed map."""
    return probs.T.contiguous().masked_select(rmap.T.contiguous())


def check_moe(device, dtype, tokens, experts, hidden, topk, with_probs=True) -> None:
    """Permute then unpermute (weighted by the probabilities, or not), forward and backward."""
    rmap, probs = routing(tokens, experts, topk, device)
    gen = torch.Generator().manual_seed(3)
    x = randn(gen, (tokens, hidden), dtype, device)
    assert tmoe.supports(x), f"moe_permute kernel refuses {tuple(x.shape)} {dtype}"
    (xm, pm), (xr, pr) = twins(x, probs)
    permuted, permuted_probs, idx, per_expert = tmoe.moe_permute(xm, rmap, pm if with_probs else None)
    ref, ref_idx, ref_counts = permute_reference(xr, rmap)
    assert torch.equal(permuted, ref) and torch.equal(idx, ref_idx) and torch.equal(per_expert, ref_counts)
    ref_probs = row_probs(pr, rmap) if with_probs else None
    if with_probs:
        assert torch.equal(permuted_probs, ref_probs)
    out = tmoe.moe_unpermute(permuted * 3 - 1, idx, tokens, pm if with_probs else None, rmap)
    ref_out = unpermute_reference(ref * 3 - 1, ref_idx, ref_probs, tokens)
    if dtype == torch.float32 and device == "cpu":  # fp32 sum in Megatron's (expert) order: the same bits
        assert torch.equal(out, ref_out)  # (a GPU's scatter_add in the reference adds in any order)
    close(out, ref_out, dtype, "moe unpermute(permute)")
    assert torch.count_nonzero(out[2]) == 0  # the dropped token gets nothing back
    grads = backward_both((out,) + ((permuted_probs,) if with_probs else ()),
                          (ref_out,) + ((ref_probs,) if with_probs else ()), gen)
    close(xm.grad, xr.grad, dtype, "moe dtokens")
    if with_probs:
        close_dprobs(pm.grad, pr.grad, dtype, (grads[0].double() * (x.double() * 3 - 1)).abs().sum(-1, keepdim=True))


def close_dprobs(got, want, dtype, abs_terms) -> None:
    """A token's dprob is a dot product over `hidden` (upstream gradient x its row): in fp32 two
    summation orders (a GPU's reduction tree against the reference's) differ by up to a few
    eps x sum |terms|, which at hidden 1024 passes a fixed 1e-5 (seen on an H100: 1.7e-5 on one of
    32768); a wrong row or a missing term is off by about a term, thousands of times more."""
    if dtype != torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=5e-2, msg=lambda m: f"moe dprobs: {m}")
        return
    err = (got.double() - want.double()).abs()
    allowed = 1e-5 + 1e-4 * want.double().abs() + 4 * torch.finfo(torch.float32).eps * abs_terms
    worst = int((err - allowed).argmax())
    off = int((err > allowed).sum())
    assert off == 0, (f"moe dprobs ({tuple(got.shape)}): {off} elements off, "
                      f"worst {err.flatten()[worst]:.3g} > {allowed.flatten()[worst]:.3g}")
