"""Megatron-Core 0.16's local GPT modules as the ops they run (for graph.py's replay).

Written from what the modules allocate and save on this path (checked against the tensors
autograd saves, tests/unit/test_plan_memory.py and benchmarks/plan_validate.py):
- norms: torch LayerNorm saves its input and two [tokens] statistics; torch RMSNorm saves
  its input, x * rstd and rstd.
- linears: Megatron's LinearWithGradAccumulation saves its (sequence-sharded) input; under
  SP the gathered input lives in the persistent "mpu" global buffer, not per micro-batch;
  the weight gradient is made whole then added into the DDP buffer (a transient).
- unfused attention: baddbmm into a new [b*heads, s, s] score tensor (the global buffer
  is only its beta=0 input), softmax in fp32 (bf16 scores are cast first), dropout saves a
  mask of the activation dtype, bmm saves the dropped probabilities and V; the in-place
  masked_fill_ before the softmax costs nothing forward, one score-sized gradient backward.
- bias/dropout/add (unfused): dropout saves a mask the size of its input.
- the loss: logits cast to fp32, the softmax written in place and saved, its gradient
  written into the same storage.
Variants (features' plan effects, Megatron's recompute) swap one op for another here.
"""
from __future__ import annotations

from npuspeed.plan import ops_cp, ops_moe
from npuspeed.plan.dims import Dims
from npuspeed.plan.graph import Graph, Op
from npuspeed.plan.run import ResolvedRun
from npuspeed.plan_vocabulary import SWAP_PARTS, PlanOptions


def swap_layer(op_name: str, modules) -> int:
    """The layer index of a layer op run inside one of the swapped `modules`, else -1."""
    head, _, rest = op_name.partition(".")
    if not head.startswith("l") or not head[1:].isdigit():
        return -1
    part = rest.split(".", 1)[0]  # (a module's bias/dropout/add is named for its output, x1/out)
    return int(head[1:]) if any(part in SWAP_PARTS[m] for m in modules) else -1


def _norm_saved(d: Dims, kind: str, variant: str) -> int:
    """Bytes a norm saves besides its input (its statistics; torch RMSNorm also x * rstd)."""
    small = d.tokens_sp * (4 if d.act == 4 else d.act)
    if kind == "RMSNorm" and variant != "fused":
        return d.h() + small
    if kind == "RMSNorm":
        return d.tokens_sp * 4
    return 2 * small


def _norm(g: Graph, d: Dims, x: str, out: str, kind: str, variant: str, term: str,
          recompute: bool = False) -> int:
    """The norm; with `recompute` (norm recompute) it runs without a graph, keeping only its
    input: returns the bytes its recompute makes in backward (0 without)."""
    n = d.h()
    small = d.tokens_sp * (4 if d.act == 4 else d.act)
    if recompute:
        stats = _norm_saved(d, kind, variant)
        g.add(Op(f"{out}.norm", (x,), {out: n}, saves=(x,), fwd_temp=stats, term=term))
        return n + stats
    if kind == "RMSNorm" and variant != "fused":
        g.add(Op(f"{out}.norm", (x,), {out: n}, saves=(x, f"{out}.xr", f"{out}.rstd"),
                 extras={f"{out}.xr": n, f"{out}.rstd": small}, term=term))
    elif kind == "RMSNorm":  # fused: input and rstd (fp32)
        g.add(Op(f"{out}.norm", (x,), {out: n}, saves=(x, f"{out}.rstd"),
                 extras={f"{out}.rstd": d.tokens_sp * 4}, term=term))
    else:
        g.add(Op(f"{out}.norm", (x,), {out: n}, saves=(x, f"{out}.mean", f"{out}.rstd"),
                 extras={f"{out}.mean": small, f"{out}.rstd": small}, term=term))
    return 0


def _column(g, d: Dims, x: str, out: str, width: int, bias_inside: bool, term: str,
            recomputed_input: int = 0) -> None:
    """ColumnParallelLinear: [tokens_sp, h] (gathered under SP) -> [tokens, width]. With
    `recomputed_input` (norm recompute) its input is freed after it ran and that many bytes
    are recomputed just before its backward."""
    nbytes = d.tokens * width * d.act
    full_grad = d.h(d.tokens) if d.sp else 0  # grad of the gathered input before reduce-scatter
    g.add(Op(f"{out}.linear", (x,), {out: nbytes}, saves=() if recomputed_input else (x,),
             fwd_temp=nbytes if bias_inside else 0,
             bwd_temp=d.hidden * width * d.act + full_grad + recomputed_input, term=term))


