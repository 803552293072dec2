"""Fused linear cross-entropy (`--use-fused-linear-cross-entropy [--fused-linear-cross-entropy-chunk-size N]`).

Megatron's GPT head materialises the logits [s, b, V/TP] in the activation dtype, an fp32 copy
that becomes the saved softmax, and its gradient: for a 128k-152k vocabulary, gigabytes per
micro-batch. Here the output projection and the vocab-parallel cross-entropy run together in
chunks of tokens (function.py), so at most one chunk's logits [chunk, V/TP] exist at a time,
in forward and in backward; what is saved is the hidden states and one fp32 log-sum-exp per
token. The same chunked torch code runs on every backend (CPU, CUDA, NPU: the matmuls are the
device's). The patch point and when Megatron's own path runs instead: postprocess.py (registered
by patches.py); the per-shape choice: candidates.py.
"""
from __future__ import annotations

from dataclasses import dataclass

from npuspeed.features.base import Feature, FeatureError
from npuspeed.features.config import FeatureConfig, flag
from npuspeed.features.fused_linear_ce import patches as _patches, plan as _plan

MAIN, CHUNK = "--use-fused-linear-cross-entropy", "--fused-linear-cross-entropy-chunk-size"
FALLBACK = "--fused-linear-cross-entropy-fallback"


@dataclass(frozen=True)
class Config(FeatureConfig):
    use_fused_linear_cross_entropy: bool = flag(MAIN, False)
    """Compute the output layer and the vocab-parallel cross-entropy in token chunks: the [s, b, V]
    logits and their gradient are never materialised."""
    fused_linear_cross_entropy_chunk_size: int | None = flag(CHUNK, None, type=int, metavar="LOGITS")
    """With --use-fused-linear-cross-entropy: logits per chunk (tokens x V/TP entries; all tokens
    and a slice of the vocabulary when they fit). Default 1048576 (4 MiB in fp32) on CPU, 33554432
    (128 MiB) on an accelerator."""
    fused_linear_cross_entropy_fallback: str | None = flag(FALLBACK, None, choices=["auto", "never"])
    """With --use-fused-linear-cross-entropy: auto (default) measures the chunked path against
    Megatron's once per shape and runs Megatron's where the chunked one is slower; never: always
    chunked (memory first)."""


class FusedLinearCEFeature(Feature, name="fused_linear_ce", Config=Config, patches=_patches, plan=_plan,
                           switch="use_fused_linear_cross_entropy",
                           requires={"fused_linear_cross_entropy_chunk_size": "use_fused_linear_cross_entropy",
                                     "fused_linear_cross_entropy_fallback": "use_fused_linear_cross_entropy"}):
    def __init__(self):
        self.chooser = None

    def validate(self, ctx) -> None:
        config = self.config(ctx.args)
        self.check_requires(config)
        chunk = config.fused_linear_cross_entropy_chunk_size
        if chunk is not None and chunk < 1:
            raise FeatureError(f"{CHUNK} must be a positive number of logits (tokens x V/TP entries), got "
                               f"{chunk}; drop it for the default (1048576 on CPU, 4 MiB in fp32)")

    def register_patches(self, registry, ctx) -> None:
        """The base's call, with the per-shape chooser the report reads (candidates.py)."""
        from npuspeed.features.fused_linear_ce import candidates

        config = self.config(ctx.args)
        self.chooser = candidates.LossPaths(config.fused_linear_cross_entropy_fallback or "auto",
                                        config.fused_linear_cross_entropy_chunk_size)
        self.patches.register(registry, ctx, config, self.name, self.chooser)

    def running(self, ctx) -> str:
        config = self.config(ctx.args)
        if not config.use_fused_linear_cross_entropy:
            return "off"
        from npuspeed import telemetry
        from npuspeed.features.fused_linear_ce import function, postprocess

        chunk = config.fused_linear_cross_entropy_chunk_size or function.default_chunk(ctx.accelerator.name)
        size = f"tiles of <= {chunk} logits"
        from npuspeed.features.fused_linear_ce.candidates import CHOICE

        choices = list(self.chooser.choices.values()) if self.chooser else [telemetry.last(CHOICE)]
        shapes = "; ".join(f"{'x'.join(str(k) for k in c['key'][2:])} {c['key'][1]}: {c['path']} ({c['why']})"
                           for c in choices if c)
        shapes = f"; per shape (tokens x hidden x V/TP): {shapes}" if shapes else ""
        fallbacks = telemetry.snapshot(postprocess.FALLBACK)
        falls = "; Megatron's path ran for: " + ", ".join(
            f"{k[len(postprocess.FALLBACK):]} x{v}" for k, v in sorted(fallbacks.items())) if fallbacks else ""
        return (f"chunked torch on {ctx.accelerator.name} (output matmul + vocab-parallel CE per [token block x vocab chunk] tile, "
                f"logits recomputed in backward; {size}); calls {telemetry.get(function.CALLS)}, chunks "
                f"{telemetry.get(function.CHUNKS)}{shapes}{falls}")

