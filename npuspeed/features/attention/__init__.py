"""What the attention features share (a shared room, not a feature: no flag, no patch of its own).

Fused attention's forward (`fused_attention/forward.py`) hands a call to `cp_attention.py` when
the layer was built under context parallelism (the `context_parallel` feature marks it) or
Megatron passed packed documents, which happens at CP 1 too: so the algorithm lives here, under
both features, and neither imports the other. Here: the hand-over (cp_attention.py), ring and
Ulysses attention (ring.py, ulysses.py), the block kernels and their interface (blocks.py,
kernels_cpu.py, kernels_device.py), packed documents (documents.py), the CP layout and groups
(layout.py, groups.py, comm.py), and the dropout seeds both features' CPU kernels draw
(dropout.py).
"""