def _row(g, d: Dims, x: str, out: str, width: int, term: str) -> None:
    """RowParallelLinear: [tokens, width] -> [tokens_sp, h] (reduce-scattered under SP)."""
    partial = d.h(d.tokens) if d.sp else 0
    g.add(Op(f"{out}.linear", (x,), {out: d.h()}, saves=(x,), fwd_temp=partial,
             bwd_temp=d.hidden * width * d.act, term=term))


def _dropout(g, d: Dims, x: str, out: str, p: float, nbytes: int, term: str) -> str:
    if p <= 0:
        return x
    g.add(Op(f"{out}.dropout", (x,), {out: nbytes}, saves=(f"{out}.mask",),
             extras={f"{out}.mask": nbytes}, term=term))
    return out


def _bda(g, d: Dims, x: str, residual: str, out: str, p: float, bias: bool, term: str) -> None:
    """Bias, dropout, add (unfused): out = residual + dropout(x + bias)."""
    if bias:
        g.add(Op(f"{out}.bias", (x,), {f"{out}.b": d.h()}, pass_grad=(x,)))
        x = f"{out}.b"
    y = _dropout(g, d, x, f"{out}.d", p, d.h(), term)
    g.add(Op(f"{out}.add", (y, residual), {out: d.h()}, pass_grad=(y, residual)))


def _attention_core(g, d: Dims, q: str, k: str, v: str, out: str, p: float, variant: str) -> None:
    s2 = d.scores
    a = d.act
    ctx_bytes = d.tokens * d.heads * d.head_dim * a
    if variant == "flash":
        # one fused kernel: saves q, k, v, its output and the [b, heads, s] log-sum-exp
        g.add(Op(f"{out}.flash", (q, k, v), {f"{out}.o": ctx_bytes}, saves=(q, k, v, f"{out}.o", f"{out}.lse"),
                 extras={f"{out}.lse": d.batch * d.heads * d.seq * 4}, fwd_temp=0,
                 bwd_temp=2 * ctx_bytes, term="attention"))
        g.add(Op(f"{out}.ctx", (f"{out}.o",), {out: ctx_bytes}))
        return
    if variant == "recompute":
        # Megatron's selective recompute: only q, k, v kept; the S x S work is redone in backward
        inner = 4 * s2 + (s2 * a if p > 0 else 0) + (s2 * a if a != 4 else 0)
        # backward peak: the recomputed tensors with two score gradients, or (fp32) the mask's
        # CopySlices: its incoming gradient and three score-sized copies (see below)
        copy_slices = 4 * s2 * 4 if a == 4 else 0
        g.add(Op(f"{out}.checkpoint", (q, k, v), {out: ctx_bytes}, saves=(q, k, v), fwd_temp=inner + ctx_bytes,
                 bwd_temp=max(inner + 2 * s2 * 4, copy_slices) + ctx_bytes, term="attention"))
        return
    if variant == "sdpa_math":
        # torch's math backend (CPU SDPA with dropout): fp32 copies of q and k (and of v in
        # bf16), the fp32 softmax, the dropout mask and the dropped probabilities
        c32 = d.tokens * d.heads * d.head_dim * 4
        extras = {f"{out}.q32": c32, f"{out}.k32": c32, f"{out}.p": s2 * 4, f"{out}.m": s2 * 4 if p > 0 else 0,
                  f"{out}.pd": s2 * 4 if p > 0 else 0}
        saves = [f"{out}.q32", f"{out}.k32", f"{out}.p", f"{out}.m", f"{out}.pd"]
        if a != 4:
            extras[f"{out}.v32"] = c32
            saves.append(f"{out}.v32")
        else:
            saves.append(v)
        g.add(Op(f"{out}.sdpa", (q, k, v), {f"{out}.o": ctx_bytes}, saves=tuple(saves), extras=extras,
                 fwd_temp=s2 * 4, bwd_temp=2 * s2 * 4 + 3 * c32, term="attention"))
        g.add(Op(f"{out}.ctx", (f"{out}.o",), {out: ctx_bytes}))
        return
    # unfused: Megatron's DotProductAttention
    g.add(Op(f"{out}.scores", (q, k), {f"{out}.s": s2 * a}, saves=(q, k), term="attention"))
    scores = f"{out}.s"
    if a != 4:
        g.add(Op(f"{out}.float", (scores,), {f"{out}.s32": s2 * 4}))
        scores = f"{out}.s32"
    # attention_mask_func's masked_fill_ writes in place (no new tensor forward). Backward
    # makes a new gradient while the softmax's is alive; in fp32 the scores are a view of
    # baddbmm's result, so autograd's CopySlices also clones the gradient and writes an
    # as_strided copy (two more score-sized transients, measured); in bf16 the fp32 copy is
    # its own tensor and only grad.masked_fill(mask, 0) is made.
    sb = s2 * 4
    g.add(Op(f"{out}.mask", (scores,), {f"{out}.sm": sb}, views={f"{out}.sm": scores},
             bwd_temp=2 * sb if a == 4 else 0))
    scores = f"{out}.sm"
    g.add(Op(f"{out}.softmax", (scores,), {f"{out}.p": s2 * 4}, saves=(f"{out}.p",), term="attention"))
    probs = f"{out}.p"
    if a != 4:
        g.add(Op(f"{out}.cast", (probs,), {f"{out}.p16": s2 * a}))
        probs = f"{out}.p16"
    probs = _dropout(g, d, probs, f"{out}.pd", p, s2 * a, "attention")
    g.add(Op(f"{out}.bmm", (probs, v), {f"{out}.c": ctx_bytes}, saves=(probs, v), term="attention"))
    g.add(Op(f"{out}.ctx", (f"{out}.c",), {out: ctx_bytes}))


