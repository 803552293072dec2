"""Which iterations and modules --npuspeed-dump covers: its two list flags parsed, each bad value
one FeatureError naming the flag and the fix (used by the feature's validation, its patches and
`npuspeed compare --steps`)."""
from __future__ import annotations

from npuspeed.features.base import FeatureError

MAIN, STEPS, MODULES = "--npuspeed-dump", "--dump-steps", "--dump-modules"


def parse_steps(text: str | None) -> frozenset[int] | None:
    """'1,3-5' -> {1, 3, 4, 5}; None -> None (every step). FeatureError naming the flag otherwise."""
    if text is None:
        return None
    steps = set()
    try:
        for part in text.split(","):
            first, _, last = part.strip().partition("-")
            lo, hi = int(first), int(last or first)
            if lo < 1 or hi < lo:
                raise ValueError(part)
            steps.update(range(lo, hi + 1))
    except ValueError:
        raise FeatureError(f"{STEPS} {text}: give 1-based iterations and ranges, e.g. {STEPS} 1,3-5") from None
    return frozenset(steps)


def parse_modules(text: str | None) -> tuple[str, ...]:
    globs = tuple(g.strip() for g in (text or "*").split(",") if g.strip())
    if not globs:
        raise FeatureError(f"{MODULES} {text!r} names no module; give globs such as {MODULES} 'decoder.layers.1.*'")
    return globs
