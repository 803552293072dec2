"""npuspeed's own Triton kernels (CUDA GPUs; Ascend NPUs through triton-ascend).

One module per op, each with the signature and results of the pure-PyTorch reference in
npuspeed/ops/, an `available()` probe (triton imports and targets a device, or
TRITON_INTERPRET=1 on CPU) and `supports(...)` (the shapes and dtypes its kernels take; other
calls run the reference, so a dispatcher that counts "triton" should ask first):
rms_norm.rms_norm / rms_norm_residual, swiglu.swiglu, rope.rotary_pos_emb / rotary_pos_emb_qk,
moe_permute.permute / unpermute / moe_permute / moe_unpermute. A call on tensors triton
cannot take (CPU without the interpreter) raises a RuntimeError saying so. Nothing here
imports triton at module load: the kernels are compiled on first use, so the package imports
(and `available()` answers False) where triton is absent. The kernels use only portable
Triton (no inline PTX, no tl.extra.cuda) so triton-ascend can compile them too.
"""