def layer_ops(g: Graph, d: Dims, m, x: str, i: int, variants: dict, recompute_activation: bool,
              options: PlanOptions = PlanOptions(), recompute_norm: bool = False) -> str:
    """One transformer layer on input `x`; returns its output's name."""
    L = f"l{i}"
    a = d.act
    norm_v = variants.get("norm", "torch")
    rn1 = _norm(g, d, x, f"{L}.n1", m.normalization, norm_v, "norm", recompute_norm)
    np_, ng, hn = d.heads, d.groups, d.head_dim
    qkv_w = (np_ + 2 * ng) * hn
    _column(g, d, f"{L}.n1", f"{L}.qkv", qkv_w, m.bias, "qkv", rn1)
    q_b, kv_b = d.tokens * np_ * hn * a, d.tokens * ng * hn * a
    g.add(Op(f"{L}.split", (f"{L}.qkv",), {f"{L}.q": q_b, f"{L}.k": kv_b, f"{L}.v": kv_b},
             views={f"{L}.q": f"{L}.qkv", f"{L}.k": f"{L}.qkv", f"{L}.v": f"{L}.qkv"}))
    q, k, v = f"{L}.q", f"{L}.k", f"{L}.v"
    core = variants.get("core_attention", "unfused")
    if m.position_embedding == "rope":
        fused = variants.get("rope") == "fused"
        cs = 0 if fused else 2 * d.seq * hn * 4
        g.add(Op(f"{L}.rope_q", (q,), {f"{L}.qr": q_b}, saves=(f"{L}.cq",), extras={f"{L}.cq": cs}, term="rope"))
        g.add(Op(f"{L}.rope_k", (k,), {f"{L}.kr": kv_b}, saves=(f"{L}.ck",), extras={f"{L}.ck": cs}, term="rope"))
        q, k = f"{L}.qr", f"{L}.kr"
    if np_ != ng and core in ("unfused", "sdpa_math", "recompute"):
        g.add(Op(f"{L}.expand", (k, v), {f"{L}.ke": q_b, f"{L}.ve": q_b}))
        k, v = f"{L}.ke", f"{L}.ve"
    if core != "cp":
        _attention_core(g, d, q, k, v, f"{L}.ctx", m.attention_dropout, core)
    else:
        ops_cp.attention(g, d, q, k, v, f"{L}.ctx", options.cp_ulysses or 1, options.cp_ring or 1)
    _row(g, d, f"{L}.ctx", f"{L}.proj", np_ * hn, "proj")
    _bda(g, d, f"{L}.proj", x, f"{L}.x1", m.hidden_dropout, m.bias, "dropout")
    dense = not m.num_experts
    rn2 = _norm(g, d, f"{L}.x1", f"{L}.n2", m.normalization, norm_v, "norm", recompute_norm and dense)
    if dense:
        _dense_mlp(g, d, m, L, variants, recompute_activation, rn2)
    else:
        ops_moe.moe_mlp(g, d, m, f"{L}.n2", f"{L}.fc2", options)
    _bda(g, d, f"{L}.fc2", f"{L}.x1", f"{L}.out", m.hidden_dropout, m.bias and dense, "dropout")
    return f"{L}.out"


