"""FP8 numerics beneath the `fp8` feature: formats, each recipe's quantization, the FP8 GEMM and linear.

Megatron-Core trains in FP8 only through Transformer Engine; these modules define the same
recipes (tensorwise current scaling, delayed scaling, 1x128/128x128 blockwise, MXFP8) in plain
PyTorch so that they run, and are tested bit for bit, wherever torch runs. Nothing here reads
flags: the feature folder turns Megatron's `--fp8-*` flags into a `Fp8Recipe`.
"""
from npuspeed.ops.fp8.formats import E4M3, E5M2, Fp8Format, formats_for
from npuspeed.ops.fp8.quantized import Fp8Tensor
from npuspeed.ops.fp8.recipe import Fp8Recipe

__all__ = ["E4M3", "E5M2", "Fp8Format", "Fp8Recipe", "Fp8Tensor", "formats_for"]
