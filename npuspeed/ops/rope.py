"""Rotary position embedding on Megatron's [s, b, h, d] layout (its `_apply_rotary_pos_emb_bshd`).

`freqs` is Megatron's angle tensor, broadcastable to [s, b, h, rot] with rot <= d; the last
d - rot channels pass through. cos and sin are taken as Megatron takes them (times mscale,
rounded to t's dtype) so the fp32 results agree bit for bit. `rotary_pos_emb` runs
`npuspeed::rotary_pos_emb` on CPU (csrc/cpu/rope.cpp), `torch_npu.npu_rotary_mul` on an NPU
(rotate-half form, within its documented limits: `npu_fits`; unscaled cos/sin, mscale applied
to its output), and `rotary_pos_emb_reference` otherwise. `freqs` gets no gradient from
the fused paths; when it requires one, the reference runs.
"""
from __future__ import annotations

import weakref

import torch

from npuspeed.ops import _dispatch, fused_choice
from npuspeed.ops.npu import elementwise as npu_kernels

OP = "rotary_pos_emb"


def _cos_sin(t: torch.Tensor, freqs: torch.Tensor, mscale: float):
    return (torch.cos(freqs) * mscale).to(t.dtype), (torch.sin(freqs) * mscale).to(t.dtype)


_TABLES: dict = {}  # (id, version, dtypes, mscale) -> (weakref to freqs, cos, sin)
_MAX_TABLES = 8


def cached_cos_sin(t: torch.Tensor, freqs: torch.Tensor, mscale: float, dtype: torch.dtype):
    """`_cos_sin` held as `dtype` (exact: it only widens t's rounding), computed once per freqs.

    Megatron hands every layer of a step the same freqs tensor (and RotaryEmbedding caches it
    across steps), so the fused paths would otherwise take cos, sin and a conversion 2 x layers
    times per micro-batch. The entry is keyed by the tensor's identity and version counter, so
    an in-place change or a new tensor is a miss; a dead freqs' entry is never matched again.
    """
    key = (id(freqs), freqs._version, freqs.data_ptr(), t.dtype, dtype, float(mscale))
    hit = _TABLES.get(key)
    if hit is not None and hit[0]() is freqs:
        return hit[1], hit[2]
    cos, sin = (x.to(dtype) for x in _cos_sin(t, freqs, mscale))
    if len(_TABLES) >= _MAX_TABLES:
        _TABLES.clear()
    _TABLES[key] = (weakref.ref(freqs), cos, sin)
    return cos, sin


def _rotate_half(x: torch.Tensor, interleaved: bool) -> torch.Tensor:
    if not interleaved:
        x1, x2 = torch.chunk(x, 2, dim=-1)
        return torch.cat((-x2, x1), dim=-1)
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((-x2, x1), dim=-1).flatten(-2)


def rotary_pos_emb_reference(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                             mscale: float = 1.0) -> torch.Tensor:
    rot = freqs.shape[-1]
    t_rot, t_pass = t[..., :rot], t[..., rot:]
    cos, sin = _cos_sin(t, freqs, mscale)
    return torch.cat((t_rot * cos + _rotate_half(t_rot, interleaved) * sin, t_pass), dim=-1)


def _register() -> None:
    def setup_context(ctx, inputs, output):
        _t, cos, sin, interleaved = inputs
        ctx.save_for_backward(cos, sin)
        ctx.interleaved = interleaved

    def backward(ctx, grad):
        cos, sin = ctx.saved_tensors
        return torch.ops.npuspeed.rotary_pos_emb_backward(grad, cos, sin, ctx.interleaved), None, None, None

    torch.library.register_autograd("npuspeed::rotary_pos_emb", backward, setup_context=setup_context)

    @torch.library.register_fake("npuspeed::rotary_pos_emb")
    def _fake(t, cos, sin, interleaved):
        return torch.empty_like(t)

    @torch.library.register_fake("npuspeed::rotary_pos_emb_backward")
    def _fake_bwd(grad, cos, sin, interleaved):
        return torch.empty_like(grad)


