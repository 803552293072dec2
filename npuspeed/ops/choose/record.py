"""What a chooser decided for one key: the record `npuspeed report` and every feature's path() read."""
from __future__ import annotations

from dataclasses import dataclass, field

#: the name of the path that runs with the flag off (Megatron's own); ties go to it
MEGATRON = "megatron"


@dataclass
class Choice:
    """One key's decision: what runs, why, and the measured fwd+bwd milliseconds and bytes."""

    op: str
    label: str  # e.g. "4096x512 bf16 cpu"
    impl: str
    why: str
    ms: dict[str, float] = field(default_factory=dict)
    dropped: dict[str, str] = field(default_factory=dict)
    bytes: dict[str, int] = field(default_factory=dict)
    baseline: str = MEGATRON
    #: each timed candidate's first call (warm-up) in ms: one-off costs (compile, JIT) are here,
    #: never in `ms`
    first_ms: dict[str, float] = field(default_factory=dict)
    #: every candidate offered for this key, measured or dropped (empty where not measured)
    offered: list[str] = field(default_factory=list)

    @property
    def speedup(self) -> float | None:
        """The baseline's time over the chosen one's (None when not measured)."""
        mine, base = self.ms.get(self.impl), self.ms.get(self.baseline)
        return base / mine if mine and base else None

    def line(self) -> str:
        """The report line, e.g. "rms_norm [4096x512 bf16 cpu]: cpp (1.40x megatron; ...)"."""
        return f"{self.op} [{self.label}]: {self.impl} ({self.why})"

    def as_dict(self) -> dict:
        out = {"op": self.op, "shape": self.label, "impl": self.impl, "why": self.why,
               "ms": {k: round(v, 4) for k, v in self.ms.items()}, "dropped": dict(self.dropped)}
        if self.bytes:
            out["bytes"] = dict(self.bytes)
        if self.first_ms:
            out["first_ms"] = {k: round(v, 4) for k, v in self.first_ms.items()}
        if self.offered:
            out["candidates"] = list(self.offered)
        return out

    def flat(self, **extra) -> dict:
        """impl, why and one `<name>_ms` / `<name>_bytes` field per measured candidate (the
        features' telemetry records keep these keys)."""
        out = {"impl": self.impl, "why": self.why, **extra}
        out.update({f"{n}_ms": v for n, v in self.ms.items()})
        out.update({f"{n}_bytes": v for n, v in self.bytes.items()})
        return out
