"""The "first N layers of each pipeline stage" option that --recompute-norm and
--recompute-activation-function share (`--<flag>-num-layers N`): its check and its wording."""
from __future__ import annotations

from npuspeed.features.base import FeatureError


def check(num_flag: str, num: int | None, what: str) -> None:
    """`num_flag` is a positive number of layers (`what`: the recomputed thing); that it needs its
    main flag is the feature's `requires`."""
    if num is not None and num < 1:
        raise FeatureError(f"{num_flag} must be a positive number of layers per pipeline stage, got {num}; "
                           f"drop it to recompute {what} of every layer")


def per_stage(num: int | None) -> str:
    return "all layers" if num is None else f"first {num} layers of each pipeline stage"


def per_chunk(num: int | None) -> str:
    return "every layer" if num is None else f"the first {num} layers of each chunk"