def supported(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """Whether the fused paths take this call (4-D [s, b, h, d], even rot <= d, no freqs grad)."""
    rot = freqs.shape[-1] if freqs.dim() else 0
    return (t.dim() == 4 and freqs.dim() == 4 and rot % 2 == 0 and 0 < rot <= t.shape[-1]
            and not freqs.requires_grad)


NPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_fits(t: torch.Tensor, freqs: torch.Tensor) -> bool:
    """torch_npu's documented limits of npu_rotary_mul (half mode) for Megatron's SBND layout:
    "D < 896，且为2的倍数; B, N < 1000", cos/sin shaped S11D, SB1D or SBND, float16/bfloat16/float32
    (D is the rotated part, rot). Where one fails the op is not a candidate."""
    s, b, n, _ = t.shape
    fs, fb, fn, rot = freqs.shape
    return (t.dtype in NPU_DTYPES and rot < 896 and rot % 2 == 0 and b < 1000 and n < 1000
            and fs == s and (fb, fn) in {(1, 1), (b, 1), (b, n)})


def rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool = False,
                   mscale: float = 1.0) -> torch.Tensor:
    """Megatron's rotary embedding of t [s, b, h, d] by the angles `freqs` (see the module doc)."""
    fits = supported(t, freqs) and freqs.device == t.device
    impl = _dispatch.implementation(OP, t) if fits else "reference"
    if not _takes(impl, t, freqs, interleaved):  # npu_rotary_mul: rotate-half, its limits
        impl = "reference"
    _dispatch.record(OP, impl)
    return _kernels().get(impl, rotary_pos_emb_reference)(t, freqs, interleaved, mscale)


def _kernels() -> dict:
    """The device kernel per implementation (`_dispatch.implementation`); else the reference."""
    return {"cpp": _cpp, _dispatch.NPU_IMPL: _npu}


def _takes(impl: str, t, freqs, interleaved: bool) -> bool:
    """Whether implementation `impl` takes this call: npu_rotary_mul is rotate-half only, within
    its limits (npu_fits); the others take what `supported` let through."""
    limits = {_dispatch.NPU_IMPL: lambda: not interleaved and npu_fits(t, freqs)}
    return limits.get(impl, lambda: True)()


def _cpp(t, freqs, interleaved, mscale):
    # the kernel computes in the accumulation type: hand it the tables so
    cos, sin = cached_cos_sin(t, freqs, mscale, torch.promote_types(t.dtype, torch.float32))
    _dispatch.ensure_registered(OP, _register)
    return torch.ops.npuspeed.rotary_pos_emb(t, cos, sin, bool(interleaved))


def _npu(t, freqs, interleaved, mscale):
    # npu_rotary_mul's cos/sin must lie in [-1, 1] ("r1: 数据范围：[-1, 1]"): mscale is applied to its output
    cos, sin = cached_cos_sin(t, freqs, 1.0, t.dtype)
    rot = freqs.shape[-1]
    out = npu_kernels.rotary_mul(t[..., :rot], cos, sin)
    if mscale != 1.0:
        out = out * mscale
    return out if rot == t.shape[-1] else torch.cat((out, t[..., rot:]), dim=-1)


def candidates(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float, megatron) -> dict:
    """The implementations --use-fused-rotary-pos-emb chooses among, as fn(t). `megatron(t)` is
    Megatron's `_apply_rotary_pos_emb_bshd` (the flag off); torch has no native RoPE; C++ on
    CPU, torch_npu's `npu_rotary_mul` on an NPU (rotate-half only), Triton on CUDA/NPU;
    `compile`: torch.compile of `rotary_pos_emb_reference` (Megatron's maths, op for op:
    fused_choice.compiled, accelerators by default). Liger's RoPE takes q and k together, so it
    is a candidate of the q+k op only (`qk_candidates`)."""
    found = {"megatron": megatron}
    if not (supported(t, freqs) and freqs.device == t.device):
        return found
    impl = _dispatch.implementation(OP, t)
    kernel = _kernels().get(impl)
    if kernel is not None and _takes(impl, t, freqs, interleaved):
        found[impl] = lambda t: kernel(t, freqs, interleaved, mscale)
    triton = fused_choice.triton_kernel("rope", "rotary_pos_emb", t, freqs)
    if triton is not None:
        found["triton"] = lambda t: triton(t, freqs, interleaved, mscale)
    compiled = fused_choice.compiled(OP, rotary_pos_emb_reference, t, freqs)
    if compiled is not None:
        found["compile"] = lambda t: compiled(t, freqs, interleaved, mscale)
    return found


def liger_fits(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, interleaved: bool) -> bool:
    """What Liger's LigerRopeFunction takes: the rotate-half form over the whole head
    (rot == d), one angle row per position shared by the batch (freqs [s, 1, 1, d]), q and k of
    one dtype, sequence and batch."""
    return (not interleaved and freqs.dim() == 4 and freqs.shape[1] == freqs.shape[2] == 1
            and q.dim() == k.dim() == 4 and freqs.shape[0] == q.shape[0] == k.shape[0]
            and q.shape[1] == k.shape[1] and freqs.shape[-1] == q.shape[-1] == k.shape[-1]
            and q.dtype == k.dtype)