def _dense_mlp(g, d: Dims, m, L: str, variants: dict, recompute_activation: bool, rn2: int) -> None:
    """fc1, the activation (GLU), fc2 of a dense layer: `{L}.n2` -> `{L}.fc2`."""
    a = d.act
    width = d.ffn * d.glu
    _column(g, d, f"{L}.n2", f"{L}.fc1", width, False, "mlp", rn2)
    h1 = f"{L}.fc1"
    if m.bias:
        g.add(Op(f"{L}.fc1b", (h1,), {f"{L}.fc1b": d.tokens * width * a}, pass_grad=(h1,)))
        h1 = f"{L}.fc1b"
    f_b = d.tokens * d.ffn * a
    if m.swiglu and variants.get("glu") != "fused":
        g.add(Op(f"{L}.glu", (h1,), {f"{L}.act": f_b}, saves=(h1, f"{L}.silu", f"{L}.g2"),
                 extras={f"{L}.silu": f_b, f"{L}.g2": f_b}, fwd_temp=f_b, term="mlp"))
    else:  # gelu, or the fused SwiGLU kernel: saves its input only
        g.add(Op(f"{L}.act", (h1,), {f"{L}.act": f_b}, saves=(h1,), term="mlp"))
    if recompute_activation:  # output freed after fc2, recomputed just before fc2's backward
        g.add(Op(f"{L}.fc2.linear", (f"{L}.act",), {f"{L}.fc2": d.h()}, fwd_temp=d.h(d.tokens) if d.sp else 0,
                 bwd_temp=d.hidden * d.ffn * a + f_b, term="mlp"))
    else:
        _row(g, d, f"{L}.act", f"{L}.fc2", d.ffn, "mlp")


def embedding_ops(g: Graph, d: Dims, m) -> str:
    a = d.act
    g.inputs.update({"tokens": d.tokens * 8, "positions": d.tokens * 8})
    g.no_grad.update({"tokens", "positions"})
    full = d.h(d.tokens)
    g.add(Op("emb.word", ("tokens",), {"emb.w": full}, saves=("emb.ids",), extras={"emb.ids": d.tokens * 8 if d.tp > 1 else 0},
             bwd_temp=d.vocab * d.hidden * a, term="embedding"))
    x = "emb.w"
    if m.position_embedding == "learned_absolute":
        g.add(Op("emb.pos", (x,), {"emb.p": full}, bwd_temp=m.max_position_embeddings * d.hidden * a,
                 pass_grad=(x,)))
        x = "emb.p"
    g.add(Op("emb.t", (x,), {"emb.t": full}))
    x = "emb.t"
    if d.sp:
        g.add(Op("emb.scatter", (x,), {"emb.sp": d.h()}))
        x = "emb.sp"
    return _dropout(g, d, x, "emb.out", m.hidden_dropout, d.h(), "embedding")


def recv_ops(g: Graph, d: Dims) -> str:
    g.add(Op("recv", (), {"recv.x": d.h()}))
    return "recv.x"


