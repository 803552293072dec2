"""The fused ops' kernel table: every candidate the flags choose among, per op and shape, timed
by the chooser's own measurement at the shapes a run will use.

The device report's kernel table of 2026-11-27 came from benchmarks that timed their own way
(bench_triton_ops: 20 back-to-back fwd+bwd steps, median; bench_fused_ops: the harness) at
their own shapes, beside a chooser that timed yet another way; the two disagreed
(docs/fused_op_rule.md says why). Here there is one path: each row is what
`fused_choice.choose` returns for the op's own `call(...)` (npuspeed.ops.rms_norm.call,
swiglu.call, rope.call / rope.qk_call: the very arguments the flags hand the chooser), so the
table's candidates, keys, numerics check, clock and rule are the flags' own; only the cache is
a fresh chooser's (`Chooser` from fused_choice, the process chooser's settings), so every row
is measured here rather than remembered.

`shapes(model)` gives the per-rank shapes of one Megatron layer's fused calls: RMSNorm on
[s, b, hidden], SwiGLU on fc1's output [s, b, 2 x ffn / tp], RoPE on q [s, b, heads / tp, d]
and k [s, b, groups / tp, d] with Megatron's angle tensor [s, 1, 1, d]; where npuspeed's Triton
kernel takes the pair, q and k are one call (`rotary_pos_emb_qk`), as in the run.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F

from npuspeed.ops import fused_choice
from npuspeed.ops.choose.record import Choice

EPS = 1e-5


@dataclass(frozen=True)
class Model:
    """The dimensions that set a layer's fused-op shapes (Megatron's names)."""

    hidden: int
    ffn: int
    heads: int
    groups: int
    seq: int
    micro_batch: int = 1
    head_dim: int = 0  # 0: hidden / heads (Megatron's kv_channels default)
    tp: int = 1

    @property
    def kv_channels(self) -> int:
        return self.head_dim or self.hidden // self.heads


def shapes(model: Model) -> dict[str, tuple]:
    """The per-rank input shapes of one layer's fused calls."""
    s, b, d = model.seq, model.micro_batch, model.kv_channels
    return {"rms_norm": (s, b, model.hidden), "swiglu": (s, b, 2 * model.ffn // model.tp),
            "rope_q": (s, b, model.heads // model.tp, d), "rope_k": (s, b, max(model.groups // model.tp, 1), d),
            "freqs": (s, 1, 1, d)}


def rope_freqs(seq: int, dim: int, device, base: float = 10000.0) -> torch.Tensor:
    """Megatron's RotaryEmbedding angles: [s, 1, 1, dim], rotate-half layout, fp32."""
    inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32, device=device) / dim))
    freqs = torch.outer(torch.arange(seq, dtype=torch.float32, device=device), inv_freq)
    return torch.cat((freqs, freqs), dim=-1)[:, None, None, :]


def megatron_functions() -> dict[str, Callable | None]:
    """Megatron's own functions the flags are measured against (None where megatron-core does
    not import: npuspeed's references of the same maths stand in, and the table says so)."""
    found: dict[str, Callable | None] = {"bias_swiglu": None, "rope_bshd": None}
    try:
        from megatron.core.fusions.fused_bias_swiglu import bias_swiglu_impl

        found["bias_swiglu"] = bias_swiglu_impl
    except Exception:  # noqa: BLE001 - no megatron-core here
        pass
    try:
        from megatron.core.models.common.embeddings.rope_utils import _apply_rotary_pos_emb_bshd

        found["rope_bshd"] = _apply_rotary_pos_emb_bshd
    except Exception:  # noqa: BLE001
        pass
    return found


def calls(model: Model, dtype: torch.dtype, device, generator: torch.Generator | None = None) -> list[dict]:
    """The chooser's arguments for each of a layer's fused calls at `model`'s shapes, built by
    the ops' own `call` functions with Megatron's functions as the flags hand them over."""
    from npuspeed.ops import rms_norm, rope, swiglu

    gen = generator or torch.Generator().manual_seed(0)
    megatron = megatron_functions()
    dims = shapes(model)

    def leaf(shape):
        return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype).requires_grad_(True)

    x = leaf(dims["rms_norm"])
    weight = torch.ones(dims["rms_norm"][-1], device=device, dtype=dtype, requires_grad=True)
    out = [rms_norm.call(x, weight, EPS, lambda x, w: F.rms_norm(x, (x.shape[-1],), w, EPS))]

    y = leaf(dims["swiglu"])
    glu = {"megatron": swiglu.swiglu_reference}
    if megatron["bias_swiglu"] is not None:
        fused = megatron["bias_swiglu"]
        glu["megatron_fused"] = lambda v: fused(v, None)
    out.append(swiglu.call(y, glu))

    freqs = rope_freqs(dims["freqs"][0], dims["freqs"][-1], device)
    bshd = megatron["rope_bshd"]

    def megatron_rope(t):
        return bshd(t, freqs) if bshd is not None else rope.rotary_pos_emb_reference(t, freqs)

    q, k = leaf(dims["rope_q"]), leaf(dims["rope_k"])
    pair = rope.qk_call(q, k, freqs, False, 1.0, megatron_rope)
    if pair is not None:
        out.append(pair)
    else:  # each tensor goes through the one-tensor rule, as in the run
        out += [rope.call(q, freqs, False, 1.0, megatron_rope), rope.call(k, freqs, False, 1.0, megatron_rope)]
    return out


def measure(model: Model, dtype: torch.dtype, device, chooser=None) -> list[Choice]:
    """One Choice per fused call of a layer at `model`'s shapes: each candidate's fwd+bwd ms
    (`ms`), its first call (`first_ms`), those dropped and why, and the pick (`impl`), by the
    chooser's own measurement (`chooser`: a fresh fused-op chooser unless one is given, e.g.
    one configured for the accelerator, or with injected timings in a test)."""
    chooser = fused_choice.Chooser() if chooser is None else chooser
    return [fused_choice.choose(**call, chooser=chooser) for call in calls(model, dtype, device)]
