"""Per-rank tensor sizes of one micro-batch: the numbers every op of ops.py is written in."""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.plan.spec import RunSpec


@dataclass(frozen=True)
class Dims:
    tokens: int  # s x b on this rank (after CP)
    tokens_sp: int  # tokens of the sequence-sharded tensors (/TP under SP)
    seq: int  # s on this rank (after CP)
    batch: int
    hidden: int
    heads: int  # attention heads on this rank
    groups: int  # query groups on this rank
    head_dim: int
    ffn: int  # FFN width on this rank (/TP)
    glu: int
    vocab: int  # padded vocabulary on this rank (/TP)
    act: int  # bytes of an activation element
    tp: int
    sp: bool

    @property
    def scores(self) -> int:
        """Elements of one layer's attention score matrix on this rank: b x heads x s x s."""
        return self.batch * self.heads * self.seq * self.seq

    def h(self, tokens=None) -> int:
        """Bytes of a [tokens, hidden] activation (sequence-sharded by default)."""
        return (self.tokens_sp if tokens is None else tokens) * self.hidden * self.act


def dims(spec: RunSpec, micro_batch: int | None = None) -> Dims:
    m, lay = spec.model, spec.layout
    b = micro_batch or spec.batch.micro_batch
    seq = m.seq_length // max(lay.cp, 1)
    tokens = seq * b
    return Dims(
        tokens=tokens, tokens_sp=tokens // lay.tp if lay.sp else tokens, seq=seq, batch=b,
        hidden=m.hidden, heads=m.heads // lay.tp, groups=max(m.query_groups // lay.tp, 1),
        head_dim=m.kv_channels, ffn=m.ffn // lay.tp, glu=m.glu, vocab=m.padded_vocab(lay.tp) // lay.tp,
        act=spec.batch.act_bytes, tp=lay.tp, sp=lay.sp,
    )