def _liger_qk(fn, q, k, freqs, mscale):
    """Liger's LigerRopeFunction (HF's layout [b, h, s, d], cos/sin [1, s, d]) on Megatron's
    [s, b, h, d] q and k. Its kernel rotates in place in the storage it is given and its
    backward in the incoming gradients' storage, so q and k go in as copies where its
    `.contiguous()` would not copy (batch 1: [s, 1, h, d] already is its layout)."""
    cos, sin = cached_cos_sin(q, freqs, mscale, q.dtype)  # Megatron's: cos(freqs) * mscale, in q's dtype
    cos, sin = cos[:, 0, 0, :].unsqueeze(0), sin[:, 0, 0, :].unsqueeze(0)

    def hf(t):
        t = t.permute(1, 2, 0, 3)  # [s, b, h, d] -> [b, h, s, d]
        return t.clone() if t.transpose(1, 2).is_contiguous() else t

    q_out, k_out = fn.apply(hf(q), hf(k), cos, sin)
    return q_out.permute(2, 0, 1, 3).contiguous(), k_out.permute(2, 0, 1, 3).contiguous()


def call(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float, megatron) -> dict:
    """The chooser's arguments for this call: what `fused_rotary_pos_emb` runs and the kernel
    table (npuspeed.ops.fused_table) times, one definition for both."""
    return dict(op=OP, candidates=candidates(t, freqs, interleaved, mscale, megatron), inputs=(t,),
                extra=(tuple(freqs.shape), freqs.dtype, bool(interleaved), float(mscale)),
                text_extra=f"rot {freqs.shape[-1]}{' interleaved' if interleaved else ''}")


def fused_rotary_pos_emb(t: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float,
                         megatron) -> torch.Tensor:
    """--use-fused-rotary-pos-emb's call: the fastest of `candidates`, measured once per shape."""
    return fused_choice.run_chosen(**call(t, freqs, interleaved, mscale, megatron))


QK_OP = "rotary_pos_emb_qk"


def qk_candidates(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float,
                  megatron) -> dict:
    """The implementations of RoPE on q and k with the same angles, as fn(q, k) -> (q', k'), or {}
    where npuspeed's one-launch Triton kernel cannot take the pair (then each tensor goes through
    `fused_rotary_pos_emb` on its own). `triton`: q and k in one launch each way; `megatron`:
    Megatron's `_apply_rotary_pos_emb_bshd` on q then k (`megatron(t)`); every single-tensor
    candidate (`triton_each`: the one-tensor Triton kernel; `npu`: torch_npu's op; `compile`:
    torch.compile of the reference) on q then k; `liger`: Liger-Kernel's LigerRopeFunction (q and
    k in one launch, like npuspeed's) where it is installed and takes the call (`liger_fits`)."""
    triton_qk = fused_choice.triton_kernel("rope", "rotary_pos_emb_qk", q, k, freqs, check="supports_qk")
    if triton_qk is None:
        return {}
    found = {"megatron": lambda q, k: (megatron(q), megatron(k))}
    singles_q = candidates(q, freqs, interleaved, mscale, megatron)
    singles_k = candidates(k, freqs, interleaved, mscale, megatron)
    for name in sorted((singles_q.keys() & singles_k.keys()) - {"megatron"}):
        found["triton_each" if name == "triton" else name] = (
            lambda q, k, fq=singles_q[name], fk=singles_k[name]: (fq(q), fk(k)))
    found["triton"] = lambda q, k: triton_qk(q, k, freqs, interleaved, mscale)
    liger = fused_choice.liger("rope", q, k, freqs) if liger_fits(q, k, freqs, interleaved) else None
    if liger is not None:
        found["liger"] = lambda q, k: _liger_qk(liger, q, k, freqs, mscale)
    return found


def fused_rotary_pos_emb_qk(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, interleaved: bool,
                            mscale: float, megatron):
    """--use-fused-rotary-pos-emb on an attention's q and k: the fastest of `qk_candidates`,
    measured once per shape, as (q', k'); None where the pair kernel cannot take them."""
    found = qk_call(q, k, freqs, interleaved, mscale, megatron)
    return None if found is None else fused_choice.run_chosen(**found)


def qk_call(q: torch.Tensor, k: torch.Tensor, freqs: torch.Tensor, interleaved: bool, mscale: float,
            megatron) -> dict | None:
    """The chooser's arguments for the q+k call (None where the pair kernel cannot take it):
    what `fused_rotary_pos_emb_qk` runs and the kernel table times."""
    found = qk_candidates(q, k, freqs, interleaved, mscale, megatron)
    if not found:
        return None
    return dict(op=QK_OP, candidates=found, inputs=(q, k),
                extra=(tuple(freqs.shape), freqs.dtype, bool(interleaved), float(mscale)),
                text_extra=f"k heads {k.shape[2]}, rot {freqs.shape[-1]}{' interleaved' if interleaved else ''}")