def head_ops(g: Graph, d: Dims, m, x: str, variants: dict) -> str:
    a = d.act
    _norm(g, d, x, "head.n", m.normalization, variants.get("norm", "torch"), "head")
    if variants.get("head") == "chunked":  # --use-fused-linear-cross-entropy: one tile of logits at a time
        tile = min(d.tokens * d.vocab, 1 << 20)  # fused_linear_ce.function.DEFAULT_CHUNK logits
        gathered = d.h(d.tokens) if d.sp else 0
        g.add(Op("head.flce", ("head.n",), {"head.loss": d.tokens * 4}, saves=("head.n", "head.lse", "head.tidx"),
                 extras={"head.lse": d.tokens * 4, "head.tidx": d.tokens * 9},
                 fwd_temp=tile * (4 + (d.act if d.act != 4 else 0)) + gathered + d.tokens * 16,
                 bwd_temp=tile * (4 + (d.act if d.act != 4 else 0)) + d.vocab * d.hidden * 4 + d.tokens * d.hidden * 4
                 + 2 * gathered, term="head"))
        g.add(Op("head.lossf", ("head.loss",), {"head.l": 4}, saves=("head.mask",),
                 extras={"head.mask": d.tokens * 4}, term="head"))
        return "head.l"
    _column(g, d, "head.n", "head.logits", d.vocab, False, "head")
    x = "head.logits"
    if a != 4:
        g.add(Op("head.float", (x,), {"head.l32": d.tokens * d.vocab * 4}))
        x = "head.l32"
    # the softmax is written into the fp32 logits in place and saved; its gradient reuses it
    g.add(Op("head.ce", (x,), {"head.loss": d.tokens * 4}, saves=(x, "head.tmask", "head.tidx"),
             extras={"head.tmask": d.tokens, "head.tidx": d.tokens * 8}, fwd_temp=d.tokens * 8 * 2,
             grad_in_saved=True, term="head"))
    g.add(Op("head.lossf", ("head.loss",), {"head.l": 4}, saves=("head.mask",),
             extras={"head.mask": d.tokens * 4}, term="head"))
    return "head.l"


def _checkpointed(g: Graph, d: Dims, m, x: str, first: int, count: int, variants, rc_layers, opts) -> str:
    """Megatron's full recompute of `count` layers: only the input is kept; backward reruns them
    (the block's layers go in the op as `inner`, graph.replay prices them)."""
    inner = Graph()
    inner.add(Op("ck.in", (), {"ck.x": d.h()}))
    y = "ck.x"
    for i in range(first, first + count):
        y = layer_ops(inner, d, m, y, i, variants, i in rc_layers, opts)
    out = f"ck{first}.out"
    g.add(Op(f"ck{first}", (x,), {out: d.h()}, saves=(x,), inner=inner, inner_grad=d.h(), term="recompute"))
    return out


def chunk_ops(run: ResolvedRun, pp_rank: int, chunk: int) -> Graph:
    """Every op of one model chunk's micro-batch on a rank of stage `pp_rank`, in order: the
    embedding (first chunk) or the received activation, the layers (checkpointed under full
    recompute), the head and loss (last chunk) or the send."""
    spec, effects, d = run.spec, run.effects, run.dims
    m, lay = spec.model, spec.layout
    g = Graph()
    first, last = run.placement.first(pp_rank, chunk), run.placement.last(pp_rank, chunk)
    x = embedding_ops(g, d, m) if first else recv_ops(g, d)
    n = spec.layers_per_chunk()
    variants = dict(effects.variants)
    opts = run.layer_options
    if m.recompute_granularity == "selective":
        core = variants.get("core_attention", "unfused")
        variants["core_attention"] = core if core in ("flash", "cp") else "recompute"
    rc_layers = effects.layers_for("mlp_activation", n)
    rn_layers = effects.layers_for("norm_output", n)
    full, k = m.recompute_granularity == "full", m.recompute_num_layers or 1
    block = full and m.recompute_method == "block"
    i = 0
    while i < n:
        if full and (not block or i < k):
            count = 1 if block else min(k, n - i)
            x = _checkpointed(g, d, m, x, i, count, variants, rc_layers, opts)
            i += 1 if block else k
        else:
            x = layer_ops(g, d, m, x, i, variants, i in rc_layers, opts, i in rn_layers)
            i += 1
    if effects.swap_modules:  # --swap-attention on a device backend: the chosen modules' saves leave
        for op in g.ops:
            op.swap = swap_layer(op.name, effects.swap_modules)
    if last:
        head_ops(g, d, m, x, variants)
    else:
        g.add(Op("send", (x,), {"send.y": 0}, views={"send.y": x}, pass_grad=(x,)))
    return g
