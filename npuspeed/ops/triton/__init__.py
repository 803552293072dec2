"""npuspeed's own Triton kernels (CUDA GPUs; Ascend NPUs through triton-ascend).

One module per op (rms_norm, swiglu, rope, moe_permute), each with the signature and results
of the pure-PyTorch reference in npuspeed/ops/ and an `available()` probe. Nothing here
imports triton at module load: the kernels are compiled on first use, so the package imports
(and `available()` answers False) where triton is absent. The kernels use only portable
Triton (no inline PTX, no tl.extra.cuda) so triton-ascend can compile them too.
"""
